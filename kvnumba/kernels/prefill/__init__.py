"""Prefill attention on tensor cores for 16-bit and 8-bit float K/V storage: the path's
host face.

Segments long enough to fill tensor-core tiles run on `prefill_kernel` (its doc tells
how: FlashAttention-2 style, packed GQA rows, cp.async staging through the page
tables, `mma.sync` for S = Q K^T and O += P V); `supports` says which storage and
head dims the standard tiles serve, `supports_wide` what the wide tile serves (K rows
past 256 values, to a latent layer's 576, or V narrower than K: `is_wide`), `run`
checks a launch and makes it. The decode path runs the same kernel split over its key
chunks (`decode`).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..launch.constants import FP8_FORMATS
from ..launch.calling import PER_CALL, aligned, ceil_div, device_pointer, no_output
from ..sinks import no_sinks
from .kernel import prefill_kernel
from .shape import (Q_OUT_TYPES, WIDE_TILE, default_warp_rows, grouped_tile,  # noqa: F401
                    stored_type, supports, supports_wide, tile_shape, type_name, v_slice)

#: the mma type's array dtype name (bfloat16 as uint16 bits)
MMA_DTYPES = {"float16": "float16", "bfloat16": "uint16"}


def is_wide(head_dim: int, v_dim: int) -> bool:
    """Whether a layer of K rows of `head_dim` values and V of `v_dim` takes the wide tile
    (`shape.WIDE_TILE`): K past the standard tiles' 256, or V narrower than K."""
    return v_dim != head_dim or not supports(head_dim, "float16")


def shares_rows(k_store, v_store) -> bool:
    """Whether V's storage is K's rows themselves (a latent layer: V their first values),
    so the wide tile reads V from K's staged tile."""
    return v_store is k_store or (tuple(v_store.shape) == tuple(k_store.shape)
                                  and device_pointer(v_store) == device_pointer(k_store))


@lru_cache(maxsize=None)
def served(head_dim, storage_dtype, q_dtype, out_dtype, v_dim=None) -> tuple[str, str]:
    """`(mma type, stored type)` of a launch, after refusing what this path does not serve;
    cached per combination, so a launch pays for the checks once, not per layer and step.
    16-bit storage is its own mma type; 8-bit floats take the query's 16-bit type
    (float16 for a float32 q), to which they convert exactly. `v_dim`: V's width where it
    is not K's (`supports_wide`)."""
    v_dim = head_dim if v_dim is None else v_dim
    if not (supports_wide(head_dim, v_dim, storage_dtype) if is_wide(head_dim, v_dim)
            else supports(head_dim, storage_dtype)):
        raise ValueError(f"prefill: head_dim {head_dim} (V {v_dim}) with storage "
                         f"{type_name(storage_dtype)!r} is not served")
    for name, dtype in (("q", q_dtype), ("out", out_dtype)):
        if type_name(dtype) not in Q_OUT_TYPES:
            raise ValueError(f"prefill: {name} dtype {dtype} not in {Q_OUT_TYPES}")
    stored = stored_type(storage_dtype)
    if type_name(storage_dtype) not in FP8_FORMATS:
        return stored, stored
    return ("bfloat16" if type_name(q_dtype) == "uint16" else "float16"), stored


