"""The page pools of one cache: host accounting (`page_accounting`) and device storage
(`storage`) kept in step (contract §4).

Every verb that takes pages first checks all its pools can give them (`check_room`, a
`CapacityError` changing nothing), then grows the storage of any pool without enough
free pages, by doubling up to `max_pages`, transactionally (the new storage is
allocated before anything is swapped in), and only then takes the pages. A clone's
device work is one small upload of its own (its table patches and row runs), one
patch launch, one device copy of its shared table entries and one copy launch per kind
that copies: none of it grows with the shared prefix.
"""
from __future__ import annotations

import numpy as np

from ..config import CacheConfig
from ..data.storage import PageStorage
from ..data.upload import Sections
from ..host.page_accounting import PageAccounting, PageWork
from ..host.prefix_index import PrefixIndex


class Pool:
    """`pages`: the host accounting (`PageAccounting`); `storage`: the device storage
    (`PageStorage`), with `n_rows` page-table rows (one per sequence slot, plus the
    scratch row when `scratch`) and launches on `stream`."""

    def __init__(self, config: CacheConfig, n_rows: int, scratch: bool, stream=0):
        self.config = config
        self.accounting = PageAccounting(config, n_rows, scratch)
        self.index = PrefixIndex(self.accounting)
        self.storage = PageStorage(config, n_rows, stream)
        self._kind_number = {id(kind): i for i, kind in enumerate(self.accounting.kinds)}
        self._copy_sections = [Sections.copies(i) for i in range(len(self.accounting.kinds))]

    @property
    def nbytes_held(self) -> int:
        """Bytes of the pages live sequences hold (a shared page once; not the scratch)."""
        return self.accounting.held_bytes()

    @property
    def nbytes_cached(self) -> int:
        """Bytes of the pages the prefix index alone holds (reclaimable)."""
        return self.accounting.cached_bytes()

    def reserve(self, demand: list, verb: str, protect=()) -> None:
        """Make the pages of `demand` (`(KindPages, pages)` pairs) free: free pages first
        (growing the pool, by doubling, as far as `max_pages` allows), then cached pages
        evicted from the prefix index (never those of the index nodes `protect`).
        `CapacityError`, nothing changed (the index included), when a pool cannot give
        them under `max_pages`, or when growing the storage of one fails (every grown
        storage is allocated before any is put in use, and nothing is evicted before)."""
        index = self.index
        kept = [(kind, needed, self._kind_number[id(kind)],
                 index.cached_in(self._kind_number[id(kind)], protect) if len(protect) else 0)
                for kind, needed in demand]
        for kind, needed, _, unavailable in kept:
            kind.check_room(needed, verb, unavailable)
        growing = [(kind, i, kind.grown(needed))
                   for kind, needed, i, _ in kept if needed > kind.n_free]
        fresh = [(kind, n_pages, self.storage.grown(i, n_pages, verb))
                 for kind, i, n_pages in growing if n_pages > kind.n_pages]
        for kind, n_pages, group in fresh:
            self.storage.install(self._kind_number[id(kind)], group)
            kind.grow(n_pages)
        for kind, needed, i, _ in kept:
            if needed > kind.n_free:
                index.evict(i, needed - kind.n_free, protect)

    # ------------------------------------------------------------------ verbs
    def claim_rings(self, seq: int, verb: str) -> None:
        """Give `seq` its ring pages (`CapacityError`, nothing taken, when a pool cannot)."""
        self.reserve(self.accounting.ring_demand(), verb)
        self.accounting.claim_rings(seq)

    def claim_step(self, seqs: np.ndarray, totals: np.ndarray, pos: np.ndarray, needed: int,
                   verb: str) -> PageWork:
        """Take a declared step's `needed` flat pages (growing the pool first:
        `CapacityError`, nothing taken, when it cannot); its `PageWork` as
        `PageAccounting.claim_step` gives it (`stage` and `apply` it with the step)."""
        if needed:
            self.reserve([(self.accounting.flat, needed)], verb)
        return self.accounting.claim_step(seqs, totals, pos, needed)

    def clone(self, src: int, dst: int, keep: int, upload, verb: str) -> None:
        """The pages and device work of `seq_clone` (module doc), through `upload` (an
        `upload.Upload` kept for clones); `CapacityError`, nothing changed, when a pool
        cannot give the clone's pages."""
        self.reserve(self.accounting.clone_demand(keep), verb)
        self._send(upload, self.accounting.clone(src, dst, keep))

    def start(self, seq: int, keys: list, upload, verb: str) -> int:
        """Give a free `seq` its rings and the indexed pages of `keys` (every one indexed):
        the flat pages shared, the rows the ring layers read before the match point
        copied back (`PrefixIndex.share`). A match whose own ring rows the rings would
        need is shortened until they need none of them; returns the pages shared.
        `CapacityError`, nothing changed, when a ring pool cannot give the rings even so
        (as `seq_new`)."""
        index, demand = self.index, self.accounting.ring_demand()
        chain = index.chain(keys)
        while len(chain) and any(needed > kind.available - index.cached_in(self._kind_number[id(kind)],
                                                                           chain)
                                 for kind, needed in demand):
            chain = chain[:-1]           # its last node's ring pages go to the rings
        keys = keys[:len(chain)]
        self.reserve(demand, verb, chain)
        self.accounting.claim_rings(seq)
        copies = index.share(seq, keys) if keys else self.accounting.no_copies
        self._send(upload, PageWork(self.accounting.flush(None), tuple(copies), None))
        return len(keys)

    def register(self, seq: int, keys: list, first: int, upload, verb: str) -> int:
        """Index `seq`'s pages under `keys` (`PrefixIndex.plan_register`, `register`: as
        many as its rings and the ring pools can give, pages taken as for any verb) and
        copy their ring rows; returns how many leading keys are indexed. `CapacityError`,
        nothing changed, when growing a ring pool fails."""
        index = self.index
        chain, new = index.plan_register(seq, keys, first)
        if new:
            self.reserve([(kind, len(new)) for i, kind in enumerate(self.accounting.kinds)
                          if index.keeps_rows(i)], verb, chain)
        indexed, copies = index.register(seq, keys, chain, new)
        self._send(upload, PageWork(None, tuple(copies), None))
        return indexed

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
        (`Sections.PATCHES`, `Sections.copies(kind)`)."""
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
