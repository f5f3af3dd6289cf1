"""Copy runs of rows to other rows in every layer of a storage group, K and V, as
16-byte vectors: the device side of a clone (the page holding its fork point, ring
pages), of copy-on-write, and of any copy of rows that are not whole pages.

A storage array holds the K and V of the layers of one page group and shape as one array `[n_layers, 2,
n_pages, page_size, n_kv_heads, head_dim]`. Seen as slots (`slot = page * page_size +
row`), plane `layer * 2 + (0: K, 1: V)` is `[n_pages * page_size, n_kv_heads,
head_dim]`, and a row of it (all heads of one slot) is `n_kv_heads * head_dim`
contiguous elements. A *run* of the copy is three int32 entries of the upload that
carries it: `(source slot, destination slot, rows)`, `rows >= 1` consecutive rows that
stay inside one page on each side (`row + rows <= page_size` for both slots' rows in
their pages): one contiguous range of `rows * n_kv_heads * head_dim` elements a plane.
A whole page is `(source * page_size, destination * page_size, page_size)`. A launch
copies `n_runs` runs, read from the int32 device tables, in every layer, K and V.

The wide path's work items are (layer, run), each moving the run's K rows and its V
rows (`write.move_vectors`, as the write moves a token's K and V): a block's layer is
`blockIdx.y`, and its block rows (`threadIdx.y`) take runs in a grid stride over x, so
no item needs a division. A block row has the lanes of a whole page's vectors
(`write.vector_lanes`), so a run of fewer rows leaves some idle; a run's last vector
(`_last_vector`) follows its rows. The element-wise path's items are (plane, run),
taken in a grid stride that steps both indices without a division (`masks.step_on`),
each with the lanes of a page's elements (`launch.calling.run_block`). A row that is not a
whole number of vectors (1-byte elements with an odd `n_kv_heads * head_dim`, float32
with `n_kv_heads * head_dim` not a multiple of 4, ...), a page of more than
`write.WIDE_RUN_BYTES`, or a group not on a 16-byte boundary is copied element by
element.

A launch's destination rows are distinct, and none of them is a source row of the same
launch (the caller guarantees it: a clone's and a copy-on-write's destinations are
fresh pages), so its runs are independent and may run in any order.

Index ranges: slots (`< n_pages * page_size <= INT32_MAX` by `CacheConfig`), rows,
runs, layers, table entries (`_run`) and the grid's block rows are below 2**31, and a
page of a plane below 2**32 bytes (`write.WIDE_RUN_BYTES`; a larger one is copied
element by element), so a row's elements and bytes, a run's vectors (`_last_vector`)
and a vector's offset in its run are 32-bit. A plane's elements and a run's start in
the group are not (nothing bounds a group's size below 2**32 bytes): a plane is a 32 x
32 -> 64-bit product of its slots and a row's elements, made once, its layer's K plane
start a 64-bit product made once per layer, and a run's start that plus a 32 x 32 ->
64-bit product of its slot and a row's elements (`_run_start`), once per run; its V
rows are a plane further.
"""
from __future__ import annotations

from ...device import cuda
from ..intrinsics import ptx
from ..launch.calling import VECTOR_BYTES, Specialised, aligned
from ..masks import divmod32, step_on
from ..launch.calling import run_block
from .write import WIDE_RUN_BYTES, move_vectors, run_grid, vector_lanes

from numba import uint32, uint64  # noqa: E402  (after kvnumba.device chose the target)

#: the grid's height: layers, one a block (a group of more takes them in a stride)
MAX_GRID_Y = 65535
#: int32 entries of a run in the tables: source slot, destination slot, rows
RUN_ENTRIES = 3


@cuda.jit(device=True)
def _first_run(n_runs):
    """`(plane, run)` of this block row's first item, and the grid stride as (planes, runs)."""
    plane, run = divmod32(cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y, n_runs)
    skip_planes, skip_runs = divmod32(cuda.gridDim.x * cuda.blockDim.y, n_runs)
    return plane, run, skip_planes, skip_runs


@cuda.jit(device=True, inline="always")
def _run(tables, runs_off, run):
    """`(source slot, destination slot, rows)` of run `run`: table entries `runs_off + 3 *
    run` on. The entry index is made in 32 bits (unsigned: Numba adds no negative-index
    fix-up to an unsigned index) and widened once, so the three loads share one address,
    4 and 8 bytes apart."""
    at = uint64(uint32(uint32(runs_off) + uint32(uint32(run) * uint32(RUN_ENTRIES))))
    return tables[at], tables[at + uint64(1)], tables[at + uint64(2)]


@cuda.jit(device=True, inline="always")
def _run_start(plane_start, slot, row):
    """A run's first element in the group: its plane's first (`plane_start`, 64-bit)
    plus a 32 x 32 -> 64-bit product of its slot and a row's elements."""
    return plane_start + ptx.mul_wide_u32(slot, row)


