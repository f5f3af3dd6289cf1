"""`Engine`: a `transformers` causal LM served through kvnumba, with continuous
batching, forks and speculative decoding.

Each engine step packs every running request's next tokens into one token axis
(`SessionTable.pack`): a decoding request's last token (or, with a draft model, that
token and the draft's proposals to verify), and chunks of at most `max_write` prompt
tokens of requests still prefilling, within `max_step` tokens. The model runs once
over the packed axis with the step's positions; logits are computed only at the rows
that choose a token. Requests join (`submit`) and leave (`step` returns them) between
steps; one that cannot be admitted waits: until enough sequences are free, and, with a
bounded page pool (`max_pages`, `kv_bytes`), until the pages its sequences may come to
hold are (each of its `n` sequences at its prompt plus `max_new_tokens`, and their
rings), so a step of the running requests never finds a pool exhausted.

A request is checked whole before anything is queued, drawn or seeded (`requests`),
and the engine leaves process-wide state alone: each request samples from its own
`torch.Generator`, seeded with its `seed` or with fresh entropy, never from torch's
global generators.

With the prefix cache (the default), each cache remembers the pages its requests
computed (contract §14): a request is admitted holding the longest indexed prefix of its
prompt (whole pages, never all of it) in the model's cache and the draft's, and every
request registers its committed positions, prompt and output, each time a page of them
is complete, so later requests sharing a prefix, across requests and over time, skip
computing it. Cached pages are reclaimable: admission counts them as available.

A model split over ranks by its tensor-parallel plan (`from_pretrained(...,
tp_plan="auto")` under torchrun) is served by an engine on every rank, each rank's caches
holding its kv heads (`sharding`). Rank 0's engine queues, schedules and samples; every
step's decisions reach the other ranks' engines through `torch.distributed` collectives
on the model's process group (`lockstep`), so their caches take the same steps.
"""
from __future__ import annotations

import secrets
from collections import deque
from typing import NamedTuple

import numpy as np

from ..args import as_count
from ..errors import CapacityError, ConfigError
from .attention import register
from .config import cache_config, refuse_dropout, text_config
from .lockstep import Lockstep
from .requests import Request, checked_prompts, checked_request, checked_seed
from .served import ServedModel
from .sharding import check_draft, sharding


class EngineStats(NamedTuple):
    """What the prefix cache saved (`Engine.stats`): `prompt_tokens` of the requests
    admitted so far, `cached_tokens` of them served from the model's prefix index,
    `hit_rate` (cached over prompt tokens, 0.0 before any) and the model's cache's
    `pages_evicted`."""

    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    pages_evicted: int


