"""The ring kinds (contract §4, §5, §15): sliding-window layers (`Ring`, `kv.ring(W)`) and
chunked layers (`Chunked`, `kv.chunked(C)`), each stored as a ring of `R = min(capacity,
reach + max_write - 1)` rows (reach: W or C), position `p` at ring slot `p % R`.

A sequence takes its whole ring (`ceil(R / page_size)` pages) when claimed and lets it
go with `seq_rm`; steps, rewinds and aborts take or free nothing. A clone copies the
whole ring onto fresh pages. Floors follow the ring's rows (`positions.ring_floor`). The
prefix index keeps, on pages of its own, the rows of each registered page that a match
can need, and a hit copies the window before its point back into the ring.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..arith.positions import resumed_high_water, ring_floor, ring_history, ring_rows, \
    ring_runs
from .base import KVRows, page_runs


class RingPages(KVRows):
    """What sliding-window and chunked layers share (module doc): everything but their
    mask, their name and the floor a chunk start sets (`chunk`: C, or 0)."""

    reach: int
    chunk: int
    pages_by_step = False

    def describe(self) -> str:
        return f"chunks of {self.chunk}" if self.chunk else f"window {self.reach}"

    @property
    def mask_code(self) -> int:
        """W for a sliding window, -C for chunks of C."""
        return -self.chunk if self.chunk else self.reach

    # ------------------------------------------------------------------ pages
    def rows(self, max_write: int, capacity: int) -> int:
        return ring_rows(self.reach, max_write, capacity)

    def claim_pages(self, table_pages: int) -> int:
        return table_pages

    def sequence_pages(self, positions: int, table_pages: int, page_size: int) -> int:
        return table_pages

    def clone_pages(self, keep: int, page_size: int, table_pages: int) -> int:
        return table_pages

    def clone(self, group, src: int, dst: int, keep: int) -> tuple:
        """The whole ring on fresh pages, copies of `src`'s."""
        new = group.take(group.table_pages)
        runs = page_runs(group.table[src, :group.table_pages], new, group.page_size)
        group.hold(dst, new)
        return runs, None

    # ------------------------------------------------------------------ floors
    def floor(self, high_water, rows: int, max_write: int):
        return ring_floor(high_water, rows, max_write, self.chunk)

    def floor_key(self, rows: int):
        return rows, self.chunk

    def resumed_high_water(self, position: int, max_write: int) -> int:
        return resumed_high_water(position, max_write)

    def resume_needs(self) -> str:
        """The positions resuming at p reads, as a floor's refusal states them."""
        c = self.chunk
        return f"[{c} * (p // {c}), p)" if c else f"[p - {self.reach - 1}, p)"

    # ------------------------------------------------------------------ prefix index
    def history(self, rows: int, max_write: int, capacity: int) -> int:
        return ring_history(rows, max_write, capacity)

    def kept_rows(self, page_size: int, history: int) -> int:
        return min(page_size, history)

    def first_registrable(self, high_water: int, rows: int, kept: int,
                          page_size: int) -> int:
        if not kept:
            return 0
        lowest = max(0, high_water - rows)
        return -(-(lowest + kept) // page_size) - 1

    def indexed_elsewhere(self, group, seq: int, depth: int) -> bool:
        return False

    def node_page(self, group, seq: int, depth: int, own: int) -> int:
        return own

    def kept_runs(self, group, seq: int, depth: int, own: int, kept: int):
        """Ring slot -> node slot runs of the last `kept` positions of page `depth`."""
        size = group.page_size
        runs = ring_runs((depth + 1) * size - kept, (depth + 1) * size, group.rows, size,
                         group.table[seq], [own], depth)
        return runs[:, [1, 0, 2]]

    def restore(self, group, seq: int, node_pages, end: int, history: int, kept: int,
                page_size: int):
        if not kept:
            return None
        start = max(0, end - history)
        return ring_runs(start, end, group.rows, page_size, group.table[seq],
                         node_pages[start // page_size:], start // page_size)


@dataclass(frozen=True)
class Ring(RingPages):
    """A sliding-window layer of `window` W: a query at `p` sees `max(0, p - W + 1) <= j
    <= p`."""

    window: int
    name = "ring"
    chunk = 0

    @property
    def reach(self) -> int:
        return self.window


@dataclass(frozen=True)
class Chunked(RingPages):
    """A chunked layer of chunks of `size` C: a query at `p` sees `C * (p // C) <= j <=
    p`."""

    size: int
    name = "chunked"

    @property
    def reach(self) -> int:
        return self.size

    @property
    def chunk(self) -> int:
        return self.size
