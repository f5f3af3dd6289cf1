"""The single-sequence cache and its BatchControl face (contract §10).

`SequenceCache` holds exactly one sequence. It is built on the same machinery as
the batched cache — a `BatchedSequenceCache` with one sequence slot and *no*
scratch page, holding sequence 0 — so planning, the declared slot lifecycle, the
kernels and every refusal are shared. Padding tokens of a padded step get
`seq_cols` entry -1 and are written nowhere. (`sequence_control.SequenceBatchControl`
gives it the BatchControl face with one sequence, id 0.)
"""
from __future__ import annotations

import numpy as np

from ..args import as_int, describe
from .batched import BatchedSequenceCache
from ..config import CacheConfig
from ..errors import CapacityError, ConfigError, ShapeError, StepProtocolError
from ..protocol import BatchControl
from ..refusals import split_hint
from ..host.slots import SlotState, StepState
from ..host.step import StepPlan

#: the one sequence's id
ONLY_SEQ = 0


def _inner_value(name: str, doc: str) -> property:
    """A read-only property answering `self._inner.<name>`."""
    return property(lambda self: getattr(self._inner, name), doc=doc)


class OneSequenceFace:
    """What `SequenceCache` and `SequenceBatchControl` do alike, through the one-slot
    `BatchedSequenceCache` underneath (`_inner`): queries of the cache, the step verbs
    after the declaration, and the data path of a prepared step."""

    _inner: BatchControl

    config = _inner_value("config", "The cache's shape and limits (`CacheConfig`).")
    stream = _inner_value("stream", "The CUDA stream of every launch and copy.")
    step_state = _inner_value("step_state", "`StepState.IDLE | DECLARED | PREPARED`.")
    plan = _inner_value("plan", "The open step's plan (`StepPlan`), or None between steps.")
    nbytes = _inner_value("nbytes", "Bytes of K/V storage allocated over all layers.")
    nbytes_held = _inner_value("nbytes_held", "Bytes of the pages the sequence holds over "
                                              "all layers.")

    def layer_data(self, layer: int):
        """`(k, v)` page pools of `layer`, `[n_pages, page_size, n_kv_heads, head_dim]`
        device arrays of the storage dtype."""
        return self._inner.layer_data(layer)

    def prepare_step(self, width: int | None = None) -> StepPlan:
        """Stage the step at `width` tokens (`n_tokens <= width <= max_step`, default
        `n_tokens`); padding tokens get `seq_cols` -1 and position 0 and are not written."""
        return self._inner.prepare_step(width)

    def commit_step(self) -> None:
        """Advance the sequence by the step's tokens: `pos += n_tokens`, COMMITTED;
        refused as `BatchedSequenceCache.commit_step` refuses a step written in some
        layers only (`StepProtocolError`; `abort_step` discards it)."""
        self._inner.commit_step()

    def abort_step(self) -> None:
        """Close the step without advancing (a prepared step raises the high-water)."""
        self._inner.abort_step()

    def write(self, layer: int, k, v) -> None:
        """Write the prepared step's K and V `[width, n_kv_heads, head_dim]` into `layer`."""
        self._inner.write(layer, k, v)

    def attend(self, layer: int, q, out=None, *, scale=None, softcap=None, lse=None,
               sinks=None):
        """Causal (windowed on ring layers) attention of the step's queries `[width,
        n_q_heads, head_dim]` over the sequence's history; padding rows of `out` are zero.
        Default scale `1/sqrt(head_dim)`; `softcap` applies `c * tanh(s / c)`. `lse`
        (float32 `[width, n_q_heads]`) receives each row's log-sum-exp of its scores
        (`BatchedSequenceCache.attend`); `sinks` (float32 `[n_q_heads]`) joins each head's
        logit to its softmax."""
        return self._inner.attend(layer, q, out, scale=scale, softcap=softcap, lse=lse,
                                  sinks=sinks)

    def update_and_attend(self, layer: int, q, k, v, **kw):
        """`write(layer, k, v)` then `attend(layer, q, **kw)`."""
        return self._inner.update_and_attend(layer, q, k, v, **kw)


class SequenceCache(OneSequenceFace):
    """A KV cache for exactly one sequence (`config.max_seqs` must be 1).

    Storage per layer: K and V page pools `[n_pages, page_size, n_kv_heads, head_dim]`
    holding only its sequence's pages (no scratch page). A fresh cache holds its sequence
    CLAIMED and empty. The sequence
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
    def pos(self) -> int:
        """Positions the sequence holds (the next token takes this position)."""
        return self._inner.pos(ONLY_SEQ)

    @property
    def floor(self) -> int:
        """Lowest position `rewind` accepts (0 without ring layers, or before a ring wraps)."""
        return self._inner.floor(ONLY_SEQ)

    @property
    def high_water(self) -> int:
        """Most positions ever written into the storage since the sequence was last cleared."""
        return self._inner.high_water(ONLY_SEQ)

    @property
    def capacity(self) -> int:
        """Most positions the sequence may hold (`config.capacity`)."""
        return self._inner.config.capacity

    @property
    def state(self) -> SlotState:
        """The sequence's lifecycle state (FREE only after a `SequenceBatchControl.seq_rm`)."""
        return self._inner.state(ONLY_SEQ)

    # ------------------------------------------------------------------ sequence verbs
    def rewind(self, position: int) -> None:
        """Move back to `position`, `floor <= position <= pos`; no bytes move.

        Between steps only; the sequence must hold history (COMMITTED or REWOUND),
        else `SlotStateError`. Below the floor: `RingFloorError`.
        """
        self._inner.rewind(ONLY_SEQ, position)

    def clear(self) -> None:
        """Empty the sequence: pos 0, high-water 0, CLAIMED (bytes are not zeroed).

        Between steps only (`StepProtocolError` otherwise). A FREE sequence is claimed.
        """
        inner = self._inner
        if inner.step_state != StepState.IDLE:
            raise StepProtocolError(f"clear: a step is open ({inner.step_state.name}); clear "
                                    f"runs between steps (commit_step or abort_step first)")
        if inner.state(ONLY_SEQ) != SlotState.FREE:
            inner.seq_rm(ONLY_SEQ)
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
            raise CapacityError(f"declare_step: sequence {ONLY_SEQ} writes {n_tokens} tokens, more "
                                f"than max_write {self.config.max_write}; "
                                f"{split_hint(self.config)}")
        return self._inner.declare_step(self._zeros[:n_tokens],
                                        blocks=self._block if block else ())

    def sequence_kv(self, layer: int):
        """`(positions, k, v)`: host copies of what `layer` still holds, in position order."""
        return self._inner.sequence_kv(ONLY_SEQ, layer)

    def __repr__(self):
        return (f"SequenceCache(pos={self.pos}, high_water={self.high_water}, "
                f"state={self.state.name}, step={self.step_state.name})")
