"""`Engine`: a `transformers` causal LM served through kvnumba, with continuous
batching, forks and speculative decoding.

Each engine step packs every running request's next tokens into one token axis
(`SessionTable.pack`): a decoding request's last token (or, with a draft model, that
token and the draft's proposals to verify), and chunks of at most `max_write` prompt
tokens of requests still prefilling, within `max_step` tokens. The model runs once
over the packed axis with the step's positions; logits are computed only at the rows
that choose a token. Requests join (`submit`) and leave (`step` returns them) between
steps; one that cannot be admitted waits: until enough sequences are free, and, with a
bounded page pool (`max_pages`), until the pages its sequences may come to hold are
(each of its `n` sequences at its prompt plus `max_new_tokens`, and their rings), so a
step of the running requests never finds a pool exhausted.
"""
from __future__ import annotations

import contextlib
import itertools
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .. import BatchedSequenceCache, SessionTable, run_inputs
from ..args import as_count, is_int
from ..errors import CapacityError, ConfigError
from .attention import ATTENTION, register
from .config import cache_config, text_config
from .sampling import Sampling


@dataclass
class Request:
    """One sequence being generated (a request with `n > 1` is `n` of them, forked
    from the first once its prompt is prefilled)."""

    rid: int
    tokens: list            # prompt, then the tokens generated so far
    n_prompt: int
    max_new: int
    sampling: Sampling
    eos: frozenset
    generator: object
    n: int = 1              # forks still to make from this one after its prefill
    sid: int | None = None  # its session in the target's table (None: waiting)
    dsid: int | None = None  # its session in the draft's table
    fed: int = 0            # positions the target's cache holds that stand
    dfed: int = 0           # positions the draft's cache holds that stand
    done: bool = False
    group: list = field(default_factory=list)   # the request's sequences, in order (shared)

    @property
    def new(self) -> list:
        return self.tokens[self.n_prompt:]

    def finish_if_due(self) -> None:
        """Done at `max_new` tokens or at an eos token (kept, as the last one); tokens
        past either (accepted drafts beyond it) are dropped."""
        new = self.new
        limit = next((i + 1 for i, t in enumerate(new) if t in self.eos), self.max_new)
        limit = min(limit, self.max_new)
        if len(new) >= limit:
            del self.tokens[self.n_prompt + limit:]
            self.done = True


class Model:
    """A model and its own cache and session table, run one packed step at a time."""

    def __init__(self, model, config):
        self.model = model
        self.cache = BatchedSequenceCache(config)
        self.table = SessionTable(self.cache, max_sessions=config.max_seqs,
                                  max_session_tokens=config.capacity)
        self.device = next(model.parameters()).device
        # per layer kind: (its ring rows, 0 for the flat layers; the pages its pool hands
        # out at most: all it can give while the cache holds nothing)
        self.kinds = [(pool.rows, pool.free) for pool in self.cache.pool_pages()]

    def pages_for(self, positions: int, n: int) -> list:
        """Per layer kind, the most pages `n` sequences of up to `positions` positions
        hold (no sharing counted: forks may hold fewer)."""
        return [n * pages for pages in self.cache.config.sequence_pages(positions)]

    def need(self, request) -> list:
        """Per layer kind, the most pages `request`'s sequences come to hold."""
        return self.pages_for(request.n_prompt + request.max_new, request.n)

    def reserved(self, requests) -> list:
        """Per layer kind, what `requests` may come to hold together."""
        return [sum(column) for column in zip([0] * len(self.kinds),
                                              *map(self.need, requests))]

    def fits(self, reserved: list, request) -> bool:
        """Whether `request`'s sequences fit the pools beside `reserved` pages."""
        return all(r + n <= bound for r, n, (_, bound) in
                   zip(reserved, self.need(request), self.kinds))

    @contextlib.contextmanager
    def _attention(self):
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = ATTENTION
        try:
            yield
        finally:
            config._attn_implementation = before

    def run(self, inputs, rows):
        """Run the model over `inputs` (`(sid, start, tokens)`, packed in this order) and
        return its logits `[len(rows), vocab]` at packed rows `rows` (one step of the
        step driver: any error aborts it)."""
        import torch

        def forward(packed, plan):
            ids = torch.as_tensor(np.asarray(packed.tokens, np.int64), device=self.device)[None]
            positions = torch.as_tensor(plan.positions.astype(np.int64), device=self.device)
            keep = torch.as_tensor(np.asarray(rows, np.int64), device=self.device)
            with torch.inference_mode(), self._attention():
                return self.model(input_ids=ids, position_ids=positions[None],
                                  use_cache=False, logits_to_keep=keep,
                                  kvnumba_cache=self.cache).logits[0]
        return run_inputs(self.table, inputs, forward)


