"""Copy pages to other pages in every layer of a storage group, K and V, as 16-byte
vectors: the device side of a clone (the page holding its fork point, ring pages) and
of copy-on-write.

A storage group holds the K and V of the layers of one kind as one array `[n_layers, 2,
n_pages, page_size, n_kv_heads, head_dim]`, so page `p` of plane `layer * 2 + (0: K,
1: V)` is one contiguous run of `page_size * n_kv_heads * head_dim` elements. A launch
copies `n_pairs` (source page, destination page) pairs, read from the int32 device
tables of the upload that carries them, in every layer. The wide path's runs are
(layer, pair), each moving the pair's K page and its V page (`write.move_vectors`, as
the write moves a token's K and V): a block's layer is `blockIdx.y`, and its block
rows (`threadIdx.y`) take pairs in a grid stride over x, so no run needs a division.
The element-wise path's runs are (plane, pair), taken in a grid stride that steps
both indices without a division (`masks.step_on`). A run's lanes
(`write.vector_lanes`, `write.run_block`) move its pages. A page that is not a whole
number of vectors (1-byte elements with an odd `n_kv_heads * head_dim`), or a group
not on a 16-byte boundary, is copied element by element.

A launch's destination pages are distinct and none of them is one of its source pages
(they are fresh pages), so its runs are independent and may run in any order.

Index ranges: page ids (`< n_pages`, `n_pages * page_size <= INT32_MAX` by
`CacheConfig`), pairs, layers, table entries and the grid's block rows are below
2**31, and a page of a plane below 2**32 bytes (`write.WIDE_RUN_BYTES`; a larger one
is copied element by element), so a vector's offset in its page is 32-bit; a page's
start in the group stays 64-bit (nothing bounds a group's size below 2**32 bytes),
made once per run.
"""
from __future__ import annotations

from ..device import cuda
from . import ptx
from .launch import VECTOR_BYTES, Specialised, aligned
from .masks import divmod32, step_on
from .write import WIDE_RUN_BYTES, move_vectors, run_block, run_grid, vector_lanes

from numba import uint32, uint64  # noqa: E402  (after kvnumba.device chose the target)

#: the grid's height: layers, one a block (a group of more takes them in a stride)
MAX_GRID_Y = 65535


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
    at = uint32(uint32(pairs_off) + uint32(uint32(pair) + uint32(pair)))
    return tables[at], tables[uint32(at + uint32(1))]


@cuda.jit
def _copy_vectors(group, tables, pairs_off, n_pairs):
    """Lane `threadIdx.x` of a block row copies vectors `lane`, `lane + blockDim.x`, ... of
    its runs' source pages to their destination pages, K and V (`move_vectors`): the
    runs of layer `blockIdx.y` (and on, a grid's height apart), pairs in a grid stride
    over x. `tables[pairs_off + 2 * i]`, `[pairs_off + 2 * i + 1]`: pair `i`'s page ids."""
    n_layers, pairs = uint32(group.shape[0]), uint32(n_pairs)
    page = uint32(group.shape[3] * group.shape[4] * group.shape[5])   # elements a page
    plane = uint64(group.shape[2]) * uint64(page)            # K to V of a layer
    last = uint32(uint32(uint32(page * uint32(group.itemsize)) >> uint32(4)) - uint32(1))
    first, step = uint32(cuda.threadIdx.x), uint32(cuda.blockDim.x)
    first_pair = uint32(cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y)
    skip_pairs = uint32(cuda.gridDim.x * cuda.blockDim.y)
    layer = uint32(cuda.blockIdx.y)
    while layer < n_layers:
        k_plane = uint64(uint32(layer + layer)) * plane      # in elements
        pair = first_pair
        while pair < pairs:
            src, dst = _page_pair(tables, pairs_off, pair)
            k_from = k_plane + ptx.mul_wide_u32(src, page)
            k_to = k_plane + ptx.mul_wide_u32(dst, page)
            move_vectors(ptx.bytes_from(group, k_to), ptx.bytes_from(group, k_to + plane),
                         ptx.bytes_from(group, k_from), ptx.bytes_from(group, k_from + plane),
                         first, step, last)
            pair = uint32(pair + skip_pairs)
        layer = uint32(layer + uint32(cuda.gridDim.y))


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
    if (page_bytes % VECTOR_BYTES == 0 and page_bytes <= WIDE_RUN_BYTES
            and aligned(group, VECTOR_BYTES)):
        lanes, rows = vector_lanes(page_bytes // VECTOR_BYTES)
        grid, kernel = (run_grid(n_pairs, rows), min(group.shape[0], MAX_GRID_Y)), _vectors
    else:
        lanes, rows = run_block(run)
        grid, kernel = run_grid(runs, rows), _elements
        group = group.reshape(n_planes, n_pages, run)
    kernel(grid, (lanes, rows), stream, group, tables, int(pairs_off), int(n_pairs))
