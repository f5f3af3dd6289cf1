"""The state kind (contract §17): a hybrid model's mixer layer, which keeps a fixed-size
state per sequence instead of K/V per position: the input window of a depthwise causal
convolution (`conv=(channels, width)`) and/or a recurrent state, the gated delta
rule's (`recurrent=(heads, k_dim, v_dim)`) or Mamba2's SSD's (`recurrent=(heads,
head_dim, d_state)`).

Storage is a column per sequence slot plus the scratch column (no pages):

* the window as a ring of `conv_rows = min(capacity, width - 1 + M)` input rows by
  position (position `p` in row `p % conv_rows`, `[cols, conv_rows, channels]`, the
  cache's storage dtype): a step writes its inputs first and every token reads its
  `width - 1` predecessors from the ring, so the rows of `[hw - M, hw)` and the `width -
  1` before them are always there;
* the recurrent state `[cols, heads, k_dim, v_dim]` (`state_dtype`: float32, or
  bfloat16 rounded each time it is stored) at the column's live
  position, a base state at a base position at or below the floor, and a ring of the
  step inputs of the last `log_rows = min(capacity, 3 M)` positions (k, v, a per-channel
  log-decay and beta, float32; the ssd's `d x`, B and `d A` in the same arrays): a
  sequence resumed below its live position (a rewind, a clone, an aborted step) replays
  the inputs since its base, exactly as they were first applied
  (`kernels.state.recurrence`).

For floors the layer is a ring of window 1 (`M` rows): once `hw > M` it restores any
position in `[hw - M, pos]`, below that `RingFloorError`. A clone copies the columns
eagerly. The layer takes no pages, reads no K/V, and stores no bytes per position; its
bytes per sequence (`sequence_bytes`) count every array above.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..arith.positions import ring_floor, ring_rows

#: bytes of a (float32) log element
LOG_ITEMSIZE = 4
#: log rows per position of `max_write`: a base at most `M` behind the floor, the floor
#: `M` behind the high-water, and one step of `M` more (`kernels.state.recurrence`)
LOG_WRITES = 3


@dataclass(frozen=True)
class State:
    """A state layer (`kv.state(conv=..., recurrent=...)`): `conv` `(channels, width)` or
    None, `recurrent` `(heads, k_dim, v_dim)` or None, at least one of them."""

    conv: tuple | None
    recurrent: tuple | None
    name = "state"
    stores = False
    v_in_k = False
    window = None
    keeps_state = True

    def source(self, layer: int) -> int:
        return layer

    def describe(self) -> str:
        parts = []
        if self.conv is not None:
            parts.append(f"conv {self.conv[0]} channels x {self.conv[1]}")
        if self.recurrent is not None:
            h, dk, dv = self.recurrent
            parts.append(f"recurrent {h} heads x {dk} x {dv}")
        return ", ".join(parts)

    @property
    def mask_code(self) -> int:
        return 0

    def validate(self, layer: int, config) -> None:
        """Every config serves a state layer (its shape is checked by `LayerSpec`)."""

    # ------------------------------------------------------------------ bytes
    def position_bytes(self, shape, itemsize: int) -> int:
        return 0

    def conv_rows(self, max_write: int, capacity: int) -> int:
        """Rows of the window's ring: the width - 1 inputs before the oldest position a
        sequence resumes at, and `max_write` more."""
        return ring_rows(self.conv[1], max_write, capacity) if self.conv else 0

    def log_rows(self, max_write: int, capacity: int) -> int:
        """Rows of the recurrent inputs' ring (module doc)."""
        return min(capacity, LOG_WRITES * max_write) if self.recurrent else 0

    def column_bytes(self, itemsize: int, state_itemsize: int, max_write: int,
                     capacity: int) -> dict:
        """Bytes one sequence's column takes, by part: `window` (the conv ring, elements
        of `itemsize`), `state` (the live and base states, of `state_itemsize`) and `log`
        (the recurrent inputs' ring, float32)."""
        window = state = log = 0
        if self.conv is not None:
            window = self.conv_rows(max_write, capacity) * self.conv[0] * itemsize
        if self.recurrent is not None:
            h, dk, dv = self.recurrent
            state = 2 * h * dk * dv * state_itemsize
            log = self.log_rows(max_write, capacity) * h * (2 * dk + dv + 1) * LOG_ITEMSIZE
        return {"window": window, "state": state, "log": log}

    def snapshot_bytes(self, itemsize: int, state_itemsize: int) -> int:
        """Bytes of one prefix snapshot of the layer (contract §17): its state (elements
        of `state_itemsize`) and the `width - 1` conv inputs (of `itemsize`) before the
        snapshot's position."""
        window = (self.conv[1] - 1) * self.conv[0] * itemsize if self.conv else 0
        if self.recurrent is None:
            return window
        h, dk, dv = self.recurrent
        return window + h * dk * dv * state_itemsize

    def sequence_bytes(self, itemsize: int, state_itemsize: int, max_write: int,
                       capacity: int) -> int:
        """Bytes one sequence holds on this layer whatever its length (`column_bytes`)."""
        return sum(self.column_bytes(itemsize, state_itemsize, max_write, capacity).values())

    def planes(self, shape) -> tuple:
        return ()

    # ------------------------------------------------------------------ floors
    def rows(self, max_write: int, capacity: int) -> int:
        """The positions it restores, as a ring of window 1: `min(capacity, M)`."""
        return ring_rows(1, max_write, capacity)

    def floor(self, high_water, rows: int, max_write: int):
        return ring_floor(high_water, rows, max_write)

    def floor_key(self, rows: int):
        return rows, 0

    def resumed_high_water(self, position: int, max_write: int) -> int:
        """A prefix hit restores the state at `position` and no input before it: its floor
        is `position` (a high-water `max_write` past it)."""
        return position + max_write

    def resume_needs(self) -> str:
        return "its state at p"
