"""The prefill kernel's arithmetic on mma fragments, as device functions of one
specialisation (`math_functions`): S = Q K^T, the softcap, masks, the online softmax
with P packed to 16 bits, O += P V with the row sums from one more mma, and the
normalised rows' stores (a row's sink joined there), or a key chunk's partial states for
the decode combine (`prefill_kernel`'s doc tells the fragment bookkeeping).

Narrow tiles (`shape.narrow_staging`) hold K and V as stored, 8-bit floats, and widen
what ldmatrix reads of them (`staging.widener`, exact):

* K: an `ldmatrix_x4` of 32 keys' 16 bytes (dims 16 kc ..) gives lane (g, t) the dims
  16 kc + 4t .. 4t + 3 of keys g, g + 8, g + 16, g + 24: widened, the B operands of four
  n8 tiles of S, the k16 chunk's dims taken in the order 0, 1, 4, 5, .., 12, 13, then
  2, 3, 6, 7, .., 14, 15. Q's A operands follow that order (`q_fragment`: each lane
  loads its own 8 bytes of a Q row, dims 4t .. 4t + 3), so S is unchanged.
* V: an `ldmatrix_x4_trans` of 16 keys and 32 dims gives lane (g, t) the bytes of keys
  2t, 2t + 1 (and 2t + 8, 2t + 9) at dims 2g, 2g + 1 of each block of 16 dims; one
  `prmt` pairs the keys of each dim, and widened they are the B operands of two n8
  tiles of O: the block's even dims (tile 2b) and its odd dims (tile 2b + 1). A lane's
  O columns 2t, 2t + 1 of the two tiles are the block's dims 4t .. 4t + 3, which it
  stores as one run (`o_blocks`).
"""
from __future__ import annotations

import math

from ...device import cuda
from ..intrinsics import ptx, tensorcore
from ..launch.constants import LN2, LOG2E, NEG_INF
from ..sinks import with_sink
from ..softmax import rescaling
from .shape import ONES, PrefillShape
from .staging import split_row, widener

from numba import float32, int32, int64, uint32, uint64  # noqa: E402  (after device)


