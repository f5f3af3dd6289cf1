"""Prefill attention on tensor cores, FlashAttention-2 style, for 16-bit K/V storage.

Same semantics as `attention` (visible keys from `masks.key_range`, position p of a
ring layer in row p % ring_rows, scale then optional softcap, float32 softmax and
accumulation), for segments long enough to fill tensor-core tiles; scale > 0.

A block takes `block_rows` query *rows* of one segment and one kv head, packed GQA
as in `attention`: row `r` of the segment is (token `r // group`, q head
`kv_head * group + r % group`), so each K/V tile serves the whole group. Each warp owns
16 or 32 consecutive rows (`default_warp_rows`): one or two m16 "halves" that share
every K and V fragment. Per key tile of `block_keys` keys:

  S = Q K^T   mma.m16n8k16, Q fragments loaded once into registers by ldmatrix (above
              head_dim 128: kept in shared memory, loaded per tile), K^T by ldmatrix;
  online softmax on the S accumulators (quad shuffles, `ex2.approx`), P packed to 16
              bits in place;
  O += P V    P as the A operand, V by ldmatrix .trans; O in float32 registers. The row
              sums come from one more mma per 16 keys, P times ones: sums of the very
              16-bit P that meets V, with no addition per element.

At the end each row's O is divided by its sum, and its log-sum-exp (natural log:
scale times the running max of unscaled scores, plus the log of the sum) goes to
`lse` when the caller passes one with rows.

Staging: Q, K and V reach shared memory by cp.async in 16-byte chunks, `lanes`
consecutive threads per row, so that a warp instruction reads whole 128-byte lines
(`staging_layout`). A chunk with nothing to read (a row past the segment or past the
tile's keys, the columns from head_dim to the padded head dim) is zero-filled by the
same instruction: no NaN from stale shared memory or padding meets an mma. A tile's
keys are consecutive positions, so a ring (position p in row p % ring_rows) wraps at
most once inside it: the key at unwrapped row r < 2 ring_rows lives in row min(r, r -
ring_rows) as unsigned 32-bit numbers (before the wrap, r - ring_rows underflows).

Storage is paged: K and V are slot storage [n_slots, n_kv_heads, head_dim] (a page pool
[n_pages, page_size, ...] reshaped), and row r of sequence `seq` (the segment's `COL`)
is slot `pages[seq, r >> page_bits] | (r & (page_size - 1))` of its layer kind's page
table (`masks.page_slot`). Each thread looks up the slot of each key row it stages
(one page-table load, a shift and two logical operations), so a tile may straddle
pages and the ring's wrap alike; K(j) and V(j) share rows, so V reuses K's slots, kept
in registers. A key's 64-bit address is one multiply-add, its slot times the slot's
bytes (slots are below 2**31) on the thread's head and chunk in slot 0. No 64-bit
division anywhere.

One K buffer and one V buffer, overlapped: V(j) loads while S(j) and its softmax run,
K(j+1) while O += P V(j). With Q in registers, Q is staged in V's rows together with the
first K tile. Shared rows are padded by 16 bytes, so the 8 rows an ldmatrix reads hit 8
different bank groups; the buffer is 16-byte aligned, as ldmatrix and cp.async require.

Masking: each row sees one key interval (`key_range`), moving forward with the row.
A block loads only keys [lo(first row), hi(last row)), the union of its rows'
intervals. The tiles all its rows see whole run in a loop with no masks and no checks;
the others first, in a loop where a warp computes only on tiles that meet [lo(its first
row), hi(its last row)) and masks (-inf before the softmax, per row and key) those not
inside every one of its rows' intervals. A row that sees no key of a tile gets P = 0
there: its running max stays -inf until it sees one, and exp2 then subtracts 0.

Fragment bookkeeping (m16n8k16, lane = 4 g + t, see `ptx`): of each half's 16 rows a
lane holds rows `g` ("a") and `g + 8` ("b"); half h's registers follow half h - 1's:

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

from ..arrays import aligned
from ..config import INT32_MAX, MAX_HEAD_DIM
from ..device import cuda
from . import ptx
from .launch import Specialised, ceil_div, no_output
from .masks import key_range, page_slot, read_segment

from numba import float32, int32, int64, uint16, uint32, uint64  # noqa: E402  (after device)

#: (block_rows, block_keys) for padded head dims up to the key; shared memory (see
#: `shared_layout`) stays within the 48 KiB static limit. Per thread and m16 half of
#: its warp, registers hold dpad / 2 O floats, block_keys / 2 S floats, block_keys / 4
#: P words and, up to Q_REGISTERS_MAX_DIM, dpad / 4 Q words; above it Q stays in shared
#: memory (with Q in registers head_dim 256 needs all 255 registers on sm_90). Two
#: halves per warp fit up to WIDE_WARP_MAX_DIM (head_dim 128 would need O, Q and S of
#: 64 registers each per half).
TILES = {64: (64, 64), 128: (64, 64), 256: (48, 16)}
Q_REGISTERS_MAX_DIM = 128
WIDE_WARP_MAX_DIM = 64
Q_OUT_TYPES = ("float16", "float32", "uint16")   # uint16: bfloat16 bits
STORAGE_TYPES = ("float16", "bfloat16")
LOG2E = float32(math.log2(math.e))
NEG_INF = float32(-math.inf)
FLAT_RING = INT32_MAX     # the ring size a flat layer's rows are walked with: never wraps
CHUNK = 8                 # 16-bit values in a 16-byte cp.async chunk
LINE_CHUNKS = 8           # chunks in a 128-byte line
#: a pair of 16-bit ones in each storage type: the B operand of the row-sum mma
ONES = {"float16": 0x3C003C00, "bfloat16": 0x3F803F80}


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


def shared_layout(head_dim: int, block_rows: int, block_keys: int) -> tuple[int, int, int, int]:
    """(q_row, k_row, v_row, rows): where Q, K and V start in the one shared buffer of
    `rows` rows of padded_head_dim + 8 16-bit values. Up to Q_REGISTERS_MAX_DIM Q moves to
    registers before V(0) is loaded, so it is staged in V's rows (and past them when
    block_rows > block_keys); above, Q keeps rows 0 .. block_rows, K and V follow."""
    if padded_head_dim(head_dim) <= Q_REGISTERS_MAX_DIM:
        return block_keys, 0, block_keys, block_keys + max(block_rows, block_keys)
    return 0, block_rows, block_rows + block_keys, block_rows + 2 * block_keys


def staging_layout(chunks: int, threads: int, rows: int) -> tuple[int, int]:
    """(lanes, passes): how `threads` threads cp.async `rows` rows of `chunks` 16-byte
    chunks. `lanes` consecutive threads share a row, lane h copying its chunks h, h +
    lanes, ..., so that each warp instruction reads whole 128-byte lines (lanes >=
    min(chunks, 8)); threads // lanes rows per pass, `passes` passes. Of the divisors of
    `chunks` that qualify: the fewest copies per thread, then the fewest passes (each
    pass computes one storage address)."""
    options = []
    for lanes in range(min(chunks, LINE_CHUNKS), chunks + 1):
        if chunks % lanes == 0:
            passes = ceil_div(rows, threads // lanes)
            options.append((passes * (chunks // lanes), passes, lanes))
    _, passes, lanes = min(options)
    return lanes, passes


def default_warp_rows(head_dim: int, block_rows: int) -> int:
    """Query rows per warp: 32 (two m16 row blocks sharing each K and V fragment: half the
    ldmatrix per mma) up to WIDE_WARP_MAX_DIM, where O, S and Q of 32 rows fit in
    registers, and when block_rows allows; else 16."""
    wide = padded_head_dim(head_dim) <= WIDE_WARP_MAX_DIM and block_rows % 32 == 0
    return 32 if wide else 16


@lru_cache(maxsize=None)
def tile_shape(head_dim: int) -> tuple[int, int]:
    """(block_rows, block_keys) the GPU uses for `head_dim`."""
    dpad = padded_head_dim(head_dim)
    return TILES[next(d for d in sorted(TILES) if dpad <= d)]


@lru_cache(maxsize=None)
def _prefill_kernel(head_dim: int, block_rows: int, block_keys: int, storage: str,
                    capped: bool, q_copy: bool = True, warp_rows: int | None = None):
    """The prefill kernel for one head_dim, tile shape (`warp_rows`: by default
    `default_warp_rows`), 16-bit storage type, with (`capped`) or without a softcap, and Q
    staged by cp.async (`q_copy`: q holds the storage's type, 16-byte aligned) or
    converted value by value."""
    BR, BK = block_rows, block_keys
    WR = warp_rows or default_warp_rows(head_dim, BR)
    H = WR // 16            # m16 row blocks ("halves") of a warp
    DP = padded_head_dim(head_dim)
    PITCH = DP + 8          # shared row pitch: 8 rows of an ldmatrix fall 16 bytes apart
    THREADS = 32 * (BR // WR)
    KT = BK // 8            # n8 tiles of S (keys)
    DK = DP // 16           # k16 chunks of the head dim (Q fragments, K^T)
    DT = DP // 8            # n8 tiles of O (dims)
    # per lane and half: Q words, S floats, P words, O floats
    Q_WORDS, S_FLOATS, P_WORDS, O_FLOATS = 4 * DK, 4 * KT, 2 * KT, 4 * DT
    LANE_ROWS = 2 * H       # the lane's rows: g + 8 r
    FRAGMENT = 4 * H        # per lane: Q's A words of one k16 chunk, the row sums (a, a, b, b)
    Q_ALL, S_ALL, P_ALL, O_ALL = H * Q_WORDS, H * S_FLOATS, H * P_WORDS, H * O_FLOATS
    CHUNKS = DP // CHUNK    # chunks of a padded row; those from head_dim on are zeros
    PADDED = DP > head_dim
    Q_ROW, K_ROW, V_ROW, ROWS = shared_layout(head_dim, BR, BK)
    Q_IN_REGISTERS = DP <= Q_REGISTERS_MAX_DIM
    Q_BASE, K_BASE, V_BASE = Q_ROW * PITCH, K_ROW * PITCH, V_ROW * PITCH
    SMEM = ROWS * PITCH
    # staging (see staging_layout): thread tid copies chunks tid % LANES + c LANES of rows
    # tid // LANES + p STEP; the rest of the threads (when STEP LANES < THREADS) idle
    KEY_LANES, KEY_PASSES = staging_layout(CHUNKS, THREADS, BK)
    KEY_STEP, KEY_COPIES = THREADS // KEY_LANES, CHUNKS // KEY_LANES
    KEYS_EXACT = KEY_STEP * KEY_LANES == THREADS and KEY_STEP * KEY_PASSES == BK
    Q_LANES, Q_PASSES = staging_layout(CHUNKS, THREADS, BR)
    Q_STEP, Q_COPIES = THREADS // Q_LANES, CHUNKS // Q_LANES
    Q_EXACT = Q_STEP * Q_LANES == THREADS and Q_STEP * Q_PASSES == BR
    ONE_PAIR = uint32(ONES[storage])
    assert BR % WR == 0 and WR in (16, 32) and BK % 16 == 0 and storage in STORAGE_TYPES
    mma = ptx.mma_f16_f32 if storage == "float16" else ptx.mma_bf16_f32
    pack = ptx.f32x2_to_f16x2 if storage == "float16" else ptx.f32x2_to_bf16x2

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

    @cuda.jit(device=True)
    def stage_keys(tile, dst, src, slots, slot_bytes, n_keys, first_key, d0):
        """cp.async this thread's chunks of a K or V tile: key first_key + p KEY_STEP in
        pass p, chunks d0 + c KEY_LANES, to tile index `dst` (its first key and chunk)
        on, from `src` (its head and d0 in slot 0) plus slots[p] times slot_bytes. Keys
        from n_keys on and padding columns are zero-filled."""
        for p in range(KEY_PASSES):
            key = int32(first_key + p * KEY_STEP)
            if KEYS_EXACT or key < BK:
                at = ptx.mul_wide_u32(slots[p], slot_bytes)
                for c in range(KEY_COPIES):
                    pad = PADDED and d0 + c * KEY_LANES * CHUNK >= head_dim
                    ptx.cp_async_16_zfill(tile, int32(dst + (p * KEY_STEP * PITCH
                                                            + c * KEY_LANES * CHUNK)),
                                          src, at + uint64(2 * c * KEY_LANES * CHUNK),
                                          key >= n_keys or pad)

    @cuda.jit(device=True)
    def copy_q_chunk(tile, dst, q, token, head, d, zero):
        """Q values d .. d + 8 of (token, head), or zeros, by cp.async."""
        ptx.cp_async_16_zfill(tile, dst, q, (int64(token) * q.shape[1] + head) * head_dim + d,
                              zero)

    @cuda.jit(device=True)
    def convert_q_chunk(tile, dst, q, token, head, d, zero):
        """Q values d .. d + 8 of (token, head) in the 16-bit type, or zeros, by loads and
        stores (q of another type, or not 16-byte aligned)."""
        for i in range(0, CHUNK, 2):
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
    def split_row(row, group):
        """(row // group, row % group) of a packed row (token, head in the group) by
        unsigned 32-bit division: rows are never negative."""
        token = uint32(row) // uint32(group)
        return int32(token), int32(uint32(row) - uint32(token) * uint32(group))

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
                    d = d0 + c * Q_LANES * CHUNK
                    stage_q_chunk(tile, Q_BASE + r * PITCH + d, q, q_start + token,
                                  kv_head * group + head, d,
                                  r >= n_rows or (PADDED and d >= head_dim))

    @cuda.jit(device=True)
    def stage_tile(tile, j, staging, values):
        """cp.async key tile j of K (`values` False) or V into its buffer, as one group.
        K(j) is always staged right before V(j): K finds the keys' slots, V reuses them."""
        (k_dst, k_src, v_dst, v_src, slots, pages, seq, page_bits, slot_bytes, row0, ring,
         max_keys, span, first_key, d0) = staging
        n_keys = min(max_keys, int32(span - j * BK))
        if not values:
            # the row of its first key: unwrapped below 2 ring (j BK < span <= ring),
            # wrapped, and kept below ring (a table whose window exceeds its ring reads
            # wrong keys, but inside the sequence's pages)
            start = uint32(row0 + uint32(j * BK))
            row = min(start, uint32(int64(start) - ring), uint32(ring - 1))
            find_slots(slots, pages, seq, page_bits, row, n_keys, ring, first_key)
        stage_keys(tile, v_dst if values else k_dst, v_src if values else k_src, slots,
                   slot_bytes, n_keys, first_key, d0)
        ptx.cp_async_commit()

    @cuda.jit(device=True)
    def quad_max(x):
        """Max over the 4 lanes holding one accumulator row (lanes 4g .. 4g+3)."""
        x = max(x, ptx.shfl_xor(x, 1))
        return max(x, ptx.shfl_xor(x, 2))

    @cuda.jit(device=True)
    def mma_into(acc, n, a0, a1, a2, a3, b0, b1):
        """acc's n8 tile n (acc[4n .. 4n + 4]) += A (a0..a3) times B (b0, b1)."""
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, acc[4 * n], acc[4 * n + 1],
                             acc[4 * n + 2], acc[4 * n + 3])
        acc[4 * n] = d0
        acc[4 * n + 1] = d1
        acc[4 * n + 2] = d2
        acc[4 * n + 3] = d3

    @cuda.jit(device=True)
    def mma_pair(acc, n0, a0, a1, a2, a3, b0, b1, b2, b3):
        """acc's n8 tiles n0 and n0 + 1 += A (a0..a3) times the two B fragments one
        `ldmatrix_x4` gives: (b0, b1) for the first tile, (b2, b3) for the second."""
        mma_into(acc, n0, a0, a1, a2, a3, b0, b1)
        mma_into(acc, n0 + 1, a0, a1, a2, a3, b2, b3)

    @cuda.jit(device=True)
    def scores(s, qf, qa, tile, q_lane, k_lane):
        """s = Q K^T for the warp's rows (half h in s[h S_FLOATS ..]) and the tile's BK keys
        (unscaled). Q's A operands come from registers (qf) or from the warp's Q rows in
        shared memory, through qa; each K fragment serves every half."""
        for i in range(S_ALL):
            s[i] = 0.0
        for kc in range(DK):                # dims 16 kc .. 16 kc + 15
            for h in range(H):
                if Q_IN_REGISTERS:
                    for i in range(4):
                        qa[4 * h + i] = qf[(h * DK + kc) * 4 + i]
                else:
                    qa[4 * h], qa[4 * h + 1], qa[4 * h + 2], qa[4 * h + 3] = ptx.ldmatrix_x4(
                        tile, q_lane + h * 16 * PITCH + kc * 16)
            for kp in range(BK // 16):      # keys 16 kp .. 16 kp + 15: two n8 tiles
                b0, b1, b2, b3 = ptx.ldmatrix_x4(tile, K_BASE + k_lane + kp * 16 * PITCH
                                                 + kc * 16)
                for h in range(H):
                    mma_pair(s, h * KT + 2 * kp, qa[4 * h], qa[4 * h + 1], qa[4 * h + 2],
                             qa[4 * h + 3], b0, b1, b2, b3)

    @cuda.jit(device=True)
    def accumulate(o, l, pf, tile, a_lane):
        """o += P V for the warp's rows (P from the packed pairs, V rows by .trans: each V
        fragment serves every half), and the row sums l += P's row sums."""
        for kk in range(BK // 16):          # keys 16 kk .. 16 kk + 15: A = p[4 kk .. 4 kk + 3]
            for dc in range(DK):            # dims 16 dc .. 16 dc + 15: two n8 tiles of O
                b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(tile, V_BASE + a_lane
                                                       + kk * 16 * PITCH + dc * 16)
                for h in range(H):
                    a = h * P_WORDS + 4 * kk
                    mma_pair(o, h * DT + 2 * dc, pf[a], pf[a + 1], pf[a + 2], pf[a + 3],
                             b0, b1, b2, b3)
            for h in range(H):              # P times ones: each column holds the row sums
                a = h * P_WORDS + 4 * kk
                mma_into(l, h, pf[a], pf[a + 1], pf[a + 2], pf[a + 3], ONE_PAIR, ONE_PAIR)

    @cuda.jit(device=True)
    def softcap_scores(s, scale, softcap):
        """The softcap in units of unscaled scores: `softcap / scale * tanh(scale * s /
        softcap)`, so that `scale * s` is the capped score."""
        outer = softcap / scale
        inner = scale / softcap
        for i in range(S_ALL):
            s[i] = outer * math.tanh(s[i] * inner)

    @cuda.jit(device=True)
    def mask(s, lo, hi, first):
        """-inf where the key is outside its row's visible interval: row r of the lane
        (rows g + 8 r) sees [lo[r], hi[r]) relative to the lane's first key of tile 0, so
        `s[h S_FLOATS + 4n + i]` (row 2h + i // 2) holds key `first + 8n + i % 2` on."""
        for h in range(H):
            for n in range(KT):
                for i in range(4):
                    r = 2 * h + i // 2
                    key = first + 8 * n + i % 2
                    if key < lo[r] or key >= hi[r]:
                        s[h * S_FLOATS + 4 * n + i] = NEG_INF

    @cuda.jit(device=True)
    def rescaling(m, new, scale_log2):
        """(alpha, base) of a row whose running max goes from m to new (unscaled scores):
        the factor for what it summed so far, and what exp2's argument subtracts. A row
        with no visible key yet has new == -inf: it subtracts 0, and exp2(-inf) = 0."""
        settled = new if new != NEG_INF else float32(0.0)
        return ptx.exp2_approx((m - settled) * scale_log2), settled * scale_log2

    @cuda.jit(device=True)
    def rescale(acc, i, alpha_a, alpha_b):
        """Scale the accumulator registers acc[i .. i + 4] (rows a, a, b, b)."""
        acc[i] *= alpha_a
        acc[i + 1] *= alpha_a
        acc[i + 2] *= alpha_b
        acc[i + 3] *= alpha_b

    @cuda.jit(device=True)
    def softmax_step(s, pf, o, l, m, scale_log2):
        """Online softmax over one tile's unscaled scores (scale > 0: the max commutes
        with scaling, and `exp(scale s - scale m) = exp2(s scale_log2 - m scale_log2)`
        is one FFMA and one `ex2.approx.ftz`), per half h (rows a = 2h, b = 2h + 1 of the
        lane): new running maxima m (quad-wide), P packed into pf, O and the row sums l
        rescaled. Once the maxima settle alpha is exactly 1 (exp2 of 0) and most tiles
        skip the rescale."""
        for h in range(H):
            x_a = NEG_INF
            x_b = NEG_INF
            for n in range(KT):
                x_a = max(x_a, max(s[h * S_FLOATS + 4 * n], s[h * S_FLOATS + 4 * n + 1]))
                x_b = max(x_b, max(s[h * S_FLOATS + 4 * n + 2], s[h * S_FLOATS + 4 * n + 3]))
            new_a = max(m[2 * h], quad_max(x_a))
            new_b = max(m[2 * h + 1], quad_max(x_b))
            alpha_a, base_a = rescaling(m[2 * h], new_a, scale_log2)
            alpha_b, base_b = rescaling(m[2 * h + 1], new_b, scale_log2)
            m[2 * h] = new_a
            m[2 * h + 1] = new_b
            for n in range(KT):
                i = h * S_FLOATS + 4 * n
                p0 = ptx.exp2_approx(s[i] * scale_log2 - base_a)
                p1 = ptx.exp2_approx(s[i + 1] * scale_log2 - base_a)
                p2 = ptx.exp2_approx(s[i + 2] * scale_log2 - base_b)
                p3 = ptx.exp2_approx(s[i + 3] * scale_log2 - base_b)
                pf[h * P_WORDS + 2 * n] = pack(p0, p1)
                pf[h * P_WORDS + 2 * n + 1] = pack(p2, p3)
            if alpha_a != 1 or alpha_b != 1:
                for n in range(DT):
                    rescale(o, h * O_FLOATS + 4 * n, alpha_a, alpha_b)
                rescale(l, 4 * h, alpha_a, alpha_b)

    @cuda.jit(device=True)
    def store_rows(out, lse, o, l, m, scale, warp_row, n_end, g, t, q_start, group, kv_head):
        """Write the lane's real rows (g + 8 r of the warp's), each normalised by its sum
        (every real row sees a key: its sum is > 0), and, when `lse` has rows, each row's
        log-sum-exp `scale m + log l` (lane t = 0 of the quad, which all hold m and l)."""
        for r in range(LANE_ROWS):
            row = warp_row + g + 8 * r
            if row < n_end:
                at = (r // 2) * O_FLOATS + 2 * (r % 2)      # row a or b of half r // 2
                row_sum = l[4 * (r // 2) + 2 * (r % 2)]
                inv_l = float32(1.0) / row_sum
                token, head = split_row(row, group)
                if t == 0 and lse.shape[0] > 0:
                    lse[q_start + token, kv_head * group + head] = \
                        m[r] * scale + math.log(row_sum)
                for n in range(DT):
                    d = 8 * n + 2 * t
                    if d < head_dim:
                        for i in range(2):
                            out[q_start + token, kv_head * group + head, d + i] = \
                                ptx.from_f32(o[at + 4 * n + i] * inv_l, out)

    @cuda.jit(device=True)
    def tile_of(order, i):
        """The key tile of step i of a loop: order = (first, split, skip, after) takes
        tiles first + i, skipping `skip` tiles from step `split` on."""
        first, split, skip, _ = order
        return int32(first + i + (skip if i >= split else 0))

    def key_tiles(masked):
        """The loop over `count` key tiles of a block, in `order` (see `tile_of`; K of its
        first tile staged, K(after) staged at its end unless after < 0). `masked`: tiles
        some of the block's rows do not see whole, each warp skipping those none of its
        rows meets and masking those not all of its rows see whole; else tiles every row
        sees whole: no checks."""

        @cuda.jit(device=True)
        def loop(count, order, buffers, staging, lanes, bounds, scales):
            tile, qf, qa, s, pf, o, l, m, lo, hi = buffers
            q_lane, k_lane, a_lane = lanes
            j_first, j_end, j_full, j_part = bounds
            scale_log2, scale, softcap = scales
            for i in range(count):
                j = tile_of(order, i)
                ptx.cp_async_wait(0)
                cuda.syncthreads()      # K(j) is in; every warp is done with the last V / Q
                stage_tile(tile, j, staging, True)
                active = j_first <= j < j_end if masked else j_first < j_end  # warp-uniform
                if active:
                    scores(s, qf, qa, tile, q_lane, k_lane)
                    if capped:
                        softcap_scores(s, scale, softcap)
                    if masked and (j < j_full or j >= j_part):
                        mask(s, lo, hi, int32(j * BK))
                    softmax_step(s, pf, o, l, m, scale_log2)
                ptx.cp_async_wait(0)
                cuda.syncthreads()      # V(j) is in; every warp is done with K(j)
                following = tile_of(order, int32(i + 1)) if int32(i + 1) < count else order[3]
                if following >= 0:
                    stage_tile(tile, following, staging, False)
                if active:
                    accumulate(o, l, pf, tile, a_lane)

        return loop

    masked_tiles = key_tiles(True)
    unmasked_tiles = key_tiles(False)

    @cuda.jit
    def prefill(q, k_store, v_store, pages, page_bits, tables, out, lse, seq_info_off,
                segments_off, n_row_tiles, group, ring_rows, window, scale, softcap):
        """`run`'s launch: pages and page_bits follow the slot storage they address, as
        in `attention`'s kernel; grid (kv heads, served segments, row tiles)."""
        tid = cuda.threadIdx.x
        lane = cuda.laneid
        g = lane // 4
        t = lane % 4
        kv_head = cuda.blockIdx.x
        seg = tables[segments_off + cuda.blockIdx.y]
        first_row = int32((n_row_tiles - 1 - cuda.blockIdx.z) * BR)   # longest tiles first
        q_start, q_len, col, pos_start, block = read_segment(tables, seq_info_off, seg)
        n_end = int32(group * q_len)            # the segment's rows
        n_rows = int32(min(BR, n_end - first_row))
        if n_rows <= 0:
            return
        # Integers are int32 from here (registers, 32-bit arithmetic). The block loads keys
        # [key_lo, key_hi), the union of its rows' intervals, in tiles j = 0 .. n_tiles.
        win = int32(window)
        key_lo, hi_block = key_range(split_row(first_row, group)[0], q_len, pos_start, block,
                                     win)
        lo_block, key_hi = key_range(split_row(first_row + n_rows - 1, group)[0], q_len,
                                     pos_start, block, win)
        key_lo = int32(key_lo)
        n_tiles = int32((key_hi - key_lo + BK - 1) // BK)
        # its tiles [j1, j2) are seen whole by all its rows (past its last row's lo, before
        # its first row's hi): the unmasked loop takes them, after the masked loop the others
        j1 = int32(min(n_tiles, (lo_block - key_lo + BK - 1) // BK))
        j2 = int32(max(j1, min(n_tiles, (hi_block - key_lo) // BK)))
        masked_order = (int32(0), j1, int32(j2 - j1), j1 if j2 > j1 else int32(-1))
        unmasked_order = (j1, int32(j2 - j1), int32(0), int32(-1))
        n_masked = int32(j1 + n_tiles - j2)
        # this warp's rows [warp_row, warp_end): it computes on tiles [j_first, j_end)
        # (its first row's lo, its last row's hi) and masks none in [j_full, j_part)
        warp_row = int32(first_row + WR * (tid // 32))
        warp_end = int32(min(warp_row + WR, first_row + n_rows))
        lo_first, hi_first = key_range(split_row(warp_row, group)[0], q_len, pos_start, block,
                                       win)
        lo_last, hi_last = key_range(split_row(warp_end - 1, group)[0], q_len, pos_start,
                                     block, win)
        bounds = (int32((lo_first - key_lo) // BK),
                  int32((hi_last - key_lo + BK - 1) // BK if warp_row < warp_end else 0),
                  int32((lo_last - key_lo + BK - 1) // BK), int32((hi_first - key_lo) // BK))
        # the lane's rows g + 8 r (clamped to the last real row: no key_range past q_len):
        # their intervals relative to the lane's first key of tile 0, key_lo + 2t
        lo = cuda.local.array(LANE_ROWS, int32)
        hi = cuda.local.array(LANE_ROWS, int32)
        for r in range(LANE_ROWS):
            lo_r, hi_r = key_range(split_row(min(warp_row + g + 8 * r, n_end - 1), group)[0],
                                   q_len, pos_start, block, win)
            lo[r] = int32(lo_r - key_lo - 2 * t)
            hi[r] = int32(hi_r - key_lo - 2 * t)

        # staging: this thread's first Q row and key, and its first chunk in them
        first_q = int32(tid // Q_LANES if tid < Q_STEP * Q_LANES else BR)
        q_d0 = int32(tid % Q_LANES * CHUNK)
        first_key = int32(tid // KEY_LANES if tid < KEY_STEP * KEY_LANES else BK)
        key_d0 = int32(tid % KEY_LANES * CHUNK)
        src = kv_head * head_dim + key_d0       # in slot 0: slots add slot_bytes each
        ring = int32(ring_rows if ring_rows > 0 else FLAT_RING)
        slots = cuda.local.array(KEY_PASSES, int32)     # the thread's keys' slots in a tile
        staging = (int32(K_BASE + first_key * PITCH + key_d0), ptx.bytes_from(k_store, src),
                   int32(V_BASE + first_key * PITCH + key_d0), ptx.bytes_from(v_store, src),
                   slots, pages, col, page_bits, uint32(2 * k_store.shape[1] * head_dim),
                   uint32(uint32(key_lo) % uint32(ring)), ring,
                   int32(min(BK, ring)), int32(key_hi - key_lo), first_key, key_d0)

        # 16-byte aligned: ldmatrix rows and cp.async destinations
        tile = cuda.shared.array(SMEM, uint16, alignment=16)
        stage_queries(tile, q, q_start, first_row, n_rows, group, kv_head, first_q, q_d0)
        stage_tile(tile, tile_of(masked_order, 0) if n_masked > 0 else j1, staging, False)
        ptx.cp_async_wait(0)
        cuda.syncthreads()              # Q and the first K tile are in
        # A-operand lane address: row lane % 16, columns 8 (lane // 16) on (V .trans too)
        a_lane = (lane % 16) * PITCH + (lane // 16) * 8
        # K^T (B, non-trans): key lane % 8 + 8 (lane // 16), dims 8 (lane // 8 % 2) on
        k_lane = (lane % 8 + 8 * (lane // 16)) * PITCH + (lane // 8 % 2) * 8
        q_lane = Q_BASE + (tid // 32) * WR * PITCH + a_lane     # the warp's Q rows
        qf = cuda.local.array(Q_ALL, uint32)
        if Q_IN_REGISTERS:              # V takes Q's rows after the loop's first barrier
            for h in range(H):
                for kc in range(DK):
                    a0, a1, a2, a3 = ptx.ldmatrix_x4(tile, q_lane + h * 16 * PITCH + kc * 16)
                    qf[(h * DK + kc) * 4] = a0
                    qf[(h * DK + kc) * 4 + 1] = a1
                    qf[(h * DK + kc) * 4 + 2] = a2
                    qf[(h * DK + kc) * 4 + 3] = a3

        qa = cuda.local.array(FRAGMENT, uint32)     # Q's A operands of one k16 chunk
        s = cuda.local.array(S_ALL, float32)
        pf = cuda.local.array(P_ALL, uint32)
        o = cuda.local.array(O_ALL, float32)
        for i in range(O_ALL):
            o[i] = 0.0
        l = cuda.local.array(FRAGMENT, float32)     # running sums of rows a, a, b, b per half
        m = cuda.local.array(LANE_ROWS, float32)    # running maxima (unscaled scores)
        for i in range(FRAGMENT):
            l[i] = 0.0
        for i in range(LANE_ROWS):
            m[i] = NEG_INF
        buffers = (tile, qf, qa, s, pf, o, l, m, lo, hi)
        lanes = (q_lane, k_lane, a_lane)
        scales = (scale * LOG2E, scale, softcap)
        masked_tiles(n_masked, masked_order, buffers, staging, lanes, bounds, scales)
        unmasked_tiles(int32(j2 - j1), unmasked_order, buffers, staging, lanes, bounds, scales)
        store_rows(out, lse, o, l, m, scale, warp_row, n_end, g, t, q_start, group, kv_head)

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


def run(q, k_store, v_store, tables, *, pages, page_bits, seq_info_off, segments_off,
        n_segments, max_q_len, out, ring_rows, window, scale, softcap, lse=None, stream=0,
        tile=None):
    """Attention of the listed segments' queries over their own sequence's keys, into `out`.

    q, out: [width, n_q_heads, head_dim] device arrays, float16, float32 or bfloat16
    (uint16 bits); only the listed segments' rows of `out` are written. k_store, v_store:
    slot storage [n_slots, n_kv_heads, head_dim] (a page pool [n_pages, page_size,
    n_kv_heads, head_dim] reshaped; n_slots <= INT32_MAX), 16-bit (see `storage_type`),
    C-contiguous. pages: the layer kind's int32 device page table [seq rows, pages per
    sequence], C-contiguous, indexed by a segment's `COL`, each entry a page's first slot
    (page id times page_size); page_bits: log2(page_size). Storage row r of sequence
    `seq` (its position on a flat layer, position % ring_rows on a ring) is slot
    `pages[seq, r >> page_bits] | (r & (page_size - 1))`; a sequence's pages cover rows
    up to its keys' last (flat) or all ring_rows rows (ring). tables: flat int32 device
    array; segment `s`, field `F` at `seq_info_off + s * SEQ_INFO_FIELDS + F`; the
    segments served are `tables[segments_off + i]`, `i < n_segments`, none longer than
    `max_q_len`. ring_rows: 0 (flat) or R; window: 0 (none) or W; softcap 0.0 = off.
    lse: None, or a float32 `[width, n_q_heads]` device array that receives each listed
    row's natural-log log-sum-exp of its (scaled, capped) scores. One launch on
    `stream`: no synchronisation, no allocation. `tile`: (block_rows, block_keys),
    multiples of 16, and optionally warp_rows (16 or 32, dividing block_rows; else
    `default_warp_rows`), instead of `tile_shape(head_dim)`.
    """
    if n_segments == 0 or max_q_len == 0:
        return out
    if not scale > 0:
        raise ValueError(f"prefill: scale {scale} must be positive")
    head_dim = q.shape[2]
    storage = _served(head_dim, k_store.dtype, q.dtype, out.dtype)
    shape = tuple(k_store.shape)
    if len(shape) != 3 or shape[2] != head_dim or tuple(v_store.shape) != shape:
        raise ValueError(f"prefill: storage {shape} / {tuple(v_store.shape)} is not slot "
                         f"storage [n_slots, n_kv_heads, {head_dim}] of one shape")
    n_q_heads, n_kv_heads = q.shape[1], shape[1]
    group = n_q_heads // n_kv_heads
    block_rows, block_keys, *warp_rows = tile or tile_shape(head_dim)
    warp_rows = warp_rows[0] if warp_rows else None
    q_copy = q.dtype == k_store.dtype and aligned(q, 16)   # Q in the mma type: cp.async
    kernel = _prefill_kernel(head_dim, block_rows, block_keys, storage, softcap > 0, q_copy,
                             warp_rows)
    warps = block_rows // (warp_rows or default_warp_rows(head_dim, block_rows))
    n_row_tiles = ceil_div(group * max_q_len, block_rows)
    kernel((n_kv_heads, n_segments, n_row_tiles), 32 * warps, stream,
           q, k_store, v_store, pages, int(page_bits), tables, out,
           no_output() if lse is None else lse,
           int(seq_info_off), int(segments_off), n_row_tiles, group, int(ring_rows),
           int(window), np.float32(scale), np.float32(softcap))
    return out
