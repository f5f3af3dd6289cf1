"""K/V page pools of every layer, their page tables, and their growth (contract §4).

Layers of one kind share page ids: all flat layers are one kind, the ring layers of
each distinct `R` another. A kind's storage is one allocation, a *group* `[n_layers, 2,
n_pages, page_size, n_kv_heads, head_dim]` (index 1: 0 = K, 1 = V), so that copying a
page (a clone, a copy-on-write) is one launch for all its layers. A layer's K and V
pools are views `[n_pages, page_size, n_kv_heads, head_dim]` of its group, and the
kernels read them as slots `[n_pages * page_size, n_kv_heads, head_dim]`.

Each kind keeps its page tables twice. The host's (`Kind.table`, page ids) decides;
the device's (one int32 buffer for every kind, allocated once at its full size, so it
never moves) holds each entry's slot base (page id times page size) for the kernels,
and is patched on the device from the changes the host collects (`pending`): a step's
upload carries them, and so does a clone's. A sequence's entries past what it holds
are never read, so releasing pages needs no patch.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .config import CacheConfig
from .device import allocating, cuda
from .errors import CapacityError
from .kernels.copy import copy_pages
from .kernels.page_table import patch_pages
from .pages import claim_step, grown_pages, page_bits, pages_for, release_pages, step_demand


class PoolPages(NamedTuple):
    """One layer kind's pool (`BatchedSequenceCache.pool_pages`): `kind` ("flat layers" or
    "ring layers of R rows"), `rows` (0, or that R), its `layers`, `page_size`, pages
    `in_use` (the scratch page included), `free` (pages it can still give under
    `max_pages`), `allocated` and `max_pages`."""

    kind: str
    rows: int
    layers: tuple
    page_size: int
    in_use: int
    free: int
    allocated: int
    max_pages: int


class Kind:
    """The pages of one layer kind (`rows`: 0 for the flat layers, else their ring's R).

    `table [seq rows, width]` page ids, `held [seq rows]` pages each sequence holds,
    `refs [n_pages]` holders of each page, `free[:n_free]` the free page ids;
    `pages` the device table `[seq rows, width]` of slot bases; `group` the storage.
    """

    def __init__(self, pool: "Pool", rows: int, layers: list, table_off: int):
        config = pool.config
        self.pool, self.rows, self.layers = pool, rows, layers
        self.name = "flat layers" if rows == 0 else f"ring layers of {rows} rows"
        self.width = config.table_width(rows)
        self.initial, self.max_pages = config.kind_pages(rows)
        self.table_off = table_off
        n_rows = pool.n_rows
        self.table = np.zeros((n_rows, self.width), np.int32)
        self.held = np.zeros(n_rows, np.int32)
        self.pages = pool.device_tables[table_off:table_off + n_rows * self.width].reshape(
            n_rows, self.width)
        reserved = int(pool.scratch)          # page 0: the scratch row's every entry
        self.refs = np.zeros(self.initial, np.int32)
        self.refs[:reserved] = 1
        self.n_free = self.initial - reserved
        self.free = np.zeros(self.initial, np.int32)    # popped from the end: low ids first
        self.free[:self.n_free] = np.arange(self.initial - 1, reserved - 1, -1)
        self.group = None

    @property
    def n_pages(self) -> int:
        return self.refs.size

    @property
    def in_use(self) -> int:
        return self.n_pages - self.n_free

    @property
    def available(self) -> int:
        """Pages a sequence could still take: free now, or by growing to `max_pages`."""
        return self.max_pages - self.in_use

    def report(self) -> PoolPages:
        return PoolPages(self.name, self.rows, tuple(self.layers), self.pool.page_size,
                         self.in_use, self.available, self.n_pages, self.max_pages)

    def require(self, needed: int, verb: str) -> None:
        """Refuse (`CapacityError`) taking `needed` pages past `max_pages`."""
        if needed > self.available:
            raise CapacityError(
                f"{verb}: the {self.name} need {needed} new pages of {self.pool.page_size} "
                f"positions, and their pool has {self.available} free of max_pages "
                f"{self.max_pages} ({self.in_use} in use); free sequences (seq_rm), or "
                f"raise max_pages")

    def take(self, n: int) -> np.ndarray:
        """Pop `n` free page ids (the caller made sure they exist), each held once."""
        self.n_free -= n
        pages = self.free[self.n_free:self.n_free + n].copy()
        self.refs[pages] = 1
        return pages

    def release(self, seq: int, keep: int) -> None:
        """Let `seq` hold only its first `keep` pages."""
        self.n_free = release_pages(seq, keep, self.held, self.table, self.refs, self.free,
                                    self.n_free)

    def patch(self, seq: int, first: int, pages: np.ndarray) -> None:
        """Queue the device-table entries `first ..` of `seq` for `pages`."""
        base = self.table_off + seq * self.width + first
        for i, page in enumerate(pages.tolist()):
            self.pool.pending[base + i] = page * self.pool.page_size


class Pool:
    """The storage of one cache: the kinds (`kinds`, flat first), each layer's pools
    (`k`, `v`: `[n_pages, page_size, H, D]`; `k_slots`, `v_slots`: the kernels' slot
    views), `kind_of[layer]`, and `ring_rows[layer]` (R, or 0 for a flat layer).

    `n_rows` page-table rows: one per sequence slot, plus the scratch row when
    `scratch` (padding tokens: every entry the scratch page, page 0 of each kind).
    """

    def __init__(self, config: CacheConfig, n_rows: int, scratch: bool, stream=0):
        self.config = config
        self.n_rows, self.scratch, self.stream = n_rows, scratch, stream
        self.page_size = config.page_size
        self.page_bits = page_bits(config.page_size)
        self.ring_rows = config.ring_rows()
        members = {}
        for layer, rows in enumerate(self.ring_rows.tolist()):
            members.setdefault(int(rows), []).append(layer)
        keys = sorted(members)
        total = n_rows * sum(config.table_width(rows) for rows in keys)
        # zeros: an entry no sequence holds points at the scratch page, inside storage
        self.device_tables = cuda.to_device(np.zeros(total, np.int32), stream=stream)
        self.pending = {}        # device-table index -> slot base, for the next upload
        self.kinds, self.kind_of = [], [None] * config.n_layers
        self.k = [None] * config.n_layers
        self.v = [None] * config.n_layers
        self.k_slots = [None] * config.n_layers
        self.v_slots = [None] * config.n_layers
        at = 0
        for rows in keys:
            kind = Kind(self, rows, members[rows], at)
            at += n_rows * kind.width
            self._install(kind, self._allocate(kind, kind.n_pages))
            self.kinds.append(kind)
            for layer in kind.layers:
                self.kind_of[layer] = kind
        self.flat = self.kinds[0] if keys[0] == 0 else None
        self.rings = [k for k in self.kinds if k.rows]

    def _allocate(self, kind: Kind, n_pages: int):
        """One kind's storage: `[n_layers, 2, n_pages, page_size, n_kv_heads, head_dim]`."""
        c = self.config
        shape = (len(kind.layers), 2, n_pages, self.page_size, c.n_kv_heads, c.head_dim)
        return cuda.device_array(shape, dtype=c.storage_dtype, stream=self.stream)

    def _install(self, kind: Kind, group) -> None:
        kind.group = group
        slots = (group.shape[2] * self.page_size,) + group.shape[4:]
        for i, layer in enumerate(kind.layers):
            self.k[layer], self.v[layer] = group[i, 0], group[i, 1]
            self.k_slots[layer] = group[i, 0].reshape(*slots)
            self.v_slots[layer] = group[i, 1].reshape(*slots)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage allocated, over all kinds."""
        return sum(kind.group.nbytes for kind in self.kinds)

    @property
    def nbytes_held(self) -> int:
        """Bytes of the pages live sequences hold (a shared page once; not the scratch)."""
        per_page = self.config.page_bytes
        return sum((kind.in_use - int(self.scratch)) * len(kind.layers) * per_page
                   for kind in self.kinds)

    def groups(self) -> tuple:
        return tuple(kind.group for kind in self.kinds)

    # ------------------------------------------------------------------ growth
    def ensure_free(self, kind: Kind, needed: int, verb: str) -> None:
        """Make `needed` pages free in `kind`'s storage, growing it by doubling up to
        `max_pages` (`CapacityError` past it). Transactional: the new storage is
        allocated before anything is swapped in, so a failed allocation leaves the old
        storage in use."""
        if needed <= kind.n_free:
            return
        kind.require(needed, verb)
        old_n = kind.n_pages
        new_n = grown_pages(old_n, kind.in_use + needed, kind.max_pages)
        with allocating(f"{verb}: growing the pool of the {kind.name} from {old_n} to "
                        f"{new_n} pages (the old pool is kept)"):
            fresh = self._allocate(kind, new_n)
        old = kind.group
        for i in range(len(kind.layers)):  # pages are outermost in each (layer, K/V)
            for kv in range(2):
                fresh[i, kv, :old_n].copy_to_device(old[i, kv], stream=self.stream)
        refs = np.zeros(new_n, np.int32)
        refs[:old_n] = kind.refs
        free = np.empty(new_n, np.int32)
        free[:kind.n_free] = kind.free[:kind.n_free]
        free[kind.n_free:kind.n_free + new_n - old_n] = np.arange(new_n - 1, old_n - 1, -1)
        kind.refs, kind.free, kind.n_free = refs, free, kind.n_free + new_n - old_n
        self._install(kind, fresh)

    # ------------------------------------------------------------------ sequences
    def claim_rings(self, seq: int, verb: str) -> None:
        """Give `seq` its ring pages on every ring kind (`CapacityError`, nothing taken,
        when a pool cannot)."""
        for kind in self.rings:
            kind.require(kind.width, verb)
        for kind in self.rings:
            self.ensure_free(kind, kind.width, verb)
        for kind in self.rings:
            self._hold(kind, seq, kind.take(kind.width))

    def _hold(self, kind: Kind, seq: int, pages: np.ndarray, first: int = 0) -> None:
        kind.table[seq, first:first + pages.size] = pages
        kind.held[seq] = first + pages.size
        kind.patch(seq, first, pages)

    def release(self, seq: int) -> None:
        """`seq_rm`: every page of `seq`, on every kind."""
        for kind in self.kinds:
            kind.release(seq, 0)

    def rewind(self, seq: int, position: int) -> None:
        """Release the flat pages wholly at or past `position`."""
        if self.flat is not None:
            self.flat.release(seq, pages_for(position, self.page_size))

    def step_demand(self, seqs: np.ndarray, totals: np.ndarray, pos: np.ndarray) -> int:
        """New flat pages a step of sequences `seqs` writing `totals` tokens from `pos`
        takes (copy-on-write pages included); 0 without flat layers."""
        kind = self.flat
        if kind is None:
            return 0
        return int(step_demand(seqs, totals, pos, kind.held, kind.table, kind.refs,
                               self.page_size))

    def claim_step(self, seqs, totals, pos, needed: int, verb: str):
        """Take the step's `needed` flat pages (growing the pool first: `CapacityError`,
        nothing taken, when it cannot). Returns `(patches [n, 2], copies [m, 2])`: the
        device-table patches of the step and of earlier verbs, and the page copies
        (source, destination) copy-on-write must run before the step writes."""
        kind = self.flat
        if kind is None or needed == 0:
            return self._flush(None), None
        self.ensure_free(kind, needed, verb)
        kind.n_free, patches, copies = claim_step(
            seqs, totals, pos, kind.held, kind.table, kind.refs, kind.free, kind.n_free,
            needed, self.page_size, kind.table_off)
        return self._flush(patches), copies

    def abort(self, seqs: np.ndarray, pos: np.ndarray) -> None:
        """An aborted step's sequences hold the flat pages of their positions again."""
        if self.flat is not None:
            for seq in seqs.tolist():
                self.flat.release(seq, pages_for(int(pos[seq]), self.page_size))

    def _flush(self, patches):
        """The pending patches and the step's `patches` as one `[n, 2]` array (the step's
        win where both name an entry), or None; nothing stays pending."""
        if not self.pending:
            return patches if patches is not None and len(patches) else None
        if patches is not None:
            self.pending.update(zip(patches[:, 0].tolist(), patches[:, 1].tolist()))
        merged = np.array(list(self.pending.items()), np.int32).reshape(-1, 2)
        self.pending.clear()
        return merged

    def clone(self, src: int, dst: int, keep: int, staging, verb: str) -> None:
        """Device and table work of `seq_clone`: `dst` shares the flat pages of `src`
        wholly below `keep` and gets a copy of the one that straddles it; on ring kinds
        it gets pages of its own holding copies of `src`'s. `CapacityError`, nothing
        changed, when a pool cannot give the pages. One upload (the table patches and
        the copies' page pairs), one patch launch, one copy launch per kind, and one
        device copy of the shared table entries: none of it grows with `keep`."""
        flat = self.flat
        shared = keep // self.page_size
        straddles = flat is not None and keep % self.page_size != 0
        if straddles:
            flat.require(1, verb)
        for kind in self.rings:
            kind.require(kind.width, verb)
        if straddles:
            self.ensure_free(flat, 1, verb)
        for kind in self.rings:
            self.ensure_free(kind, kind.width, verb)
        copies = []
        if flat is not None:
            pages = flat.table[src, :shared]
            flat.refs[pages] += 1
            flat.table[dst, :shared] = pages
            flat.held[dst] = shared
            if straddles:
                new = flat.take(1)
                copies.append((flat, np.array([[flat.table[src, shared], new[0]]], np.int32)))
                self._hold(flat, dst, new, shared)
        for kind in self.rings:
            new = kind.take(kind.width)
            copies.append((kind, np.stack([kind.table[src, :kind.width], new], axis=1)))
            self._hold(kind, dst, new)
        patches = self._flush(None)
        staging.begin(0)
        end = 0 if patches is None else staging.put(patches, 0)
        placed = []
        for kind, pairs in copies:
            placed.append((kind, end, len(pairs)))
            end = staging.put(pairs, end)
        staging.send(end)
        if patches is not None:
            patch_pages(self.device_tables, staging.device, 0, len(patches), self.stream)
        if flat is not None and shared:
            row = flat.table_off + src * flat.width
            to = flat.table_off + dst * flat.width
            self.device_tables[to:to + shared].copy_to_device(
                self.device_tables[row:row + shared], stream=self.stream)
        for kind, at, n in placed:
            copy_pages(kind.group, staging.device, at, n, self.stream)

    def run_step_tables(self, tables, patches_at: int, n_patches: int, copies_at: int,
                        n_copies: int) -> None:
        """The device side of a prepared step's pages, from its upload `tables`: the
        table patches, then the copy-on-write copies (both before any write)."""
        if n_patches:
            patch_pages(self.device_tables, tables, patches_at, n_patches, self.stream)
        if n_copies:
            copy_pages(self.flat.group, tables, copies_at, n_copies, self.stream)

    # ------------------------------------------------------------------ reading back
    def slots(self, layer: int, seq: int, rows: np.ndarray) -> np.ndarray:
        """The slots of storage rows `rows` of `seq` on `layer` (host tables)."""
        kind = self.kind_of[layer]
        return kind.table[seq, rows >> self.page_bits] * self.page_size + \
            (rows & (self.page_size - 1))
