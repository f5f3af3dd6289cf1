"""Device functions every attention path shares: a segment's fields, which keys a query
sees, where a key lives.

Segments are read from the step's flat int32 tables (`read_segment`). Visibility is
one interval per query, `[lo, hi)`, moving forward with the query's position (see
`key_range`); a ring layer keeps position `p` in storage row `p % ring_rows` (see
`storage_row`, and `store_row` for walking a tile's rows without a division per key).
"""
from __future__ import annotations

from ..device import cuda
from ..plan import COL, FLAG_BLOCK, FLAGS, POS_START, Q_LEN, Q_START, SEQ_INFO_FIELDS


@cuda.jit(device=True)
def read_segment(tables, seq_info_off, seg):
    """`(q_start, q_len, col, pos_start, block)` of segment `seg` of the step's tables."""
    base = seq_info_off + seg * SEQ_INFO_FIELDS
    return (tables[base + Q_START], tables[base + Q_LEN], tables[base + COL],
            tables[base + POS_START], (tables[base + FLAGS] & FLAG_BLOCK) != 0)


@cuda.jit(device=True)
def key_range(i, q_len, pos_start, block, window):
    """`[lo, hi)`: the keys query `i` of a segment sees (one interval, moving forward with `i`).

    Causal: `lo(p) <= j <= p`, `lo(p) = max(0, p - W + 1)` (0 without a window): FlashAttention's
    `window_size=(W - 1, 0)`, Hugging Face's `sliding_window=W`.
    Block: the whole block `[pos_start, pos_start + q_len)` plus history `j >= lo(p)`.
    """
    p = pos_start + i
    lo = 0
    if window > 0:
        lo = max(0, p - window + 1)
    if block:
        return min(lo, pos_start), pos_start + q_len
    return lo, p + 1


@cuda.jit(device=True)
def storage_row(position, ring_rows):
    """Row of `position`: itself on a flat layer, `position % ring_rows` on a ring."""
    return position % ring_rows if ring_rows > 0 else position


@cuda.jit(device=True)
def store_row(row0, c, ring_rows):
    """Storage row of key `key0 + c`, given `row0`, the row of `key0` (no division per key)."""
    row = row0 + c
    if ring_rows > 0:
        while row >= ring_rows:
            row -= ring_rows
    return row
