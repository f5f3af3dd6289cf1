"""Requests from `submit` to running: each checked whole against every pool before
anything is queued, queued with its id and its own generator, and admitted in order while
sequences are free and every pool can hold what the running sequences and the next may
come to hold."""
from __future__ import annotations

import secrets

import numpy as np

from ..errors import CapacityError
from .config import refuse_dropout
from .requests import Sequence, checked_request
from .seating import MODEL


class Admission:
    """The engine's queue: requests checked (`checked`), queued (`queue`) into the
    `roster`'s waiting sequences and admitted (`admit`) to its running ones, seated by
    `seating`; `counts` gains the prompt tokens admitted and those the prefix index
    served. `config`: the model's cache config; `vocab`: its vocabulary size."""

    def __init__(self, *, roster, seating, counts, config, vocab: int):
        self.roster, self.seating, self.counts = roster, seating, counts
        self.config, self.vocab = config, vocab
        self.last_id = 0        # the last request id drawn

    def checked(self, prompt, *, max_new_tokens, temperature, top_p, seed, eos_token_id, n,
                extra_key=None) -> Sequence:
        """A request's first sequence, once its every option passed and every pool could
        hold its sequences."""
        for served in self.seating.models:
            refuse_dropout(served.model)
        seq = checked_request(prompt, vocab=self.vocab, capacity=self.config.capacity,
                              max_seqs=self.config.max_seqs, max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p, seed=seed,
                              eos_token_id=eos_token_id, n=n, extra_key=extra_key)
        positions = seq.n_prompt + seq.max_new
        for served in self.seating.models:
            for (rows, bound), pages in zip(served.groups, served.pages_for(positions, seq.n)):
                if pages > bound:
                    raise CapacityError(
                        f"a prompt of {seq.n_prompt} tokens and max_new_tokens="
                        f"{seq.max_new} in {seq.n} sequences may hold {pages} pages "
                        f"of {served.cache.config.page_size} positions on the "
                        f"{'flat layers' if not rows else f'ring layers of {rows} rows'}, "
                        f"more than their pool's {bound}: raise max_pages (or kv_bytes)")
        return seq

    def draw_id(self) -> int:
        """The next request id (drawn in call order)."""
        self.last_id += 1
        return self.last_id

    def queue(self, seq: Sequence) -> int:
        """Queue a checked request's first sequence: its id drawn, its generator seeded."""
        import torch
        rid = self.draw_id()
        generator = torch.Generator(device=self.seating.models[MODEL].device)
        generator.manual_seed(seq.seed if seq.seed is not None else secrets.randbits(63))
        seq.rid, seq.generator = rid, generator
        seq.group.append(seq)
        self.roster.waiting.append(seq)
        return rid

    def admit(self) -> None:
        """Seat waiting requests, in order, while sequences are free and every pool can
        hold what the running requests and the next may come to hold."""
        roster, models = self.roster, self.seating.models
        free = self.config.max_seqs - sum(s.n for s in roster.running)
        reserved = [served.reserved(roster.running) for served in models]
        while roster.waiting and roster.waiting[0].n <= free and all(
                served.fits(r, roster.waiting[0]) for served, r in zip(models, reserved)) \
                and not self._computing_its_prefix(roster.waiting[0]):
            seq = roster.waiting[0]
            roster.stepping.append(seq)
            free -= seq.n
            reserved = [[a + b for a, b in zip(r, served.need(seq))]
                        for served, r in zip(models, reserved)]
            self.seating.open(seq)
            seq.cached = seq.fed
            roster.running.append(roster.waiting.popleft())
            self.counts.prompt_tokens += seq.n_prompt
            self.counts.cached_tokens += seq.fed

    def _computing_its_prefix(self, seq) -> bool:
        """With the prefix cache: whether a running sequence is still prefilling whole
        pages of `seq`'s prompt, which `seq` would match once they are registered (it
        waits for them rather than compute them a second time)."""
        if not self.seating.prefix_cache:
            return False
        size, prompt = self.config.page_size, seq.tokens[:seq.n_prompt - 1]
        for other in self.roster.running:
            if other.fed < other.n_prompt and other.extra == seq.extra:
                shared = shared_pages(prompt, other.tokens[:other.n_prompt], size)
                if shared > other.fed // size:
                    return True
        return False


def shared_pages(a: list, b: list, page_size: int) -> int:
    """Whole pages of `a` that `b` begins with too."""
    n = min(len(a), len(b)) // page_size * page_size
    differs = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return (int(differs[0]) if differs.size else n) // page_size
