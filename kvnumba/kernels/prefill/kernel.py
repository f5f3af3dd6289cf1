"""The prefill attention kernel on tensor cores, FlashAttention-2 style, for 16-bit K/V
storage, or 8-bit float storage converted to a 16-bit type as it is staged, or, in a
one-warp block, staged as stored and widened from the fragments ldmatrix reads (the
narrow tile, `shape.narrow_staging`). `prefill.staging` stages the tiles, `prefill`
plans and launches the kernel.

Same semantics as the generic kernel (`generic.kernel`: visible keys from
`masks.key_range`, position p of a ring layer in row p % ring_rows, scale then optional
softcap, float32 softmax and accumulation), for segments long enough to fill tensor-core tiles; scale > 0.

A block takes `block_rows` query *rows* of one segment and one kv head, packed GQA
as in `generic.kernel`: row `r` of the segment is (token `r // group`, q head
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
`lse` when the caller passes one with rows. A lane writes its run of each row's dims
(2, or a narrow tile's 4) as one store where `out` is 16-byte aligned (`out_aligned`),
else a value at a time; a chunk's partial rows (`split`) always as runs.

Staging: Q, K and V reach shared memory by cp.async in 16-byte chunks, `lanes`
consecutive threads per row, so that a warp instruction reads whole 128-byte lines
(`staging_layout`). A chunk with nothing to read (a row past the segment or past the
tile's keys, the columns from head_dim to the padded head dim) is zero-filled by the
same instruction: no NaN from stale shared memory or padding meets an mma. A tile's
keys are consecutive positions, so a ring (position p in row p % ring_rows) wraps at
most once inside it: the key at unwrapped row r < 2 ring_rows lives in row min(r, r -
ring_rows) as unsigned 32-bit numbers (before the wrap, r - ring_rows underflows).

Storage is paged: K and V are slot storage [n_slots, n_kv_heads, head_dim] (a page pool
[n_pages, page_size, ...] reshaped), and row r of sequence `seq` (the segment's `SEQ`)
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

The wide tile (`v_dim`: `shape.WIDE_TILE`) serves K rows up to 576 values and V up to
512, no wider than K: one warp of 16 rows, Q kept in shared memory (its fragments
loaded chunk by chunk per tile), one key buffer that holds K(j), then V(j) (staged
once the scores are done; a latent layer's V is K(j)'s first values, nothing staged),
then K(j + 1). V is cut in slices of `V_SLICE` dims, the grid's z running over row
tiles times slices: a block scores every key over the whole row and accumulates its
slice's dims (a slice that would pass K's padded row starts earlier, each block
writing only its own dims); the first slice's block writes the rows' log-sum-exps, or
their partials' (max, sum).
"""
from __future__ import annotations

from functools import lru_cache

from ...device import cuda
from ..intrinsics import ptx, tensorcore
from ..launch.constants import LOG2E, NEG_INF
from ..launch.calling import Specialised
from ..decode.chunks import WORK_FIELDS, WORK_KEY_HI, WORK_KEY_LO, WORK_PART, WORK_SEG
from ..masks import divmod32, key_range, read_segment
from .arithmetic import math_functions
from .shape import CHUNK_VALUES, FLAT_RING, PrefillShape
from .staging import split_row, staging_functions

from numba import float32, int32, int64, uint16, uint32  # noqa: E402  (after device)