@cuda.jit(device=True, inline="always")
def _last_vector(rows, row_vectors):
    """The index of the last 16-byte vector of a run of `rows` rows of `row_vectors`
    vectors each (uint32: a run is at most a page, below 2**32 bytes)."""
    return uint32(uint32(uint32(rows) * row_vectors) - uint32(1))


@cuda.jit
def _copy_vectors(group, tables, runs_off, n_runs):
    """Lane `threadIdx.x` of a block row copies vectors `lane`, `lane + blockDim.x`, ... of
    its runs' source rows to their destination rows, K and V (`move_vectors`): the runs
    of layer `blockIdx.y` (and on, a grid's height apart), in a grid stride over x.
    `tables[runs_off + 3 * i]`, `[... + 1]`, `[... + 2]`: run `i`'s source slot,
    destination slot and rows."""
    n_layers, runs = uint32(group.shape[0]), uint32(n_runs)
    row = uint32(group.shape[4] * group.shape[5])                 # elements a row
    row_bytes = uint32(row * uint32(group.itemsize))
    row_vectors = uint32(row_bytes >> uint32(4))
    slots = uint32(group.shape[2] * group.shape[3])                  # rows a plane
    plane = ptx.mul_wide_u32(slots, row)                      # elements: K to V of a layer
    first, step = uint32(cuda.threadIdx.x), uint32(cuda.blockDim.x)
    first_run = uint32(cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y)
    skip_runs = uint32(cuda.gridDim.x * cuda.blockDim.y)
    layer = uint32(cuda.blockIdx.y)
    while layer < n_layers:
        k_plane = uint64(uint32(layer + layer)) * plane           # in elements
        run = first_run
        while run < runs:
            src, dst, rows = _run(tables, runs_off, run)
            k_from, k_to = _run_start(k_plane, src, row), _run_start(k_plane, dst, row)
            move_vectors(ptx.bytes_from(group, k_to), ptx.bytes_from(group, k_to + plane),
                         ptx.bytes_from(group, k_from), ptx.bytes_from(group, k_from + plane),
                         first, step, _last_vector(rows, row_vectors))
            run = uint32(run + skip_runs)
        layer = uint32(layer + uint32(cuda.gridDim.y))


@cuda.jit
def _copy_elements(planes, tables, runs_off, n_runs, row):
    """As `_copy_vectors`, one element per lane and trip, on the group viewed as
    `[n_layers * 2, n_pages * page_size * row]` (`row`: elements a row)."""
    n_planes = planes.shape[0]
    plane, run, skip_planes, skip_runs = _first_run(n_runs)
    while plane < n_planes:
        src, dst, rows = _run(tables, runs_off, run)
        src_at, dst_at, span = src * row, dst * row, rows * row      # 64-bit
        e = cuda.threadIdx.x
        while e < span:
            planes[plane, dst_at + e] = planes[plane, src_at + e]
            e += cuda.blockDim.x
        plane, run = step_on(plane, run, skip_planes, skip_runs, n_runs)


_vectors = Specialised(_copy_vectors)
_elements = Specialised(_copy_elements)


def copy_rows(group, tables, runs_off: int, n_runs: int, stream=0) -> None:
    """Copy each run `i < n_runs`: the `tables[runs_off + 3 * i + 2]` (at least 1) rows
    from slot `tables[runs_off + 3 * i]` to the rows from slot `tables[runs_off + 3 * i +
    1]` (slot: page times page_size plus row), in every plane of `group` (`[n_layers,
    planes, n_pages, page_size, n_kv_heads, head_dim]`: 2 planes, K and V, or 1, K or V
    alone where their widths differ, which takes the element-wise path): one launch. `tables`: an int32
    device array. The caller guarantees that each run stays inside one page on each side
    and that the destination rows are distinct and none is a source row of the launch
    (the runs are independent)."""
    n_planes, n_pages = group.shape[0] * group.shape[1], group.shape[2]
    page_size = group.shape[3]
    row = group.shape[4] * group.shape[5]
    page = page_size * row
    items = n_planes * n_runs
    if items * page == 0:
        return
    itemsize = group.dtype.itemsize
    if (group.shape[1] == 2 and row * itemsize % VECTOR_BYTES == 0
            and page * itemsize <= WIDE_RUN_BYTES and aligned(group, VECTOR_BYTES)):
        lanes, block_rows = vector_lanes(page * itemsize // VECTOR_BYTES)
        grid = (run_grid(n_runs, block_rows), min(group.shape[0], MAX_GRID_Y))
        _vectors(grid, (lanes, block_rows), stream, group, tables, int(runs_off), int(n_runs))
    else:
        lanes, block_rows = run_block(page)
        _elements(run_grid(items, block_rows), (lanes, block_rows), stream,
                  group.reshape(n_planes, n_pages * page), tables, int(runs_off), int(n_runs),
                  int(row))
