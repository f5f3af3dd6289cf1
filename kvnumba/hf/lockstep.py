"""Ranks in lockstep: rank 0's step decisions replayed on the other ranks of a model split
by its tensor-parallel plan (contract §13).

Each rank's cache holds that rank's kv heads, and the model's forward is one computation
over all the ranks (its projections meet in collectives), so every rank must run the
model over the same packed steps, in the same order, and its cache must take the same
verbs. Rank 0 owns the queue, the scheduling and the sampling. Every verb it applies to a
served model's session table (`LeadingModel`: a request's session opened from its
prompt, a fork, pages offered to the prefix index, a finished session closed) is
recorded; before each run of a model, the records and the run's inputs go to the other
ranks in one `torch.distributed.broadcast_object_list` on the lockstep's process group
(below), and they apply them to their own tables and run the model over the same inputs
(their rewinds come with the inputs, as `SessionTable.pack` makes them). At the end of a step
rank 0 broadcasts the requests it finished, whether it is still busy and its counters,
so every rank's `step()` returns what rank 0's does. No transport of kvnumba's own.

The other ranks map rank 0's session ids onto their own: equal while the ranks agree,
and a rank whose tables were changed behind the engine's back still replays the step,
so the check below can name it. With `check=True`, after each step every rank digests
its tables (each sequence slot's state, positions, floor and page tables; the sessions;
the pools' counts) and the requests it has drawn ids for, the digests are gathered with
the step's outcome (`all_gather_object`, below) and every rank raises the same
`RankDivergenceError`, naming the step and the ranks that differ from rank 0, when they
do not all agree.

Every collective of the lockstep goes over a gloo process group of its own, opened once
over the model's ranks (`control_group`), never over the group the model's own
collectives use: a rank that stops in the middle of a step can never have its messages
taken for one of the model's all-reduces, and their waits are bounded by the engine's
`rank_timeout`. A rank that dies or hangs makes the other ranks' next wait raise
`RankFailureError` within that time.

Failures (contract §13). Before each forward every rank meets at a gate
(`Lockstep.gate`, one `all_gather_object`): where any rank's verbs or step preparation
raised, every rank skips the forward and raises the same exception (the lowest failing
rank's), so the ranks' caches and the model's collectives stay in step and the engine
serves on. At the end of each step every rank reports what failed on it alone since the
gate (`Lockstep._settle`): where every rank's forward raised (the same fault on each,
such as memory), the step ends as a failure on rank 0 does, every rank raising rank 0's
exception; where only some ranks' did, or a collective failed, the ranks' collectives
or caches are out of step and every rank raises `RankFailureError`, as every later
step does: the job must be restarted.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import pickle
from datetime import timedelta

from .. import SlotState
from ..errors import RankDivergenceError, RankFailureError
from .served import TABLE_VERBS, ServedModel

#: what each part of a rank's digest covers, in the digest's order after the requests
MODEL_NAMES = ("the model's cache", "the draft model's cache")


#: the lockstep's process groups, by members and timeout (`control_group`)
_GROUPS: dict = {}


def control_group(members: tuple, timeout: float):
    """The lockstep's gloo process group over global ranks `members`, its collectives
    waiting at most `timeout` seconds: opened once per members and timeout (every process
    of the job opens it, as `torch.distributed.new_group` asks, in the same order: the
    engines made in the same order on every rank), destroyed at exit (`close_groups`)."""
    import torch.distributed as dist
    if not _GROUPS:
        atexit.register(close_groups)
    key = (members, timeout)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(ranks=list(members), backend="gloo",
                                      timeout=timedelta(seconds=timeout))
    return _GROUPS[key]


def close_groups() -> None:
    """Destroy the lockstep's process groups (at exit, where the job has not destroyed
    them). A gloo group left to the end of the process frees its last collective's
    buffers from its own thread, which needs the interpreter: while Python finalizes,
    that thread is killed and the process aborts (SIGABRT, or SIGSEGV)."""
    import torch.distributed as dist
    if dist.is_initialized():
        for group in _GROUPS.values():
            dist.destroy_process_group(group)
    _GROUPS.clear()


class Lockstep:
    """This rank's side of the lockstep (module doc) for the served models an engine makes
    through `serve` (the model's first, then its draft's), over `sharding`'s ranks, each
    wait at most `timeout` seconds."""

    def __init__(self, sharding, *, check: bool, timeout: float):
        import torch.distributed as dist
        self.sharding = sharding
        self.timeout = timeout
        self.group = control_group(sharding.members, timeout)
        self.leading = sharding.rank == 0
        self.check = check
        self.source = dist.get_global_rank(self.group, 0)     # the group's rank 0, globally
        self.models: list[SplitModel] = []
        self._sids: list[dict] = []      # per model: rank 0's session ids -> this rank's
        self._pending: list = []         # rank 0: the verbs applied since the last broadcast
        self.steps = 0                   # steps taken, counted from 1
        # the other ranks: whether rank 0 is busy, as its last step said (or a submit since),
        # and whether its engine closed (`Engine.follow` returns)
        self.busy, self.stopped = False, False
        #: why the ranks can no longer serve together (None while they can)
        self.broken: str | None = None
        # this step: whether the run's gate was passed, the failure it raised on this rank,
        # and what failed on this rank alone since (a forward, or a verb rank 0 took)
        self.gated, self.relayed, self.stray = False, None, None

    def serve(self, model, config) -> SplitModel:
        """The model served on this rank: rank 0's records its verbs for the others."""
        served = (LeadingModel if self.leading else SplitModel)(model, config, self)
        self.models.append(served)
        self._sids.append({})
        return served

    def refuse_broken(self) -> None:
        """`RankFailureError` once the ranks can no longer serve together."""
        if self.broken is not None:
            raise RankFailureError(self.broken)

    # ------------------------------------------------------------------ rank 0
    def record(self, served, verb: str, args: tuple, made=None) -> None:
        """Note a verb rank 0 applied to `served`'s table with `args` (and the session id
        it `made`), for the next broadcast."""
        self._pending.append((self.models.index(served), verb, args, made))

    def send_run(self, served, inputs, rows) -> None:
        """Send the verbs recorded so far and a run of `served` over `inputs` (logits at
        `rows`) to the other ranks, which start it as rank 0 does."""
        inputs = [(int(sid), int(start), [int(t) for t in tokens])
                  for sid, start, tokens in inputs]
        self.record(served, "run", (inputs, [int(row) for row in rows]))
        self._broadcast([self._pending])
        self._pending = []

    def end_step(self, finished: list, busy: bool, counters: tuple, ids: int,
                 failure: BaseException | None = None, *, stop: bool = False) -> None:
        """Send the rest of the step and its end: the requests `finished`, whether rank 0
        is still `busy`, its `counters`, the exception its step raised (None) and whether
        the other ranks `stop` following; then settle the step with the other ranks
        (`ids`: request ids drawn). Nothing is sent once the ranks have lost each other."""
        if self.broken is not None:
            return
        sent = None if failure is None else portable(failure)
        self._pending.append((None, "end", (finished, busy, counters, sent, stop), None))
        self._broadcast([self._pending])
        self._pending = []
        self._settle(ids, failure)

    # ------------------------------------------------------------------ the other ranks
    def follow_step(self, ids: int) -> tuple:
        """Take part in rank 0's next step: apply its verbs and runs as they come, until
        its end; returns `(finished, counters)` as rank 0 sent them (`ids`: request ids
        this rank drew, for the check). Where rank 0's step raised, this rank raises its
        exception at the end (having applied the verbs that ended its requests)."""
        failed = None
        while True:
            message = [None]
            self._broadcast(message)
            for which, verb, args, made in message[0]:
                if verb == "end":
                    finished, self.busy, counters, failure, self.stopped = args
                    if failed is not None and failed is not self.relayed:
                        self.stray = failed     # this rank's tables left rank 0's
                    self._settle(ids, failure)
                    if failure is not None:
                        raise failure
                    return finished, counters
                try:
                    if verb == "run" and failed is not None:
                        self.gate(failed)    # the ranks agree to skip the run
                    self._apply(self.models[which], self._sids[which], verb, args, made)
                except RankFailureError:
                    raise
                except Exception as exc:     # noqa: BLE001  (raised at the step's end)
                    failed = exc

    @staticmethod
    def _apply(served, sids: dict, verb: str, args: tuple, made) -> None:
        """One of rank 0's verbs on this rank's `served`, its session ids mapped (`made`:
        the session id rank 0's verb returned)."""
        if verb == "run":
            inputs, rows = args
            served.run([(sids[sid], start, tokens) for sid, start, tokens in inputs], rows)
            return
        spec = TABLE_VERBS[verb]
        mapped = (sids[args[0]],) + args[1:] if spec.takes else args
        result = getattr(served, verb)(*mapped)
        if spec.makes:
            sids[made] = result
        if spec.ends:
            del sids[args[0]]

    # ------------------------------------------------------------------ every rank
    def gate(self, failure: BaseException | None) -> None:
        """Meet every rank before a forward, telling them what made this rank unable to
        run it (`failure`, None when it can); where any rank cannot, raise the lowest
        such rank's exception on every rank (this rank's own where it is that rank)."""
        self.gated = True
        every = self._gather(None if failure is None else portable(failure))
        first = next((exc for exc in every if exc is not None), None)
        if first is None:
            return
        if failure is not None and every.index(first) == self.sharding.rank:
            first = failure
        self.relayed = first
        raise first

    def _settle(self, ids: int, failure: BaseException | None) -> None:
        """End the step on every rank together (`failure`: rank 0's exception, or None):
        gather what failed on each rank alone since its gate and, with `check`, each
        rank's digest. Where some ranks failed alone, unless every rank did with the same
        exception (the same fault, at the same point of the forward),
        `RankFailureError` (the job must restart); where the digests differ,
        `RankDivergenceError`."""
        self.steps += 1
        stray, self.stray, self.relayed = self.stray, None, None
        digest = (str(ids),) + tuple(tables_digest(served) for served in self.models) \
            if self.check else ()
        every = self._gather((None if stray is None else portable(stray), digest))
        strays = {rank: exc for rank, (exc, _) in enumerate(every) if exc is not None}
        said = {f"{type(exc).__name__}: {exc}" for exc in strays.values()}
        if strays and (len(strays) < len(every) or len(said) > 1):
            told = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}"
                             for rank, exc in strays.items())
            self.broken = (f"step {self.steps}: the model failed on some ranks, not on "
                           f"every rank alike ({told}); the ranks' caches and the model's "
                           f"collectives are out of step: every rank's engine is unusable, "
                           f"restart the job")
            error = RankFailureError(self.broken)
            error.failed_requests = getattr(failure, "failed_requests", ())
            raise error
        if self.check:
            self._compare([digest for _, digest in every])

    def _compare(self, every: list) -> None:
        """`RankDivergenceError` on every rank unless every rank's digest is rank 0's."""
        parts = ("the requests submitted",) + MODEL_NAMES
        differ = {rank: [part for part, a, b in zip(parts, theirs, every[0]) if a != b]
                  for rank, theirs in enumerate(every) if theirs != every[0]}
        if differ:
            which = "; ".join(f"rank {rank} in {' and '.join(what)}"
                              for rank, what in differ.items())
            raise RankDivergenceError(
                f"step {self.steps}: {_ranks(differ)} from rank 0 "
                f"({which}: sequence states, positions, page tables, sessions, pool counts); "
                f"every rank must make the same Engine calls, and nothing else may change an "
                f"engine's caches")

    def _broadcast(self, message: list) -> None:
        import torch.distributed as dist
        self._collective(dist.broadcast_object_list, message, src=self.source)

    def _gather(self, mine) -> list:
        """Every rank's `mine`, in rank order."""
        import torch.distributed as dist
        every = [None] * self.sharding.ranks
        self._collective(dist.all_gather_object, every, mine)
        return every

    def _collective(self, call, *args, **kwargs) -> None:
        """`call` on the lockstep's group; `RankFailureError` (the ranks then lost for
        good) where it fails: a rank died, or did not meet this one within the timeout."""
        try:
            call(*args, group=self.group, **kwargs)
        except RuntimeError as exc:      # torch.distributed's errors (DistError and others)
            self.broken = (f"step {self.steps + 1}: the ranks lost each other "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0]}): a rank died, "
                           f"or did not meet this one within rank_timeout="
                           f"{self.timeout:g} s; every rank's engine is unusable, restart the "
                           f"job")
            raise RankFailureError(self.broken) from exc


def portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling (as a broadcast sends it), else a `RuntimeError`
    naming its type and message."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:                       # noqa: BLE001  (any unpicklable exception)
        return RuntimeError(f"rank 0's step raised {type(exc).__name__}: {exc}")


def _ranks(differ: dict) -> str:
    """"rank 1 differs", "ranks 1, 3 differ"."""
    if len(differ) == 1:
        return f"rank {next(iter(differ))} differs"
    return f"ranks {', '.join(map(str, differ))} differ"


class SplitModel(ServedModel):
    """A served model on one rank of a split model: every run meets the other ranks at the
    lockstep's gate before its forward, or after its step preparation raised."""

    def __init__(self, model, config, lockstep: Lockstep):
        super().__init__(model, config)
        self.lockstep = lockstep

    def run(self, inputs, rows):
        lockstep = self.lockstep
        lockstep.gated = False
        try:
            return super().run(inputs, rows)
        except BaseException as exc:
            if not lockstep.gated:
                lockstep.gate(exc)           # raises on every rank
            if exc is not lockstep.relayed:
                lockstep.stray = exc         # failed in the forward: maybe on this rank alone
            raise

    def entering(self) -> None:
        """At the gate before the forward (raising any rank's failure)."""
        self.lockstep.gate(None)


class LeadingModel(SplitModel):
    """A served model on rank 0 (module doc): each verb of `TABLE_VERBS` is applied, then
    recorded for the other ranks; each run is sent to them before it starts, since every
    rank enters the model's forward together."""

    def run(self, inputs, rows):
        self.lockstep.send_run(self, inputs, rows)
        return super().run(inputs, rows)


