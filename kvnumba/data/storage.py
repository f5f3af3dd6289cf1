"""Device storage of a cache's page pools (contract §4): K and V of every layer, the
device page tables, their growth, and the launches that change them.

A layer kind's storage is one allocation per layer shape among its layers (contract §15:
layers of one kind and one shape share it), a *group* `[n_layers, 2, n_pages,
page_size, n_kv_heads, head_dim]` (index 1: 0 = K, 1 = V), so that copying a page (a
clone, a copy-on-write) is one launch for all its layers; layers whose V is not as wide
as their K hold two groups, `[n_layers, 1, ...]` of K and of V. A layer's K and V pools
are views `[n_pages, page_size, n_kv_heads, head_dim]` (V: `v_head_dim`) of its groups,
and the kernels read them as slots `[n_pages * page_size, n_kv_heads, head_dim]`
(`k_slots`, `v_slots`). A shared layer (`kv.shared`) has no storage: its views are its
producer's.

The device page tables are one int32 buffer, allocated once at its full size (so it
never moves, and a captured CUDA graph keeps reading it): each kind's table `[seq rows,
table_pages]` of slot bases (page id times page size) is a fixed view of it
(`kind_tables`). The host decides every entry (`page_accounting`); this module stores
the patches an upload carries and copies the pages a clone or copy-on-write names.
"""
from __future__ import annotations

import numpy as np

from ..config import CacheConfig
from ..device import allocating, cuda
from ..kernels.moves.page_copy import RUN_ENTRIES, copy_rows
from ..kernels.launch.calling import device_pointer
from ..kernels.moves.page_table import PagePatcher


def kind_groups(config: CacheConfig, layers: tuple) -> list:
    """The groups of a kind's `layers`: `(layers of one shape, planes, n_kv_heads,
    width)` per group, in order of first appearance: `planes` "kv" (K and V, both of
    `width`), or, for a shape whose V is not as wide as its K, two groups over the same
    layers, "k" (K of `head_dim`) and "v" (V of `v_head_dim`); a latent shape (`v_in_k`)
    one "k" group of its rows, V read from them."""
    shapes: dict = {}
    for layer in layers:
        shapes.setdefault(config.layer_shapes[layer], []).append(layer)
    groups = []
    for shape, members in shapes.items():
        if shape.v_in_k:                # a latent layer: its rows, V their first values
            groups.append((tuple(members), "k", shape.n_kv_heads, shape.head_dim))
        elif shape.head_dim == shape.v_head_dim:
            groups.append((tuple(members), "kv", shape.n_kv_heads, shape.head_dim))
        else:
            groups.append((tuple(members), "k", shape.n_kv_heads, shape.head_dim))
            groups.append((tuple(members), "v", shape.n_kv_heads, shape.v_head_dim))
    return groups


class PageStorage:
    """The storage of one cache: per layer kind (`config.layer_kinds` order) its groups
    `groups[i]` (a list: `kind_groups`), starting with `initial_pages[i]` pages, and its
    device table `kind_tables[i]` (int32 `[n_rows, table_pages]`, a view of
    `device_tables`); per layer its pools `k[layer]`, `v[layer]` and their slot views
    (a shared layer's: its producer's). Launches and copies go on `stream`."""

    def __init__(self, config: CacheConfig, n_rows: int, stream=0):
        self.config, self.stream = config, stream
        self.page_size = config.page_size
        kinds = config.layer_kinds
        sizes = [n_rows * kind.table_pages for kind in kinds]
        # zeros: an entry no sequence holds points at page 0 (the scratch page), in storage
        self.device_tables = cuda.to_device(np.zeros(sum(sizes), np.int32), stream=stream)
        self._patcher = PagePatcher(self.device_tables, stream)
        self.kind_tables, at = [], 0
        for kind, size in zip(kinds, sizes):
            self.kind_tables.append(self.device_tables[at:at + size].reshape(
                n_rows, kind.table_pages))
            at += size
        n_layers = config.n_layers
        self.k, self.v = [None] * n_layers, [None] * n_layers
        self.k_slots, self.v_slots = [None] * n_layers, [None] * n_layers
        self.groups = [None] * len(kinds)
        self._groups = [kind_groups(config, kind.layers) for kind in kinds]
        for i, kind in enumerate(kinds):
            self._install(i, self._allocate(i, kind.initial_pages))

    def _allocate(self, i: int, n_pages: int) -> list:
        """Storage for kind `i`: per group (`kind_groups`) `[n_layers, planes, n_pages,
        page_size, n_kv_heads, width]`."""
        dtype = self.config.storage_dtype
        return [cuda.device_array((len(layers), len(planes), n_pages, self.page_size, heads,
                                   width), dtype=dtype, stream=self.stream)
                for layers, planes, heads, width in self._groups[i]]

    def _install(self, i: int, groups: list) -> None:
        self.groups[i] = groups
        for (layers, planes, _, _), group in zip(self._groups[i], groups):
            for j, layer in enumerate(layers):
                for plane, role in enumerate(planes):
                    (self.k if role == "k" else self.v)[layer] = group[j, plane]
        shapes = self.config.layer_shapes
        for layer in range(self.config.n_layers):   # a shared layer: its producer's views
            source = self.config.source(layer)
            self.k[layer], self.v[layer] = self.k[source], self.v[source]
            if shapes[layer].v_in_k:                # a latent layer: V in its rows
                self.v[layer] = self.k[layer]
            if self.k[layer] is not None:
                self.k_slots[layer] = _slots(self.k[layer])
                self.v_slots[layer] = _slots(self.v[layer])

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage allocated, over all kinds."""
        return sum(group.nbytes for groups in self.groups for group in groups)

    def n_pages(self, i: int) -> int:
        return self.groups[i][0].shape[2]

    def grown(self, i: int, n_pages: int, what: str) -> list:
        """Kind `i`'s storage grown to `n_pages`, every page copied in, not yet in use
        (`install` it): a failed allocation (`CapacityError` naming `what`) leaves the old
        storage as it was."""
        old_n = self.n_pages(i)
        with allocating(f"{what}: growing the pool of the "
                        f"{self.config.layer_kinds[i].name} from {old_n} to {n_pages} pages "
                        f"(the old pool is kept)"):
            fresh = self._allocate(i, n_pages)
        for old, new in zip(self.groups[i], fresh):
            for j in range(old.shape[0]):          # pages are outermost in each plane
                for kv in range(old.shape[1]):
                    new[j, kv, :old_n].copy_to_device(old[j, kv], stream=self.stream)
        return fresh

    def install(self, i: int, groups: list) -> None:
        """Kind `i`'s storage is `groups` from now on (`grown`)."""
        self._install(i, groups)

    # ------------------------------------------------------------------ device work
    def patch(self, tables, section) -> None:
        """Store the page-table patches (flat index, slot base) of `section` (an
        `upload.Section`) of the int32 device array `tables`; one launch."""
        self._patcher(tables, section.offset, section.size // 2)

    def copy(self, i: int, tables, section) -> None:
        """Copy the row runs of `section` of `tables` (`[m, 3]`: source slot, destination
        slot, rows; `kernels.copy`) in every layer of kind `i`, K and V; one launch per
        group."""
        for group in self.groups[i]:
            copy_rows(group, tables, section.offset, section.size // RUN_ENTRIES,
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
                     (*(g for groups in self.groups for g in groups), self.device_tables))


def _slots(pool):
    """A pool `[n_pages, page_size, n_kv_heads, width]` seen as slots `[n_pages *
    page_size, n_kv_heads, width]`."""
    return pool.reshape(pool.shape[0] * pool.shape[1], *pool.shape[2:])
