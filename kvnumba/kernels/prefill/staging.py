"""The prefill kernel's staging, as device functions of one specialisation
(`staging_functions`): each key row's slot through the page table (wrapping a ring),
K / V tiles and Q rows into shared memory by cp.async in 16-byte chunks (zero-filled
where there is nothing to read), and a packed row's (token, head) (`prefill_kernel`'s
doc tells the layout).

8-bit float storage is converted on the way in: a chunk of 8 values is one 8-byte
load, widened exactly to the mma's 16-bit type (e4m3 / e5m2 to float16 pairs by
`cvt.rn.f16x2`; to bfloat16 through float32, exact too) and stored to shared memory
as 16 bytes. These loads are synchronous, so a tile's loads do not overlap the math
as cp.async's do. A narrow tile (`shape.narrow_staging`: one warp) stages the stored
bytes themselves by cp.async, 16 values a chunk, and widens the fragments it reads
(`widener`)."""
from __future__ import annotations

from ...device import cuda
from ..intrinsics import fp8, ptx, tensorcore
from ..masks import page_slot
from .shape import CHUNK_VALUES, PrefillShape

from numba import float32, int32, int64, uint16, uint32, uint64  # noqa: E402  (after device)


@cuda.jit(device=True)
def split_row(row, group):
    """(row // group, row % group) of a packed row (token, head in the group) by
    unsigned 32-bit division: rows are never negative."""
    token = uint32(row) // uint32(group)
    return int32(token), int32(uint32(row) - uint32(token) * uint32(group))


def widener(shape: PrefillShape):
    """`widen(u) -> (lo, hi)`: the four 8-bit floats of word `u` (byte 0 lowest) as two
    pairs of the mma type, exactly (`lo` bytes 0 and 1): to float16 by `cvt.rn.f16x2`,
    to bfloat16 through float32."""
    to_f16x4 = fp8.e4m3x4_to_f16x4 if shape.stored == "e4m3" else fp8.e5m2x4_to_f16x4
    to_f32x4 = fp8.e4m3x4_to_f32 if shape.stored == "e4m3" else fp8.e5m2x4_to_f32

    @cuda.jit(device=True, inline="always")
    def widen_to_f16(u):
        return to_f16x4(u)

    @cuda.jit(device=True, inline="always")
    def widen_to_bf16(u):
        a, b, c, d = to_f32x4(u)
        return ptx.f32x2_to_bf16x2(a, b), ptx.f32x2_to_bf16x2(c, d)

    return widen_to_f16 if shape.storage == "float16" else widen_to_bf16


