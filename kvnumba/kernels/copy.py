"""Copy one column's rows to another column in every layer of a storage group
(the device side of `seq_clone`), as 16-byte vectors.

A storage group holds the K and V of several layers with the same row count as one
array `[n_layers, 2, rows, n_cols, n_kv_heads, head_dim]`. Position row `r` of
column `c` is one contiguous run of `n_kv_heads * head_dim` elements, so the clone
of `n_rows` rows is `n_layers * 2 * n_rows` such runs, (plane, row) with plane
`layer * 2 + (0: K, 1: V)`: one launch per group. Each block row (`threadIdx.y`)
takes runs in a grid stride, stepping its (plane, row) pair without a division
(`masks.step_on`); its lanes (`write.run_block`) move the run. A run that is not a
whole number of vectors (an odd head_dim at float16) is copied element by element.

Index ranges: rows (`< capacity`) and columns (`<= max_seqs`) are below 2**31
(`CacheConfig`), and so are the grid's block rows; element indices into the group
stay int64 (nothing bounds a group's size below 2**31), made by multiplication once
per run.
"""
from __future__ import annotations

from ..device import cuda
from . import ptx
from .launch import VECTOR_BYTES, Specialised, ceil_div
from .masks import div32, divmod32, step_on
from .write import PAIR, run_block, run_grid


@cuda.jit(device=True)
def _first_run(n_rows):
    """`(plane, row)` of this block row's first run, and the grid stride as (planes, rows)."""
    plane, row = divmod32(cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y, n_rows)
    skip_planes, skip_rows = divmod32(cuda.gridDim.x * cuda.blockDim.y, n_rows)
    return plane, row, skip_planes, skip_rows


@cuda.jit
def _copy_vectors(group, src_col, dst_col, n_rows):
    """Lane `threadIdx.x` of a block row copies vectors `lane`, `lane + blockDim.x`, ... of
    each of the row's runs from column `src_col` to `dst_col`, `PAIR` of them a trip."""
    n_planes = group.shape[0] * group.shape[1]
    rows, n_cols = group.shape[2], group.shape[3]
    run = group.shape[4] * group.shape[5]              # elements per (row, column)
    elems = div32(VECTOR_BYTES, group.itemsize)        # elements per vector (itemsize: a field)
    first = cuda.threadIdx.x * elems
    step = cuda.blockDim.x * elems
    shift = (dst_col - src_col) * run                  # destination index - source index
    plane, row, skip_planes, skip_rows = _first_run(n_rows)
    while plane < n_planes:
        start = ((plane * rows + row) * n_cols + src_col) * run
        last = start + run - elems                     # the run's last vector
        e = start + first
        while e <= last:                               # not `range`: it divides by its step
            far = min(e + step, last)                  # past the run: loaded, not stored
            a, b, c, d = ptx.ld_v4(group, e)
            a2, b2, c2, d2 = ptx.ld_v4(group, far)
            ptx.st_v4(group, shift + e, a, b, c, d)
            if e + step <= last:
                ptx.st_v4(group, shift + far, a2, b2, c2, d2)
            e += PAIR * step
        plane, row = step_on(plane, row, skip_planes, skip_rows, n_rows)


@cuda.jit
def _copy_elements(group, src_col, dst_col, n_rows):
    """As `_copy_vectors`, one (head, dim) element per lane and trip."""
    n_planes = group.shape[0] * group.shape[1]
    n_heads, head_dim = group.shape[4], group.shape[5]
    first_head, first_dim = divmod32(cuda.threadIdx.x, head_dim)
    skip_heads, skip_dims = divmod32(cuda.blockDim.x, head_dim)
    plane, row, skip_planes, skip_rows = _first_run(n_rows)
    while plane < n_planes:
        layer = plane >> 1
        kv = plane & 1
        head, dim = first_head, first_dim
        while head < n_heads:
            group[layer, kv, row, dst_col, head, dim] = group[layer, kv, row, src_col, head, dim]
            head, dim = step_on(head, dim, skip_heads, skip_dims, head_dim)
        plane, row = step_on(plane, row, skip_planes, skip_rows, n_rows)


_vectors = Specialised(_copy_vectors)
_elements = Specialised(_copy_elements)


def copy_column(group, src_col: int, dst_col: int, n_rows: int, stream=0) -> None:
    """Copy rows `[0, n_rows)` of column `src_col` to `dst_col` in every layer of `group`
    (`[n_layers, 2, rows, n_cols, n_kv_heads, head_dim]`), K and V: one launch."""
    run = group.shape[4] * group.shape[5]
    runs = group.shape[0] * 2 * n_rows
    if runs * run == 0:
        return
    if run * group.dtype.itemsize % VECTOR_BYTES == 0:  # items: pairs of vectors
        items, kernel = ceil_div(run * group.dtype.itemsize // VECTOR_BYTES, PAIR), _vectors
    else:
        items, kernel = run, _elements
    lanes, rows = run_block(items)
    kernel(run_grid(runs, rows), (lanes, rows), stream,
           group, int(src_col), int(dst_col), int(n_rows))
