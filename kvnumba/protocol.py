"""The BatchControl face written down (contract §7, §8): what the session table, the step
driver and an integration may call on any cache.

`BatchControl` is the neutral control face every cache offers (`BatchedSequenceCache`,
`SequenceBatchControl`): sequence verbs, per-slot queries and the step protocol.
`StepData` is the data path inside a prepared step. Both are `typing.Protocol`s, so a
type checker holds an implementation to them and `isinstance(x, BatchControl)` tells
whether `x` has every member (by name, as runtime protocols do).

`PrefixControl` is the prefix index (contract §14) a control may offer besides
(`BatchedSequenceCache` does; `SequenceBatchControl` does not), a runtime protocol too;
`members_lacking` names the members of a face an object lacks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:   # names for the annotations only: the face imports no implementation
    import numpy as np

    from .config import CacheConfig
    from .host.slots import SlotState, StepState
    from .host.step import StepPlan


class IndexCounts(NamedTuple):
    """The prefix index of a cache (`PrefixControl.prefix_counts`): `pages` of positions it
    indexes now, `pages_evicted` so far (each a page of positions: its page in every page
    group), and `nbytes_cached`, the bytes of pages only it holds (reclaimable) and of its
    state snapshots (contract §17)."""

    pages: int
    pages_evicted: int
    nbytes_cached: int


@runtime_checkable
class BatchControl(Protocol):
    """Sequence slots `0 .. max_seqs - 1` and the step protocol over them.

    Sequence verbs run between steps; a refused call raises a typed `KVCacheError` and
    changes nothing. Ids are ints (a session id is refused).
    """

    @property
    def config(self) -> CacheConfig:
        """The cache's shape and limits (`capacity`, `max_write`, `max_step`, ...)."""

    @property
    def max_seqs(self) -> int:
        """Sequence slots handed out."""

    @property
    def step_state(self) -> StepState:
        """`IDLE`, `DECLARED` or `PREPARED`."""

    @property
    def plan(self) -> StepPlan | None:
        """The open step's read-only plan, or None between steps."""

    def seq_new(self) -> int:
        """Claim the lowest free slot (CLAIMED, pos 0)."""

    def seq_rm(self, seq: int) -> None:
        """Free a sequence (FREE, pos 0, high-water 0)."""

    def seq_clone(self, src: int, upto: int | None = None) -> int:
        """A new COMMITTED sequence holding `src`'s first `upto` positions."""

    def rewind(self, seq: int, position: int) -> None:
        """Move back to `position`, `floor <= position <= pos`."""

    def pos(self, seq: int) -> int:
        """Positions the sequence holds (0 for a free slot)."""

    def floor(self, seq: int) -> int:
        """Lowest position it can rewind or be cloned to."""

    def high_water(self, seq: int) -> int:
        """Most positions ever written since it was claimed."""

    def state(self, seq: int) -> SlotState:
        """Its lifecycle state (`FREE` for a free slot)."""

    def declare_step(self, seq_ids, *, blocks=()) -> StepPlan:
        """Open a step: one sequence id per token (`int` list or int array `[n_tokens]`)."""

    def prepare_step(self, width: int | None = None) -> StepPlan:
        """Stage the declared step at `width` tokens (`n_tokens <= width <= max_step`)."""

    def commit_step(self) -> None:
        """Advance every sequence of the step by its tokens."""

    def abort_step(self) -> None:
        """Close the step without advancing."""


@runtime_checkable
class StepData(Protocol):
    """The data path of a prepared step of `width` tokens (contract §8)."""

    def write(self, layer: int, k, v) -> None:
        """Write K and V, each `[width, n_kv_heads, head_dim]`, into `layer`."""

    def attend(self, layer: int, q, out=None, *, scale=None, softcap=None, lse=None,
               sinks=None):
        """Attention of q `[width, n_q_heads, head_dim]` over each token's own history;
        returns `out` `[width, n_q_heads, head_dim]` (q's dtype unless given); `sinks`
        (float32 `[n_q_heads]`): each head's logit joins its softmax (contract §15)."""

    def update_and_attend(self, layer: int, q, k, v, **kw):
        """`write(layer, k, v)`, then `attend(layer, q, **kw)`, every argument checked
        first."""

    def sequence_kv(self, seq: int, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Host copies `(positions [n], k [n, n_kv_heads, head_dim], v [n, ...])` of what
        `layer` still holds for `seq`, in position order."""


@runtime_checkable
class PrefixControl(Protocol):
    """A prefix index over a control's pages (contract §14): sequences started from the
    pages of an indexed prefix of page keys (`prefix_keys.page_keys`), and committed pages
    offered to the index. Verbs run between steps; a refusal changes nothing."""

    @property
    def prefix_counts(self) -> IndexCounts:
        """What the index holds and has given back (`pages`, `pages_evicted`, ...)."""

    def prefix_match(self, keys) -> int:
        """How many leading keys of `keys` the index holds. Changes nothing."""

    def seq_from_prefix(self, keys) -> int:
        """Claim the lowest free slot holding the longest indexed prefix of `keys` (with no
        match it is `seq_new`)."""

    def prefix_register(self, seq: int, keys) -> int:
        """Index `seq`'s committed pages under `keys`; returns the leading keys now
        indexed."""

    def prefix_forget(self, keys) -> int:
        """Drop the index entries of `keys`; returns how many were indexed."""


def members_lacking(obj, face: type) -> list:
    """The public members of protocol `face` that `obj` lacks, in the order `face` lists
    them (empty when `isinstance(obj, face)`)."""
    return [name for name in vars(face) if not name.startswith("_")
            and not hasattr(obj, name)]


#: the members a BatchControl has, in the order the protocol lists them
BATCH_CONTROL_MEMBERS = tuple(name for name in vars(BatchControl)
                              if not name.startswith("_"))
