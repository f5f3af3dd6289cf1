"""Prefill attention on tensor cores, FlashAttention-2 style, for 16-bit K/V storage.

Same semantics as `attention` (visible keys from `masks.key_range`, position p of a
ring layer in row p % ring_rows, scale then optional softcap, float32 softmax and
accumulation), for segments long enough to fill tensor-core tiles; scale > 0.

A block takes `block_rows` query *rows* of one segment and one kv head, packed GQA
as in `attention`: row `r` of the segment is (token `r // group`, q head
`kv_head * group + r % group`), so each K/V tile serves the whole group. Warp `w`
owns the block's rows `16 w .. 16 w + 15`. Per key tile of `block_keys` keys:

  S = Q K^T   mma.m16n8k16, Q fragments loaded once into registers by ldmatrix (above
              head_dim 128: kept in shared memory, loaded per tile), K^T by ldmatrix;
  online softmax on the S accumulators (quad shuffles), P packed to 16 bits in place;
  O += P V    P as the A operand, V by ldmatrix .trans; O in float32 registers.

K and V tiles go through shared memory by cp.async, each 16-byte chunk computing its
own storage row (a ring may wrap inside a tile). One K buffer and one V buffer,
overlapped: V(j) loads while S(j) and its softmax run, K(j+1) while O += P V(j).
Shared rows are padded by 16 bytes, so the 8 rows an ldmatrix reads hit 8 different
bank groups.

Masking: each row sees one key interval (`key_range`), moving forward with the row.
A block loads only keys [lo(first row), hi(last row)), the union of its rows'
intervals. A warp computes only on key tiles that meet [lo(its first row), hi(its
last row)), and masks (-inf before the softmax, per row and key) only tiles not
inside every one of its rows' intervals. A row that sees no key of a tile gets
P = 0 there: its running max stays -inf until it sees one, and exp2 then subtracts 0.

Fragment bookkeeping (m16n8k16, lane = 4 g + t, see `ptx`): a lane holds, of its
warp's 16 rows, rows `g` ("a") and `g + 8` ("b"):

  S n8 tile n (keys 8n .. 8n+7):  s[4n], s[4n+1] = row a, keys 8n+2t, 8n+2t+1;
                                  s[4n+2], s[4n+3] = row b, the same keys.
  P for keys 16k .. 16k+15 is the A operand of P V: its rows g / g+8, columns 2t, 2t+1
  are S tile 2k, its columns 2t+8, 2t+9 are S tile 2k+1, so the packed pairs
  p[2n] = (s[4n], s[4n+1]), p[2n+1] = (s[4n+2], s[4n+3]) give a0..a3 = p[4k .. 4k+3].
  O n8 tile n (dims 8n .. 8n+7):  o[4n .. 4n+3], rows a, a, b, b as S.

Storage 16-bit types: "float16" (`mma.f32.f16`) or "bfloat16" (`mma.f32.bf16`, the
storage holding bfloat16 bit patterns, e.g. as uint16), a compile-time choice of the
kernel factory with the tile shape and head_dim.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ..config import INT32_MAX, MAX_HEAD_DIM
from ..device import cuda
from ..plan import SEQ_INFO_FIELDS
from . import ptx
from .launch import Specialised, ceil_div
from .masks import key_range, read_segment

from numba import float32, int32, int64, uint16, uint32  # noqa: E402  (after kvnumba.device)

#: (block_rows, block_keys) for padded head dims up to the key; shared memory (see
#: `shared_rows`) stays within the 48 KiB static limit. Per thread, registers hold
#: dpad / 2 O floats, block_keys / 2 S floats, block_keys / 4 P words and, up to
#: Q_REGISTERS_MAX_DIM, dpad / 4 Q words; above it Q stays in shared memory (with Q
#: in registers head_dim 256 needs all 255 registers on sm_90).
TILES = {64: (64, 64), 128: (64, 64), 256: (48, 16)}
Q_REGISTERS_MAX_DIM = 128
Q_OUT_TYPES = ("float16", "float32", "uint16")   # uint16: bfloat16 bits
STORAGE_TYPES = ("float16", "bfloat16")
LOG2E = float32(math.log2(math.e))
NEG_INF = float32(-math.inf)
FLAT_RING = INT32_MAX     # the ring size a flat layer's rows are walked with: never wraps


def padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to whole k16 fragments."""
    return ceil_div(head_dim, 16) * 16


