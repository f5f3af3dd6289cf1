"""Device storage of a cache's page pools (contract §4): K and V of every layer, the
device page tables, their growth, and the launches that change them.

A page group's storage is one *array* per layer shape and planes among its layers
(contract §15: layers of one group and one shape share it), `[n_layers, planes,
n_pages, page_size, n_kv_heads, width]`, so that copying a page (a clone, a
copy-on-write) is one launch for all its layers. The planes are the layers' kind's to
say (`kinds`: `planes`): K and V in one array (index 1: 0 = K, 1 = V), or, for a shape
whose V is not as wide as its K, two arrays `[n_layers, 1, ...]` of K and of V; a
latent layer's one array of its rows, V read from them. A layer's K and V pools are
views `[n_pages, page_size, n_kv_heads, head_dim]` (V: `v_head_dim`) of its arrays, and
the kernels read them as slots `[n_pages * page_size, n_kv_heads, head_dim]` (`k_slots`,
`v_slots`). A shared layer (`kv.shared`) has no storage: its views are its producer's.

The device page tables are one int32 buffer, allocated once at its full size (so it
never moves, and a captured CUDA graph keeps reading it): each group's table `[seq
rows, table_pages]` of slot bases (page id times page size) is a fixed view of it
(`group_tables`). The host decides every entry (`page_accounting`); this module stores
the patches an upload carries and copies the pages a clone or copy-on-write names.
"""
from __future__ import annotations

import numpy as np

from ..config import CacheConfig
from ..device import allocating, cuda
from ..kernels.moves.page_copy import RUN_ENTRIES, copy_rows
from ..kernels.launch.calling import device_pointer
from ..kernels.moves.page_table import PagePatcher


def group_arrays(config: CacheConfig, layers: tuple) -> list:
    """The arrays of a page group's `layers`: `(layers of one shape, planes, n_kv_heads,
    width)` per array, in order of first appearance, the planes as the layers' kind says
    (`kinds`: `planes`): "kv" (K and V, both of `width`), "k" or "v"."""
    shapes: dict = {}
    for layer in layers:
        shape = config.layer_shapes[layer]
        shapes.setdefault((shape, config.kinds[layer].planes(shape)), []).append(layer)
    return [(tuple(members), planes, shape.n_kv_heads, width)
            for (shape, kind_planes), members in shapes.items()
            for planes, width in kind_planes]


