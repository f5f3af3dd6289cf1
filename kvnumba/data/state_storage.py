"""Device storage of a cache's state layers (contract §17): per state layer, one column per
sequence slot plus the scratch column, allocated once at its full size (no pages, no
growth).

Per layer (`kinds.state` says why each is there and its rows):

* `window [cols, conv_rows, channels]` (storage dtype): the conv inputs' ring by position;
* `state`, `base` `[cols, heads, k_dim, v_dim]` (`state_dtype`: float32 or bfloat16
  bits): the live and the base state
  (an ssd layer's `recurrent=(heads, head_dim, d_state)`: `[cols, heads, head_dim,
  d_state]`);
* `log_k [cols, log_rows, heads, k_dim]`, `log_v [cols, log_rows, heads, v_dim]`, `log_g
  [cols, log_rows, heads, k_dim]`, `log_b [cols, log_rows, heads]` (float32): the
  recurrent inputs' ring by position (an ssd layer keeps `d x` in `log_k`, `B` in
  `log_v`, `d A` in `log_g`: `kernels.state.ssd`);
* `marks [cols, 2]` (int32): each column's live and base positions, which only the
  recurrence kernel writes.

A part a layer does not have is None. A clone copies the source column of every array
to the destination column on the device (`copy_column`).

The prefix index's snapshots (contract §17) live in slots beside the columns, per layer
`snap_state [slots, heads, k_dim, v_dim]` (`state_dtype`) and `snap_window [slots, width - 1,
channels]`, grown by doubling (`reserve_snapshots`); the index's host side decides which
slot holds which node's. `capture` rebuilds a column's state at a past position into a
slot (`kernels.state.capture`) and copies its window's rows; `restore` puts a slot back
into a column, its live and base positions at the snapshot's.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..config import CacheConfig
from ..device import cuda
from ..kernels.state import capture as capture_kernel

#: the recurrent part's arrays, in the order the recurrence kernel takes them
RECURRENT_ARRAYS = ("state", "base", "log_k", "log_v", "log_g", "log_b", "marks")


class Rule(NamedTuple):
    """The recurrence a layer's steps run, which its replays and snapshots take alike:
    `op` (`"delta_rule"` or `"ssd"`), a gate per key channel (`per_channel`), beta
    (`has_beta`)."""

    op: str
    per_channel: bool
    has_beta: bool

    @property
    def transposed(self) -> bool:
        """The state stored `[heads, head_dim, d_state]`, the lanes' `[Dv, Dk]` (ssd)."""
        return self.op == "ssd"

    def logs(self, arrays) -> tuple:
        """`(log_k, log_v)` of `arrays` (a `LayerState`) in the lanes' roles (row
        inputs, column inputs: `kernels.state.recurrence`)."""
        if self.transposed:
            return arrays.log_v, arrays.log_k
        return arrays.log_k, arrays.log_v


class LayerState(NamedTuple):
    """One state layer's arrays (module doc); None for a part it does not have."""

    window: object
    state: object
    base: object
    log_k: object
    log_v: object
    log_g: object
    log_b: object
    marks: object