def math_functions(shape: PrefillShape, sunk: bool = False, out_aligned: bool = True) -> tuple:
    """`(scores, softcap_scores, mask, softmax_step, accumulate, store_rows,
    store_partial, q_fragment)` for one kernel `shape`, its rows' sinks joined (`sunk`)
    or not, its output rows stored a run of dims at once (`out_aligned`: `out` 16-byte
    aligned) or a value at a time."""
    SUNK = sunk
    head_dim, BK, PITCH, H = shape.head_dim, shape.bk, shape.pitch, shape.h
    KT, DK, DT = shape.kt, shape.dk, shape.dt
    S_FLOATS, P_WORDS, O_FLOATS = shape.s_floats, shape.p_words, shape.o_floats
    LANE_ROWS, S_ALL, Q_IN_REGISTERS = shape.lane_rows, shape.s_all, shape.q_in_registers
    K_BASE, V_BASE = shape.k_base, shape.v_base
    OUT_DIM = shape.v_dim or head_dim           # an output row's (and a partial's) width
    WIDE = shape.wide                           # V in slices: a block writes its own dims
    ONE_PAIR = uint32(ONES[shape.storage])
    float16 = shape.storage == "float16"
    mma = tensorcore.mma_f16_f32 if float16 else tensorcore.mma_bf16_f32
    pack = ptx.f32x2_to_f16x2 if float16 else ptx.f32x2_to_bf16x2
    NARROW, KV_PITCH, PITCH_Q = shape.narrow, shape.kv_pitch, shape.pitch
    widen = widener(shape) if NARROW else None
    # a lane's O dims: GROUPS runs of RUN dims, STEP apart (`PrefillShape.o_blocks`); all
    # real unless padded or the wide tile's slice (then each run is checked)
    GROUPS, STEP, RUN = shape.o_blocks
    ALL_DIMS = not WIDE and shape.dt * 8 == OUT_DIM
    OUT_ALIGNED = out_aligned

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

    @cuda.jit(device=True, inline="always")
    def q_fragment(tile, at):
        """The A operands (a0..a3) of one m16 half's k16 chunk of Q, its lane address `at`
        (`prefill_kernel`'s q_lane plus the half's rows and the chunk's dims): by ldmatrix,
        or, for a narrow tile, in its dims' order (module doc): rows g and g + 8, each
        lane's own 8 bytes, dims 4t .. 4t + 3."""
        if NARROW:
            a0, a2 = tensorcore.ld_shared_v2(tile, at)
            a1, a3 = tensorcore.ld_shared_v2(tile, at + 8 * PITCH_Q)
            return a0, a1, a2, a3
        return tensorcore.ldmatrix_x4(tile, at)

    @cuda.jit(device=True, inline="always")
    def widened_keys(s, n, qa, r):
        """s's n8 tile n (of each half) += Q's chunk times 8 keys' stored bytes `r` of a
        narrow tile, widened."""
        b0, b1 = widen(r)
        for h in range(H):
            mma_into(s, h * KT + n, qa[4 * h], qa[4 * h + 1], qa[4 * h + 2], qa[4 * h + 3],
                     b0, b1)

    @cuda.jit(device=True, inline="always")
    def score_chunk(s, qf, qa, tile, q_lane, k_lane, kc):
        """s += the products of dims 16 kc .. 16 kc + 15 (see `scores`)."""
        for h in range(H):
            if Q_IN_REGISTERS:
                for i in range(4):
                    qa[4 * h + i] = qf[(h * DK + kc) * 4 + i]
            else:
                qa[4 * h], qa[4 * h + 1], qa[4 * h + 2], qa[4 * h + 3] = q_fragment(
                    tile, q_lane + h * 16 * PITCH + kc * 16)
        if NARROW:
            for kq in range(BK // 32):      # keys 32 kq ..: four n8 tiles
                r0, r1, r2, r3 = tensorcore.ldmatrix_x4(tile, K_BASE + k_lane
                                                        + kq * 32 * KV_PITCH + kc * 8)
                widened_keys(s, 4 * kq, qa, r0)
                widened_keys(s, 4 * kq + 1, qa, r1)
                widened_keys(s, 4 * kq + 2, qa, r2)
                widened_keys(s, 4 * kq + 3, qa, r3)
        else:
            for kp in range(BK // 16):      # keys 16 kp .. 16 kp + 15: two n8 tiles
                b0, b1, b2, b3 = tensorcore.ldmatrix_x4(tile, K_BASE + k_lane
                                                        + kp * 16 * PITCH + kc * 16)
                for h in range(H):
                    mma_pair(s, h * KT + 2 * kp, qa[4 * h], qa[4 * h + 1], qa[4 * h + 2],
                             qa[4 * h + 3], b0, b1, b2, b3)

    @cuda.jit(device=True)
    def scores(s, qf, qa, tile, q_lane, k_lane):
        """s = Q K^T for the warp's rows (half h in s[h S_FLOATS ..]) and the tile's BK keys
        (unscaled). Q's A operands come from registers (qf) or from the warp's Q rows in
        shared memory, through qa; each K fragment serves every half. The wide tile's
        chunks (36 at 576) are counted in int32, which LLVM unrolls whole (a range of
        them it unrolls by 4, with 64-bit counts and 53 instructions of overhead a trip)."""
        for i in range(S_ALL):
            s[i] = 0.0
        if WIDE:
            kc = int32(0)
            while kc < DK:
                score_chunk(s, qf, qa, tile, q_lane, k_lane, kc)
                kc += 1
        else:
            for kc in range(DK):            # dims 16 kc .. 16 kc + 15
                score_chunk(s, qf, qa, tile, q_lane, k_lane, kc)

    @cuda.jit(device=True, inline="always")
    def widened_values(o, n, pf, kk, r_lo, r_hi):
        """o's n8 tiles n and n + 1 (of each half) += P's keys 16 kk .. 16 kk + 15 times a
        narrow tile's block of 16 dims: `r_lo` / `r_hi` the bytes of its keys 2t, 2t + 1
        / 2t + 8, 2t + 9 at dims 2g, 2g + 1, paired per dim by `prmt` and widened (tile
        n: the even dims, n + 1: the odd)."""
        even0, odd0 = widen(ptx.prmt(r_lo, 0, 0x3120))
        even1, odd1 = widen(ptx.prmt(r_hi, 0, 0x3120))
        for h in range(H):
            a = h * P_WORDS + 4 * kk
            mma_pair(o, h * DT + n, pf[a], pf[a + 1], pf[a + 2], pf[a + 3], even0, even1,
                     odd0, odd1)

    @cuda.jit(device=True)
    def accumulate(o, l, pf, tile, v_lane):
        """o += P V for the warp's rows (P from the packed pairs, V rows by .trans from
        `v_lane`, the A-operand lane address at the block's first V dim: each V fragment
        serves every half), and the row sums l += P's row sums."""
        for kk in range(BK // 16):          # keys 16 kk .. 16 kk + 15: A = p[4 kk .. 4 kk + 3]
            if NARROW:
                for dq in range(DT // 4):   # dims 32 dq ..: two blocks of 16, four n8 tiles
                    r0, r1, r2, r3 = tensorcore.ldmatrix_x4_trans(
                        tile, V_BASE + v_lane + kk * 16 * KV_PITCH + dq * 16)
                    widened_values(o, 4 * dq, pf, kk, r0, r1)
                    widened_values(o, 4 * dq + 2, pf, kk, r2, r3)
            else:
                for dc in range(DT // 2):   # dims 16 dc .. 16 dc + 15: two n8 tiles of O
                    b0, b1, b2, b3 = tensorcore.ldmatrix_x4_trans(tile, V_BASE + v_lane
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
        is one FFMA and one `ex2.approx.ftz`: `softmax.rescaling`), per half h (rows a =
        2h, b = 2h + 1 of the lane): new running maxima m (quad-wide), P packed into pf, O
        and the row sums l rescaled. Once the maxima settle alpha is exactly 1 (exp2 of
        0) and most tiles skip the rescale."""
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

    @cuda.jit(device=True, inline="always")
    def run_value(o, at, n, i, scale):
        """Value i of run n of the lane's O row whose registers start at `at` (row a or
        b of a half: `o_blocks`), times `scale`."""
        if RUN == 2:
            return o[at + 4 * n + i] * scale
        return o[at + 8 * n + 4 * (i % 2) + i // 2] * scale

    @cuda.jit(device=True, inline="always")
    def owned(d, own_lo, own_hi):
        """Whether the run from dim d is the block's to write (`store_rows`' dims)."""
        return ALL_DIMS or (d < own_hi and (not WIDE or d >= own_lo))

    @cuda.jit(device=True)
    def store_row(array, row_index, o, at, scale, t, dims):
        """The lane's runs of one O row times `scale` into `array`'s row that starts at
        flat element `row_index`, one aligned store a run (`ptx.st_f32x2` / `st_f32x4`:
        the row 16-byte aligned); `dims` as `store_rows`'."""
        first, own_lo, own_hi, _ = dims
        base = int64(row_index) + first + RUN * t
        for n in range(GROUPS):
            if owned(first + STEP * n + RUN * t, own_lo, own_hi):
                if RUN == 2:
                    ptx.st_f32x2(array, base + STEP * n, run_value(o, at, n, 0, scale),
                                 run_value(o, at, n, 1, scale))
                else:
                    ptx.st_f32x4(array, base + STEP * n, run_value(o, at, n, 0, scale),
                                 run_value(o, at, n, 1, scale), run_value(o, at, n, 2, scale),
                                 run_value(o, at, n, 3, scale))

    @cuda.jit(device=True)
    def store_rows(out, lse, sinks, o, l, m, scale, warp_row, n_end, g, t, q_start, group,
                   kv_head, dims):
        """Write the lane's real rows (g + 8 r of the warp's), each normalised by its sum
        (every real row sees a key: its sum is > 0), its head's sink joined first when
        the kernel is `sunk` (`kernels.sinks`), and, when `lse` has rows, each row's
        log-sum-exp `scale m + log l` (lane t = 0 of the quad, which all hold m and l).
        `dims` = (first, lo, hi, lead): O's first column is dim `first` of the row, the
        block writes dims [lo, hi), and the log-sum-exp where `lead` (V's first slice).
        A run of dims is one store where `out` is 16-byte aligned (`out_aligned`), else
        one a value."""
        first, own_lo, own_hi, lead = dims
        for r in range(LANE_ROWS):
            row = warp_row + g + 8 * r
            if row < n_end:
                at = (r // 2) * O_FLOATS + 2 * (r % 2)      # row a or b of half r // 2
                row_sum = l[4 * (r // 2) + 2 * (r % 2)]
                token, head = split_row(row, group)
                best = m[r] * scale                         # natural log
                weight = float32(1.0)
                if SUNK:
                    best, weight, row_sum = with_sink(
                        best * LOG2E, row_sum, sinks[kv_head * group + head] * LOG2E)
                    best *= LN2
                inv_l = weight / row_sum
                # unsigned indices: no negative-index wraparound code per store
                token_at = uint32(q_start + token)
                head_at = uint32(kv_head * group + head)
                if t == 0 and lse.shape[0] > 0 and lead:
                    lse[token_at, head_at] = best + math.log(row_sum)
                if OUT_ALIGNED:
                    store_row(out, (uint64(token_at) * uint32(out.shape[1]) + head_at)
                              * uint32(OUT_DIM), o, at, inv_l, t, dims)
                else:
                    for n in range(GROUPS):
                        d = first + STEP * n + RUN * t
                        if owned(d, own_lo, own_hi):
                            for i in range(RUN):
                                out[token_at, head_at, uint32(d + i)] = ptx.from_f32(
                                    run_value(o, at, n, i, inv_l), out)

    @cuda.jit(device=True)
    def store_partial(part_acc, part_ml, o, l, m, scale_log2, warp_row, n_end, g, t,
                      part_row, group, kv_head, n_heads, dims):
        """Write the lane's real rows as one chunk's partial state, unnormalised, in the
        decode combine's layout (`decode.combine`): a row's accumulators at `at *
        OUT_DIM`, its (max in base 2, sum) pair at `2 at`, `at = (part_row + token) *
        n_heads + head` (`part_row`: the chunk's partial slot times the partials'
        max_q_len); `dims` as `store_rows`'. A row that saw no key of the chunk holds max
        -inf, sum 0, acc 0."""
        lead = dims[3]
        for r in range(LANE_ROWS):
            row = warp_row + g + 8 * r
            if row < n_end:
                first = (r // 2) * O_FLOATS + 2 * (r % 2)    # row a or b of half r // 2
                token, head = split_row(row, group)
                # unsigned indices: no negative-index wraparound code per store
                at = uint32((part_row + token) * n_heads + kv_head * group + head)
                if t == 0 and lead:
                    part_ml[at * uint32(2)] = m[r] * scale_log2
                    part_ml[at * uint32(2) + uint32(1)] = l[4 * (r // 2) + 2 * (r % 2)]
                store_row(part_acc, uint64(at) * uint32(OUT_DIM), o, first, float32(1.0), t,
                          dims)

    return (scores, softcap_scores, mask, softmax_step, accumulate, store_rows, store_partial,
            q_fragment)