def _type_name(dtype) -> str:
    """A dtype's name; a name stays as it is ("bfloat16" needs no NumPy dtype)."""
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def supports(head_dim, storage_dtype) -> bool:
    """Can this path serve a layer? head_dim a multiple of 8 (16-byte chunks) up to 256,
    storage float16 or bfloat16 (a dtype, its name, or uint16: bfloat16 bits). float32
    storage is not served."""
    return (_type_name(storage_dtype) in STORAGE_TYPES + ("uint16",)
            and 8 <= head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0)


def shared_rows(head_dim: int, block_rows: int, block_keys: int) -> tuple[int, int]:
    """(q_rows, rows): the one shared buffer, `rows` rows of padded_head_dim + 8 16-bit
    values. Q is staged in rows 0 .. block_rows; K follows in rows q_rows .. q_rows +
    block_keys, V after it. q_rows is 0 when Q moves to registers (K and V then take
    its rows), block_rows when it stays."""
    q_rows = 0 if padded_head_dim(head_dim) <= Q_REGISTERS_MAX_DIM else block_rows
    return q_rows, max(block_rows, q_rows + 2 * block_keys)


@lru_cache(maxsize=None)
def tile_shape(head_dim: int) -> tuple[int, int]:
    """(block_rows, block_keys) the GPU uses for `head_dim`."""
    dpad = padded_head_dim(head_dim)
    return TILES[next(d for d in sorted(TILES) if dpad <= d)]