def _recorded(spec):
    """`ServedModel`'s verb `spec`, applied and then recorded on rank 0's lockstep."""
    verb = getattr(ServedModel, spec.name)

    @functools.wraps(verb)
    def recorded(self, *args):
        result = verb(self, *args)
        sent = (int(args[0]),) + args[1:] if spec.takes else args
        self.lockstep.record(self, spec.name, sent, int(result) if spec.makes else None)
        return result
    return recorded


for _spec in TABLE_VERBS.values():
    setattr(LeadingModel, _spec.name, _recorded(_spec))


def tables_digest(served) -> str:
    """A digest of `served`'s cache and session tables: every sequence slot's state,
    position, high-water and floor and, for a live one, its page table on each layer
    page group; the sessions with their sequences and positions; each pool's counts and the
    prefix index's."""
    cache, table = served.cache, served.table
    digest = hashlib.blake2b(digest_size=16)
    kinds = [pool.layers[0] for pool in cache.pool_pages()]
    for seq in range(cache.max_seqs):
        state = cache.state(seq)
        digest.update(repr((seq, int(state), cache.pos(seq), cache.high_water(seq),
                            cache.floor(seq))).encode())
        if state != SlotState.FREE:
            for layer in kinds:
                digest.update(cache.page_table(seq, layer).tobytes())
    digest.update(repr([(int(sid), table.seq(sid), table.pos(sid))
                        for sid in table.sessions]).encode())
    digest.update(repr((cache.pool_pages(), tuple(cache.prefix_counts))).encode())
    return digest.hexdigest()
