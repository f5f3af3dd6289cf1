"""The page pools of one cache: host accounting (`page_accounting`) and device storage
(`storage`) kept in step (contract §4).

Every verb that takes pages first checks all its pools can give them (`check_room`, a
`CapacityError` changing nothing), then grows the storage of any pool without enough
free pages, by doubling up to `max_pages`, transactionally (the new storage is
allocated before anything is swapped in), and only then takes the pages. A clone's
device work is one small upload of its own (its table patches and row runs), one
patch launch, one device copy of its shared table entries and one copy launch per page
group that copies: none of it grows with the shared prefix.
"""
from __future__ import annotations

import numpy as np

from ..config import CacheConfig
from ..data.state_storage import StateStorage
from ..data.storage import PageStorage
from ..data.upload import Sections
from ..host.page_accounting import PageAccounting, PageWork
from ..host.prefix_index import PrefixIndex


class Pool:
    """`pages`: the host accounting (`PageAccounting`); `storage`: the device storage
    (`PageStorage`), with `n_rows` page-table rows (one per sequence slot, plus the
    scratch row when `scratch`) and launches on `stream`; `states`: the state layers'
    columns (`StateStorage`, `n_rows` of them)."""

    def __init__(self, config: CacheConfig, n_rows: int, scratch: bool, stream=0):
        self.config = config
        self.accounting = PageAccounting(config, n_rows, scratch)
        self.index = PrefixIndex(self.accounting)
        self.storage = PageStorage(config, n_rows, stream)
        self.states = StateStorage(config, n_rows, stream)
        #: per column, the base position of its state layers as the step kernels set it
        #: (`kernels.state.recurrence`; mirrored at each `prepare_step` by the step
        #: protocol, an upper bound where a step ran on some layers only): the oldest
        #: position a snapshot can be rebuilt at
        self.state_base = np.zeros(n_rows, np.int64)
        self._number = {id(group): i for i, group in enumerate(self.accounting.groups)}
        self._copy_sections = [Sections.copies(i) for i in range(len(self.accounting.groups))]

    @property
    def nbytes_held(self) -> int:
        """Bytes of the pages live sequences hold (a shared page once; not the scratch)."""
        return self.accounting.held_bytes()

    @property
    def nbytes_cached(self) -> int:
        """Bytes of the pages the prefix index alone holds (reclaimable), and of its state
        snapshots."""
        return self.accounting.cached_bytes() + \
            self.index.n_snapshots * self.config.snapshot_bytes

    def reserve(self, demand: list, verb: str, protect=()) -> None:
        """Make the pages of `demand` (`(GroupPages, pages)` pairs) free: free pages first
        (growing the pool, by doubling, as far as `max_pages` allows), then cached pages
        evicted from the prefix index (never those of the index nodes `protect`).
        `CapacityError`, nothing changed (the index included), when a pool cannot give
        them under `max_pages`, or when growing the storage of one fails (every grown
        storage is allocated before any is put in use, and nothing is evicted before)."""
        index = self.index
        kept = [(group, needed, self._number[id(group)],
                 index.cached_in(self._number[id(group)], protect) if len(protect) else 0)
                for group, needed in demand]
        for group, needed, _, unavailable in kept:
            group.check_room(needed, verb, unavailable)
        growing = [(group, i, group.grown(needed))
                   for group, needed, i, _ in kept if needed > group.n_free]
        fresh = [(group, i, n_pages, self.storage.grown(i, n_pages, verb))
                 for group, i, n_pages in growing if n_pages > group.n_pages]
        for group, i, n_pages, arrays in fresh:
            self.storage.install(i, arrays)
            group.grow(n_pages)
        for group, needed, i, _ in kept:
            if needed > group.n_free:
                index.evict(i, needed - group.n_free, protect)

    # ------------------------------------------------------------------ verbs
    def claim(self, seq: int, verb: str) -> None:
        """Give `seq` the pages a new sequence holds, its rings (`CapacityError`, nothing
        taken, when a pool cannot)."""
        self.reserve(self.accounting.claim_demand(), verb)
        self.accounting.claim(seq)

    def claim_step(self, seqs: np.ndarray, totals: np.ndarray, pos: np.ndarray,
                   needed: tuple, verb: str) -> PageWork:
        """Take a declared step's `needed` pages per group (growing the pools first:
        `CapacityError`, nothing taken, when they cannot); its `PageWork` as
        `PageAccounting.claim_step` gives it (`stage` and `apply` it with the step)."""
        accounting = self.accounting
        if needed is not accounting.no_pages:
            short = [(group, needed[i]) for i, group in accounting.stepping
                     if needed[i] > group.n_free]      # the others have them free now
            if short:
                self.reserve(short, verb)
        return accounting.claim_step(seqs, totals, pos, needed)

    def clone(self, src: int, dst: int, keep: int, upload, verb: str) -> None:
        """The pages and device work of `seq_clone` (module doc), through `upload` (an
        `upload.Upload` kept for clones); `CapacityError`, nothing changed, when a pool
        cannot give the clone's pages."""
        self.reserve(self.accounting.clone_demand(keep), verb)
        self._send(upload, self.accounting.clone(src, dst, keep))
        self.states.copy_column(src, dst)
        self.state_base[dst] = self.state_base[src]

    def start(self, seq: int, keys: list, upload, verb: str) -> int:
        """Give a free `seq` what a new sequence holds and the indexed pages of `keys`
        (every one indexed), each group as its kind restores them (`PrefixIndex.share`:
        pages paged by position shared, the rows the ring layers read before the match
        point copied back). A match whose own pages the new sequence's rings would need
        is shortened until they need none of them, and to its deepest snapshot on a cache
        with state layers, whose columns the snapshot restores; returns the pages
        shared.
        `CapacityError`, nothing changed, when a pool cannot give the rings even so (as
        `seq_new`)."""
        index, demand = self.index, self.accounting.claim_demand()
        chain = index.chain(keys)
        while len(chain) and any(needed > group.available - index.cached_in(
                self._number[id(group)], chain) for group, needed in demand):
            chain = chain[:-1]           # its last node's ring pages go to the rings
        if index.snapshots:
            chain = chain[:index.snapshotted(chain)]
        keys = keys[:len(chain)]
        self.reserve(demand, verb, chain)
        self.accounting.claim(seq)
        copies = index.share(seq, keys) if keys else self.accounting.no_copies
        self._send(upload, PageWork(self.accounting.flush(None), tuple(copies), None))
        if index.snapshots and keys:
            end = len(keys) * self.config.page_size
            self.states.restore(seq, end, int(index.snap[chain[-1]]))
            self.state_base[seq] = end
        return len(keys)

    def register(self, seq: int, keys: list, first: int, upload, verb: str, pos: int,
                 high_water: int) -> int:
        """Index `seq`'s pages under `keys` (`PrefixIndex.plan_register`, `register`: as
        many as its rings and the ring pools can give, pages taken as for any verb) and
        copy their ring rows, and on a cache with state layers take their snapshots
        (`PrefixIndex.plan_captures`, `seq` at `pos` with `high_water`); returns how many
        leading keys a match now shares. `CapacityError`, nothing changed, when growing a
        ring pool fails."""
        index = self.index
        chain, new = index.plan_register(seq, keys, first)
        if new:
            self.reserve([(group, len(new)) for i, group in enumerate(self.accounting.groups)
                          if index.keeps_rows(i)], verb, chain)
        indexed, copies = index.register(seq, keys, chain, new)
        self._send(upload, PageWork(None, tuple(copies), None))
        if not index.snapshots:
            return indexed
        caps = index.plan_captures(keys[:indexed], pos, high_water, int(self.state_base[seq]))
        if len(caps):
            caps[:, 0] = seq
            self.states.reserve_snapshots(index.slots_made)
            self.states.capture(caps)
        return index.match(keys)

    def _send(self, upload, work: PageWork) -> None:
        """Device work outside a step, in one upload of its own."""
        if work.empty:
            return
        upload.begin()
        self.stage(upload, work)
        upload.send()
        self.apply(upload, work)

    def stage(self, upload, work: PageWork) -> None:
        """Write `work`'s table patches and row runs into `upload` as its next sections
        (`Sections.PATCHES`, `Sections.copies(group)`)."""
        patches, copies, _ = work
        if patches is not None:
            upload.put(Sections.PATCHES, patches)
        if copies is not self.accounting.no_copies:
            for name, runs in zip(self._copy_sections, copies):
                if runs is not None:
                    upload.put(name, runs)

    def apply(self, upload, work: PageWork) -> None:
        """The device side of `work`, once `upload` (`stage`d with it) is sent: the table
        patches, the shared entries copied, then the row copies, all before any write
        that follows on the stream. The one place page work reaches the device."""
        storage, tables, section = self.storage, upload.device, upload.section
        patches, copies, shared = work
        if patches is not None:
            storage.patch(tables, section(Sections.PATCHES))
        if shared is not None:
            storage.copy_entries(*shared)
        if copies is not self.accounting.no_copies:
            for i, runs in enumerate(copies):
                if runs is not None:
                    storage.copy(i, tables, section(self._copy_sections[i]))
