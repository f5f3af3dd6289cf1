"""Column-shaped test storage laid out in pages, as a cache's pools hold it.

The kernel tests build each case's K/V as `[rows, n_cols, n_kv_heads, head_dim]` (row
`r` of column `c`: position `r` of sequence `c` on a flat layer, ring slot `r` on a
ring layer), which is easy to fill and to read back. `paged` moves that into what the
kernels read: storage of slots `[n_pages * page_size, n_kv_heads, head_dim]` and a page
table `pages [n_cols, ceil(rows / page_size)]` (int32) of slot bases, so that row `r`
of column `c` lives at slot `pages[c, r >> page_bits] | (r & (page_size - 1))`.
"""
from __future__ import annotations

import numpy as np


def paged(stores, page_size: int, *, seed: int = 0, spare_pages: int = 2):
    """`(slot stores, pages)`: each of `stores` (host arrays `[rows, n_cols, H, D]` of one
    shape) as slots `[n_pages * page_size, H, D]`, and the page table of slot bases.

    Pages are handed out in a shuffled order, so no column's pages are adjacent or in
    order; `spare_pages` pages no column references, and the slots of a column's last
    page past `rows`, hold NaN where the dtype has one (else its largest value), so a
    kernel that reads the wrong page or past a row meets them.
    """
    stores = [np.asarray(s) for s in stores]
    rows, n_cols = stores[0].shape[:2]
    width = -(-rows // page_size)
    n_pages = n_cols * width + spare_pages
    order = np.random.default_rng(seed).permutation(n_pages)[:n_cols * width]
    pages = (order.reshape(n_cols, width) * page_size).astype(np.int32)
    out = []
    for store in stores:
        slots = np.full((n_pages * page_size,) + store.shape[2:], _junk(store.dtype),
                        store.dtype)
        for c in range(n_cols):
            for r0 in range(0, rows, page_size):
                base = pages[c, r0 // page_size]
                n = min(page_size, rows - r0)
                slots[base:base + n] = store[r0:r0 + n, c]
        out.append(slots)
    return out, pages


def _junk(dtype):
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return np.nan
    return np.iinfo(dtype).max if dtype.kind in "ui" else 0


def page_bits(page_size: int) -> int:
    """log2 of a power-of-two page size."""
    assert page_size & (page_size - 1) == 0 and page_size > 0
    return page_size.bit_length() - 1