class Engine:
    """Serve `model` (a `transformers` causal LM whose attention goes through its
    AttentionInterface) through a kvnumba cache.

    `max_seqs` sequences at once (a request with `n > 1` takes `n`), each of at most
    `capacity` positions; `max_write` prompt tokens per request per step (default
    `min(capacity, 256)`) and `max_step` tokens per step (default `max_write +
    max_seqs * (draft_len + 1)`: every request's decode or verify beside one prompt
    chunk); `dtype`: the storage dtype (default: the model's). `draft_model`: a smaller
    model with the same vocabulary that proposes `draft_len` tokens per step for the
    model to verify (speculative decoding; with `temperature=0` the output is the
    model's own greedy output). `kv_bytes`: a byte budget for the K/V storage of every
    cache the engine makes (the model's and the draft's, shared in proportion to their
    bytes per token), each a fixed pool that never grows (`CacheConfig.fixed_pool`);
    without it each pool starts small and doubles as needed up to `max_pages`
    (docs/sizing.md). `cache_options` go to `CacheConfig` (`page_size`,
    `initial_pages`, `max_pages`). `prefix_cache`: reuse the pages of prompt prefixes
    across requests (module doc; `stats` says how much).

    A model in training mode with attention dropout is refused (`ConfigError`): kvnumba
    attends without dropout; put it in eval mode (`model.eval()`).

    A model split over ranks by its tensor-parallel plan needs an engine on every rank of
    its group, each made and called the same way (a script torchrun runs on every rank):
    each rank's caches hold that rank's kv heads (a head count the ranks cannot share is
    refused, and so is a draft model split otherwise), `kv_bytes` is each rank's budget,
    and rank 0's engine serves the requests while the others follow its steps (`submit`,
    `step`: every rank returns what rank 0 returns). `check_ranks`: after each step,
    compare every rank's tables with rank 0's and raise `RankDivergenceError` on every
    rank when they differ (a collective per step, for debugging; nothing in one process).
    """

    def __init__(self, model, *, max_seqs: int, capacity: int, max_write: int | None = None,
                 max_step: int | None = None, dtype: str | None = None, draft_model=None,
                 draft_len: int = 4, kv_bytes: int | None = None, prefix_cache: bool = True,
                 check_ranks: bool = False, **cache_options):
        for name, value in (("prefix_cache", prefix_cache), ("check_ranks", check_ranks)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name}={value!r}: pass True or False")
        self.prefix_cache = prefix_cache
        split = sharding(model)
        if draft_model is not None:
            check_draft(split, sharding(draft_model))
        self.draft_len = as_count(draft_len, "draft_len", 1) if draft_model else 0
        for served in (model, draft_model):
            if served is not None:
                refuse_dropout(served)
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
        configs = [config]
        if draft_model is not None:
            configs.append(cache_config(draft_model, max_seqs=max_seqs, capacity=capacity,
                                        max_write=config.max_write, max_step=config.max_step,
                                        dtype=dtype, **cache_options))
        if kv_bytes is not None:
            configs = budgeted(configs, as_count(kv_bytes, "kv_bytes", 1))
        register()
        self.config = configs[0]
        # rank 0 of a split model leads the others' engines; in one process, none
        self.lockstep = Lockstep(split, check=check_ranks) if split.ranks > 1 else None
        serve = self.lockstep.serve if self.lockstep else ServedModel
        self.target = serve(model, configs[0])
        self.draft = serve(draft_model, configs[1]) if draft_model is not None else None
        self._last_id = 0        # the last request id drawn
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._stepping: list[Request] = []     # the requests the current step admits or runs
        self.proposed = self.accepted = 0      # draft tokens proposed / accepted so far
        self.prompt_tokens = self.cached_tokens = 0   # of admitted requests, from the index

    # ------------------------------------------------------------------ requests
    @property
    def _following(self) -> bool:
        """Whether this engine follows rank 0's steps (a rank other than 0)."""
        return self.lockstep is not None and not self.lockstep.leading

    @property
    def busy(self) -> bool:
        """Whether any request is waiting or running (on a rank other than 0: on rank 0,
        as its last step said, or since a `submit` on this rank)."""
        if self._following:
            return self.lockstep.busy
        return bool(self._waiting or self._running)

    @property
    def stats(self) -> EngineStats:
        """Prompt tokens admitted, those served from the prefix index, the hit rate and
        the pages the model's cache evicted (`EngineStats`)."""
        rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        return EngineStats(self.prompt_tokens, self.cached_tokens, rate,
                           self.target.cache.prefix_counts.pages_evicted)

    @property
    def acceptance_rate(self) -> float | None:
        """Draft tokens accepted / proposed so far (None before any was proposed)."""
        return self.accepted / self.proposed if self.proposed else None

    def submit(self, prompt, *, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, seed: int | None = None, eos_token_id=None,
               n: int = 1, extra_key=None) -> int:
        """Queue a request; returns its id. `step()` reports it when done: its new
        tokens (with `n > 1`, a list of `n` such lists, the prompt prefilled once and
        forked). `prompt`: a list (or 1-D int array) of token ids; `seed`: an int in
        `[0, 2**64)` for the request's own generator (None: fresh entropy; torch's
        global generators are never touched); `eos_token_id`: an int, a list of ints or
        None; `extra_key` (None, bytes or str): what besides the token ids makes the
        request's K/V (a tenant, an adapter, an image digest), part of every prefix-cache
        key it looks up and registers. Every prompt id and option is checked before
        anything is queued, drawn or seeded (`ConfigError`, `CapacityError`).

        On a rank other than 0 of a split model, the request is checked as rank 0 checks
        it and gets the id rank 0's same call gets (ids are drawn in call order), but it
        is rank 0's request that is served: this rank only follows its steps."""
        return self._queue(self._checked(prompt, max_new_tokens, temperature, top_p, seed,
                                         eos_token_id, n, extra_key))

    def generate(self, prompts, *, max_new_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, eos_token_id=None,
                 n: int = 1, extra_key=None) -> list:
        """The new tokens of each prompt (`prompts`: a list of prompts, each a list of
        token ids; `n > 1`: `n` lists per prompt, in order), served with continuous
        batching; `seed` seeds prompt `i` with `seed + i`; `extra_key` as `submit`'s,
        for every prompt. The whole call is checked before any prompt is queued: a
        refusal queues nothing."""
        prompts = checked_prompts(prompts)
        checked_seed(seed, len(prompts) - 1)
        checked = [self._checked(p, max_new_tokens, temperature, top_p,
                                 None if seed is None else seed + i, eos_token_id, n,
                                 extra_key)
                   for i, p in enumerate(prompts)]
        rids = [self._queue(request) for request in checked]
        results = {}
        try:
            while self.busy:
                results.update(self.step())
        except BaseException:
            for rid in rids:                 # the call's other requests end with it
                self.cancel(rid)
            raise
        out = []
        for rid in rids:
            out.extend(results[rid] if n > 1 else [results[rid]])
        return out

    def _checked(self, prompt, max_new_tokens, temperature, top_p, seed, eos_token_id,
                 n, extra_key=None) -> Request:
        """A request whose every option passed, and which every pool could hold."""
        for served in self._models():
            refuse_dropout(served.model)
        request = checked_request(prompt, vocab=self.vocab, capacity=self.config.capacity,
                                  max_seqs=self.config.max_seqs,
                                  max_new_tokens=max_new_tokens, temperature=temperature,
                                  top_p=top_p, seed=seed, eos_token_id=eos_token_id, n=n,
                                  extra_key=extra_key)
        positions = request.n_prompt + request.max_new
        for served in self._models():
            for (rows, bound), pages in zip(served.kinds, served.pages_for(positions,
                                                                           request.n)):
                if pages > bound:
                    raise CapacityError(
                        f"a prompt of {request.n_prompt} tokens and max_new_tokens="
                        f"{request.max_new} in {request.n} sequences may hold {pages} pages "
                        f"of {served.cache.config.page_size} positions on the "
                        f"{'flat layers' if not rows else f'ring layers of {rows} rows'}, "
                        f"more than their pool's {bound}: raise max_pages (or kv_bytes)")
        return request

    def _queue(self, request: Request) -> int:
        """Queue a checked request: its id drawn, its generator seeded (following rank 0:
        its id drawn, this engine busy until rank 0 says otherwise)."""
        import torch
        self._last_id += 1
        if self._following:
            self.lockstep.busy = True
            return self._last_id
        generator = torch.Generator(device=self.target.device)
        generator.manual_seed(request.seed if request.seed is not None else
                              secrets.randbits(63))
        request.rid, request.generator = self._last_id, generator
        request.group.append(request)
        self._waiting.append(request)
        return request.rid

    def cancel(self, rid: int) -> bool:
        """End request `rid` now, between steps: a waiting request leaves the queue, a
        running one's sequences are freed (with `n > 1`, all of them); the pages it
        registered in earlier steps stay indexed. Returns whether it was waiting or
        running (a finished, failed or unknown id: False, nothing changed). On a rank
        other than 0 of a split model: nothing (rank 0's cancel is replayed here)."""
        if self._following:
            return False
        return bool(self._end({rid}))

    # ------------------------------------------------------------------ the loop
    def step(self) -> list:
        """Run one engine step; returns `(request id, tokens)` of the requests that
        finished in it. On a rank other than 0 of a split model: take part in rank 0's
        step, and return what it returns.

        A step in which a model (or anything else) raises ends the requests in it (the
        model run that raised is aborted, as any step of the step driver): their sequences are freed, nothing of
        the failed step is registered in a prefix index (what earlier steps registered
        stays), and the exception propagates with `failed_requests`, the ids of the
        requests it ended. Requests outside the step go on; the engine serves the next
        steps as if the failed requests had never been submitted. On the other ranks of
        a split model, `step()` raises rank 0's exception too."""
        if self._following:
            finished, counters = self.lockstep.follow_step(self._last_id)
            self.proposed, self.accepted, self.prompt_tokens, self.cached_tokens = counters
            return finished
        failure = None
        try:
            finished = self._step()
        except BaseException as exc:
            failure, finished = exc, []
            failed = self._end({r.rid for r in self._stepping})
            _name_failed(exc, failed)
        if self.lockstep:
            counters = self.proposed, self.accepted, self.prompt_tokens, self.cached_tokens
            self.lockstep.end_step(finished, self.busy, counters, self._last_id, failure)
        if failure is not None:
            raise failure
        return finished

    def _end(self, rids: set) -> list:
        """End the requests `rids` (every sequence of each, waiting or running), their
        sessions closed; returns the ids that were waiting or running, in order."""
        ended = sorted({r.rid for r in [*self._waiting, *self._running] if r.rid in rids})
        self._waiting = deque(r for r in self._waiting if r.rid not in rids)
        for request in [r for r in self._running if r.rid in rids]:
            self._running.remove(request)
            self._close(request)
        return ended

    def _close(self, request) -> None:
        """Close `request`'s sessions (those it has opened)."""
        for served, sid in ((self.target, request.sid), (self.draft, request.dsid)):
            if served is not None and sid is not None:
                served.close(sid)
        request.sid = request.dsid = None

    def _step(self) -> list:
        """One step of the engine that serves the requests."""
        self._stepping = []          # the requests this step admits or runs
        self._admit()
        plan = self._plan()
        self._stepping += [request for request, _, _ in plan]
        self._running = self._running[1:] + self._running[:1]   # a fair turn at the budget
        if not plan:
            return []
        drafts = self._propose(plan) if self.draft else {}
        self._verify(plan, drafts)
        if self.prefix_cache:
            self._register(plan)
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
                model.fits(r, self._waiting[0]) for model, r in zip(models, reserved)) \
                and not self._computing_its_prefix(self._waiting[0]):
            request = self._waiting[0]
            self._stepping.append(request)
            free -= request.n
            reserved = [[a + b for a, b in zip(r, model.need(request))]
                        for model, r in zip(models, reserved)]
            self._open(request)
            self._running.append(self._waiting.popleft())
            self.prompt_tokens += request.n_prompt
            self.cached_tokens += request.fed

    def _computing_its_prefix(self, request) -> bool:
        """With the prefix cache: whether a running request is still prefilling whole
        pages of `request`'s prompt, which `request` would match once they are
        registered (it waits for them rather than compute them a second time)."""
        if not self.prefix_cache:
            return False
        size, prompt = self.config.page_size, request.tokens[:request.n_prompt - 1]
        for other in self._running:
            if other.fed < other.n_prompt and other.extra == request.extra:
                shared = shared_pages(prompt, other.tokens[:other.n_prompt], size)
                if shared > other.fed // size:
                    return True
        return False

    def _open(self, request) -> None:
        """Open `request`'s sessions, in the model's table and the draft's, at one
        position: with the prefix cache, the shorter of the two caches' hits on its
        prompt (each cache's later pages are recomputed), so the draft is always fed the
        tokens the model is fed, at the same positions. A refusal closes what it opened."""
        models = self._models()
        prompt = request.tokens[:request.n_prompt]
        hits = [served.indexed(prompt, request.extra) if self.prefix_cache else 0
                for served in models]
        sids = []
        try:
            for served, hit in zip(models, hits):
                sids.append(self._open_at(served, request, min(hits), hit))
            # a match is shortened where a ring pool cannot spare its rows: reopen the
            # longer sessions at the shortest until they agree (positions only fall)
            while len({served.table.pos(sid) for served, sid in zip(models, sids)}) > 1:
                upto = min(served.table.pos(sid) for served, sid in zip(models, sids))
                for i, served in enumerate(models):
                    if served.table.pos(sids[i]) > upto:
                        served.close(sids[i])
                        sids[i] = self._open_at(served, request, upto, upto + 1)
        except BaseException:
            for served, sid in zip(models, sids):
                served.close(sid)
            raise
        request.sid = sids[0]
        request.fed = request.offered = self.target.table.pos(request.sid)
        if self.draft:
            request.dsid = sids[1]
            request.dfed = request.doffered = request.fed

    def _open_at(self, served, request, upto: int, hit: int) -> int:
        """A session of `served`'s table for `request` holding at most `upto` positions of
        its prompt from the prefix index, whose own hit on the prompt is `hit` (the whole
        prompt is looked up unless that is more; without the prefix cache: empty)."""
        if not self.prefix_cache:
            return served.open()
        end = upto + 1 if hit > upto else request.n_prompt
        return served.open(request.tokens[:end], request.extra)

    def _register(self, plan) -> None:
        """Offer each stepped request's newly completed pages of committed positions to
        its caches' prefix indexes (the ring layers keep a page's rows only while their
        windows cover them: registered at once, step by step)."""
        size = self.config.page_size
        for request in {id(r): r for r, _, _ in plan}.values():
            if request.fed // size > request.offered // size:
                self.target.register(request.sid, request.tokens[:request.fed])
                request.offered = request.fed
            if self.draft and request.dfed // size > request.doffered // size:
                self.draft.register(request.dsid, request.tokens[:request.dfed])
                request.doffered = request.dfed

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
            child = Request(list(request.tokens), request.n_prompt, request.max_new,
                            request.sampling, request.eos, None, rid=request.rid,
                            generator=generator, sid=self.target.clone(request.sid),
                            fed=request.fed, group=request.group, extra=request.extra,
                            offered=request.offered, doffered=request.doffered)
            if self.draft:
                child.dsid = self.draft.clone(request.dsid)
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
            self._close(request)
            group = request.group
            if id(group) not in reported and all(s.done for s in group) and group[0].n == 1:
                reported.add(id(group))
                outs = [s.new for s in group]
                finished.append((request.rid, outs if len(outs) > 1 else outs[0]))
        return finished


def shared_pages(a: list, b: list, page_size: int) -> int:
    """Whole pages of `a` that `b` begins with too."""
    n = min(len(a), len(b)) // page_size * page_size
    differs = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return (int(differs[0]) if differs.size else n) // page_size


def budgeted(configs: list, kv_bytes: int) -> list:
    """`configs` made fixed pools sharing `kv_bytes` in proportion to their bytes per
    token (so each holds as many positions); `ConfigError` when a share is too small
    for a pool."""
    total = sum(config.bytes_per_token for config in configs)
    return [config.fixed_pool(kv_bytes * config.bytes_per_token // total) for config in configs]


def _name_failed(exc: BaseException, failed: list) -> None:
    """Tell a step's exception which requests it ended (`failed_requests`, and a note)."""
    try:
        exc.failed_requests = tuple(failed)
    except AttributeError:                  # an exception type that takes no attributes
        pass
    if failed and hasattr(exc, "add_note"):
        exc.add_note(f"kvnumba.hf.Engine: the step failed; requests {failed} ended, their "
                     f"sequences freed")