class Engine:
    """Serve `model` (a `transformers` causal LM whose attention goes through its
    AttentionInterface) through a kvnumba cache.

    `max_seqs` sequences at once (a request with `n > 1` takes `n`), each of at most
    `capacity` positions; `max_write` prompt tokens per request per step (default
    `min(capacity, 256)`) and `max_step` tokens per step (default `max_write +
    max_seqs * (draft_len + 1)`: every request's decode or verify beside one prompt
    chunk); `dtype`: the storage
    dtype (default: the model's). `draft_model`: a smaller model with the same
    vocabulary that proposes `draft_len` tokens per step for the model to verify
    (speculative decoding; with `temperature=0` the output is the model's own greedy
    output). `cache_options` go to `CacheConfig` (`page_size`, `initial_pages`, `max_pages`).
    """

    def __init__(self, model, *, max_seqs: int, capacity: int, max_write: int | None = None,
                 max_step: int | None = None, dtype: str | None = None, draft_model=None,
                 draft_len: int = 4, **cache_options):
        register()
        self.draft_len = as_count(draft_len, "draft_len", 1) if draft_model else 0
        config = cache_config(model, max_seqs=max_seqs, capacity=capacity,
                              max_write=max_write, max_step=max_step, dtype=dtype,
                              tokens_per_decode=self.draft_len + 1, **cache_options)
        if config.max_write < self.draft_len + 1:
            raise ConfigError(f"max_write={config.max_write}: verifying a draft writes "
                              f"draft_len + 1 = {self.draft_len + 1} tokens of a request in "
                              f"one step; raise max_write or lower draft_len")
        self.vocab = text_config(model.config).vocab_size
        if draft_model is not None and text_config(draft_model.config).vocab_size != self.vocab:
            raise ConfigError(f"draft_model: vocabulary of "
                              f"{text_config(draft_model.config).vocab_size} tokens, the "
                              f"model's has {self.vocab}")
        self.config = config
        self.target = Model(model, config)
        self.draft = None
        if draft_model is not None:
            self.draft = Model(draft_model, cache_config(
                draft_model, max_seqs=max_seqs, capacity=capacity,
                max_write=config.max_write, max_step=config.max_step, dtype=dtype,
                **cache_options))
        self._ids = itertools.count(1)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self.proposed = self.accepted = 0      # draft tokens proposed / accepted so far

    # ------------------------------------------------------------------ requests
    @property
    def busy(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self._waiting or self._running)

    @property
    def acceptance_rate(self) -> float | None:
        """Draft tokens accepted / proposed so far (None before any was proposed)."""
        return self.accepted / self.proposed if self.proposed else None

    def submit(self, prompt, *, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, eos_token_id=None,
               n: int = 1) -> int:
        """Queue a request; returns its id. `step()` reports it when done: its new
        tokens (with `n > 1`, a list of `n` such lists, the prompt prefilled once and
        forked). Refused (`ConfigError`, `CapacityError`) before anything is queued:
        an empty prompt or one with ids outside the vocabulary, a prompt plus
        `max_new_tokens` past `capacity`, `n` past `max_seqs`, bad sampling options."""
        import torch
        tokens = self._prompt(prompt)
        max_new = as_count(max_new_tokens, "max_new_tokens", 1)
        n = as_count(n, "n", 1)
        sampling = Sampling(temperature, top_p)
        if len(tokens) + max_new > self.config.capacity:
            raise CapacityError(f"a prompt of {len(tokens)} tokens and max_new_tokens="
                                f"{max_new} need {len(tokens) + max_new} positions; capacity "
                                f"is {self.config.capacity}")
        if n > self.config.max_seqs:
            raise CapacityError(f"n={n} sequences: the engine holds max_seqs="
                                f"{self.config.max_seqs}")
        for model in self._models():
            need = model.pages_for(len(tokens) + max_new, n)
            for (rows, bound), pages in zip(model.kinds, need):
                if pages > bound:
                    raise CapacityError(
                        f"a prompt of {len(tokens)} tokens and max_new_tokens={max_new} "
                        f"in {n} sequences may hold {pages} pages of "
                        f"{model.cache.config.page_size} positions on the "
                        f"{'flat layers' if not rows else f'ring layers of {rows} rows'}, "
                        f"more than their pool's {bound}: raise max_pages")
        if seed is not None and not is_int(seed):
            raise ConfigError(f"seed={seed!r}: must be an int or None")
        generator = torch.Generator(device=self.target.device)
        generator.manual_seed(int(seed) if seed is not None else int(torch.seed()))
        rid = next(self._ids)
        request = Request(rid, tokens, len(tokens), max_new, sampling, _eos(eos_token_id),
                          generator, n=n)
        request.group.append(request)
        self._waiting.append(request)
        return rid

    def generate(self, prompts, *, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, eos_token_id=None,
                 n: int = 1) -> list:
        """The new tokens of each prompt (`n > 1`: `n` lists per prompt, in order),
        served with continuous batching; `seed` seeds prompt `i` with `seed + i`."""
        rids = [self.submit(p, max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=top_p, seed=None if seed is None else seed + i,
                            eos_token_id=eos_token_id, n=n)
                for i, p in enumerate(prompts)]
        results = {}
        while self.busy:
            results.update(self.step())
        out = []
        for rid in rids:
            out.extend(results[rid] if n > 1 else [results[rid]])
        return out

    # ------------------------------------------------------------------ the loop
    def step(self) -> list:
        """Run one engine step; returns `(request id, tokens)` of the requests that
        finished in it."""
        self._admit()
        plan = self._plan()
        self._running = self._running[1:] + self._running[:1]   # a fair turn at the budget
        if not plan:
            return []
        drafts = self._propose(plan) if self.draft else {}
        self._verify(plan, drafts)
        return self._retire()

    def _models(self) -> list:
        return [self.target] + ([self.draft] if self.draft else [])

    def _admit(self) -> None:
        """Open sessions for waiting requests, in order, while sequences are free and
        every pool can hold what the running requests and the next may come to hold."""
        free = self.config.max_seqs - sum(r.n for r in self._running)
        models = self._models()
        reserved = [model.reserved(self._running) for model in models]
        while self._waiting and self._waiting[0].n <= free and all(
                model.fits(r, self._waiting[0]) for model, r in zip(models, reserved)):
            request = self._waiting.popleft()
            free -= request.n
            reserved = [[a + b for a, b in zip(r, model.need(request))]
                        for model, r in zip(models, reserved)]
            request.sid = self.target.table.open()
            if self.draft:
                request.dsid = self.draft.table.open()
            self._running.append(request)

    def _plan(self) -> list:
        """`(request, tokens to feed, draft tokens wanted)` for this step, within
        `max_step` tokens: decoding requests first, then prompt chunks."""
        budget, plan = self.config.max_step, []
        decoding = [r for r in self._running if r.fed >= r.n_prompt]
        for request in decoding:
            room = self.config.capacity - len(request.tokens)
            k = min(self.draft_len, room, request.max_new - len(request.new) - 1)
            feed = request.tokens[request.fed:]
            if len(feed) + k > budget:
                continue
            budget -= len(feed) + k
            plan.append((request, feed, k))
        for request in self._running:
            if request.fed < request.n_prompt and budget > 0:
                chunk = min(self.config.max_write, request.n_prompt - request.fed, budget)
                budget -= chunk
                plan.append((request, request.tokens[request.fed:request.fed + chunk], 0))
        return plan

    def _propose(self, plan) -> dict:
        """Run the draft model for the step: its first run prefills the step's prompt
        chunks and catches each decoding request up to its last token, then one run per
        draft token. `{rid: (drafts, their draft probabilities or None)}`."""
        import torch
        wanted = {r.rid: k for r, _, k in plan if k}
        proposals = {rid: ([], []) for rid in wanted}
        inputs, rows, order, at = [], [], [], 0
        for request, feed, k in plan:
            tokens = feed if request.fed < request.n_prompt else request.tokens[request.dfed:]
            if request.fed < request.n_prompt or k:
                inputs.append((request.dsid, request.dfed, tokens))
                request.dfed += len(tokens)
                at += len(tokens)
            if k:
                rows.append(at - 1)
                order.append(request)
        while inputs:
            logits = self.draft.run(inputs, rows)
            inputs, rows, still = [], [], []
            for i, request in enumerate(order):
                drafts, probs = proposals[request.rid]
                if request.sampling.greedy:
                    token = int(logits[i].argmax())
                else:
                    p = request.sampling.probabilities(logits[i:i + 1])
                    token = int(torch.multinomial(p, 1, generator=request.generator)[0, 0])
                    probs.append(p[0])
                drafts.append(token)
                if len(drafts) < wanted[request.rid]:      # feed it for the next one
                    inputs.append((request.dsid, request.dfed, [token]))
                    request.dfed += 1
                    rows.append(len(rows))
                    still.append(request)
            order = still
        return {rid: (drafts, torch.stack(probs) if probs else None)
                for rid, (drafts, probs) in proposals.items()}

    def _verify(self, plan, drafts) -> None:
        """Run the model over the step: prompt chunks, decoding tokens and the drafts to
        verify; choose each request's tokens."""
        inputs, rows, spans = [], [], []
        at = 0
        for request, feed, k in plan:
            proposed = drafts.get(request.rid, ([], None))[0]
            tokens = feed + proposed
            inputs.append((request.sid, request.fed, tokens))
            at += len(tokens)
            ends_prompt = request.fed + len(feed) >= request.n_prompt
            first = at - len(proposed) - 1
            picks = list(range(first, at)) if ends_prompt else []
            spans.append((len(rows), len(picks)))
            rows += picks
        logits = self.target.run(inputs, rows)
        for (request, feed, k), (row, count) in zip(plan, spans):
            request.fed += len(feed)
            if not count:
                continue
            proposed, probs = drafts.get(request.rid, ([], None))
            chosen = request.sampling.accept(logits[row:row + count], proposed, probs,
                                             request.generator)
            self.proposed += len(proposed)
            self.accepted += len(chosen) - 1
            if request.n > 1:                          # prompt done: fork it
                self._fork(request, logits[row:row + 1])
            request.fed = len(request.tokens) + len(chosen) - 1
            request.tokens += chosen
            if self.draft:
                request.dfed = min(request.dfed, request.fed)
            request.finish_if_due()

    def _fork(self, request, logits) -> None:
        """`request.n - 1` copies of a request whose prompt is prefilled, each with its
        own first token from the same logits."""
        import torch
        for i in range(1, request.n):
            generator = torch.Generator(device=self.target.device)
            generator.manual_seed(int(torch.randint(2**62, (), generator=request.generator)))
            child = Request(request.rid, list(request.tokens), request.n_prompt,
                            request.max_new, request.sampling, request.eos, generator,
                            sid=self.target.table.clone(request.sid), fed=request.fed,
                            group=request.group)
            if self.draft:
                child.dsid = self.draft.table.clone(request.dsid)
                child.dfed = request.dfed
            child.tokens.append(int(request.sampling.choose(logits, generator)[0]))
            child.fed = len(child.tokens) - 1
            child.finish_if_due()
            request.group.append(child)
            self._running.append(child)
        request.n = 1

    def _retire(self) -> list:
        """Close the sessions of finished sequences; `(rid, tokens)` of each request all
        of whose sequences are done (`n > 1`: the list of their token lists)."""
        finished, reported = [], set()
        for request in [r for r in self._running if r.done]:
            self._running.remove(request)
            self.target.table.close(request.sid)
            if self.draft:
                self.draft.table.close(request.dsid)
            group = request.group
            if id(group) not in reported and all(s.done for s in group) and group[0].n == 1:
                reported.add(id(group))
                outs = [s.new for s in group]
                finished.append((request.rid, outs if len(outs) > 1 else outs[0]))
        return finished

    def _prompt(self, prompt) -> list:
        """A prompt as a list of token ids, or `ConfigError`."""
        try:
            array = np.asarray(prompt)
        except ValueError as exc:
            raise ConfigError(f"prompt: expected a 1-D sequence of token ids ({exc})") from exc
        if array.size == 0:
            raise ConfigError("prompt: empty; a request needs at least one token")
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise ConfigError(f"prompt: expected a 1-D sequence of int token ids, got shape "
                              f"{array.shape} dtype {array.dtype}")
        bad = array[(array < 0) | (array >= self.vocab)]
        if bad.size:
            raise ConfigError(f"prompt: token ids {bad[:4].tolist()} outside the vocabulary "
                              f"[0, {self.vocab})")
        return array.tolist()


def _eos(eos_token_id) -> frozenset:
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if is_int(eos_token_id) else list(eos_token_id)
    if not all(is_int(i) for i in ids):
        raise ConfigError(f"eos_token_id={eos_token_id!r}: an int, a list of ints or None")
    return frozenset(int(i) for i in ids)