class PrefillRun:
    """The prefill launches of one step (`prepare`): the step's tables (where the segment
    table and the served list are), how many segments, the longest, `page_bits`, the
    tile and the stream fixed. A call (`run(q, k_store, v_store, pages, out, lse, sinks,
    ring_rows, mask_code, scale, softcap)`, once per layer) looks its signature up: q's and
    out's dtypes and heads, q's 16-byte alignment, the storage's dtype and heads, V's
    width in out and in its storage rows, out's 16-byte alignment, softcap and sinks on
    or off. The first call of
    a signature checks what the path serves (`served`, `check_storage`), picks the
    kernel (the wide tile where `is_wide`) and its grid and binds it; later calls pack
    their arrays and scalars only."""

    def __init__(self, tables, *, seq_info_off: int, segments_off: int, n_segments: int,
                 max_q_len: int, page_bits: int, stream=0, tile=None):
        self.tables, self.seq_info_off, self.segments_off = tables, seq_info_off, segments_off
        self.n_segments, self.max_q_len, self.page_bits = n_segments, max_q_len, page_bits
        self.stream, self.tile = stream, tile
        self._launches = {}

    def __call__(self, q, k_store, v_store, pages, out, lse, sinks, ring_rows, mask_code, scale,
                 softcap) -> None:
        if self.n_segments == 0 or self.max_q_len == 0:
            return
        if not scale > 0:
            raise ValueError(f"prefill: scale {scale} must be positive")
        head_dim, v_dim = q.shape[2], out.shape[2]
        mma, stored = served(head_dim, k_store.dtype, q.dtype, out.dtype, v_dim)  # cached
        check_storage(head_dim, v_dim, k_store, v_store)
        key = (q.dtype, q.shape[1], aligned(q, 16), out.dtype, k_store.dtype,
               k_store.shape[1:], v_dim, v_store.shape[2], aligned(out, 16), softcap > 0,
               sinks.shape[0] > 0)
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = self._bind(
                q, k_store, v_dim, shares_rows(k_store, v_store), mma, stored, key[2],
                *key[-3:])
        launch(q, k_store, v_store, pages, out, lse, sinks, int(ring_rows), int(mask_code),
               np.float32(scale), np.float32(softcap))

    def _bind(self, q, k_store, v_dim: int, v_in_k: bool, mma: str, stored: str,
              q_aligned: bool, out_aligned: bool, capped: bool, sunk: bool):
        head_dim, n_q_heads, n_kv_heads = q.shape[2], q.shape[1], k_store.shape[1]
        group = n_q_heads // n_kv_heads
        q_copy = type_name(q.dtype) == MMA_DTYPES[mma] and q_aligned  # Q in the mma type
        if is_wide(head_dim, v_dim):
            (block_rows, block_keys), warp_rows, slices = WIDE_TILE, 16, \
                v_slice(head_dim, v_dim)[1]
            kernel = prefill_kernel(head_dim, block_rows, block_keys, mma, capped, q_copy,
                                    None, stored, sunk, False, v_dim, v_in_k, out_aligned)
        else:
            block_rows, block_keys, *warp_rows = self.tile or tile_shape(head_dim)
            warp_rows, slices = (warp_rows[0] if warp_rows else None), 1
            kernel = prefill_kernel(head_dim, block_rows, block_keys, mma, capped, q_copy,
                                    warp_rows, stored, sunk, out_aligned=out_aligned)
        warps = block_rows // (warp_rows or default_warp_rows(head_dim, block_rows))
        n_row_tiles = ceil_div(group * self.max_q_len, block_rows)
        return kernel.bind((n_kv_heads, self.n_segments, n_row_tiles * slices), 32 * warps,
                           self.stream,
                           PER_CALL, PER_CALL, PER_CALL, PER_CALL, int(self.page_bits),
                           self.tables, PER_CALL, PER_CALL, PER_CALL, int(self.seq_info_off),
                           int(self.segments_off), n_row_tiles, group, PER_CALL, PER_CALL,
                           PER_CALL, PER_CALL, no_sinks(), no_sinks(), 0, 0)  # not split


