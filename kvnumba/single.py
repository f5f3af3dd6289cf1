"""The single-sequence cache and its BatchControl face (contract §10).

`SequenceCache` holds exactly one sequence. It is built on the same machinery as
the batched cache — a `BatchedSequenceCache` with one sequence slot and *no*
scratch page, holding sequence 0 — so planning, the declared slot lifecycle, the
kernels and every refusal are shared. Padding tokens of a padded step get
`seq_cols` entry -1 and are written nowhere.

`SequenceBatchControl` gives a `SequenceCache` the neutral BatchControl face with
one sequence (id 0), so a `SessionTable` can serve one session at a time on it.
"""
from __future__ import annotations

import numpy as np

from .batched import BatchedSequenceCache
from .config import CacheConfig
from .args import SessionId, as_int, describe
from .errors import CapacityError, CloneRefusedError, ConfigError, ShapeError, StepProtocolError
from .refusals import split_hint
from .step import StepPlan
from .slots import SlotState, StepState

_SEQ = 0  # the one sequence's id


class SequenceCache:
    """A KV cache for exactly one sequence (`config.max_seqs` must be 1).

    Storage per layer: K and V page pools `[n_pages, page_size, n_kv_heads, head_dim]`
    holding only its sequence's pages (no scratch page). A fresh cache holds its sequence CLAIMED and empty. The sequence
    follows the declared slot lifecycle of contract §6: `rewind` needs history
    (COMMITTED or REWOUND), the step verbs follow the step protocol, and every
    refusal is typed and changes nothing.

    `device`: the CUDA device holding the storage (an int id or a Numba device; None:
    the current one); `stream`: the CUDA stream every launch and copy goes on (Numba's
    default if None). Both as for `BatchedSequenceCache`.
    """

    def __init__(self, config: CacheConfig, device=None, stream=None):
        if not isinstance(config, CacheConfig):
            raise ConfigError(f"config: expected a CacheConfig, got {type(config).__name__}")
        if config.max_seqs != 1:
            raise ConfigError(f"max_seqs={config.max_seqs}: a SequenceCache holds exactly one "
                              f"sequence, so it requires max_seqs == 1")
        self._inner = BatchedSequenceCache(config, device, stream, scratch_column=False)
        self._inner.seq_new()
        self._zeros = np.zeros(config.max_write, dtype=np.int64)  # seq_ids of any step
        self._zeros.setflags(write=False)
        self._block = np.zeros(1, dtype=np.int64)
        self._block.setflags(write=False)

    # ------------------------------------------------------------------ queries
    @property
    def config(self) -> CacheConfig:
        return self._inner.config

    @property
    def stream(self):
        """The CUDA stream of every launch and copy."""
        return self._inner.stream

    @property
    def pos(self) -> int:
        """Positions the sequence holds (the next token takes this position)."""
        return self._inner.pos(_SEQ)

    @property
    def floor(self) -> int:
        """Lowest position `rewind` accepts (0 without ring layers, or before a ring wraps)."""
        return self._inner.floor(_SEQ)

    @property
    def high_water(self) -> int:
        """Most positions ever written into the storage since the sequence was last cleared."""
        return self._inner.high_water(_SEQ)

    @property
    def capacity(self) -> int:
        """Most positions the sequence may hold (`config.capacity`)."""
        return self._inner.config.capacity

    @property
    def state(self) -> SlotState:
        """The sequence's lifecycle state (FREE only after a `SequenceBatchControl.seq_rm`)."""
        return self._inner.state(_SEQ)

    @property
    def step_state(self) -> StepState:
        """`StepState.IDLE | DECLARED | PREPARED`."""
        return self._inner.step_state

    @property
    def plan(self) -> StepPlan | None:
        """The open step's plan, or None between steps."""
        return self._inner.plan

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage allocated over all layers (its pools' pages)."""
        return self._inner.nbytes

    @property
    def nbytes_held(self) -> int:
        """Bytes of the pages the sequence holds over all layers."""
        return self._inner.nbytes_held

    def layer_data(self, layer: int):
        """`(k, v)` page pools of `layer`, `[n_pages, page_size, n_kv_heads, head_dim]`."""
        return self._inner.layer_data(layer)

    # ------------------------------------------------------------------ sequence verbs
    def rewind(self, position: int) -> None:
        """Move back to `position`, `floor <= position <= pos`; no bytes move.

        Between steps only; the sequence must hold history (COMMITTED or REWOUND),
        else `SlotStateError`. Below the floor: `RingFloorError`.
        """
        self._inner.rewind(_SEQ, position)

    def clear(self) -> None:
        """Empty the sequence: pos 0, high-water 0, CLAIMED (bytes are not zeroed).

        Between steps only (`StepProtocolError` otherwise). A FREE sequence is claimed.
        """
        inner = self._inner
        if inner.step_state != StepState.IDLE:
            raise StepProtocolError(f"clear: a step is open ({inner.step_state.name}); clear "
                                    f"runs between steps (commit_step or abort_step first)")
        if inner.state(_SEQ) != SlotState.FREE:
            inner.seq_rm(_SEQ)
        inner.seq_new()

    # ------------------------------------------------------------------ step protocol
    def declare_step(self, n_tokens: int, *, block: bool = False) -> StepPlan:
        """Open a step of `n_tokens` tokens at positions `pos .. pos + n_tokens - 1`.

        `block=True`: the tokens are a draft block, bidirectional within itself.
        Refused: an open step, a FREE sequence, `n_tokens > max_write`,
        `pos + n_tokens > capacity` (`CapacityError`), `n_tokens < 1` (`ShapeError`).
        """
        n_tokens = as_int(n_tokens, "declare_step: n_tokens")
        if n_tokens < 1:
            raise ShapeError(f"declare_step: n_tokens={n_tokens} must be >= 1")
        if not isinstance(block, (bool, np.bool_)):
            raise ShapeError(f"declare_step: block must be True or False, got {describe(block)}")
        if n_tokens > self._zeros.size:  # past max_write: refused without building its ids
            self._inner.check_declarable(self._block)
            raise CapacityError(f"declare_step: sequence {_SEQ} writes {n_tokens} tokens, more "
                                f"than max_write {self.config.max_write}; "
                                f"{split_hint(self.config)}")
        return self._inner.declare_step(self._zeros[:n_tokens],
                                        blocks=self._block if block else ())

    def prepare_step(self, width: int | None = None) -> StepPlan:
        """Stage the step at `width` tokens (`n_tokens <= width <= max_step`, default
        `n_tokens`); padding tokens get `seq_cols` -1 and position 0 and are not written."""
        return self._inner.prepare_step(width)

    def commit_step(self) -> None:
        """Advance the sequence by the step's tokens: `pos += n_tokens`, COMMITTED.

        A step that wrote some layers and not others is refused (`StepProtocolError`
        naming the unwritten layers; `abort_step` discards it); a step that wrote no
        layer commits positions only.
        """
        self._inner.commit_step()

    def abort_step(self) -> None:
        """Close the step without advancing (a prepared step raises the high-water)."""
        self._inner.abort_step()

    # ------------------------------------------------------------------ data path
    def write(self, layer: int, k, v) -> None:
        """Write the prepared step's K and V `[width, n_kv_heads, head_dim]` into `layer`."""
        self._inner.write(layer, k, v)

    def attend(self, layer: int, q, out=None, *, scale=None, softcap=None, lse=None):
        """Causal (windowed on ring layers) attention of the step's queries `[width,
        n_q_heads, head_dim]` over the sequence's history; padding rows of `out` are zero.
        Default scale `1/sqrt(head_dim)`; `softcap` applies `c * tanh(s / c)`. `lse`
        (float32 `[width, n_q_heads]`) receives each row's log-sum-exp of its scores
        (`BatchedSequenceCache.attend`)."""
        return self._inner.attend(layer, q, out, scale=scale, softcap=softcap, lse=lse)

    def update_and_attend(self, layer: int, q, k, v, **kw):
        """`write(layer, k, v)` then `attend(layer, q, **kw)`."""
        return self._inner.update_and_attend(layer, q, k, v, **kw)

    def sequence_kv(self, layer: int):
        """`(positions, k, v)`: host copies of what `layer` still holds, in position order."""
        return self._inner.sequence_kv(_SEQ, layer)

    def __repr__(self):
        return (f"SequenceCache(pos={self.pos}, high_water={self.high_water}, "
                f"state={self.state.name}, step={self.step_state.name})")


class SequenceBatchControl:
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
        if (inner.state(_SEQ) == SlotState.CLAIMED and inner.pos(_SEQ) == 0
                and inner.high_water(_SEQ) == 0):
            inner.seq_rm(_SEQ)

    # ------------------------------------------------------------------ queries
    @property
    def max_seqs(self) -> int:
        """Always 1."""
        return 1

    @property
    def config(self) -> CacheConfig:
        return self.cache.config

    @property
    def step_state(self) -> StepState:
        return self._inner.step_state

    @property
    def plan(self) -> StepPlan | None:
        return self._inner.plan

    @property
    def nbytes(self) -> int:
        return self._inner.nbytes

    def layer_data(self, layer: int):
        return self._inner.layer_data(layer)

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

    def prepare_step(self, width: int | None = None) -> StepPlan:
        """Stage the step at `width` tokens; padding tokens are not written."""
        return self.cache.prepare_step(width)

    def commit_step(self) -> None:
        self.cache.commit_step()

    def abort_step(self) -> None:
        self.cache.abort_step()

    # ------------------------------------------------------------------ data path
    def write(self, layer: int, k, v) -> None:
        self.cache.write(layer, k, v)

    def attend(self, layer: int, q, out=None, *, scale=None, softcap=None, lse=None):
        return self.cache.attend(layer, q, out, scale=scale, softcap=softcap, lse=lse)

    def update_and_attend(self, layer: int, q, k, v, **kw):
        return self.cache.update_and_attend(layer, q, k, v, **kw)

    def sequence_kv(self, seq: int, layer: int):
        """`(positions, k, v)` of sequence `seq` (only 0 exists) on `layer`."""
        return self._inner.sequence_kv(seq, layer)
