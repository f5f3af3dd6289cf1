"""Copy a column's row prefix to another column (the device side of `seq_clone`)."""
from __future__ import annotations

from ..device import cuda

THREADS = 256


@cuda.jit
def _copy_column(k_store, v_store, src_col, dst_col, n_rows):
    """One thread per (row, head, lane) element of rows `[0, n_rows)`, K and V together."""
    idx = cuda.grid(1)
    n_heads = k_store.shape[2]
    head_dim = k_store.shape[3]
    if idx >= n_rows * n_heads * head_dim:
        return
    lane = idx % head_dim
    head = (idx // head_dim) % n_heads
    row = idx // (head_dim * n_heads)
    k_store[row, dst_col, head, lane] = k_store[row, src_col, head, lane]
    v_store[row, dst_col, head, lane] = v_store[row, src_col, head, lane]


def copy_column(k_store, v_store, src_col: int, dst_col: int, n_rows: int, stream=0) -> None:
    """Copy rows `[0, n_rows)` of column `src_col` to `dst_col` in both K and V, on the device."""
    total = n_rows * k_store.shape[2] * k_store.shape[3]
    if total == 0:
        return
    blocks = (total + THREADS - 1) // THREADS
    _copy_column[blocks, THREADS, stream](k_store, v_store, src_col, dst_col, n_rows)
