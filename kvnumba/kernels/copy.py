"""Copy pages to other pages in every layer of a storage group, K and V, as 16-byte
vectors: the device side of a clone (the page holding its fork point, ring pages) and
of copy-on-write.

A storage group holds the K and V of the layers of one kind as one array `[n_layers, 2,
n_pages, page_size, n_kv_heads, head_dim]`, so page `p` of plane `layer * 2 + (0: K,
1: V)` is one contiguous run of `page_size * n_kv_heads * head_dim` elements. A launch
copies `n_pairs` (source page, destination page) pairs, read from the int32 device
tables of the upload that carries them, in every plane: `n_layers * 2 * n_pairs` runs
(plane, pair), one launch per group. Each block row (`threadIdx.y`) takes runs in a
grid stride, stepping its (plane, pair) without a division (`masks.step_on`); its
lanes (`write.run_block`) move the run. A run that is not a whole number of vectors
(1-byte elements with an odd `n_kv_heads * head_dim`), or a group not on a 16-byte
boundary, is copied element by element.

A launch's destination pages are distinct and none of them is one of its source pages
(they are fresh pages), so its runs are independent and may run in any order.

Index ranges: page ids (`< n_pages`, `n_pages * page_size <= INT32_MAX` by
`CacheConfig`), pairs, table entries and the grid's block rows are below 2**31;
element indices into the group stay int64 (nothing bounds a group's size below
2**31), made by multiplication once per run.
"""
from __future__ import annotations

from ..device import cuda
from . import ptx
from .launch import VECTOR_BYTES, Specialised, aligned, ceil_div
from .masks import div32, divmod32, step_on
from .write import PAIR, run_block, run_grid

from numba import uint32  # noqa: E402  (after kvnumba.device chose the target)


@cuda.jit(device=True)
def _first_run(n_pairs):
    """`(plane, pair)` of this block row's first run, and the grid stride as (planes, pairs)."""
    plane, pair = divmod32(cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y, n_pairs)
    skip_planes, skip_pairs = divmod32(cuda.gridDim.x * cuda.blockDim.y, n_pairs)
    return plane, pair, skip_planes, skip_pairs


@cuda.jit(device=True)
def _page_pair(tables, pairs_off, pair):
    """`(source, destination)` page ids of pair `pair` (a uint32 index: Numba adds no
    negative-index fix-up to an unsigned one)."""
    at = uint32(pairs_off + 2 * pair)
    return tables[at], tables[at + uint32(1)]


@cuda.jit
def _copy_vectors(group, tables, pairs_off, n_pairs):
    """Lane `threadIdx.x` of a block row copies vectors `lane`, `lane + blockDim.x`, ... of
    each of the row's runs from its source page to its destination page, `PAIR` of them
    a trip. `tables[pairs_off + 2 * i]`, `[pairs_off + 2 * i + 1]`: pair `i`'s page ids."""
    n_planes = group.shape[0] * group.shape[1]
    n_pages = group.shape[2]
    run = group.shape[3] * group.shape[4] * group.shape[5]   # elements per page
    elems = div32(VECTOR_BYTES, group.itemsize)              # elements per vector
    first = cuda.threadIdx.x * elems
    step = cuda.blockDim.x * elems
    plane, pair, skip_planes, skip_pairs = _first_run(n_pairs)
    while plane < n_planes:
        src, dst = _page_pair(tables, pairs_off, pair)
        start = (plane * n_pages + src) * run
        last = start + run - elems                     # the run's last vector
        shift = (dst - src) * run                      # destination index - source index
        e = start + first
        while e <= last:                               # not `range`: it divides by its step
            far = min(e + step, last)                  # past the run: loaded, not stored
            a, b, c, d = ptx.ld_v4(group, e)
            a2, b2, c2, d2 = ptx.ld_v4(group, far)
            ptx.st_v4(group, shift + e, a, b, c, d)
            if e + step <= last:
                ptx.st_v4(group, shift + far, a2, b2, c2, d2)
            e += PAIR * step
        plane, pair = step_on(plane, pair, skip_planes, skip_pairs, n_pairs)


@cuda.jit
def _copy_elements(planes, tables, pairs_off, n_pairs):
    """As `_copy_vectors`, one element per lane and trip, on the group viewed as
    `[n_layers * 2, n_pages, page elements]`."""
    n_planes, run = planes.shape[0], planes.shape[2]
    plane, pair, skip_planes, skip_pairs = _first_run(n_pairs)
    while plane < n_planes:
        src, dst = _page_pair(tables, pairs_off, pair)
        e = cuda.threadIdx.x
        while e < run:
            planes[plane, dst, e] = planes[plane, src, e]
            e += cuda.blockDim.x
        plane, pair = step_on(plane, pair, skip_planes, skip_pairs, n_pairs)


_vectors = Specialised(_copy_vectors)
_elements = Specialised(_copy_elements)


def copy_pages(group, tables, pairs_off: int, n_pairs: int, stream=0) -> None:
    """Copy page `tables[pairs_off + 2 * i]` to page `tables[pairs_off + 2 * i + 1]`, `i <
    n_pairs`, in every layer of `group` (`[n_layers, 2, n_pages, page_size, n_kv_heads,
    head_dim]`), K and V: one launch. `tables`: an int32 device array."""
    n_planes, n_pages = group.shape[0] * group.shape[1], group.shape[2]
    run = group.shape[3] * group.shape[4] * group.shape[5]
    runs = n_planes * n_pairs
    if runs * run == 0:
        return
    page_bytes = run * group.dtype.itemsize
    if page_bytes % VECTOR_BYTES == 0 and aligned(group, VECTOR_BYTES):
        items, kernel = ceil_div(page_bytes // VECTOR_BYTES, PAIR), _vectors  # pairs
    else:
        items, kernel = run, _elements
        group = group.reshape(n_planes, n_pages, run)
    lanes, rows = run_block(items)
    kernel(run_grid(runs, rows), (lanes, rows), stream,
           group, tables, int(pairs_off), int(n_pairs))
