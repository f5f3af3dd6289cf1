"""Device functions the kernels share: a segment's fields, which keys a query sees, where
a key lives, and index arithmetic without 64-bit division.

Segments are read from the step's flat int32 tables (`read_segment`). Visibility is
one interval per query, `[lo, hi)`, moving forward with the query's position (see
`key_range_of`); a ring layer keeps position `p` in storage row `p % ring_rows` (see
`storage_row`, and `store_row` for walking a tile's rows without a division per key).
Storage is paged: row `r` of a sequence lives in slot `page_slot(pages, seq, r, page_bits)`
of its layer's slot storage `[n_pages * page_size, n_kv_heads, head_dim]`, where
`pages [seq rows, pages per sequence]` (int32) is its layer kind's device page table,
each entry a page's first slot (page id times page_size): one load, a shift and one
logical operation per row, no multiplication.

Numba types integer arithmetic as int64, and a 64-bit division compiles to a test of
both operands' widths, a 32-bit path and a call of a software routine
(`__cuda_sm20_div_s64`, ~80 instructions). `div32` / `divmod32` divide operands known
to be below 2**32 in one `div.u32`; `step_on` moves a pair of indices (plane and row,
head and dim) along a grid-stride loop with no division at all.

The vector writes (`moves.write`, `moves.write_fp8`) share their walk over a block row's
tokens (`token_runs`) and the clamped vector indices of one trip of their wide loops
(`clamped_trip`).
"""
from __future__ import annotations

from ..device import cuda
from .intrinsics import ptx
from ..arith.positions import SEQ, FLAG_BLOCK, FLAGS, POS_START, Q_LEN, Q_START, SEQ_INFO_FIELDS

from numba import int32, int64, uint32, uint64  # noqa: E402  (after kvnumba.device chose the target)


@cuda.jit(device=True, inline="always")
def page_slot(pages, seq, row, page_bits):
    """Slot of storage row `row` (`>= 0`, a position or a ring slot) of sequence `seq`:
    `pages[seq, row >> page_bits] | (row & (page_size - 1))` as int32 (the table's
    entries are page-aligned slot bases, so `|` adds the offset in the page)."""
    r = uint32(row)
    base = pages[uint32(seq), r >> uint32(page_bits)]
    return int32(base | int32(r & ((uint32(1) << uint32(page_bits)) - uint32(1))))


@cuda.jit(device=True)
def read_segment(tables, seq_info_off, seg):
    """`(q_start, q_len, seq, pos_start, block)` of segment `seg` of the step's tables."""
    base = seq_info_off + seg * SEQ_INFO_FIELDS
    return (tables[base + Q_START], tables[base + Q_LEN], tables[base + SEQ],
            tables[base + POS_START], (tables[base + FLAGS] & FLAG_BLOCK) != 0)


def key_range_of(chunks: bool):
    """The `key_range` device function of a kernel built for layers of every mask
    (`chunks` True) or for flat and sliding-window layers only (`chunks` False: the
    chunk's division is not compiled in, and a chunk code reads as flat)."""
    @cuda.jit(device=True)
    def key_range(i, q_len, pos_start, block, mask_code):
        """`[lo, hi)`: the keys query `i` of a segment sees (one interval, moving forward
        with `i`).

        `mask_code` is the layer's mask code (`CacheConfig.mask_codes`): 0 none, W > 0 a
        sliding window of W positions, -C chunks of C positions.
        Causal: `lo(p) <= j <= p`, with `lo(p) = 0` without a window; `max(0, p - W + 1)`
        for a sliding window (FlashAttention's `window_size=(W - 1, 0)`, Hugging Face's
        `sliding_window=W`); `C * (p // C)` for chunks (the query's own chunk: Hugging
        Face's `chunked_attention` layers of `attention_chunk_size=C`; one 32-bit
        division).
        Block: the whole block `[pos_start, pos_start + q_len)` plus history `j >= lo(p)`.
        """
        p = pos_start + i
        lo = 0
        if mask_code > 0:
            lo = max(0, p - mask_code + 1)
        elif chunks and mask_code < 0:
            lo = p - int64(uint32(p) % uint32(-mask_code))
        if block:
            return min(lo, pos_start), pos_start + q_len
        return lo, p + 1
    return key_range


#: `key_range_of(True)`: every mask
key_range = key_range_of(True)


