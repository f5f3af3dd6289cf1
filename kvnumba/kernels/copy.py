"""Copy one column's rows to another column in every layer of a storage group
(the device side of `seq_clone`), as 16-byte vectors.

A storage group holds the K and V of several layers with the same row count as one
array `[n_layers, 2, rows, n_cols, n_kv_heads, head_dim]`. Position row `r` of
column `c` is one contiguous run of `n_kv_heads * head_dim` elements, so the clone
of `n_rows` rows is `n_layers * 2 * n_rows` such runs: one launch per group, one
thread per 16-byte vector in a grid-stride loop. A run that is not a whole number of
vectors (an odd head_dim at float16) is copied element by element.
"""
from __future__ import annotations

from ..device import cuda
from . import ptx
from .launch import STRIDE_THREADS, VECTOR_BYTES, Specialised, stride_blocks


@cuda.jit
def _copy_vectors(group, src_col, dst_col, n_rows):
    """Vector `lane` of run (`layer`, `kv`, `row`), from column `src_col` to `dst_col`."""
    n_layers, two, rows, n_cols = group.shape[0], group.shape[1], group.shape[2], group.shape[3]
    run = group.shape[4] * group.shape[5]              # elements per (row, column)
    elems = VECTOR_BYTES // group.itemsize
    per_run = run // elems
    for i in range(cuda.grid(1), n_layers * two * n_rows * per_run, cuda.gridsize(1)):
        lane = i % per_run
        row = (i // per_run) % n_rows
        plane = i // (per_run * n_rows)                 # layer * 2 + (0: K, 1: V)
        base = (plane * rows + row) * n_cols
        a, b, c, d = ptx.ld_v4(group, (base + src_col) * run + lane * elems)
        ptx.st_v4(group, (base + dst_col) * run + lane * elems, a, b, c, d)


@cuda.jit
def _copy_elements(group, src_col, dst_col, n_rows):
    """One thread per element of the copied runs."""
    n_layers, two, n_heads, head_dim = group.shape[0], group.shape[1], group.shape[4], \
        group.shape[5]
    run = n_heads * head_dim
    for i in range(cuda.grid(1), n_layers * two * n_rows * run, cuda.gridsize(1)):
        dim = i % head_dim
        head = (i // head_dim) % n_heads
        row = (i // run) % n_rows
        plane = i // (run * n_rows)
        layer = plane // 2
        kv = plane - 2 * layer
        group[layer, kv, row, dst_col, head, dim] = group[layer, kv, row, src_col, head, dim]


_vectors = Specialised(_copy_vectors)
_elements = Specialised(_copy_elements)


def copy_column(group, src_col: int, dst_col: int, n_rows: int, stream=0) -> None:
    """Copy rows `[0, n_rows)` of column `src_col` to `dst_col` in every layer of `group`
    (`[n_layers, 2, rows, n_cols, n_kv_heads, head_dim]`), K and V: one launch."""
    run_bytes = group.shape[4] * group.shape[5] * group.dtype.itemsize
    total = group.shape[0] * 2 * n_rows * group.shape[4] * group.shape[5]
    if total == 0:
        return
    if run_bytes % VECTOR_BYTES == 0:
        work, kernel = total * group.dtype.itemsize // VECTOR_BYTES, _vectors
    else:
        work, kernel = total, _elements
    kernel(stride_blocks(work), STRIDE_THREADS, stream,
           group, int(src_col), int(dst_col), int(n_rows))