@lru_cache(maxsize=None)
def _prefill_kernel(head_dim: int, block_rows: int, block_keys: int, storage: str,
                    capped: bool):
    """The prefill kernel for one head_dim, tile shape, 16-bit storage type, and with
    (`capped`) or without a softcap."""
    BR, BK = block_rows, block_keys
    DP = padded_head_dim(head_dim)
    PITCH = DP + 8          # shared row pitch: 8 rows of an ldmatrix fall 16 bytes apart
    WARPS = BR // 16
    THREADS = 32 * WARPS
    KT = BK // 8            # n8 tiles of S (keys)
    DK = DP // 16           # k16 chunks of the head dim (Q fragments, K^T)
    DT = DP // 8            # n8 tiles of O (dims)
    Q_WORDS, S_FLOATS, P_WORDS, O_FLOATS = 4 * DK, 4 * KT, 2 * KT, 4 * DT   # per lane
    CHUNKS = head_dim // 8  # 16-byte chunks per key row
    # cp.async staging: thread tid < STAGERS copies the 16-byte column tid % CHUNKS of
    # keys tid // CHUNKS + i KEY_STEP, i < KEY_PASSES: one address offset per thread
    KEY_STEP = THREADS // CHUNKS
    STAGERS = KEY_STEP * CHUNKS
    KEY_PASSES = ceil_div(BK, KEY_STEP)
    Q_CHUNKS = DP // 8      # 8-value chunks of a staged Q row (padding included)
    Q_ROWS, ROWS = shared_rows(head_dim, BR, BK)
    Q_IN_REGISTERS = Q_ROWS == 0
    SMEM = ROWS * PITCH
    K_BASE = Q_ROWS * PITCH
    V_BASE = (Q_ROWS + BK) * PITCH
    assert BR % 16 == 0 and BK % 16 == 0 and head_dim % 8 == 0 and storage in STORAGE_TYPES
    mma = ptx.mma_f16_f32 if storage == "float16" else ptx.mma_bf16_f32
    pack = ptx.f32x2_to_f16x2 if storage == "float16" else ptx.f32x2_to_bf16x2

    @cuda.jit(device=True)
    def wrap(row, ring):
        """`row`, below 2 `ring`, as a row of a ring of `ring` rows."""
        return int32(row - ring) if row >= ring else row

    @cuda.jit(device=True)
    def stage_keys(tile, base, store, row0, n_keys, ring, first_key, dim, offset):
        """cp.async keys 0 .. n_keys of a tile, key 0 in storage row `row0`, into tile rows
        from `base`: this thread's keys first_key + i KEY_STEP, 8 dims from `dim`, at
        `offset` in a storage row. Each key finds its own row, so a ring (`ring` rows;
        FLAT_RING: none) may wrap inside the tile. One wrap per step is enough: a tile
        holds at most its rows' visible keys, which a ring holds whole, so n_keys <=
        ring; the min keeps even an inconsistent table inside the storage."""
        row_stride = int64(int32(store.shape[1] * store.shape[2] * head_dim))
        last_row = int32(ring - 1)
        row = wrap(int32(row0 + first_key), ring)
        for i in range(KEY_PASSES):
            key = first_key + i * KEY_STEP
            if key < n_keys:
                ptx.cp_async_16(tile, base + key * PITCH + dim, store,
                                int64(min(row, last_row)) * row_stride + offset)
            row = wrap(int32(row + KEY_STEP), ring)

    @cuda.jit(device=True)
    def split_row(row, group):
        """(row // group, row % group) of a packed row (token, head in the group) by
        unsigned 32-bit division: rows are never negative."""
        token = uint32(row) // uint32(group)
        return int32(token), int32(uint32(row) - uint32(token) * uint32(group))

    @cuda.jit(device=True)
    def stage_queries(tile, q, q_start, first_row, n_rows, group, kv_head, tid):
        """Q rows `first_row ..` in the 16-bit type in tile rows 0 .. BR, 8 values per
        step; zero past the segment's rows and past head_dim (padding columns must
        not meet NaN)."""
        for e in range(tid, BR * Q_CHUNKS, THREADS):
            r = e // Q_CHUNKS
            d = (e - r * Q_CHUNKS) * 8
            real = r < n_rows and d < head_dim
            token, head = split_row(first_row + r if real else 0, group)
            for i in range(0, 8, 2):
                lo = float32(0.0)
                hi = float32(0.0)
                if real:
                    lo = ptx.to_f32(q[q_start + token, kv_head * group + head, d + i])
                    hi = ptx.to_f32(q[q_start + token, kv_head * group + head, d + i + 1])
                word = pack(lo, hi)
                tile[r * PITCH + d + i] = uint16(word & 0xFFFF)
                tile[r * PITCH + d + i + 1] = uint16(word >> 16)
        if DP > head_dim:       # K/V rows past the Q rows: zero their padding columns too
            for e in range(tid, (ROWS - BR) * (DP - head_dim), THREADS):
                r = BR + e // (DP - head_dim)
                tile[r * PITCH + head_dim + e % (DP - head_dim)] = uint16(0)

    @cuda.jit(device=True)
    def quad_max(x):
        """Max over the 4 lanes holding one accumulator row (lanes 4g .. 4g+3)."""
        x = max(x, ptx.shfl_xor(x, 1))
        return max(x, ptx.shfl_xor(x, 2))

    @cuda.jit(device=True)
    def quad_sum(x):
        x += ptx.shfl_xor(x, 1)
        return x + ptx.shfl_xor(x, 2)

    @cuda.jit(device=True)
    def q_operand(qf, tile, q_lane, kc):
        """The A operand of Q for dims 16 kc .. 16 kc + 15: from registers, or from the
        warp's Q rows in shared memory."""
        if Q_IN_REGISTERS:
            return qf[4 * kc], qf[4 * kc + 1], qf[4 * kc + 2], qf[4 * kc + 3]
        return ptx.ldmatrix_x4(tile, q_lane + kc * 16)

    @cuda.jit(device=True)
    def mma_pair(acc, n0, a0, a1, a2, a3, b0, b1, b2, b3):
        """acc's n8 tiles n0 and n0 + 1 += A (a0..a3) times the two B fragments one
        `ldmatrix_x4` gives: (b0, b1) for the first tile, (b2, b3) for the second."""
        for h in range(2):
            n = n0 + h
            d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0 if h == 0 else b2, b1 if h == 0 else b3,
                                 acc[4 * n], acc[4 * n + 1], acc[4 * n + 2], acc[4 * n + 3])
            acc[4 * n] = d0
            acc[4 * n + 1] = d1
            acc[4 * n + 2] = d2
            acc[4 * n + 3] = d3

    @cuda.jit(device=True)
    def scores(s, qf, tile, q_lane, k_lane):
        """s = Q K^T for the warp's 16 rows and the tile's BK keys (unscaled)."""
        for i in range(S_FLOATS):
            s[i] = 0.0
        for kc in range(DK):                # dims 16 kc .. 16 kc + 15
            a0, a1, a2, a3 = q_operand(qf, tile, q_lane, kc)
            for kp in range(BK // 16):      # keys 16 kp .. 16 kp + 15: two n8 tiles
                b0, b1, b2, b3 = ptx.ldmatrix_x4(tile, K_BASE + k_lane + kp * 16 * PITCH
                                                 + kc * 16)
                mma_pair(s, 2 * kp, a0, a1, a2, a3, b0, b1, b2, b3)

    @cuda.jit(device=True)
    def accumulate(o, pf, tile, a_lane):
        """o += P V for the warp's 16 rows: P from the packed pairs, V rows by .trans."""
        for kk in range(BK // 16):          # keys 16 kk .. 16 kk + 15: A = p[4 kk .. 4 kk + 3]
            for dc in range(DK):            # dims 16 dc .. 16 dc + 15: two n8 tiles of O
                b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(tile, V_BASE + a_lane
                                                       + kk * 16 * PITCH + dc * 16)
                mma_pair(o, 2 * dc, pf[4 * kk], pf[4 * kk + 1], pf[4 * kk + 2],
                         pf[4 * kk + 3], b0, b1, b2, b3)

    @cuda.jit(device=True)
    def softcap_scores(s, scale, softcap):
        """The softcap in units of unscaled scores: `softcap / scale * tanh(scale * s /
        softcap)`, so that `scale * s` is the capped score."""
        outer = softcap / scale
        inner = scale / softcap
        for i in range(S_FLOATS):
            s[i] = outer * math.tanh(s[i] * inner)

    @cuda.jit(device=True)
    def mask(s, lo_a, hi_a, lo_b, hi_b):
        """-inf where the key is outside the row's visible interval; bounds are relative
        to the lane's first key of the tile (`s[4n + i]` holds key `8n + i % 2` on)."""
        for n in range(KT):
            for i in range(4):
                key = 8 * n + i % 2
                if i < 2:
                    hidden = key < lo_a or key >= hi_a
                else:
                    hidden = key < lo_b or key >= hi_b
                if hidden:
                    s[4 * n + i] = NEG_INF

    @cuda.jit(device=True)
    def softmax_step(s, pf, o, m_a, m_b, l_a, l_b, scale_log2):
        """Online softmax over one tile's unscaled scores (scale > 0: the max commutes
        with scaling, and `exp(scale s - scale m) = exp2(s scale_log2 - m scale_log2)`
        is one FFMA and one `math.exp2`, ex2 plus its range handling): new running max
        (quad-wide), P packed into `pf`, O and
        the lane's partial sums rescaled; returns (m_a, m_b, l_a, l_b)."""
        x_a = NEG_INF
        x_b = NEG_INF
        for n in range(KT):
            x_a = max(x_a, max(s[4 * n], s[4 * n + 1]))
            x_b = max(x_b, max(s[4 * n + 2], s[4 * n + 3]))
        new_a = max(m_a, quad_max(x_a))
        new_b = max(m_b, quad_max(x_b))
        # a row with no visible key yet subtracts 0: exp2(-inf - 0) = 0, never NaN
        base_a = new_a * scale_log2 if new_a != NEG_INF else float32(0.0)
        base_b = new_b * scale_log2 if new_b != NEG_INF else float32(0.0)
        alpha_a = math.exp2(m_a * scale_log2 - base_a)
        alpha_b = math.exp2(m_b * scale_log2 - base_b)
        l_a *= alpha_a
        l_b *= alpha_b
        for n in range(KT):
            p0 = math.exp2(s[4 * n] * scale_log2 - base_a)
            p1 = math.exp2(s[4 * n + 1] * scale_log2 - base_a)
            p2 = math.exp2(s[4 * n + 2] * scale_log2 - base_b)
            p3 = math.exp2(s[4 * n + 3] * scale_log2 - base_b)
            l_a += p0 + p1
            l_b += p2 + p3
            pf[2 * n] = pack(p0, p1)
            pf[2 * n + 1] = pack(p2, p3)
        if alpha_a != 1 or alpha_b != 1:    # once the maxima settle, most tiles skip it
            for n in range(DT):
                o[4 * n] *= alpha_a
                o[4 * n + 1] *= alpha_a
                o[4 * n + 2] *= alpha_b
                o[4 * n + 3] *= alpha_b
        return new_a, new_b, l_a, l_b

    @cuda.jit(device=True)
    def store_rows(out, o, row, n_end, l, t, q_start, group, kv_head, first_reg):
        """Write one accumulator row (`first_reg` 0: row a, 2: row b), normalised by its
        sum `l`, if it is a real row (every real row sees a key: l > 0)."""
        if row < n_end:
            inv_l = float32(1.0) / l
            token, head = split_row(row, group)
            token += q_start
            head += kv_head * group
            for n in range(DT):
                d = 8 * n + 2 * t
                if d < head_dim:
                    out[token, head, d] = ptx.from_f32(o[4 * n + first_reg] * inv_l, out)
                    out[token, head, d + 1] = ptx.from_f32(o[4 * n + first_reg + 1] * inv_l,
                                                           out)

    @cuda.jit
    def prefill(q, k_store, v_store, tables, out, seq_info_off, segments_off, n_row_tiles,
                group, ring_rows, window, scale, softcap):
        tid = cuda.threadIdx.x
        lane = cuda.laneid
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        kv_head = cuda.blockIdx.x
        seg = tables[segments_off + cuda.blockIdx.y]
        first_row = (n_row_tiles - 1 - cuda.blockIdx.z) * BR   # the longest row tiles first
        q_start, q_len, col, pos_start, block = read_segment(tables, seq_info_off, seg)
        n_end = group * q_len                   # the segment's rows
        n_rows = min(BR, n_end - first_row)
        if n_rows <= 0:
            return
        # Long-lived integers are kept as int32 (registers). The block loads keys
        # [key_lo, key_hi), the union of its rows' intervals, in tiles j = 0 .. n_tiles.
        key_lo = int32(key_range(split_row(first_row, group)[0], q_len, pos_start, block,
                                 window)[0])
        key_hi = key_range(split_row(first_row + n_rows - 1, group)[0], q_len, pos_start,
                           block, window)[1]
        n_tiles = int32((key_hi - key_lo + BK - 1) // BK)
        # this warp's rows [warp_row, warp_end): it computes on tiles [j_first, j_end)
        # (its first row's lo, its last row's hi) and masks none in [j_full, j_part)
        # (visible to all its rows: past its last row's lo, before its first row's hi)
        warp_row = first_row + 16 * warp
        warp_end = min(warp_row + 16, first_row + n_rows)
        lo_first, hi_first = key_range(split_row(warp_row, group)[0], q_len, pos_start, block,
                                       window)
        lo_last, hi_last = key_range(split_row(warp_end - 1, group)[0], q_len, pos_start,
                                     block, window)
        j_first = int32((lo_first - key_lo) // BK)
        j_end = int32((hi_last - key_lo + BK - 1) // BK if warp_row < warp_end else 0)
        j_full = int32((lo_last - key_lo + BK - 1) // BK)
        j_part = int32((hi_first - key_lo) // BK)
        # this lane's rows a, b (clamped to the last real row: no key_range past q_len),
        # their intervals relative to the lane's first key of tile 0, key_lo + 2t
        row_a = warp_row + g
        row_b = warp_row + g + 8
        lo_a, hi_a = key_range(split_row(min(row_a, n_end - 1), group)[0], q_len, pos_start,
                               block, window)
        lo_b, hi_b = key_range(split_row(min(row_b, n_end - 1), group)[0], q_len, pos_start,
                               block, window)
        lo_a = int32(lo_a - key_lo - 2 * t)
        hi_a = int32(hi_a - key_lo - 2 * t)
        lo_b = int32(lo_b - key_lo - 2 * t)
        hi_b = int32(hi_b - key_lo - 2 * t)

        tile = cuda.shared.array(SMEM, uint16)
        stage_queries(tile, q, q_start, first_row, n_rows, group, kv_head, tid)
        cuda.syncthreads()
        # A-operand lane address: row lane % 16, columns 8 (lane // 16) on (V .trans too)
        a_lane = (lane % 16) * PITCH + (lane // 16) * 8
        # K^T (B, non-trans): key lane % 8 + 8 (lane // 16), dims 8 (lane // 8 % 2) on
        k_lane = (lane % 8 + 8 * (lane // 16)) * PITCH + (lane // 8 % 2) * 8
        q_lane = 16 * warp * PITCH + a_lane     # the warp's Q rows
        qf = cuda.local.array(Q_WORDS, uint32)
        if Q_IN_REGISTERS:
            for kc in range(DK):
                a0, a1, a2, a3 = ptx.ldmatrix_x4(tile, q_lane + kc * 16)
                qf[4 * kc] = a0
                qf[4 * kc + 1] = a1
                qf[4 * kc + 2] = a2
                qf[4 * kc + 3] = a3
            cuda.syncthreads()          # Q is in registers: K and V take its rows
        # The mma read every row of a K and V tile. V rows past the tile's keys get
        # P = 0 but must not be NaN (0 * NaN); K rows there are masked, and zeroed too
        # so that no NaN enters an mma. Past the first tile's keys both are zeroed;
        # later tiles only leave an earlier tile's (finite) rows there
        for e in range(tid + min(BK, key_hi - key_lo) * PITCH, BK * PITCH, THREADS):
            tile[K_BASE + e] = uint16(0)
            tile[V_BASE + e] = uint16(0)

        s = cuda.local.array(S_FLOATS, float32)
        pf = cuda.local.array(P_WORDS, uint32)
        o = cuda.local.array(O_FLOATS, float32)
        for i in range(O_FLOATS):
            o[i] = 0.0
        m_a = NEG_INF                   # running max (unscaled scores) of rows a, b
        m_b = NEG_INF
        l_a = float32(0.0)              # this lane's part of the running sums
        l_b = float32(0.0)
        scale_log2 = scale * LOG2E

        # staging: this thread's first key, its 8 dims and their offset in a storage row
        first_key = int32(tid // CHUNKS if tid < STAGERS else BK)
        dim = int32(tid % CHUNKS * 8)
        offset = int32((col * k_store.shape[2] + kv_head) * head_dim + dim)
        ring = int32(ring_rows) if ring_rows > 0 else FLAT_RING
        row0 = int32(key_lo % ring)     # storage row of the tile's first key
        stage_keys(tile, K_BASE, k_store, row0, int32(min(BK, key_hi - key_lo)), ring,
                   first_key, dim, offset)
        ptx.cp_async_commit()
        for j in range(n_tiles):
            keys_left = int32(key_hi - key_lo - j * BK)
            n_keys = int32(min(BK, keys_left))
            ptx.cp_async_wait(0)
            cuda.syncthreads()          # K(j) is in; every warp is done with V(j - 1)
            stage_keys(tile, V_BASE, v_store, row0, n_keys, ring, first_key, dim, offset)
            ptx.cp_async_commit()
            active = j_first <= j < j_end     # warp-uniform
            if active:
                scores(s, qf, tile, q_lane, k_lane)
                if capped:
                    softcap_scores(s, scale, softcap)
                if j < j_full or j >= j_part:
                    mask(s, lo_a - j * BK, hi_a - j * BK, lo_b - j * BK, hi_b - j * BK)
                m_a, m_b, l_a, l_b = softmax_step(s, pf, o, m_a, m_b, l_a, l_b,
                                                  scale_log2)
            ptx.cp_async_wait(0)
            cuda.syncthreads()          # V(j) is in; every warp is done with K(j)
            if j + 1 < n_tiles:         # then the ring holds more than BK keys: one wrap
                row0 = wrap(int32(row0 + BK), ring)
                stage_keys(tile, K_BASE, k_store, row0, int32(min(BK, keys_left - BK)), ring,
                           first_key, dim, offset)
                ptx.cp_async_commit()
            if active:
                accumulate(o, pf, tile, a_lane)

        store_rows(out, o, row_a, n_end, quad_sum(l_a), t, q_start, group, kv_head, 0)
        store_rows(out, o, row_b, n_end, quad_sum(l_b), t, q_start, group, kv_head, 2)

    return Specialised(prefill)


def storage_type(dtype) -> str:
    """The 16-bit type K/V storage of `dtype` holds: "float16", or "bfloat16" (its bit
    patterns held as uint16, as everywhere in kvnumba; the name "bfloat16" too)."""
    name = _type_name(dtype)
    name = "bfloat16" if name == "uint16" else name
    if name not in STORAGE_TYPES:
        raise ValueError(f"prefill: storage {name!r} not in {STORAGE_TYPES}")
    return name


@lru_cache(maxsize=None)
def _served(head_dim, storage_dtype, q_dtype, out_dtype) -> str:
    """The storage type of a launch, after refusing what this path does not serve; cached
    per combination, so a launch pays for the checks once, not per layer and step."""
    storage = storage_type(storage_dtype)
    if not supports(head_dim, storage):
        raise ValueError(f"prefill: head_dim {head_dim} with {storage} storage is not served")
    for name, dtype in (("q", q_dtype), ("out", out_dtype)):
        if _type_name(dtype) not in Q_OUT_TYPES:
            raise ValueError(f"prefill: {name} dtype {dtype} not in {Q_OUT_TYPES}")
    return storage


def run(q, k_store, v_store, tables, *, seq_info_off, segments_off, n_segments, max_q_len,
        out, ring_rows, window, scale, softcap, stream=0, tile=None):
    """Attention of the listed segments' queries over their own column's keys, into `out`.

    q, out: [width, n_q_heads, head_dim] device arrays, float16, float32 or bfloat16
    (uint16 bits); only the
    listed segments' rows of `out` are written. k_store, v_store: [rows, n_cols,
    n_kv_heads, head_dim] 16-bit (see `storage_type`), C-contiguous. tables: flat int32
    device array; segment `s`, field `F` at `seq_info_off + s * SEQ_INFO_FIELDS + F`;
    the segments served are `tables[segments_off + i]`, `i < n_segments`, none longer
    than `max_q_len`. ring_rows: 0 (flat) or R (position p in row p % R); window: 0
    (none) or W; softcap 0.0 = off. One launch on `stream`: no synchronisation, no
    allocation. `tile`: (block_rows, block_keys), multiples of 16, instead of
    `tile_shape(head_dim)`.
    """
    if n_segments == 0 or max_q_len == 0:
        return out
    if not scale > 0:
        raise ValueError(f"prefill: scale {scale} must be positive")
    head_dim = q.shape[2]
    n_q_heads, n_kv_heads = q.shape[1], k_store.shape[2]
    group = n_q_heads // n_kv_heads
    storage = _served(head_dim, k_store.dtype, q.dtype, out.dtype)
    block_rows, block_keys = tile or tile_shape(head_dim)
    kernel = _prefill_kernel(head_dim, block_rows, block_keys, storage, softcap > 0)
    n_row_tiles = ceil_div(group * max_q_len, block_rows)
    kernel((n_kv_heads, n_segments, n_row_tiles), 32 * (block_rows // 16), stream,
           q, k_store, v_store, tables, out, int(seq_info_off), int(segments_off),
           n_row_tiles, group, int(ring_rows), int(window), np.float32(scale),
           np.float32(softcap))
    return out