@cuda.jit(device=True)
def div32(a, b):
    """`a // b` for `0 <= a < 2**32`, `0 < b < 2**32`, as int64: one 32-bit division.

    LLVM narrows a division of operands zero-extended from uint32 to `div.u32`; the
    caller guarantees the range (for non-negative operands floor division is the
    unsigned quotient, so the result is Python's `a // b`).
    """
    return int64(uint32(a) // uint32(b))


@cuda.jit(device=True)
def divmod32(a, b):
    """`(a // b, a % b)` for `0 <= a < 2**32`, `0 < b < 2**32`: one 32-bit division."""
    return div32(a, b), int64(uint32(a) % uint32(b))   # LLVM pairs the two: one division


@cuda.jit(device=True)
def step_on(major, minor, major_step, minor_step, minor_size):
    """`(major, minor)` moved on by `major_step * minor_size + minor_step` items of a
    row-major `[*, minor_size]` walk (`0 <= minor, minor_step < minor_size`).

    A grid-stride loop over (plane, row) runs or (head, dim) elements splits its
    stride once (`divmod32`) and keeps both indices this way: no division per trip.
    """
    major += major_step
    minor += minor_step
    if minor >= minor_size:
        minor -= minor_size
        major += 1
    return major, minor


@cuda.jit(device=True)
def storage_row(position, ring_rows):
    """Row of `position`: itself on a flat layer, `position % ring_rows` on a ring.

    Positions are int32 (the step's tables) and never negative, and `ring_rows <=
    capacity <= INT32_MAX` (`CacheConfig`), so the modulo is one 32-bit division.
    """
    if ring_rows > 0:
        return int64(uint32(position) % uint32(ring_rows))
    return int64(position)


@cuda.jit(device=True)
def store_row(row0, c, ring_rows):
    """Storage row of key `key0 + c`, given `row0`, the row of `key0` (no division per key)."""
    row = row0 + c
    if ring_rows > 0:
        while row >= ring_rows:
            row -= ring_rows
    return row


@cuda.jit(device=True)
def seq_and_position(tables, width, token):
    """`(sequence, position)` of `token` in the write tables. The indices are uint32 (Numba
    adds no negative-index fix-up to an unsigned index): `token < width <= max_step`."""
    return tables[uint32(token)], tables[uint32(uint32(width) + uint32(token))]


@cuda.jit(device=True, inline="always")
def token_slot(pages, seq, position, ring, shift, in_page):
    """`page_slot(pages, seq, storage_row(position, ring), shift)` in 32-bit
    arithmetic: `ring` (uint32, 0 on a flat layer) and `shift`, `in_page` (page_bits and
    page_size - 1, uint32) are the launch's; the table has at most INT32_MAX entries
    (`CacheConfig`), so a flat index into it is 32-bit."""
    row = uint32(position)
    if ring != 0:
        row = uint32(row % ring)
    entry = uint32(uint32(uint32(seq) * uint32(pages.shape[1])) + uint32(row >> shift))
    return int32(pages.flat[entry] | int32(row & in_page))


@cuda.jit(device=True, inline="always")
def token_lanes(ring_rows, page_bits):
    """What a token-writing kernel's lane works from (`token_slot`'s launch numbers and
    its place in the grid): `(ring, shift, in_page, first, step, token, stride)`, uint32:
    the ring's rows (0 flat), page_bits and page_size - 1; its first item of a token's
    run (`threadIdx.x`) and the step between its items (`blockDim.x`); its block row's
    first token and the step between its tokens (a grid stride)."""
    shift = uint32(page_bits)
    return (uint32(ring_rows), shift, uint32(uint32(uint32(1) << shift) - uint32(1)),
            uint32(cuda.threadIdx.x), uint32(cuda.blockDim.x),
            uint32(cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y),
            uint32(cuda.gridDim.x * cuda.blockDim.y))


def clamped_trip(trip: int):
    """The device function `(at, first, step, last, scale) -> vector` of a wide loop's
    trip of `trip` vectors (a compile-time count, so `at` lives in registers): `at[j]`
    (uint64) is the trip's vector `j`, `first + j * step` clamped to `last` (uint32
    vector indices), times `scale`; it returns the trip's last vector, from which the
    next trip starts `step` on."""
    @cuda.jit(device=True, inline="always")
    def trip_at(at, first, step, last, scale):
        vector = first
        for j in range(trip):
            if j > 0:
                vector = min(uint32(vector + step), last)
            at[j] = uint64(vector) * scale
        return vector
    return trip_at


def token_runs(move):
    """The device function `(k_store, v_store, k, v, tables, width, ring_rows, pages,
    page_bits, run, last, k_inv, v_inv)` of the vector writes: a block row's tokens in a
    grid stride (`token_lanes`), each one written (`tables[token]`, its sequence, `>= 0`;
    `tables[width + token]` its position) handed to `move(k_to, v_to, k_from, v_from,
    first, step, last, k_inv, v_inv)` as byte views from its run of `run` elements in
    storage (its slot, `token_slot`) and in the input, with the lane's first vector, its
    stride and the run's `last` vector (uint32)."""
    @cuda.jit(device=True, inline="always")
    def walk(k_store, v_store, k, v, tables, width, ring_rows, pages, page_bits, run, last,
             k_inv, v_inv):
        ring, shift, in_page, first, step, token, stride = token_lanes(ring_rows, page_bits)
        while token < uint32(width):
            seq, position = seq_and_position(tables, width, token)
            if seq >= 0:
                slot = token_slot(pages, seq, position, ring, shift, in_page)
                start = ptx.mul_wide_u32(token, run)             # input elements
                at = ptx.mul_wide_u32(slot, run)                 # storage elements
                move(ptx.bytes_from(k_store, at), ptx.bytes_from(v_store, at),
                     ptx.bytes_from(k, start), ptx.bytes_from(v, start), first, step, last,
                     k_inv, v_inv)
            token = uint32(token + stride)
    return walk
