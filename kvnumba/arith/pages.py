"""Page arithmetic and the page tables' compiled passes (contract §4).

Pure functions over integers and NumPy arrays: nothing here touches a device, a
slot state or a cache object. A layer kind's pages are described by

* `table [seq rows, width]` (int32): the page ids of each sequence, in position order
  (flat: page `i` holds positions `[i P, (i + 1) P)`; ring: ring slots);
* `held [seq rows]` (int32): how many leading entries of its row a sequence holds;
* `refs [n_pages]` (int32): how many sequences hold each page (a clone shares);
* `free [n_pages]` (int32): a stack of free page ids, `free[:n_free]`.

On a flat page group a sequence at `pos` holds exactly `ceil(pos / P)` pages between steps:
a step takes the pages its new positions reach, a rewind, an abort and `seq_rm`
release the pages wholly at or past the position they leave the sequence at.
"""
from __future__ import annotations

import numpy as np
from numba import njit

#: page sizes the kernels serve: powers of two in this range
MIN_PAGE_SIZE, MAX_PAGE_SIZE = 8, 256
#: the default: a sequence wastes at most 15 positions of its last page, and every
#: kernel's page lookups stay a few instructions per key at any size (docs/sizing.md)
DEFAULT_PAGE_SIZE = 16


def pages_for(positions: int, page_size: int) -> int:
    """Pages that hold `positions` positions: `ceil(positions / page_size)`."""
    return -(-positions // page_size)


@njit(cache=True)
def step_demand(seqs, totals, pos, held, table, refs, page_size):
    """New pages a step takes on one flat page group (exactly what `claim_step` takes): for
    each sequence `seqs[i]` writing `totals[i]` tokens from `pos[seq]`, the pages its new
    positions reach past those it holds, plus one when its first write lands in a page
    another sequence still holds (copy-on-write; of several holders writing one page in
    the step, the last keeps it). `refs` is left as it was."""
    needed = 0
    copied = np.empty(seqs.size, np.int32)
    n_copied = 0
    for i in range(seqs.size):
        seq = seqs[i]
        start = pos[seq]
        reach = (start + totals[i] + page_size - 1) // page_size
        if reach > held[seq]:
            needed += reach - held[seq]
        if start % page_size != 0:
            page = table[seq, start // page_size]
            if refs[page] > 1:
                needed += 1
                refs[page] -= 1           # as `claim_step` will: undone below
                copied[n_copied] = page
                n_copied += 1
    for j in range(n_copied):
        refs[copied[j]] += 1
    return needed


@njit(cache=True)
def claim_step(seqs, totals, pos, held, table, refs, free, n_free, needed, page_size,
               table_off):
    """Take a step's `needed` pages on one flat kind (`step_demand`; the caller made
    sure `n_free` covers them): each new page is pushed off `free`, a shared page
    the step writes into is replaced by a copy (copy-on-write). Returns `(n_free,
    patches, copies)`: the device-table patches `[n, 2]` (flat index into the device
    tables, from `table_off`: the entry's new slot base, page id times `page_size`), and
    the page copies to run before the step writes, as row runs `[m, 3]` (source slot,
    destination slot, rows: `(old * page_size, new * page_size, page_size)`,
    `kernels.moves.page_copy`)."""
    width = table.shape[1]
    patches = np.empty((needed, 2), np.int32)
    copies = np.empty((min(needed, seqs.size), 3), np.int32)
    n_patches = 0
    n_copies = 0
    for i in range(seqs.size):
        seq = seqs[i]
        start = pos[seq]
        if start % page_size != 0:
            at = start // page_size
            old = table[seq, at]
            if refs[old] > 1:
                n_free -= 1
                new = free[n_free]
                refs[old] -= 1
                refs[new] = 1
                table[seq, at] = new
                copies[n_copies, 0] = old * page_size
                copies[n_copies, 1] = new * page_size
                copies[n_copies, 2] = page_size
                n_copies += 1
                patches[n_patches, 0] = table_off + seq * width + at
                patches[n_patches, 1] = new * page_size
                n_patches += 1
        reach = (start + totals[i] + page_size - 1) // page_size
        for at in range(held[seq], reach):
            n_free -= 1
            new = free[n_free]
            refs[new] = 1
            table[seq, at] = new
            patches[n_patches, 0] = table_off + seq * width + at
            patches[n_patches, 1] = new * page_size
            n_patches += 1
        if reach > held[seq]:
            held[seq] = reach
    return n_free, patches[:n_patches], copies[:n_copies]


@njit(cache=True)
def release_pages(seq, keep, held, table, refs, free, n_free):
    """Let sequence `seq` hold only its first `keep` pages: each later one loses a
    reference, and a page no sequence holds any more goes back on `free`. Returns
    `n_free`."""
    for at in range(keep, held[seq]):
        page = table[seq, at]
        refs[page] -= 1
        if refs[page] == 0:
            free[n_free] = page
            n_free += 1
    if held[seq] > keep:
        held[seq] = keep
    return n_free


@njit(cache=True)
def release_each(seqs, keeps, held, table, refs, free, n_free):
    """`release_pages` of each sequence `seqs[i]` down to `keeps[i]` pages, in one compiled
    pass. Returns `n_free`."""
    for i in range(seqs.size):
        n_free = release_pages(seqs[i], keeps[i], held, table, refs, free, n_free)
    return n_free


def grown_pages(n_pages: int, needed: int, max_pages: int) -> int:
    """A pool's growth: `min(max_pages, max(needed, 2 * n_pages))` pages, or `n_pages`
    when it has `needed` already."""
    if needed <= n_pages:
        return n_pages
    return min(max_pages, max(needed, 2 * n_pages))


def flashinfer_tables(table: np.ndarray, seqs: np.ndarray, lengths: np.ndarray,
                      page_size: int) -> tuple:
    """`(kv_indptr [n + 1], kv_indices [nnz], kv_last_page_len [n])` (int32), FlashInfer's
    paged-KV description of sequences `seqs` holding `lengths` positions each on one
    flat page group: sequence `i`'s pages are `kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`, in
    position order, its last page holding `kv_last_page_len[i]` positions (0 for an
    empty sequence)."""
    n_pages = (lengths + page_size - 1) // page_size
    indptr = np.zeros(seqs.size + 1, np.int32)
    np.cumsum(n_pages, out=indptr[1:])
    indices = np.concatenate([table[s, :n] for s, n in zip(seqs.tolist(), n_pages.tolist())]
                             + [np.zeros(0, np.int32)]).astype(np.int32)
    last = np.where(lengths > 0, lengths - (n_pages - 1) * page_size, 0).astype(np.int32)
    return indptr, indices, last
