"""The flat kind (contract §4): position `p` lives at slot `p % page_size` of the
sequence's page `p // page_size`; every past position stays visible.

Pages are taken as positions need them (`step_pages`, `claim_step`, copy-on-write
included) and let go on rewind, abort and `seq_rm`. A clone shares the pages wholly
below its point and copies the one that straddles it. The prefix index shares a
registered page with the sequence (one reference more) and a hit holds it again.
"""
from __future__ import annotations

import numpy as np

from dataclasses import dataclass

from ..arith import pages
from ..arith.pages import pages_for
from .base import KVRows, page_runs


@dataclass(frozen=True)
class Flat(KVRows):
    """A flat layer (`kv.flat()`); the protocol's methods are `base.LayerKind`'s."""

    name = "flat"
    pages_by_step = True

    def describe(self) -> str:
        return "flat"

    @property
    def mask_code(self) -> int:
        return 0

    # ------------------------------------------------------------------ pages
    def rows(self, max_write: int, capacity: int) -> int:
        return 0

    def claim_pages(self, table_pages: int) -> int:
        return 0

    def sequence_pages(self, positions: int, table_pages: int, page_size: int) -> int:
        return pages_for(positions, page_size)

    def step_pages(self, group, seqs, totals, pos) -> int:
        return int(pages.step_demand(seqs, totals, pos, group.held, group.table, group.refs,
                                     group.page_size))

    def claim_step(self, group, seqs, totals, pos, needed: int) -> tuple:
        group.n_free, patches, copies = pages.claim_step(
            seqs, totals, pos, group.held, group.table, group.refs, group.free, group.n_free,
            needed, group.page_size, group.table_off)
        return patches, copies if len(copies) else None

    def clone_pages(self, keep: int, page_size: int, table_pages: int) -> int:
        return int(keep % page_size != 0)

    def clone(self, group, src: int, dst: int, keep: int) -> tuple:
        """The pages wholly below `keep` shared (their device entries copied on the
        device: `(from index, to index, count)`), the one straddling it on a fresh page
        (its rows copied)."""
        size = group.page_size
        n_shared = keep // size
        group.share(src, dst, n_shared)
        shared = (group.entry(src), group.entry(dst), n_shared) if n_shared else None
        if not keep % size:
            return None, shared
        new = group.take(1)
        runs = page_runs(group.table[src, n_shared:n_shared + 1], new, size)
        group.hold(dst, new, n_shared)
        return runs, shared

    def rewind(self, group, seq: int, position: int) -> None:
        group.release(seq, pages_for(position, group.page_size))

    def abort(self, group, seqs, pos) -> None:
        keeps = pages_for(pos[seqs], group.page_size)
        group.n_free = pages.release_each(seqs, keeps, group.held, group.table, group.refs,
                                          group.free, group.n_free)

    # ------------------------------------------------------------------ floors
    def floor(self, high_water, rows: int, max_write: int):
        return 0

    def floor_key(self, rows: int):
        return None

    def resumed_high_water(self, position: int, max_write: int) -> int:
        return position

    # ------------------------------------------------------------------ prefix index
    def history(self, rows: int, max_write: int, capacity: int) -> int:
        return 0

    def kept_rows(self, page_size: int, history: int) -> int:
        return 0

    def first_registrable(self, high_water: int, rows: int, kept: int,
                          page_size: int) -> int:
        return 0

    def indexed_elsewhere(self, group, seq: int, depth: int) -> bool:
        return bool(group.owner[group.table[seq, depth]] >= 0)

    def node_page(self, group, seq: int, depth: int, own: int) -> int:
        return int(group.table[seq, depth])

    def kept_runs(self, group, seq: int, depth: int, own: int, kept: int):
        return None

    def restore(self, group, seq: int, node_pages: np.ndarray, end: int, history: int,
                kept: int, page_size: int):
        group.attach(seq, node_pages)
        return None
