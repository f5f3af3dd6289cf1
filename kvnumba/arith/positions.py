"""Position, row and floor arithmetic, and the segment table's layout (contract §4, §5,
§7).

Pure functions over integers and NumPy arrays: nothing here touches a device,
a slot state or a cache object.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, uint64

# --- the segment table the attention kernel reads: seq_info[segment, field] (int32) ---
Q_START = 0      # first token of the segment on the step's token axis
Q_LEN = 1        # tokens in the segment
SEQ = 2          # the sequence (its slot: the row of its page tables)
POS_START = 3    # position of its first token (pos(seq) for a first span; later ones follow)
FLAGS = 4        # bit field, see FLAG_BLOCK
SEQ_INFO_FIELDS = 5
FLAG_BLOCK = 1   # the segment is a draft block: bidirectional within itself


@njit(cache=True)
def decode_segments(seqs, pos, seq_info):
    """Fill `seq_info` [len(seqs), SEQ_INFO_FIELDS] (int32), the segment table of a step
    whose token `i` is a segment of its own, of sequence `seqs[i]` (each in `[0,
    len(pos))`) at position `pos[seqs[i]]` (a decode step): Q_START `i`, Q_LEN 1, SEQ
    `seqs[i]`, POS_START its position, FLAGS 0. Returns the index of the first segment at
    the furthest position, or -1 when a sequence has two tokens (not a decode step: the
    table is then left unfinished). One compiled pass; the caller allocates the table
    (an array NumPy owns, which a read-only view of can never be made writeable again)."""
    seen = np.zeros(pos.size, np.bool_)
    furthest = 0
    for i in range(seqs.size):
        seq = seqs[i]
        if seen[seq]:
            return -1
        seen[seq] = True
        seq_info[i, Q_START] = i
        seq_info[i, Q_LEN] = 1
        seq_info[i, SEQ] = seq
        seq_info[i, POS_START] = pos[seq]
        seq_info[i, FLAGS] = 0
        if seq_info[i, POS_START] > seq_info[furthest, POS_START]:
            furthest = i
    return furthest


def ring_rows(window: int, max_write: int, capacity: int) -> int:
    """Rows of a ring layer: `R = min(capacity, W + M - 1)`.

    A step writes all its tokens before attending, and its earliest query still
    reads back to `p - W + 1`, so `W + M - 1` positions must be live at once.
    """
    return min(capacity, window + max_write - 1)


def ring_floor(high_water, rows: int, max_write: int, chunk: int = 0):
    """Lowest position a sequence can resume at on one ring layer of `rows` rows.

    The layer holds `[hw - R, hw)`. On a sliding window, resuming at `L` needs `[L - W +
    1, L)`, so the floor is `hw - M` once `hw > R`, else 0. On a chunked layer (`chunk`
    C) it needs `[C * (L // C), L)`: the floor is the first chunk start at or after
    `hw - R`, `C * ceil((hw - R) / C)` (never above `hw - M`), once `hw > R`, else 0.
    Works on scalars and arrays.
    """
    hw = np.asarray(high_water, dtype=np.int64)
    held_from = hw - rows
    lowest = -(-held_from // chunk) * chunk if chunk else hw - max_write
    floor = np.where(hw > rows, lowest, 0)
    return int(floor) if floor.ndim == 0 else floor


def span_offsets(span_seqs: np.ndarray, span_lens: np.ndarray):
    """Where each span of a step starts within its sequence's tokens, and each sequence's
    total.

    `span_seqs`, `span_lens`: the step's spans (maximal runs of one id) in token order.
    A sequence's spans take consecutive positions in token order, so span `i`
    starts `offsets[i]` positions after `pos(span_seqs[i])`. Returns
    `(offsets [n_spans], seqs [n_seqs] (ascending), totals [n_seqs])`; vectorised,
    no loop over spans.
    """
    order = np.argsort(span_seqs, kind="stable")    # spans grouped by sequence, token order kept
    seqs = span_seqs[order]
    lens = span_lens[order]
    first = np.empty(seqs.size, dtype=bool)
    first[0] = True
    np.not_equal(seqs[1:], seqs[:-1], out=first[1:])
    before = np.cumsum(lens) - lens                  # tokens of all earlier spans (this order)
    # `before` never decreases, so carrying each group's first value forward is a running max
    group_base = np.maximum.accumulate(np.where(first, before, 0))
    offsets = np.empty_like(before)
    offsets[order] = before - group_base
    starts = np.flatnonzero(first)
    return offsets, seqs[starts], np.add.reduceat(lens, starts)


@njit(cache=True)
def stage_tables(out, span_seqs, span_lens, seq_info, n_tokens, width, pad_col):
    """Write a step's tables into the flat int32 buffer `out` (one compiled pass): each
    token's sequence at `[0, width)` and its position at `[width, 2 * width)`, from its
    spans (`span_seqs`, `span_lens`, in token order) and its segment table (the
    `width - n_tokens` padding tokens take sequence `pad_col` and position 0), then the
    segment table's rows; returns where they end. (The buffer is indexed unsigned: Numba
    adds no negative-index fix-up to it.)"""
    columns = uint64(0)
    positions = uint64(width)
    for span in range(span_seqs.size):
        seq = span_seqs[span]
        position = seq_info[span, POS_START]
        for _ in range(span_lens[span]):
            out[columns] = seq
            out[positions] = position
            columns += uint64(1)
            positions += uint64(1)
            position += 1
    for _ in range(n_tokens, width):
        out[columns] = pad_col
        out[positions] = 0
        columns += uint64(1)
        positions += uint64(1)
    end = uint64(2 * width)
    for segment in range(seq_info.shape[0]):
        for field in range(SEQ_INFO_FIELDS):
            out[end] = seq_info[segment, field]
            end += uint64(1)
    return end


def held_positions(pos: int, high_water: int, rows: int) -> tuple[int, int]:
    """`[start, stop)` of the positions a layer still holds for a sequence.

    Flat (rows 0): `[0, pos)`. Ring: `[max(0, hw - R), pos)`.
    """
    if rows == 0:
        return 0, pos
    return max(0, high_water - rows), pos


def ring_history(rows: int, max_write: int, capacity: int) -> int:
    """How many positions before a resume point `L` a ring layer of `rows` rows reads:
    `W - 1 = R - M` (its queries at `L` and on see back to `L - W + 1`), or `capacity`
    for a ring no shorter than the capacity (it never wraps: its window may reach past
    `R - M`, and it holds every position)."""
    return capacity if rows >= capacity else rows - max_write


def resumed_high_water(position: int, max_write: int) -> int:
    """The high-water of a sequence resumed at `position` from pages holding only the
    window before it (a prefix match): `position + M`, so that a ring layer's floor is
    `position` once past its rows (`ring_floor`; below them it is 0 and everything
    before `position` is held), and the layer holds `[position + M - R, position)`,
    which is `[position - W + 1, position)`: as if the sequence had been written to
    `position + M` and rewound to `position`."""
    return position + max_write


def ring_runs(lo: int, hi: int, rows: int, page_size: int, ring_pages: np.ndarray,
              absolute_pages: np.ndarray, first_page: int) -> np.ndarray:
    """Row runs `[m, 3]` int32 `(absolute slot, ring slot, rows)` pairing positions `[lo,
    hi)` held by absolute position (position `p` at row `p % P` of
    `absolute_pages[p // P - first_page]`) with the same positions in a ring of `rows`
    rows (ring slot `s = p % R` at row `s % P` of `ring_pages[s // P]`); a run ends where
    either side's page or the ring ends. Slots are page id times `page_size` plus row."""
    runs = []
    p = lo
    while p < hi:
        s = p % rows
        n = min(hi - p, page_size - p % page_size, page_size - s % page_size, rows - s)
        runs.append((int(absolute_pages[p // page_size - first_page]) * page_size
                     + p % page_size,
                     int(ring_pages[s // page_size]) * page_size + s % page_size, n))
        p += n
    return np.array(runs, np.int32).reshape(-1, 3)


@dataclass(frozen=True)
class Segment:
    """One span of a step: tokens `[q_start, q_start + q_len)` of `seq`, at positions from
    `pos_start`."""

    seq: int
    q_start: int
    q_len: int
    pos_start: int
    block: bool


def frozen(array: np.ndarray) -> np.ndarray:
    """`array`, made read-only: the cache's record of a step (`step.OpenStep`) is never
    written after it is built. (Callers never see it: a `StepPlan` hands out sealed
    copies.)"""
    array.setflags(write=False)
    return array
