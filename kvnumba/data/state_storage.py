"""Device storage of a cache's state layers (contract §17): per state layer, one column per
sequence slot plus the scratch column, allocated once at its full size (no pages, no
growth).

Per layer (`kinds.state` says why each is there and its rows):

* `window [cols, conv_rows, channels]` (storage dtype): the conv inputs' ring by position;
* `state`, `base` `[cols, heads, k_dim, v_dim]` (float32): the live and the base state;
* `log_k [cols, log_rows, heads, k_dim]`, `log_v [cols, log_rows, heads, v_dim]`, `log_g
  [cols, log_rows, heads, k_dim]`, `log_b [cols, log_rows, heads]` (float32): the
  recurrent inputs' ring by position;
* `marks [cols, 2]` (int32): each column's live and base positions, which only the
  recurrence kernel writes.

A part a layer does not have is None. A clone copies the source column of every array
to the destination column on the device (`copy_column`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..config import CacheConfig
from ..device import cuda

#: the recurrent part's arrays, in the order the recurrence kernel takes them
RECURRENT_ARRAYS = ("state", "base", "log_k", "log_v", "log_g", "log_b", "marks")


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
        self.stream = stream
        self.layers = [None] * config.n_layers
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
                shapes = ((n_cols, h, dk, dv), (n_cols, h, dk, dv), (n_cols, rows, h, dk),
                          (n_cols, rows, h, dv), (n_cols, rows, h, dk), (n_cols, rows, h))
                recurrent = tuple(cuda.device_array(shape, dtype=np.float32, stream=stream)
                                  for shape in shapes)
                recurrent += (cuda.to_device(np.zeros((n_cols, 2), np.int32), stream=stream),)
            self.layers[layer] = LayerState(*(window or (None,)),
                                            *(recurrent or (None,) * len(RECURRENT_ARRAYS)))

    @property
    def nbytes(self) -> int:
        """Bytes of state storage allocated, over all state layers and columns."""
        return sum(array.nbytes for arrays in self.layers if arrays is not None
                   for array in arrays if array is not None)

    def copy_column(self, src: int, dst: int) -> None:
        """Column `src` of every state layer's arrays copied to column `dst` (a clone)."""
        for arrays in self.layers:
            for array in arrays or ():
                if array is not None:
                    array[dst].copy_to_device(array[src], stream=self.stream)
