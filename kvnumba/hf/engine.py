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

A model in training mode with attention dropout is refused (`ConfigError`): kvnumba
attends without dropout; put it in eval mode (`model.eval()`). With `verify` (the
default), before serving, a short probe runs the model (and the draft) through its own
attention and through kvnumba, and refuses it (`ConfigError`, naming the first decoder
layer that differs and by how much) when they disagree beyond the storage dtype's
tolerance (`kvnumba.hf.probe`: two forwards of 7 tokens per model).

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
over the model's ranks (`lockstep`), so their caches take the same steps.

Such a model needs an engine on every rank of its group, each made and called the same
way (a script torchrun runs on every rank): each rank's caches hold that rank's kv heads
(a head count the ranks cannot share is refused, and so is a draft model split
otherwise), `kv_bytes` is each rank's budget, and rank 0's engine serves the requests
while the others follow its steps (`submit`, `step`: every rank returns what rank 0
returns). Where rank 0 alone takes requests (a server), the other ranks `follow` until
rank 0's engine `close`s. `check_ranks`: after each step, compare every rank's tables
with rank 0's and raise `RankDivergenceError` on every rank when they differ (a
collective per step, for debugging; nothing in one process). A failed step there:
module `lockstep` (`RankFailureError` where the ranks lose each other, a rank not meeting
the others within `rank_timeout` seconds).
"""
from __future__ import annotations

from typing import NamedTuple

from ..args import as_count, as_finite
from ..errors import ConfigError, StepProtocolError
from . import probe, speculative
from .admission import Admission
from .attention import register
from .config import refuse_dropout, served_configs, text_config
from .ending import end, fail_step
from .lockstep import Lockstep
from .requests import Sequence, checked_prompts, checked_seed
from .seating import Seating
from .served import ServedModel
from .sharding import check_draft, sharding
from .state import Counts, Roster
from .stepping import Stepper


#: seconds a rank of a split model waits for the others at the lockstep's collectives
RANK_TIMEOUT = 600.0


class EngineStats(NamedTuple):
    """What the prefix cache saved (`Engine.stats`): `prompt_tokens` of the requests
    admitted so far, `cached_tokens` of them served from the model's prefix index,
    `hit_rate` (cached over prompt tokens, 0.0 before any) and the model's cache's
    `pages_evicted`."""

    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    pages_evicted: int


class Usage(NamedTuple):
    """One request's tokens (`Update.usage`): `prompt_tokens`, `completion_tokens`
    generated so far (over its `n` sequences) and `cached_tokens`, the prompt tokens the
    prefix index served at its admission."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Update(NamedTuple):
    """What one step gave one request (`Engine.stream_step`): its id `rid`, `tokens`
    (one list per sequence of the request, in order: the tokens each gained in the step,
    possibly none), `done` (every sequence finished: the request left the engine) and
    its `usage` so far."""

    rid: int
    tokens: list
    done: bool
    usage: Usage


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

    `verify`, a model in training mode, a model split over ranks (`check_ranks`,
    `rank_timeout`, `follow`): module doc.
    """

    def __init__(self, model, *, max_seqs: int, capacity: int, max_write: int | None = None,
                 max_step: int | None = None, dtype: str | None = None, draft_model=None,
                 draft_len: int = speculative.DRAFT_LEN, kv_bytes: int | None = None,
                 prefix_cache: bool = True, check_ranks: bool = False,
                 rank_timeout: float = RANK_TIMEOUT, verify: bool = True, **cache_options):
        for name, value in (("prefix_cache", prefix_cache), ("check_ranks", check_ranks),
                            ("verify", verify)):
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
        configs = served_configs(model, draft_model, max_seqs=max_seqs, capacity=capacity,
                                 max_write=max_write, max_step=max_step, dtype=dtype,
                                 draft_len=self.draft_len, kv_bytes=kv_bytes,
                                 **cache_options)
        self.vocab = text_config(model.config).vocab_size
        register()
        if verify:
            for served, config in zip((model, draft_model), configs):
                probe.verify(served, config)
        self.config = configs[0]
        # rank 0 of a split model leads the others' engines; in one process, none
        rank_timeout = as_finite(rank_timeout, "rank_timeout", positive=True)
        self.lockstep = (Lockstep(split, check=check_ranks, timeout=rank_timeout)
                         if split.ranks > 1 else None)
        serve = self.lockstep.serve if self.lockstep else ServedModel
        self.target = serve(model, configs[0])
        self.draft = serve(draft_model, configs[1]) if draft_model is not None else None
        # the parts: the sequences held and the counts, shared by the queue and the steps
        self.counts, self._roster = Counts(), Roster()
        self._seating = Seating([self.target] + ([self.draft] if self.draft else []),
                                prefix_cache=prefix_cache, page_size=self.config.page_size)
        parts = dict(roster=self._roster, seating=self._seating, counts=self.counts,
                     config=self.config)
        self._admission = Admission(vocab=self.vocab, **parts)
        self._stepper = Stepper(draft_len=self.draft_len, **parts)
        # per queued request: its sequences (shared with them) and the tokens of each
        # that `stream_step` has reported
        self._streams: dict = {}

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
        return bool(self._roster.waiting or self._roster.running)

    @property
    def stats(self) -> EngineStats:
        """Prompt tokens admitted, those served from the prefix index, the hit rate and
        the pages the model's cache evicted (`EngineStats`)."""
        counts = self.counts
        rate = counts.cached_tokens / counts.prompt_tokens if counts.prompt_tokens else 0.0
        return EngineStats(counts.prompt_tokens, counts.cached_tokens, rate,
                           self.target.cache.prefix_counts.pages_evicted)

    @property
    def acceptance_rate(self) -> float | None:
        """Draft tokens accepted / proposed so far (None before any was proposed)."""
        counts = self.counts
        return counts.accepted / counts.proposed if counts.proposed else None

    proposed = property(lambda self: self.counts.proposed, doc="Draft tokens proposed so far.")
    accepted = property(lambda self: self.counts.accepted, doc="Draft tokens accepted so far.")

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
        return self._queue(self._admission.checked(
            prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            seed=seed, eos_token_id=eos_token_id, n=n, extra_key=extra_key))

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
        checked = [self._admission.checked(p, max_new_tokens=max_new_tokens,
                                           temperature=temperature, top_p=top_p,
                                           seed=None if seed is None else seed + i,
                                           eos_token_id=eos_token_id, n=n, extra_key=extra_key)
                   for i, p in enumerate(prompts)]
        rids = [self._queue(seq) for seq in checked]
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

    def _queue(self, seq: Sequence) -> int:
        """Queue a checked request (following rank 0: its id drawn, this engine busy until
        rank 0 says otherwise)."""
        if self._following:
            self.lockstep.busy = True
            return self._admission.draw_id()
        rid = self._admission.queue(seq)
        self._streams[rid] = (seq.group, [0] * seq.n)
        return rid

    @property
    def waiting(self) -> int:
        """Requests queued and not yet admitted (rank 0's; 0 on the other ranks)."""
        return len(self._roster.waiting)

    @property
    def running(self) -> int:
        """Requests admitted and not yet finished (rank 0's; 0 on the other ranks)."""
        return len({seq.rid for seq in self._roster.running})

    def usage(self, rid: int) -> Usage | None:
        """Request `rid`'s `Usage` so far (None once it finished, was cancelled or failed,
        and for an unknown id)."""
        stream = self._streams.get(rid)
        return None if stream is None else self._usage(stream[0])

    @staticmethod
    def _usage(group: list) -> Usage:
        first = group[0]
        return Usage(first.n_prompt, sum(len(s.new) for s in group), first.cached)

    def cancel(self, rid: int) -> bool:
        """End request `rid` now, between steps: a waiting request leaves the queue, a
        running one's sequences are freed (with `n > 1`, all of them); the pages it
        registered in earlier steps stay indexed. Returns whether it was waiting or
        running (a finished, failed or unknown id: False, nothing changed). On a rank
        other than 0 of a split model: nothing (rank 0's cancel is replayed here)."""
        if self._following:
            return False
        self._streams.pop(rid, None)
        return bool(end(self._roster, self._seating, {rid}))

    # ------------------------------------------------------------------ the loop
    def stream_step(self) -> list:
        """Run one engine step (as `step`); returns an `Update` of each request that gained
        tokens or finished in it: the tokens each of its sequences gained since the last
        `stream_step` (with `step()` calls between, what those steps gave too), whether it
        finished, and its `Usage`. A request's updates, joined, are `step()`'s tokens of
        it. Tokens once reported stand: a sequence is cut at eos or `max_new_tokens`
        before its tokens are reported. A step that raises raises here too (as `step`).
        On a rank other than 0 of a split model: an update of each request rank 0
        finished, all its tokens, and no usage."""
        if self._following:
            return [Update(rid, tokens if tokens and isinstance(tokens[0], list) else [tokens],
                           True, None) for rid, tokens in self.step()]
        finished = {rid for rid, _ in self._advance()}
        updates = []
        for rid, (group, reported) in list(self._streams.items()):
            gained = []
            for i, seq in enumerate(group):
                new = seq.new
                gained.append(new[reported[i]:])
                reported[i] = len(new)
            gained += [[] for _ in range(len(reported) - len(gained))]
            done = rid in finished
            if done:
                del self._streams[rid]
            if done or any(gained):
                updates.append(Update(rid, gained, done, self._usage(group)))
        return updates

    def close(self) -> None:
        """Rank 0 of a split model: end the other ranks' `follow`, between steps (nothing
        in one process or on another rank)."""
        if self.lockstep is not None and self.lockstep.leading:
            self.lockstep.end_step([], False, self.counts.values(), self._admission.last_id,
                                   stop=True)

    def follow(self) -> None:
        """A rank other than 0 of a split model: take part in rank 0's steps until its
        engine `close`s (a server's other ranks, while rank 0 takes the requests);
        `StepProtocolError` anywhere else."""
        if not self._following:
            raise StepProtocolError("follow(): only a rank other than 0 of a split model "
                                    "follows rank 0; call step()")
        while not self.lockstep.stopped:
            self.step()

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
        if self.lockstep:
            self.lockstep.refuse_broken()
        if self._following:
            finished, counters = self.lockstep.follow_step(self._admission.last_id)
            self.counts.set(counters)
            return finished
        finished = self._advance()
        for rid, _ in finished:
            self._streams.pop(rid, None)
        return finished

    def _advance(self) -> list:
        """`step()` on rank 0 (or in one process), the finished requests' streams kept for
        `stream_step` to report their last tokens."""
        failure = None
        try:
            finished = self._step()
        except BaseException as exc:
            failure, finished = exc, []
            fail_step(exc, self._roster, self._seating)
            held = {s.rid for s in [*self._roster.waiting, *self._roster.running]}
            self._streams = {rid: v for rid, v in self._streams.items() if rid in held}
        if self.lockstep:
            self.lockstep.end_step(finished, self.busy, self.counts.values(),
                                   self._admission.last_id, failure=failure)
        if failure is not None:
            raise failure
        return finished

    def _step(self) -> list:
        """One step of the engine that serves the requests: admit, schedule, draft, verify,
        register, retire."""
        roster = self._roster
        roster.stepping = []          # the sequences this step admits or runs
        self._admission.admit()
        schedule = self._stepper.schedule()
        roster.stepping += [seq for seq, _, _ in schedule]
        roster.running = roster.running[1:] + roster.running[:1]   # a fair turn at the budget
        if not schedule:
            return []
        drafts = speculative.propose(self.draft, schedule) if self.draft else {}
        self._stepper.verify(schedule, drafts)
        if self.prefix_cache:
            self._seating.register({id(s): s for s, _, _ in schedule}.values())
        return self._stepper.retire()
