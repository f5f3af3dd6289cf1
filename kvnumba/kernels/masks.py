"""Device functions every attention path shares: which keys a query sees, where a key lives.

Visibility is one interval per query, `[lo, hi)`, moving forward with the query's
position (see `key_range`); a ring layer keeps position `p` in storage row
`p % ring_rows` (see `store_row`).
"""
from __future__ import annotations

from ..device import cuda


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
def store_row(row0, c, ring_rows):
    """Storage row of key `key0 + c`, given `row0`, the row of `key0` (no division per key)."""
    row = row0 + c
    if ring_rows > 0:
        while row >= ring_rows:
            row -= ring_rows
    return row
