"""Write a step's K and V into their columns, wrapping ring layers (one launch per layer).

A token's K (all heads) is one contiguous run of `n_kv_heads * head_dim` elements in
the input and one in storage (row `row(position)`, column `seq_cols[token]`), so
the wide path moves it as 16-byte vectors: one thread per vector of K and the same
vector of V, in a grid-stride loop over the step's tokens. It needs the input in the
storage dtype, C-contiguous and 16-byte aligned, and a run length that is a whole
number of vectors; anything else (a float32 input into float16 storage, a strided
view) takes the element-wise path.
"""
from __future__ import annotations

from ..arrays import aligned
from ..device import cuda
from . import ptx
from .launch import STRIDE_THREADS, VECTOR_BYTES, Specialised, stride_blocks
from .masks import storage_row


@cuda.jit
def _write_vectors(k_store, v_store, k, v, tables, width, ring_rows):
    """Thread `i` of the grid-stride loop moves vector `i % per_token` of token `i // per_token`.

    `tables[token]` is the token's column (negative: write nowhere), `tables[width +
    token]` its position. Indices are in elements of a flat view of each array.
    """
    per_token = k.shape[1] * k.shape[2] * k.itemsize // VECTOR_BYTES
    elems = VECTOR_BYTES // k.itemsize             # elements per vector
    run = k.shape[1] * k.shape[2]                  # elements per token
    n_cols = k_store.shape[1]
    for i in range(cuda.grid(1), width * per_token, cuda.gridsize(1)):
        token = i // per_token
        lane = i - token * per_token
        col = tables[token]
        if col >= 0:
            row = storage_row(tables[width + token], ring_rows)
            src = token * run + lane * elems
            dst = (row * n_cols + col) * run + lane * elems
            a, b, c, d = ptx.ld_nc_v4(k, src)
            ptx.st_v4(k_store, dst, a, b, c, d)
            a, b, c, d = ptx.ld_nc_v4(v, src)
            ptx.st_v4(v_store, dst, a, b, c, d)


@cuda.jit
def _write_elements(k_store, v_store, k, v, tables, width, ring_rows):
    """One thread per (token, head, dim) element, converting to the storage dtype (float16,
    float32, or bfloat16 held as uint16 bits)."""
    n_heads = k.shape[1]
    head_dim = k.shape[2]
    for idx in range(cuda.grid(1), width * n_heads * head_dim, cuda.gridsize(1)):
        dim = idx % head_dim
        head = (idx // head_dim) % n_heads
        token = idx // (head_dim * n_heads)
        col = tables[token]
        if col >= 0:
            row = storage_row(tables[width + token], ring_rows)
            k_store[row, col, head, dim] = ptx.from_f32(ptx.to_f32(k[token, head, dim]), k_store)
            v_store[row, col, head, dim] = ptx.from_f32(ptx.to_f32(v[token, head, dim]), v_store)


_vectors = Specialised(_write_vectors)
_elements = Specialised(_write_elements)


def wide_ok(store, array) -> bool:
    """Whether `array` can be moved into `store` as 16-byte vectors."""
    run_bytes = array.shape[1] * array.shape[2] * array.dtype.itemsize
    return (array.dtype == store.dtype and run_bytes % VECTOR_BYTES == 0
            and array.is_c_contiguous() and aligned(array, VECTOR_BYTES))


def write_kv(k_store, v_store, k, v, tables, ring_rows: int, stream=0) -> None:
    """Scatter `k`, `v` `[width, n_kv_heads, head_dim]` into `[rows, cols, n_kv_heads, head_dim]`.

    `tables`: int32 device array: `[0, width)` the column of each token, `[width,
    2 * width)` its position. One launch, on `stream`.
    """
    width = k.shape[0]
    elements = width * k.shape[1] * k.shape[2]
    if elements == 0:
        return
    if wide_ok(k_store, k) and wide_ok(k_store, v):
        work, kernel = elements * k.dtype.itemsize // VECTOR_BYTES, _vectors
    else:
        work, kernel = elements, _elements
    kernel(stride_blocks(work), STRIDE_THREADS, stream,
           k_store, v_store, k, v, tables, width, int(ring_rows))
