"""Typed errors of kvnumba (contract §9).

Every refusal raises one of these and leaves the cache exactly as it was:
slot states, positions, high-waters, the open step and the bytes of every live row.
"""


class KVCacheError(Exception):
    """Base class of every error kvnumba raises on purpose."""


class ConfigError(KVCacheError, ValueError):
    """An invalid `CacheConfig` or `LayerSpec`: names the field and the rule."""


class UnknownSequenceError(KVCacheError, KeyError):
    """A sequence id outside `[0, max_seqs)`, or a free one where a live one is needed."""

    def __str__(self):  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SlotStateError(KVCacheError):
    """An event its slot's lifecycle does not allow from the slot's current state."""


class CacheFullError(KVCacheError):
    """No free sequence slot is left."""


class CapacityError(KVCacheError):
    """A limit on positions or tokens, wherever it is found: `capacity`, `max_write`,
    `max_step`, a `SessionTable`'s `max_session_tokens` (or storage that cannot be had)."""


class PositionError(KVCacheError):
    """A position outside `[floor, pos]` of its sequence."""


class RingFloorError(PositionError):
    """A rewind or clone target below the floor a ring layer still supports."""


class StepProtocolError(KVCacheError):
    """A step verb out of order (declare while a step is open, write before prepare, ...)."""


class OwnerRunError(KVCacheError):
    """A draft-block owner whose tokens do not form exactly one contiguous run in a step."""


class ShapeError(KVCacheError, ValueError):
    """An array of the wrong shape, rank or dtype, refused before any launch."""


class CloneRefusedError(KVCacheError):
    """`seq_clone` on a cache that cannot hold a second sequence."""


class SessionError(KVCacheError):
    """Session identity (an unknown or closed session, too many sessions, a `SessionId`
    where a sequence id belongs) or inputs that do not line up with a session's cursor
    (gaps, overlaps, malformed inputs)."""


class FreeSequenceError(UnknownSequenceError, SlotStateError):
    """A free sequence slot named where a live sequence is needed: both unknown and in the
    wrong state."""


class RankDivergenceError(KVCacheError):
    """The ranks serving a model split by its tensor-parallel plan no longer hold the same
    tables (`kvnumba.hf.Engine(..., check_ranks=True)`): names the step and the ranks that
    differ from rank 0, and in what."""


class RankFailureError(KVCacheError):
    """The ranks serving a model split by its tensor-parallel plan lost each other (a
    rank died, or did not meet the others within `kvnumba.hf.Engine(...,
    rank_timeout=...)`), or the model failed on some ranks only, leaving their caches and
    the model's collectives out of step: names the step, the ranks and what they raised.
    Every later step raises it too; the job must be restarted."""
