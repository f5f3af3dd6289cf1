"""Write a step's K and V into their columns, wrapping ring layers (one launch per layer)."""
from __future__ import annotations

from ..device import cuda

THREADS = 256


@cuda.jit
def _write_kv(k_store, v_store, k, v, seq_cols, positions, ring_rows):
    """One thread per (token, head, lane) element; lanes run along head_dim (coalesced).

    row = position (flat) or position % ring_rows (ring); a negative column means
    "write nowhere" (padding in a cache without a scratch column).
    """
    idx = cuda.grid(1)
    n_heads = k.shape[1]
    head_dim = k.shape[2]
    if idx >= k.shape[0] * n_heads * head_dim:
        return
    lane = idx % head_dim
    head = (idx // head_dim) % n_heads
    token = idx // (head_dim * n_heads)
    col = seq_cols[token]
    if col < 0:
        return
    position = positions[token]
    row = position % ring_rows if ring_rows > 0 else position
    k_store[row, col, head, lane] = k[token, head, lane]
    v_store[row, col, head, lane] = v[token, head, lane]


def write_kv(k_store, v_store, k, v, seq_cols, positions, ring_rows: int, stream=0) -> None:
    """Scatter `k`, `v` `[width, n_kv_heads, head_dim]` into `[rows, cols, n_kv_heads, head_dim]`.

    `seq_cols`, `positions`: int32 device arrays of at least `width` entries.
    """
    total = k.shape[0] * k.shape[1] * k.shape[2]
    if total == 0:
        return
    blocks = (total + THREADS - 1) // THREADS
    _write_kv[blocks, THREADS, stream](k_store, v_store, k, v, seq_cols, positions, ring_rows)