def check_storage(head_dim: int, v_dim: int, k_store, v_store) -> None:
    """Refuse (`ValueError`) storage that is not slot storage: K `[n_slots, n_kv_heads,
    head_dim]`, V of its slots and heads, `v_dim` wide (or, on the wide tile, rows of at
    least `v_dim` values: a latent layer's V is K's rows)."""
    shape, v_shape = tuple(k_store.shape), tuple(v_store.shape)
    if len(shape) != 3 or shape[2] != head_dim or len(v_shape) != 3 or \
            v_shape[:2] != shape[:2] or not (v_shape[2] == v_dim or (
                is_wide(head_dim, v_dim) and v_shape[2] >= v_dim)):
        raise ValueError(f"prefill: storage {shape} / {v_shape} is not slot storage "
                         f"[n_slots, n_kv_heads, {head_dim}] / [.., .., {v_dim}]")


def prepare(tables, *, seq_info_off, segments_off, n_segments, max_q_len, page_bits,
            stream=0, tile=None) -> PrefillRun:
    """The prepared half of `run`: what a step fixes for its prefill group, once
    (`PrefillRun`); the arguments are `run`'s."""
    return PrefillRun(tables, seq_info_off=int(seq_info_off), segments_off=int(segments_off),
                      n_segments=int(n_segments), max_q_len=int(max_q_len),
                      page_bits=int(page_bits), stream=stream, tile=tile)


def run(q, k_store, v_store, tables, *, pages, page_bits, seq_info_off, segments_off,
        n_segments, max_q_len, out, ring_rows, mask_code, scale, softcap, lse=None, sinks=None,
        stream=0, tile=None):
    """Attention of the listed segments' queries over their own sequence's keys, into `out`.

    q: [width, n_q_heads, head_dim], out: [width, n_q_heads, v_dim] device arrays,
    float16, float32 or bfloat16 (uint16 bits); only the listed segments' rows of `out`
    are written. k_store, v_store: slot storage [n_slots, n_kv_heads, head_dim] and
    [n_slots, n_kv_heads, v_dim] (page pools [n_pages, page_size, n_kv_heads, ...]
    reshaped; n_slots <= INT32_MAX), 16-bit or 8-bit floats (see `stored_type`),
    C-contiguous. V as wide as K up to 256 takes the standard tiles; K to 576 and V to
    512, no wider than K, the wide tile (`supports_wide`), where `v_store` may be K's
    rows themselves (a latent layer: V their first `v_dim` values). pages: the layer kind's int32 device page table [seq rows, pages per
    sequence], C-contiguous, indexed by a segment's `SEQ`, each entry a page's first slot
    (page id times page_size); page_bits: log2(page_size). Storage row r of sequence
    `seq` (its position on a flat layer, position % ring_rows on a ring) is slot
    `pages[seq, r >> page_bits] | (r & (page_size - 1))`; a sequence's pages cover rows
    up to its keys' last (flat) or all ring_rows rows (ring). tables: flat int32 device
    array; segment `s`, field `F` at `seq_info_off + s * SEQ_INFO_FIELDS + F`; the
    segments served are `tables[segments_off + i]`, `i < n_segments`, none longer than
    `max_q_len`. ring_rows: 0 (flat) or R; mask_code: the layer's mask code (`masks.key_range`: 0, W or -C); softcap 0.0 = off.
    lse: None, or a float32 `[width, n_q_heads]` device array that receives each listed
    row's natural-log log-sum-exp of its (scaled, capped) scores. sinks: None, or a
    float32 `[n_q_heads]` device array: each q head's logit joins its rows' softmax
    (`kernels.sinks`; `lse` includes it). One launch on
    `stream`: no synchronisation, no allocation. `tile`: (block_rows, block_keys),
    multiples of 16, and optionally warp_rows (16 or 32, dividing block_rows; else
    `default_warp_rows`), instead of `tile_shape(head_dim)`.
    """
    prepare(tables, seq_info_off=seq_info_off, segments_off=segments_off,
            n_segments=n_segments, max_q_len=max_q_len, page_bits=page_bits, stream=stream,
            tile=tile)(q, k_store, v_store, pages, out, no_output() if lse is None else lse,
                       no_sinks() if sinks is None else sinks, ring_rows, mask_code, scale,
                       softcap)
    return out