@lru_cache(maxsize=None)
def prefill_kernel(head_dim: int, block_rows: int, block_keys: int, storage: str,
                   capped: bool, q_copy: bool = True, warp_rows: int | None = None,
                   stored: str | None = None, sunk: bool = False, split: bool = False,
                   v_dim: int | None = None, v_in_k: bool = False, out_aligned: bool = True):
    """The prefill kernel for one head_dim, tile shape (`warp_rows`: by default
    `default_warp_rows`), 16-bit mma type `storage` over K/V storage holding `stored`
    (default the same type; "e4m3" / "e5m2": 8-bit floats converted while staged), with
    (`capped`) or without a softcap, and Q staged by cp.async (`q_copy`: q holds the mma
    type, 16-byte aligned) or converted value by value; with (`sunk`) or without sinks;
    over whole segments, or (`split`) over the decode path's key chunks (module doc).
    `v_dim`: the wide tile (`shape.WIDE_TILE`) for V of `v_dim` dims, V read from K's
    staged rows (`v_in_k`: a latent layer) or staged from its own storage. `out_aligned`:
    `out` is 16-byte aligned, so that a lane's run of an output row is one store."""
    shape = PrefillShape.of(head_dim, block_rows, block_keys, storage, warp_rows, stored,
                            None, v_dim)
    if split and not shape.narrow and stored not in (None, storage):
        # split over 8-bit float storage widened while staged: Q's fragments from shared
        # memory, tile by tile, so that the widening loads of a one-warp block have the
        # registers
        shape = PrefillShape.of(head_dim, block_rows, block_keys, storage, warp_rows, stored,
                                False, v_dim)
    WIDE, V_IN_K, SLICES, VS, DP = shape.wide, v_in_k, shape.slices, shape.vs, shape.dp
    V_DIM = shape.v_dim or head_dim
    stage_queries, stage_tile = staging_functions(shape, q_copy)
    (scores, softcap_scores, mask, softmax_step, accumulate, store_rows,
     store_partial, q_fragment) = math_functions(shape, sunk, out_aligned)
    SPLIT = split
    BR, BK, WR, H, PITCH = shape.br, shape.bk, shape.wr, shape.h, shape.pitch
    DK, LANE_ROWS, FRAGMENT = shape.dk, shape.lane_rows, shape.fragment
    Q_ALL, S_ALL, P_ALL, O_ALL = shape.q_all, shape.s_all, shape.p_all, shape.o_all
    Q_IN_REGISTERS, Q_BASE, K_BASE, V_BASE = (shape.q_in_registers, shape.q_base,
                                              shape.k_base, shape.v_base)
    SMEM, KEY_LANES, KEY_STEP, KEY_PASSES = (shape.smem, shape.key_lanes, shape.key_step,
                                             shape.key_passes)
    Q_LANES, Q_STEP = shape.q_lanes, shape.q_step
    STORED_BYTES = shape.stored_bytes
    NARROW, KV_PITCH, KV_VALUES = shape.narrow, shape.kv_pitch, shape.kv_values

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
            q_lane, k_lane, v_lane = lanes
            j_first, j_end, j_full, j_part = bounds
            scale_log2, scale, softcap = scales
            for i in range(count):
                j = tile_of(order, i)
                tensorcore.cp_async_wait(0)
                cuda.syncthreads()      # K(j) is in; every warp is done with the last V / Q
                if not WIDE:
                    stage_tile(tile, j, staging, True)
                active = j_first <= j < j_end if masked else j_first < j_end  # warp-uniform
                if active:
                    scores(s, qf, qa, tile, q_lane, k_lane)
                    if capped:
                        softcap_scores(s, scale, softcap)
                    if masked and (j < j_full or j >= j_part):
                        mask(s, lo, hi, int32(j * BK))
                    softmax_step(s, pf, o, l, m, scale_log2)
                if WIDE:                # one key buffer: V(j) after K(j), K(j + 1) after V(j)
                    if not V_IN_K:
                        cuda.syncthreads()      # every warp is done with K(j)
                        stage_tile(tile, j, staging, True)
                        tensorcore.cp_async_wait(0)
                        cuda.syncthreads()      # V(j) is in
                    if active:
                        accumulate(o, l, pf, tile, v_lane)
                    cuda.syncthreads()          # every warp is done with V(j)
                    following = tile_of(order, int32(i + 1)) if int32(i + 1) < count else order[3]
                    if following >= 0:
                        stage_tile(tile, following, staging, False)
                else:
                    tensorcore.cp_async_wait(0)
                    cuda.syncthreads()      # V(j) is in; every warp is done with K(j)
                    following = tile_of(order, int32(i + 1)) if int32(i + 1) < count else order[3]
                    if following >= 0:
                        stage_tile(tile, following, staging, False)
                    if active:
                        accumulate(o, l, pf, tile, v_lane)

        return loop

    masked_tiles = key_tiles(True)
    unmasked_tiles = key_tiles(False)

    @cuda.jit(device=True, inline="always")
    def seen(i, q_len, pos_start, block, code, chunk_lo, chunk_hi):
        """The keys query `i` of a segment sees (`key_range`), inside the block's chunk
        [chunk_lo, chunk_hi) when the kernel is `split` (then perhaps none: lo >= hi)."""
        lo, hi = key_range(i, q_len, pos_start, block, code)
        if SPLIT:
            return max(lo, chunk_lo), min(hi, chunk_hi)
        return lo, hi

    @cuda.jit
    def prefill(q, k_store, v_store, pages, page_bits, tables, out, lse, sinks, seq_info_off,
                segments_off, n_row_tiles, group, ring_rows, mask_code, scale, softcap,
                part_acc, part_ml, max_q_len, least_rows):
        """`run`'s launch: pages and page_bits follow the slot storage they address, as
        in the generic kernel (`generic.kernel`); grid (kv heads, served segments, row
        tiles). `split`: grid (work items, kv heads, row tiles), `segments_off` the work
        table's offset, `part_acc`, `part_ml` and `max_q_len` the partials'
        (`decode.combine`), and
        only the items of segments of more than `least_rows` rows (group times q_len:
        `decode.shape.grouped`; the CUDA-core kernel serves the others); else those
        four are unused."""
        tid = cuda.threadIdx.x
        lane = cuda.laneid
        g = lane // 4
        t = lane % 4
        if SPLIT:
            item = int32(segments_off) + int32(cuda.blockIdx.x) * int32(WORK_FIELDS)
            kv_head = cuda.blockIdx.y
            seg = tables[item + WORK_SEG]
            chunk_lo = tables[item + WORK_KEY_LO]
            chunk_hi = tables[item + WORK_KEY_HI]
            part = tables[item + WORK_PART]
        else:
            kv_head = cuda.blockIdx.x
            seg = tables[segments_off + cuda.blockIdx.y]
            chunk_lo = chunk_hi = part = int32(0)
        # the wide tile's z runs over row tiles times V slices
        if WIDE:
            row_tile, v_part = divmod32(cuda.blockIdx.z, SLICES)
        else:
            row_tile, v_part = int64(cuda.blockIdx.z), int64(0)
        first_row = int32((n_row_tiles - 1 - row_tile) * BR)   # longest tiles first
        # O's first column is V dim v_first (a slice ending inside K's padded rows), the
        # block writes [v_lo, v_hi), its first slice the rows' log-sum-exps / (max, sum)
        v_lo = int32(v_part * VS)
        v_first = int32(min(v_lo, DP - VS))
        dims = (v_first, v_lo, int32(min(v_lo + VS, V_DIM)), v_part == 0)
        q_start, q_len, seq, pos_start, block = read_segment(tables, seq_info_off, seg)
        n_end = int32(group * q_len)            # the segment's rows
        n_rows = int32(min(BR, n_end - first_row))
        if n_rows <= 0 or (SPLIT and n_end <= least_rows):
            return
        # Integers are int32 from here (registers, 32-bit arithmetic). The block loads keys
        # [key_lo, key_hi), the union of its rows' intervals (inside its chunk when split),
        # in tiles j = 0 .. n_tiles.
        code = int32(mask_code)
        key_lo, hi_block = seen(split_row(first_row, group)[0], q_len, pos_start, block, code,
                                chunk_lo, chunk_hi)
        lo_block, key_hi = seen(split_row(first_row + n_rows - 1, group)[0], q_len,
                                pos_start, block, code, chunk_lo, chunk_hi)
        key_lo = int32(key_lo)
        n_tiles = int32((key_hi - key_lo + BK - 1) // BK)
        if SPLIT:
            n_tiles = max(n_tiles, int32(0))    # no key of the chunk: rows of -inf, 0, 0
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
        lo_first, hi_first = seen(split_row(warp_row, group)[0], q_len, pos_start, block,
                                  code, chunk_lo, chunk_hi)
        lo_last, hi_last = seen(split_row(warp_end - 1, group)[0], q_len, pos_start, block,
                                code, chunk_lo, chunk_hi)
        bounds = (int32((lo_first - key_lo) // BK),
                  int32((hi_last - key_lo + BK - 1) // BK if warp_row < warp_end else 0),
                  int32((lo_last - key_lo + BK - 1) // BK), int32((hi_first - key_lo) // BK))
        # the lane's rows g + 8 r (clamped to the last real row: no key_range past q_len):
        # their intervals relative to the lane's first key of tile 0, key_lo + 2t
        lo = cuda.local.array(LANE_ROWS, int32)
        hi = cuda.local.array(LANE_ROWS, int32)
        for r in range(LANE_ROWS):
            lo_r, hi_r = seen(split_row(min(warp_row + g + 8 * r, n_end - 1), group)[0],
                              q_len, pos_start, block, code, chunk_lo, chunk_hi)
            lo[r] = int32(lo_r - key_lo - 2 * t)
            hi[r] = int32(hi_r - key_lo - 2 * t)

        # staging: this thread's first Q row and key, and its first chunk in them
        first_q = int32(tid // Q_LANES if tid < Q_STEP * Q_LANES else BR)
        q_d0 = int32(tid % Q_LANES * CHUNK_VALUES)
        first_key = int32(tid // KEY_LANES if tid < KEY_STEP * KEY_LANES else BK)
        key_d0 = int32(tid % KEY_LANES * KV_VALUES)            # its first value
        key_col = int32(tid % KEY_LANES * CHUNK_VALUES)        # .. and tile column
        src = kv_head * head_dim + key_d0       # in slot 0: slots add slot_bytes each
        ring = int32(ring_rows if ring_rows > 0 else FLAT_RING)
        slots = cuda.local.array(KEY_PASSES, int32)     # the thread's keys' slots in a tile
        if WIDE:    # V's slice, from its own storage rows (a latent layer's: K's)
            v_row = v_store.shape[2]
            v_src = kv_head * v_row + key_d0 + v_first
            v_dst = int32(V_BASE + first_key * KV_PITCH + key_col + v_first)
            v_slot_bytes = uint32(STORED_BYTES * v_store.shape[1] * v_row)
        else:
            v_src = src
            v_dst = int32(V_BASE + first_key * KV_PITCH + key_col)
            v_slot_bytes = uint32(0)        # K's slot bytes serve V
        staging = (int32(K_BASE + first_key * KV_PITCH + key_col), ptx.bytes_from(k_store, src),
                   v_dst, ptx.bytes_from(v_store, v_src), slots, pages, seq, page_bits,
                   uint32(STORED_BYTES * k_store.shape[1] * head_dim),
                   uint32(uint32(key_lo) % uint32(ring)), ring,
                   int32(min(BK, ring)), int32(key_hi - key_lo), first_key, key_d0,
                   v_slot_bytes, int32(V_DIM - v_first))

        # 16-byte aligned: ldmatrix rows and cp.async destinations
        tile = cuda.shared.array(SMEM, uint16, alignment=16)
        stage_queries(tile, q, q_start, first_row, n_rows, group, kv_head, first_q, q_d0)
        if not SPLIT or n_tiles > 0:
            stage_tile(tile, tile_of(masked_order, 0) if n_masked > 0 else j1, staging, False)
        tensorcore.cp_async_wait(0)
        cuda.syncthreads()              # Q and the first K tile are in
        # A-operand lane address: row lane % 16, columns 8 (lane // 16) on (V .trans too)
        a_lane = (lane % 16) * PITCH + (lane // 16) * 8
        if NARROW:      # (`prefill.arithmetic`'s doc)
            # Q: row g, dims 4t on; K: key lane, the chunk's 16 bytes; V .trans: key
            # lane % 8 + 8 (lane // 8 % 2), bytes 16 (lane // 16) on
            q_lane = Q_BASE + (tid // 32) * WR * PITCH + g * PITCH + 4 * t
            k_lane = lane * KV_PITCH
            v_lane = (lane % 8 + 8 * (lane // 8 % 2)) * KV_PITCH + (lane // 16) * 8
        else:
            q_lane = Q_BASE + (tid // 32) * WR * PITCH + a_lane     # the warp's Q rows
            # K^T (B, non-trans): key lane % 8 + 8 (lane // 16), dims 8 (lane // 8 % 2) on
            k_lane = (lane % 8 + 8 * (lane // 16)) * PITCH + (lane // 8 % 2) * 8
            v_lane = a_lane + (v_first if WIDE else 0)
        qf = cuda.local.array(Q_ALL, uint32)
        if Q_IN_REGISTERS:              # V takes Q's rows after the loop's first barrier
            for h in range(H):
                for kc in range(DK):
                    a0, a1, a2, a3 = q_fragment(tile, q_lane + h * 16 * PITCH + kc * 16)
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
        lanes = (q_lane, k_lane, v_lane)
        scales = (scale * LOG2E, scale, softcap)
        masked_tiles(n_masked, masked_order, buffers, staging, lanes, bounds, scales)
        unmasked_tiles(int32(j2 - j1), unmasked_order, buffers, staging, lanes, bounds, scales)
        if SPLIT and part >= 0:
            store_partial(part_acc, part_ml, o, l, m, scale * LOG2E, warp_row, n_end, g, t,
                          int32(part * max_q_len), group, kv_head, q.shape[1], dims)
        else:
            store_rows(out, lse, sinks, o, l, m, scale, warp_row, n_end, g, t, q_start,
                       group, kv_head, dims)

    return Specialised(prefill)