def staging_functions(shape: PrefillShape, q_copy: bool) -> tuple:
    """`(stage_queries, stage_tile)` for one kernel `shape`, Q staged by
    cp.async (`q_copy`: q holds the storage's type, 16-byte aligned) or converted value
    by value."""
    head_dim, BR, BK, PITCH = shape.head_dim, shape.br, shape.bk, shape.pitch
    PADDED, Q_BASE = shape.padded, shape.q_base
    KEY_LANES, KEY_PASSES, KEY_STEP = shape.key_lanes, shape.key_passes, shape.key_step
    KEY_COPIES, KEYS_EXACT = shape.key_copies, shape.keys_exact
    Q_LANES, Q_PASSES, Q_STEP = shape.q_lanes, shape.q_passes, shape.q_step
    Q_COPIES, Q_EXACT = shape.q_copies, shape.q_exact
    WIDE, VS, V_COPIES, V_EXACT = shape.wide, shape.vs, shape.v_copies, shape.v_exact
    pack = ptx.f32x2_to_f16x2 if shape.storage == "float16" else ptx.f32x2_to_bf16x2
    STORED_BYTES = shape.stored_bytes
    KV_PITCH, KV_VALUES, NARROW = shape.kv_pitch, shape.kv_values, shape.narrow
    widen = widener(shape) if STORED_BYTES == 1 else None

    @cuda.jit(device=True)
    def find_slots(slots, pages, seq, page_bits, row, n_keys, ring, first_key):
        """slots[p]: the slot, in sequence `seq`'s pages, of this thread's key first_key +
        p KEY_STEP of a tile (see `stage_keys`): of storage row `row` (the tile's first
        key's, < ring) plus the key, wrapped. A key from n_keys on (1 <= n_keys <= ring)
        takes the last key's slot, so that its page-table load stays inside the
        sequence's pages (the key itself is zero-filled)."""
        for p in range(KEY_PASSES):
            key = int32(first_key + p * KEY_STEP)
            if KEYS_EXACT or key < BK:
                unwrapped = int64(row) + min(key, int32(n_keys - 1))    # below 2 ring
                r = min(uint32(unwrapped), uint32(unwrapped - ring))
                slots[p] = page_slot(pages, seq, r, page_bits)

    @cuda.jit(device=True, inline="always")
    def copy_chunk(tile, index, src, at, zero):
        """cp.async the 16 bytes at byte `at` of `src` (8 16-bit values) to tile element
        `index`, or zeros there where `zero`."""
        tensorcore.cp_async_16_zfill(tile, index, src, at, zero)

    @cuda.jit(device=True, inline="always")
    def convert_chunk(tile, index, src, at, zero):
        """The 8 bytes at byte `at` of `src` (8 8-bit floats, one load) widened to the mma
        type and stored to tile element `index` (16 bytes), or zeros, nothing loaded."""
        w0 = w1 = w2 = w3 = uint32(0)
        if not zero:
            u0, u1 = ptx.ld_nc_v2(src, at)
            w0, w1 = widen(u0)
            w2, w3 = widen(u1)
        tensorcore.st_shared_v4(tile, index, w0, w1, w2, w3)

    stage_chunk = copy_chunk if STORED_BYTES == 2 or NARROW else convert_chunk

    @cuda.jit(device=True)
    def stage_keys(tile, dst, src, slots, slot_bytes, n_keys, first_key, d0):
        """Stage this thread's chunks of a K or V tile (`stage_chunk`): key first_key + p
        KEY_STEP in pass p, chunks of values d0 + c KEY_LANES KV_VALUES, to tile index
        `dst` (its first key and chunk; a chunk is 8 tile elements) on, from `src` (its
        head and d0 in slot 0) plus slots[p] times slot_bytes. Keys from n_keys on and
        padding columns are zero-filled."""
        for p in range(KEY_PASSES):
            key = int32(first_key + p * KEY_STEP)
            if KEYS_EXACT or key < BK:
                at = ptx.mul_wide_u32(slots[p], slot_bytes)
                for c in range(KEY_COPIES):
                    pad = PADDED and d0 + c * KEY_LANES * KV_VALUES >= head_dim
                    stage_chunk(
                        tile, int32(dst + (p * KEY_STEP * KV_PITCH + c * KEY_LANES * CHUNK_VALUES)),
                        src, at + uint64(STORED_BYTES * c * KEY_LANES * KV_VALUES),
                        key >= n_keys or pad)

    @cuda.jit(device=True)
    def stage_values(tile, dst, src, slots, slot_bytes, n_keys, first_key, d0, v_end):
        """The wide tile's V slice (`VS` dims from the slice's start): as `stage_keys`,
        chunks d0 + c KEY_LANES of the slice, zero-filled from `v_end` (V's dims past the
        slice's start) on and for keys from n_keys on."""
        for p in range(KEY_PASSES):
            key = int32(first_key + p * KEY_STEP)
            if KEYS_EXACT or key < BK:
                at = ptx.mul_wide_u32(slots[p], slot_bytes)
                for c in range(V_COPIES):
                    d = d0 + c * KEY_LANES * CHUNK_VALUES
                    if V_EXACT or d < VS:
                        stage_chunk(
                            tile, int32(dst + (p * KEY_STEP * KV_PITCH + c * KEY_LANES * CHUNK_VALUES)),
                            src, at + uint64(STORED_BYTES * c * KEY_LANES * CHUNK_VALUES),
                            key >= n_keys or d >= v_end)

    @cuda.jit(device=True)
    def copy_q_chunk(tile, dst, q, token, head, d, zero):
        """Q values d .. d + 8 of (token, head), or zeros, by cp.async."""
        at = (int64(token) * q.shape[1] + head) * head_dim + d
        tensorcore.cp_async_16_zfill(tile, dst, q, at, zero)

    @cuda.jit(device=True)
    def convert_q_chunk(tile, dst, q, token, head, d, zero):
        """Q values d .. d + 8 of (token, head) in the 16-bit type, or zeros, by loads and
        stores (q of another type, or not 16-byte aligned)."""
        for i in range(0, CHUNK_VALUES, 2):
            lo = float32(0.0)
            hi = float32(0.0)
            if not zero:
                lo = ptx.to_f32(q[token, head, d + i])
                hi = ptx.to_f32(q[token, head, d + i + 1])
            word = pack(lo, hi)
            tile[dst + i] = uint16(word & 0xFFFF)
            tile[dst + i + 1] = uint16(word >> 16)

    stage_q_chunk = copy_q_chunk if q_copy else convert_q_chunk

    @cuda.jit(device=True)
    def stage_queries(tile, q, q_start, first_row, n_rows, group, kv_head, first_q, d0):
        """This thread's chunks of the block's Q rows (packed row first_row + r in tile row
        r from Q_ROW on): rows first_q + p Q_STEP, chunks d0 + c Q_LANES; zeros past the
        segment's rows and past head_dim."""
        for p in range(Q_PASSES):
            r = first_q + p * Q_STEP
            if Q_EXACT or r < BR:
                token, head = split_row(first_row + min(r, n_rows - 1), group)
                for c in range(Q_COPIES):
                    d = d0 + c * Q_LANES * CHUNK_VALUES
                    stage_q_chunk(tile, Q_BASE + r * PITCH + d, q, q_start + token,
                                  kv_head * group + head, d,
                                  r >= n_rows or (PADDED and d >= head_dim))

    @cuda.jit(device=True)
    def stage_tile(tile, j, staging, values):
        """cp.async key tile j of K (`values` False) or V into its buffer, as one group.
        K(j) is always staged right before V(j): K finds the keys' slots, V reuses them.
        The wide tile stages its V slice (`stage_values`; V's own slot bytes)."""
        (k_dst, k_src, v_dst, v_src, slots, pages, seq, page_bits, slot_bytes, row0, ring,
         max_keys, span, first_key, d0, v_slot_bytes, v_end) = staging
        n_keys = min(max_keys, int32(span - j * BK))
        if not values:
            # the row of its first key: unwrapped below 2 ring (j BK < span <= ring),
            # wrapped, and kept below ring (a table whose window exceeds its ring reads
            # wrong keys, but inside the sequence's pages)
            start = uint32(row0 + uint32(j * BK))
            row = min(start, uint32(int64(start) - ring), uint32(ring - 1))
            find_slots(slots, pages, seq, page_bits, row, n_keys, ring, first_key)
        if WIDE and values:
            stage_values(tile, v_dst, v_src, slots, v_slot_bytes, n_keys, first_key, d0, v_end)
        else:
            stage_keys(tile, v_dst if values else k_dst, v_src if values else k_src, slots,
                       slot_bytes, n_keys, first_key, d0)
        tensorcore.cp_async_commit()

    return stage_queries, stage_tile
