"""`SequenceBatchControl`: the BatchControl face (contract §7, §10) over a single-sequence
cache, so that a `SessionTable` serves one session at a time on it."""
from __future__ import annotations

from ..args import SessionId
from ..errors import CloneRefusedError, ConfigError
from .single import ONLY_SEQ, OneSequenceFace, SequenceCache
from ..host.slots import SlotState
from ..host.step import StepPlan


class SequenceBatchControl(OneSequenceFace):
    """The BatchControl face (contract §7) over a `SequenceCache`: one sequence, id 0.

    `seq_new` claims the sequence (`CacheFullError` while it is in use), `seq_rm`
    clears and frees it, `seq_clone` always raises `CloneRefusedError`; every other
    verb goes to the cache, validated by the same declared slot lifecycle.

    Starting state: if the cache's sequence is CLAIMED and empty (pos 0, high-water
    0, e.g. a freshly built cache), the control frees it, so the first `seq_new`
    returns 0. Otherwise (it holds history, is in a step, or is already FREE) the
    control adopts it as it is: a live sequence 0 must be `seq_rm`-ed before the
    next `seq_new`.
    """

    def __init__(self, cache: SequenceCache):
        if not isinstance(cache, SequenceCache):
            raise ConfigError(f"cache: expected a SequenceCache, got {type(cache).__name__}")
        self.cache = cache
        self._inner = cache._inner
        inner = self._inner
        if (inner.state(ONLY_SEQ) == SlotState.CLAIMED and inner.pos(ONLY_SEQ) == 0
                and inner.high_water(ONLY_SEQ) == 0):
            inner.seq_rm(ONLY_SEQ)

    # ------------------------------------------------------------------ queries
    @property
    def max_seqs(self) -> int:
        """Always 1."""
        return 1

    def pos(self, seq: int) -> int:
        """Positions sequence `seq` (only 0 exists) holds; 0 when free."""
        return self._inner.pos(seq)

    def floor(self, seq: int) -> int:
        return self._inner.floor(seq)

    def high_water(self, seq: int) -> int:
        return self._inner.high_water(seq)

    def state(self, seq: int) -> SlotState:
        return self._inner.state(seq)

    # ------------------------------------------------------------------ sequence verbs
    def seq_new(self) -> int:
        """Claim sequence 0 (CLAIMED, pos 0); `CacheFullError` while it is in use."""
        return self._inner.seq_new()

    def seq_rm(self, seq: int) -> None:
        """Clear and free sequence 0 (FREE, pos 0, high-water 0)."""
        self._inner.seq_rm(seq)

    def seq_clone(self, src: int, upto: int | None = None) -> int:
        """Always refused with `CloneRefusedError`: there is no second sequence slot (a
        session id for `src` is a `SessionError`, as on every BatchControl). Changes
        nothing."""
        if isinstance(src, SessionId):
            raise src.refusal("seq_clone")
        raise CloneRefusedError(f"seq_clone: sequence {src!r} (upto {upto!r}) cannot be cloned: "
                                f"a single-sequence cache has max_seqs 1 and no slot for a "
                                f"copy")

    def rewind(self, seq: int, position: int) -> None:
        """`floor(seq) <= position <= pos(seq)`; no bytes move."""
        self._inner.rewind(seq, position)

    # ------------------------------------------------------------------ step protocol
    def declare_step(self, seq_ids, *, blocks=()) -> StepPlan:
        """Open a step: one sequence id (always 0) per token; see `BatchedSequenceCache`."""
        return self._inner.declare_step(seq_ids, blocks=blocks)

    def sequence_kv(self, seq: int, layer: int):
        """`(positions, k, v)` of sequence `seq` (only 0 exists) on `layer`."""
        return self._inner.sequence_kv(seq, layer)