class StateStorage:
    """The state layers' arrays of one cache with `n_cols` columns: `layers[layer]` a
    `LayerState` for a state layer, None for any other; launches and copies on
    `stream`."""

    def __init__(self, config: CacheConfig, n_cols: int, stream=0):
        self.stream, self.config = stream, config
        self.layers = [None] * config.n_layers
        #: per state layer: the `Rule` its steps ran (the one writer: `state_path`), which
        #: a capture replays alike
        self.rules: dict = {}
        self.snap_state, self.snap_window = {}, {}
        self.n_slots = 0
        m, capacity = config.max_write, config.capacity
        for layer in config.state_layers:
            kind = config.kinds[layer]
            window = recurrent = ()
            if kind.conv is not None:
                channels = kind.conv[0]
                window = (cuda.device_array((n_cols, kind.conv_rows(m, capacity), channels),
                                            dtype=config.storage_dtype, stream=stream),)
            if kind.recurrent is not None:
                h, dk, dv = kind.recurrent
                rows = kind.log_rows(m, capacity)
                states = ((n_cols, h, dk, dv), (n_cols, h, dk, dv))
                logs = ((n_cols, rows, h, dk), (n_cols, rows, h, dv), (n_cols, rows, h, dk),
                        (n_cols, rows, h))
                recurrent = tuple(cuda.device_array(shape, dtype=config.state_storage_dtype,
                                                    stream=stream) for shape in states)
                recurrent += tuple(cuda.device_array(shape, dtype=np.float32, stream=stream)
                                   for shape in logs)
                recurrent += (cuda.to_device(np.zeros((n_cols, 2), np.int32), stream=stream),)
            self.layers[layer] = LayerState(*(window or (None,)),
                                            *(recurrent or (None,) * len(RECURRENT_ARRAYS)))

    @property
    def nbytes(self) -> int:
        """Bytes of state storage allocated, over all state layers and columns (not the
        snapshots' slots)."""
        return sum(array.nbytes for arrays in self.layers if arrays is not None
                   for array in arrays if array is not None)

    def reserve_snapshots(self, n: int) -> None:
        """At least `n` snapshot slots (doubling), the slots in use copied over."""
        if n <= self.n_slots:
            return
        size = max(n, 2 * self.n_slots, 4)
        for layer in self.config.state_layers:
            kind = self.config.kinds[layer]
            if kind.recurrent is not None:
                self.snap_state[layer] = self._grown(self.snap_state.get(layer),
                                                     (size, *kind.recurrent),
                                                     self.config.state_storage_dtype)
            if kind.conv is not None:
                channels, width = kind.conv
                self.snap_window[layer] = self._grown(
                    self.snap_window.get(layer), (size, width - 1, channels),
                    self.config.storage_dtype)
        self.n_slots = size

    def _grown(self, old, shape: tuple, dtype):
        fresh = cuda.device_array(shape, dtype=dtype, stream=self.stream)
        if old is not None and old.shape[0]:
            fresh[:old.shape[0]].copy_to_device(old, stream=self.stream)
        return fresh

    def capture(self, caps: np.ndarray) -> None:
        """Snapshots `caps [n, 3]` (`(col, E, slot)` each, `kernels.state.capture`) of
        every state layer: the state rebuilt at `E`, the window's `width - 1` rows before
        it copied."""
        device_caps = cuda.to_device(np.ascontiguousarray(caps, np.int32), stream=self.stream)
        for layer, arrays in enumerate(self.layers):
            if arrays is None:
                continue
            if arrays.state is not None and layer in self.rules:
                rule = self.rules[layer]
                capture_kernel.capture(arrays.base, *rule.logs(arrays), arrays.log_g,
                                       arrays.log_b, arrays.marks, self.snap_state[layer],
                                       device_caps, len(caps), rule.per_channel,
                                       rule.has_beta, rule.transposed, stream=self.stream)
            if arrays.window is not None:
                for col, end, slot in caps.tolist():
                    self._window_rows(arrays.window, self.snap_window[layer], col, end, slot,
                                      into_slot=True)

    def restore(self, col: int, position: int, slot: int) -> None:
        """Column `col` of every state layer from snapshot `slot` taken at `position`:
        live and base state, the window's rows, marks `(position, position)`."""
        marks = np.array([position, position], np.int32)
        for layer, arrays in enumerate(self.layers):
            if arrays is None:
                continue
            if arrays.state is not None:
                for array in (arrays.state, arrays.base):
                    array[col].copy_to_device(self.snap_state[layer][slot], stream=self.stream)
                arrays.marks[col].copy_to_device(marks, stream=self.stream)
            if arrays.window is not None:
                self._window_rows(arrays.window, self.snap_window[layer], col, position, slot,
                                  into_slot=False)

    def _window_rows(self, ring, snaps, col: int, end: int, slot: int, into_slot: bool):
        """Copy the ring rows of positions `[end - width + 1, end)` (those at or past 0)
        of column `col` to snapshot `slot`'s rows, or back."""
        kept, rows = snaps.shape[1], ring.shape[1]
        for j in range(kept):
            position = end - kept + j
            if position < 0:
                continue
            source, target = ring[col, position % rows], snaps[slot, j]
            if not into_slot:
                source, target = target, source
            target.copy_to_device(source, stream=self.stream)

    def copy_column(self, src: int, dst: int) -> None:
        """Column `src` of every state layer's arrays copied to column `dst` (a clone)."""
        for arrays in self.layers:
            for array in arrays or ():
                if array is not None:
                    array[dst].copy_to_device(array[src], stream=self.stream)
