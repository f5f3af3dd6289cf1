"""K/V storage of every layer, and its growth (DESIGN §4).

Each layer holds K and V as `[rows, n_cols, n_kv_heads, head_dim]` device arrays.
Flat layers start at `min(initial_rows, capacity)` rows and grow by whole rows;
ring layers hold `R = min(capacity, W + M - 1)` rows, allocated once.
"""
from __future__ import annotations

from .config import CacheConfig
from .device import allocating, cuda
from .kernels.copy import copy_column
from .plan import grown_rows, layer_rows


class Pool:
    """The storage of one cache. `ring_rows[layer]` is R, or 0 for a flat layer."""

    def __init__(self, config: CacheConfig, n_cols: int, stream=0):
        self.config = config
        self.n_cols = n_cols
        self.stream = stream
        self.ring_rows = layer_rows([s.window for s in config.layers], config.max_write,
                                    config.capacity)
        self.flat_rows = min(config.initial_rows, config.capacity)
        self.flat_layers = [i for i, rows in enumerate(self.ring_rows) if rows == 0]
        self.k, self.v = [], []
        for rows in self.ring_rows:
            k, v = self._allocate(int(rows) or self.flat_rows)
            self.k.append(k)
            self.v.append(v)

    def _allocate(self, rows: int):
        shape = (rows, self.n_cols, self.config.n_kv_heads, self.config.head_dim)
        dtype = self.config.np_dtype
        return (cuda.device_array(shape, dtype=dtype, stream=self.stream),
                cuda.device_array(shape, dtype=dtype, stream=self.stream))

    def rows(self, layer: int) -> int:
        """Rows layer `layer` has now."""
        return self.k[layer].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.k, self.v))

    def ensure_row(self, needed_row: int, live_rows: int) -> None:
        """Grow every flat layer so row `needed_row` exists, keeping rows `[0, live_rows)`.

        Transactional: all new arrays are allocated before any is swapped in, so a
        failed allocation leaves the old storage in use and raises `CapacityError`.
        """
        new_rows = grown_rows(self.flat_rows, needed_row, self.config.capacity)
        if new_rows == self.flat_rows or not self.flat_layers:
            return
        with allocating(f"growing flat layers from {self.flat_rows} to {new_rows} rows (the "
                        f"old storage is kept)"):
            fresh = {layer: self._allocate(new_rows) for layer in self.flat_layers}
        keep = min(live_rows, self.flat_rows)
        for layer, (k, v) in fresh.items():
            if keep:  # rows are the outermost axis: the live prefix is one contiguous copy
                k[:keep].copy_to_device(self.k[layer][:keep], stream=self.stream)
                v[:keep].copy_to_device(self.v[layer][:keep], stream=self.stream)
            self.k[layer], self.v[layer] = k, v
        self.flat_rows = new_rows

    def copy_sequence(self, src_col: int, dst_col: int, keep: int, high_water: int) -> None:
        """Device copy for a clone: flat rows `[0, keep)`, ring rows still held (at most R)."""
        for layer, ring in enumerate(self.ring_rows):
            n_rows = keep if ring == 0 else min(int(ring), high_water)
            copy_column(self.k[layer], self.v[layer], src_col, dst_col, n_rows, self.stream)
