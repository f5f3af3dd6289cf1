"""K/V storage of every layer, and its growth (contract §4).

Layers with the same row count share one allocation, a *group*
`[n_layers, 2, rows, n_cols, n_kv_heads, head_dim]` (index 1: 0 = K, 1 = V): all
flat layers form one group, and the ring layers of each distinct `R` another. A
layer's K and V are C-contiguous views `[rows, n_cols, n_kv_heads, head_dim]` of its
group, so a clone copies a whole group in one launch. Flat layers start at
`min(initial_rows, capacity)` rows and grow together by whole rows; ring layers hold
`R = min(capacity, W + M - 1)` rows, allocated once.
"""
from __future__ import annotations

from .config import CacheConfig
from .device import allocating, cuda
from .kernels.copy import copy_column
from .plan import grown_rows, layer_rows


class Pool:
    """The storage of one cache. `ring_rows[layer]` is R, or 0 for a flat layer;
    `k[layer]`, `v[layer]` its views."""

    def __init__(self, config: CacheConfig, n_cols: int, stream=0):
        self.config = config
        self.n_cols = n_cols
        self.stream = stream
        self.ring_rows = layer_rows([s.window for s in config.layers], config.max_write,
                                    config.capacity)
        self.flat_rows = min(config.initial_rows, config.capacity)
        self.flat_layers = [i for i, rows in enumerate(self.ring_rows) if rows == 0]
        # group key: 0 for the flat layers, R for ring layers of R rows
        self.members = {}
        for layer, rows in enumerate(self.ring_rows):
            self.members.setdefault(int(rows), []).append(layer)
        self.groups = {}
        self.k = [None] * config.n_layers
        self.v = [None] * config.n_layers
        for key, layers in self.members.items():
            self._install(key, self._allocate(len(layers), key or self.flat_rows))

    def _allocate(self, n_layers: int, rows: int):
        """One group's storage: `[n_layers, 2, rows, n_cols, n_kv_heads, head_dim]`."""
        shape = (n_layers, 2, rows, self.n_cols, self.config.n_kv_heads, self.config.head_dim)
        return cuda.device_array(shape, dtype=self.config.storage_dtype, stream=self.stream)

    def _install(self, key: int, group) -> None:
        self.groups[key] = group
        for i, layer in enumerate(self.members[key]):
            self.k[layer], self.v[layer] = group[i, 0], group[i, 1]

    def rows(self, layer: int) -> int:
        """Rows layer `layer` has now."""
        return self.k[layer].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups.values())

    def ensure_row(self, needed_row: int, live_rows: int) -> None:
        """Grow every flat layer so row `needed_row` exists, keeping rows `[0, live_rows)`.

        Transactional: the new group is allocated before anything is swapped in, so a
        failed allocation leaves the old storage in use and raises `CapacityError`.
        """
        new_rows = grown_rows(self.flat_rows, needed_row, self.config.capacity)
        if new_rows == self.flat_rows or not self.flat_layers:
            return
        with allocating(f"growing flat layers from {self.flat_rows} to {new_rows} rows (the "
                        f"old storage is kept)"):
            fresh = self._allocate(len(self.flat_layers), new_rows)
        old = self.groups[0]
        keep = min(live_rows, self.flat_rows)
        if keep:  # rows are outermost within each (layer, K/V): one contiguous copy each
            for i in range(len(self.flat_layers)):
                for kv in range(2):
                    fresh[i, kv, :keep].copy_to_device(old[i, kv, :keep], stream=self.stream)
        self._install(0, fresh)
        self.flat_rows = new_rows

    def copy_sequence(self, src_col: int, dst_col: int, keep: int, high_water: int) -> None:
        """Device copy for a clone: flat rows `[0, keep)`, ring rows still held (at most R);
        one launch per group."""
        for key, group in self.groups.items():
            n_rows = keep if key == 0 else min(key, high_water)
            copy_column(group, src_col, dst_col, n_rows, self.stream)
