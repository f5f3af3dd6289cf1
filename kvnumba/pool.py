"""The page pools of one cache: host accounting (`page_accounting`) and device storage
(`storage`) kept in step (contract §4).

Every verb that takes pages first checks all its pools can give them (`require`, a
`CapacityError` changing nothing), then grows the storage of any pool without enough
free pages, by doubling up to `max_pages`, transactionally (the new storage is
allocated before anything is swapped in), and only then takes the pages. A clone's
device work is one small upload of its own (its table patches and row runs), one
patch launch, one device copy of its shared table entries and one copy launch per kind
that copies: none of it grows with the shared prefix.
"""
from __future__ import annotations

import numpy as np

from .config import CacheConfig
from .page_accounting import PageAccounting
from .storage import PageStorage


class Pool:
    """`pages`: the host accounting (`PageAccounting`); `storage`: the device storage
    (`PageStorage`), with `n_rows` page-table rows (one per sequence slot, plus the
    scratch row when `scratch`) and launches on `stream`."""

    def __init__(self, config: CacheConfig, n_rows: int, scratch: bool, stream=0):
        self.config = config
        self.pages = PageAccounting(config, n_rows, scratch)
        self.storage = PageStorage(config, n_rows, stream)
        self._index = {id(kind): i for i, kind in enumerate(self.pages.kinds)}

    @property
    def nbytes_held(self) -> int:
        """Bytes of the pages live sequences hold (a shared page once; not the scratch)."""
        return self.pages.held_pages() * self.config.page_bytes

    def reserve(self, demand: list, verb: str) -> None:
        """Make the pages of `demand` (`(KindPages, pages)` pairs) free: `CapacityError`,
        nothing changed, when a pool cannot give them under `max_pages`, or when growing
        the storage of one that has too few free pages fails (every grown storage is
        allocated before any is put in use)."""
        for kind, needed in demand:
            kind.require(needed, verb)
        growing = [(kind, kind.grown(needed)) for kind, needed in demand]
        fresh = [(kind, n_pages, self.storage.grown(self._index[id(kind)], n_pages, verb))
                 for kind, n_pages in growing if n_pages > kind.n_pages]
        for kind, n_pages, group in fresh:
            self.storage.install(self._index[id(kind)], group)
            kind.grow(n_pages)

    # ------------------------------------------------------------------ verbs
    def claim_rings(self, seq: int, verb: str) -> None:
        """Give `seq` its ring pages (`CapacityError`, nothing taken, when a pool cannot)."""
        self.reserve(self.pages.ring_demand(), verb)
        self.pages.claim_rings(seq)

    def claim_step(self, seqs: np.ndarray, totals: np.ndarray, pos: np.ndarray, needed: int,
                   verb: str) -> tuple:
        """Take a declared step's `needed` flat pages (growing the pool first:
        `CapacityError`, nothing taken, when it cannot); `(patches, copies)` as
        `PageAccounting.claim_step` gives them."""
        if needed:
            self.reserve([(self.pages.flat, needed)], verb)
        return self.pages.claim_step(seqs, totals, pos, needed)

    def clone(self, src: int, dst: int, keep: int, upload, verb: str) -> None:
        """The pages and device work of `seq_clone` (module doc), through `upload` (an
        `upload.Upload` kept for clones); `CapacityError`, nothing changed, when a pool
        cannot give the clone's pages."""
        self.reserve(self.pages.clone_demand(keep), verb)
        work = self.pages.clone(src, dst, keep)
        upload.begin()
        if work.patches is not None:
            upload.put("patches", work.patches)
        for i, runs in enumerate(work.copies):
            if runs is not None:
                upload.put(f"copies {i}", runs)
        upload.send()
        storage, tables = self.storage, upload.device
        if work.patches is not None:
            storage.patch(tables, upload.section("patches"))
        if work.shared is not None:
            storage.copy_entries(*work.shared)
        for i, runs in enumerate(work.copies):
            if runs is not None:
                storage.copy(i, tables, upload.section(f"copies {i}"))

    def run_step_pages(self, upload) -> None:
        """The device side of a prepared step's pages, from its upload: the table patches,
        then the copy-on-write copies (both before any write; none when the upload has no
        such section)."""
        sections, tables = upload.sections, upload.device
        if "patches" in sections:
            self.storage.patch(tables, sections["patches"])
        if "copies" in sections:
            self.storage.copy(0, tables, sections["copies"])