class PageStorage:
    """The storage of one cache: per page group (`config.page_groups` order) its arrays
    `arrays[i]` (a list: `group_arrays`), starting with its `initial_pages`, and its
    device table `group_tables[i]` (int32 `[n_rows, table_pages]`, a view of
    `device_tables`); per layer its pools `k[layer]`, `v[layer]` and their slot views
    (a shared layer's: its producer's). Launches and copies go on `stream`."""

    def __init__(self, config: CacheConfig, n_rows: int, stream=0):
        self.config, self.stream = config, stream
        self.page_size = config.page_size
        groups = config.page_groups
        sizes = [n_rows * group.table_pages for group in groups]
        # zeros: an entry no sequence holds points at page 0 (the scratch page), in storage
        self.device_tables = cuda.to_device(np.zeros(sum(sizes), np.int32), stream=stream)
        self._patcher = PagePatcher(self.device_tables, stream)
        self.group_tables, at = [], 0
        for group, size in zip(groups, sizes):
            self.group_tables.append(self.device_tables[at:at + size].reshape(
                n_rows, group.table_pages))
            at += size
        n_layers = config.n_layers
        self.k, self.v = [None] * n_layers, [None] * n_layers
        self.k_slots, self.v_slots = [None] * n_layers, [None] * n_layers
        self.arrays = [None] * len(groups)
        self._layouts = [group_arrays(config, group.layers) for group in groups]
        for i, group in enumerate(groups):
            self._install(i, self._allocate(i, group.initial_pages))

    def _allocate(self, i: int, n_pages: int) -> list:
        """Storage for page group `i`: per array (`group_arrays`) `[n_layers, planes,
        n_pages, page_size, n_kv_heads, width]`."""
        dtype = self.config.storage_dtype
        return [cuda.device_array((len(layers), len(planes), n_pages, self.page_size, heads,
                                   width), dtype=dtype, stream=self.stream)
                for layers, planes, heads, width in self._layouts[i]]

    def _install(self, i: int, arrays: list) -> None:
        self.arrays[i] = arrays
        for layers, _, _, _ in self._layouts[i]:
            for layer in layers:
                self.v[layer] = None
        for (layers, planes, _, _), array in zip(self._layouts[i], arrays):
            for j, layer in enumerate(layers):
                for plane, role in enumerate(planes):
                    (self.k if role == "k" else self.v)[layer] = array[j, plane]
        for layer in range(self.config.n_layers):   # a shared layer: its producer's views
            source = self.config.source(layer)
            self.k[layer], self.v[layer] = self.k[source], self.v[source]
            if self.v[layer] is None:               # a layer without V planes: V in K's rows
                self.v[layer] = self.k[layer]
            if self.k[layer] is not None:
                self.k_slots[layer] = _slots(self.k[layer])
                self.v_slots[layer] = _slots(self.v[layer])

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage allocated, over all page groups."""
        return sum(array.nbytes for arrays in self.arrays for array in arrays)

    def n_pages(self, i: int) -> int:
        return self.arrays[i][0].shape[2]

    def grown(self, i: int, n_pages: int, what: str) -> list:
        """Page group `i`'s storage grown to `n_pages`, every page copied in, not yet in use
        (`install` it): a failed allocation (`CapacityError` naming `what`) leaves the old
        storage as it was."""
        old_n = self.n_pages(i)
        with allocating(f"{what}: growing the pool of the "
                        f"{self.config.page_groups[i].name} from {old_n} to {n_pages} pages "
                        f"(the old pool is kept)"):
            fresh = self._allocate(i, n_pages)
        for old, new in zip(self.arrays[i], fresh):
            for j in range(old.shape[0]):          # pages are outermost in each plane
                for kv in range(old.shape[1]):
                    new[j, kv, :old_n].copy_to_device(old[j, kv], stream=self.stream)
        return fresh

    def install(self, i: int, arrays: list) -> None:
        """Page group `i`'s storage is `arrays` from now on (`grown`)."""
        self._install(i, arrays)

    # ------------------------------------------------------------------ device work
    def patch(self, tables, section) -> None:
        """Store the page-table patches (flat index, slot base) of `section` (an
        `upload.Section`) of the int32 device array `tables`; one launch."""
        self._patcher(tables, section.offset, section.size // 2)

    def copy(self, i: int, tables, section) -> None:
        """Copy the row runs of `section` of `tables` (`[m, 3]`: source slot, destination
        slot, rows; `kernels.moves.page_copy`) in every layer of page group `i`, K and V;
        one launch per array."""
        for array in self.arrays[i]:
            copy_rows(array, tables, section.offset, section.size // RUN_ENTRIES,
                      self.stream)

    def copy_entries(self, source: int, destination: int, n: int) -> None:
        """Copy `n` device-table entries from index `source` to `destination` on the
        device (a clone's shared pages: one copy, whatever their number)."""
        tables = self.device_tables
        tables[destination:destination + n].copy_to_device(tables[source:source + n],
                                                           stream=self.stream)

    def read(self, layer: int, slots: np.ndarray, host_dtype) -> tuple:
        """Host copies `(k, v)` `[len(slots), n_kv_heads, head_dim]` (V: `v_head_dim`) of
        `layer`'s slots `slots` (int64), as `host_dtype`; a latent layer's V the first
        `v_head_dim` values of its rows."""
        k, v = (store.copy_to_host(stream=self.stream)[slots].view(host_dtype)
                for store in (self.k_slots[layer], self.v_slots[layer]))
        return k, v[..., :self.config.layer_shapes[layer].v_head_dim]

    def addresses(self) -> tuple:
        """Where the buffers every launch reads are now (they move when a pool grows)."""
        return tuple(device_pointer(array) for array in
                     (*(a for arrays in self.arrays for a in arrays), self.device_tables))


def _slots(pool):
    """A pool `[n_pages, page_size, n_kv_heads, width]` seen as slots `[n_pages *
    page_size, n_kv_heads, width]`."""
    return pool.reshape(pool.shape[0] * pool.shape[1], *pool.shape[2:])
