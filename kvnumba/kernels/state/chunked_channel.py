"""The gated delta rule's chunked form with a gate per key channel (Kimi's KDA, `g [width,
H, Dk]`), its state-side products on the tensor cores: the recurrence of `delta_rule`'s
module doc over chunks of `CHUNK` new tokens of one sequence at a time, as `chunked`
takes it for a gate a head.

Within a chunk of tokens `1..C` from the state `S` (`[Dk, Dv]`, float32; stored
float32, or bfloat16 rounded at each update, as `chunked` keeps it), with `G_tc`
the cumulative log-decay of key channel `c` over tokens `1..t`, row `c` of the state
after token `t` is `exp(G_tc) S_c + sum_{s<=t} exp(G_tc - G_sc) k_sc d_s^T`. The
decay between two tokens now differs per channel, so it sits inside the sums over `c`:

    A[t, s] = beta_t sum_c k_tc k_sc exp(G_tc - G_sc)      (s < t)
    P[t, s] = sum_c q_tc k_sc exp(G_tc - G_sc)             (s <= t; 0 above)
    T = (I + A)^{-1} diag(beta)                             (forward substitution)
    D = T (V - (K . exp(G)) S)                              (without beta: D = V)
    O = scale ((Q . exp(G)) S + P D)
    S' = diag(exp(G_C)) S + (K . exp(G_C - G))^T D

(`.` the elementwise product, `exp(G)` the `[C, Dk]` decays). `A` and `P` cannot be
tensor-core products of scaled operands as the per-head kernel's are: `exp(G_t - G_s)`
as `exp(G_t) exp(-G_s)` overflows float32 once a chunk's decay passes `exp(-88)` (a
log-gate of -6 a token over 16 tokens) and leaves float16's range long before. So a
chunk is one 16 x 16 diagonal block (`CHUNK = 16`), whose `A` and `P` are exact float32
sums on the CUDA cores, every factor `exp(G_tc - G_sc) <= 1` (`t >= s`): a thread a
pair `(t, s)` (two rounds of the block's 128 threads over the 256 pairs; a pair above
the diagonal sums its transpose's and is dropped, so no factor exceeds 1), one
exponential a channel shared by both sums, the gate tile's pitch `Dk + 1` so a warp's
16 rows `s` fall in distinct banks. Every state-side product keeps its factors at most
1 and runs on the tensor cores (`mma.m16n8k16`, `tiles`): `(K . exp(G)) S`, `(Q .
exp(G)) S`, `T R`, `P D` and `(K . exp(G_C - G))^T D`; the state rows decay by
`exp(G_C,c)` in float32. `G` is kept in base-2 units (`ex2.approx`, relative error about
2^-22: far inside the float16 operands' rounding). Longer chunks would need fla's
`chunk_kda` blocking (a reference at each row block's start for the off-diagonal
blocks) and more shared memory than the 48 KiB a Numba kernel may have: the cumulative
gate alone is `[C, Dk]` float32 (8 KiB at C 16, d128); a d128 block with `BV = 32` value
columns takes 41,920 bytes at C 16 (`shared_bytes`), its arrays at C 32 77,696, with
value blocks of 64 at C 16 54,208.

q and k are staged as float16 (normalised as the per-token kernel normalises them: the
lanes' own `rnorm` over the same float32 values, which the log keeps), a warp a token,
its gate row beside them; once `A` and `P` are summed from them, each element is scaled
in place into `K . exp(G)`, `Q . exp(G)` and a third tile `K . exp(G_C - G)`. A
sequence's tokens past its last chunk's end are zero rows (`beta = g = 0`): they add
nothing and decay nothing.

Column `j` of the state evolves alone, so a block is (run, head, block of `BV` value
columns): grid `(n_runs, H, Dv / BV)`, `THREADS` threads, `BV` as `chunked`'s
(`chunked.value_block`). The blocks of a run write the log rows of its new positions
as the per-token kernel would have, bit for bit: `log_v` of its columns; block 0
`log_k` and `log_b`; the gate's channel `c` block `c % (Dv / BV)` (spread over the
blocks, and no branch LLVM would hoist out of the staging loop). Replays (rewinds,
clones, prefix snapshots) from the log are therefore the per-token kernel's; the state
the chunked kernel leaves is the float32 one of the chunked order of sums (float16
operands), within 2e-3 of the largest value of the exact one (about 6e-4 seen).

The caller (`recurrence.RecurrentStep`, for `delta_rule.apply`) first runs the
per-token kernel over these runs up to their first new position (`replay_only`),
then this kernel, then the marks. It takes `Dk` and `Dv` multiples of 16, `Dk <= 128`,
and plans whose chunked runs have at least `CHUNK` new tokens (`fits`), a run of any
length `CHUNK` tokens at a time.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ...arith.positions import POS_START, Q_LEN, Q_START
from ...arith.state_runs import RUN_COL, RUN_HI, RUN_LO
from ...device import SIMULATOR, cuda
from ..intrinsics import ptx
from ..launch.calling import Specialised, ceil_div
from ..masks import storage_row
from .chunked import MAX_DK, PAD, SHARED_LIMIT, THREADS, WARPS, value_block
from .lanes import WARP, lane_functions
from .tiles import TILE, product, tile_col, tile_row

from numba import float32, int32  # noqa: E402  (after kvnumba.device chose the target)

#: tokens a chunk: one diagonal block, whose `A` and `P` are exact float32 sums
CHUNK = TILE
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
LOG2E = np.float32(1.0 / np.log(2.0))


def shared_bytes(dk: int, dv: int) -> int:
    """Static shared memory of a block (the kernel's arrays)."""
    bv = value_block(dv)
    halves = 3 * CHUNK * (dk + PAD) + dk * (bv + PAD) + 2 * CHUNK * (bv + PAD) + \
        2 * CHUNK * (CHUNK + PAD)
    words = CHUNK * (dk + 1) + CHUNK * bv + 2 * CHUNK * CHUNK + WARPS * dk + 2 * CHUNK
    return 2 * halves + 4 * words


def loop_trips(dk: int, dv: int) -> tuple:
    """The most trips of each loop inside a chunk the compiled kernel keeps (LLVM
    unrolls the rest), in address order: the walk over a run's segments (counted as
    one), the q/k/gate rows a warp stages, the state elements (`("LD", n)`: `n` loads in
    all, the loop unrolled in part), a thread's two pairs' sums over the channels (the
    pairs' loop unrolled: one loop each, `("MUFU", n)`: an `ex2` a channel), the rows of
    `T`'s forward substitution, the elements a thread scales (two `ex2` each), the
    state's tiles a warp updates."""
    bv = value_block(dv)
    elements = CHUNK * dk // THREADS
    return (1, CHUNK // WARPS, ("LD", dk * bv // THREADS), ("MUFU", dk), ("MUFU", dk), CHUNK,
            ("MUFU", 2 * elements), ceil_div(dk // TILE * (bv // TILE), WARPS))


def fits(dk: int, dv: int, chunk: int) -> bool:
    """Whether the kernel takes heads of `dk` x `dv` for a plan whose chunked runs have at
    least `chunk` new tokens."""
    return (dk % TILE == 0 and dv % TILE == 0 and 0 < dk <= MAX_DK and chunk >= CHUNK
            and shared_bytes(dk, dv) <= SHARED_LIMIT)


def _kernels(dk: int, dv: int):
    """The kernel of heads of `dk` keys and `dv` values (module doc). Every loop inside a
    chunk but the walk over a run's segments has a compile-time trip count, counted in
    int32 where LLVM should unroll it whole (`loop_trips` lists those it keeps)."""
    bv = value_block(dv)
    kp, sp, tp = dk + PAD, bv + PAD, CHUNK + PAD        # pitches of the float16 tiles
    qk_size, s_size, v_size, t_size = CHUNK * kp, dk * sp, CHUNK * sp, CHUNK * tp
    gp = dk + 1                           # the gate tile's pitch: a column's rows in
    gate_size, vf_size, rows_size = CHUNK * gp, CHUNK * bv, WARPS * dk  # distinct banks
    square = CHUNK * CHUNK
    last = (CHUNK - 1) * gp                             # G_C's row in the gate tile
    blocks = dv // bv
    rnorm = lane_functions(dk, dv, True, 1).rnorm
    k_s = product(False, False, dk)       # (K . b) S, (Q . b) S
    t_r = product(False, False, CHUNK)    # T R, P D
    kt_d = product(True, False, CHUNK)    # (K . e)^T D
    v_tiles = bv // TILE
    tall = dk // TILE * v_tiles
    lane_rows, warp_rows = ceil_div(dk, WARP), CHUNK // WARPS
    v_rounds, g_rounds = CHUNK * bv // THREADS, CHUNK * dk // THREADS
    s_rounds, s_step = dk * bv // THREADS, THREADS // bv
    pair_rounds, tall_rounds = CHUNK * CHUNK // THREADS, ceil_div(tall, WARPS)
    bounds = {} if SIMULATOR else {"launch_bounds": (THREADS,)}

    @cuda.jit(device=True)
    def stage_row(x, token, h, x_h, t, row, lane, qk_l2norm, log_k, col, log_row, log):
        """Row `t` of a float16 tile from token `token`'s q or k (normalised with the
        per-token kernel's `rnorm` when asked; into the log when `log`); one warp, each
        lane reading back only the elements of `row` it wrote."""
        r = int32(0)
        while r < lane_rows:
            i = r * WARP + lane
            if dk % WARP == 0 or i < dk:
                row[i] = ptx.to_f32(x[token, h, i])
            r = int32(r + 1)
        f = rnorm(row) if qk_l2norm else ONE
        r = int32(0)
        while r < lane_rows:
            i = r * WARP + lane
            if dk % WARP == 0 or i < dk:
                y = float32(row[i] * f) if qk_l2norm else row[i]
                x_h[t * kp + i] = ptx.from_f32(y, x_h)
                if log:
                    log_k[col, log_row, h, i] = y
            r = int32(r + 1)

    @cuda.jit(device=True)
    def pair_sums(q_h, k_h, g_f, t, s):
        """`(sum_c k_tc k_sc exp(G_tc - G_sc), sum_c q_tc k_sc exp(G_tc - G_sc))` in
        channel order (`t >= s`: every factor a decay, at most 1; `g_f` holds `G` in
        base-2 units), over views of the rows: each index a non-negative count."""
        k_t, q_t, k_s = k_h[t * kp:], q_h[t * kp:], k_h[s * kp:]
        g_t, g_s = g_f[t * gp:], g_f[s * gp:]
        a, p = ZERO, ZERO
        c = int32(0)
        while c < dk:
            w = float32(ptx.to_f32(k_s[c]) * ptx.exp2_approx(float32(g_t[c] - g_s[c])))
            a = float32(a + float32(ptx.to_f32(k_t[c]) * w))
            p = float32(p + float32(ptx.to_f32(q_t[c]) * w))
            c = int32(c + 1)
        return a, p

    @cuda.jit(device=True)
    def substitute(a_f, x_f, t_h, b_f, tid):
        """Column `tid` of `T = (I + A)^{-1}` (`A` strictly lower, its upper triangle
        zeros, in `a_f`) by forward substitution into `x_f[r, tid]`, cleared first:
        `x_r = [r == tid]` for `r <= tid`, else `-sum_j A[r, j] x_j` over every `j` (the
        sum unrolled, no predicate: `A[r, j] = 0` for `j >= r`; `A[r, j]` one broadcast
        load for the 16 columns, `x_j` each lane its own bank); `T diag(beta)` into
        `t_h`."""
        b = b_f[tid]
        for j in range(CHUNK):
            x_f[j * CHUNK + tid] = ZERO
        r = int32(0)
        while r < CHUNK:
            y = ZERO
            for j in range(CHUNK):
                y = float32(y + float32(a_f[r * CHUNK + j] * x_f[j * CHUNK + tid]))
            xr = -y if r > tid else ONE if r == tid else ZERO
            x_f[r * CHUNK + tid] = xr
            t_h[r * tp + tid] = ptx.from_f32(float32(xr * b), t_h)
            r = int32(r + 1)

    @cuda.jit(**bounds)
    def chunk_kernel(state, base, log_k, log_v, log_g, log_b, marks, q, k, v, g, beta,
                     unused5, unused6, out, runs, order, seq_info, first, scale, unused_f1,
                     qk_l2norm, has_beta):
        """Block (first + run, head, value block): the run's new positions, chunk by
        chunk (module doc); the step kernel's arguments (`recurrence.RecurrentStep`),
        `base` and `marks` unread."""
        run, h, vb = first + cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = int32(cuda.threadIdx.x)
        warp, lane = int32(tid // WARP), int32(tid % WARP)
        j0 = int32(vb * bv)
        log_rows = log_k.shape[1]
        k_h = cuda.shared.array(qk_size, np.float16, alignment=16)   # K, then K . exp(G)
        q_h = cuda.shared.array(qk_size, np.float16, alignment=16)   # Q, then Q . exp(G)
        e_h = cuda.shared.array(qk_size, np.float16, alignment=16)   # K . exp(G_C - G)
        s_h = cuda.shared.array(s_size, np.float16, alignment=16)
        r_h = cuda.shared.array(v_size, np.float16, alignment=16)    # V - (K . b) S
        d_h = cuda.shared.array(v_size, np.float16, alignment=16)    # D
        t_h = cuda.shared.array(t_size, np.float16, alignment=16)    # T diag(beta)
        p_h = cuda.shared.array(t_size, np.float16, alignment=16)    # P
        g_f = cuda.shared.array(gate_size, float32)                  # g, then G
        v_f = cuda.shared.array(vf_size, float32)
        a_f = cuda.shared.array(square, float32)                     # A
        x_f = cuda.shared.array(square, float32)                     # T
        rows = cuda.shared.array(rows_size, float32)
        b_f = cuda.shared.array(CHUNK, float32)                      # beta
        tok = cuda.shared.array(CHUNK, int32)
        col, lo, hi = runs[run, RUN_COL], runs[run, RUN_LO], runs[run, RUN_HI]
        end_seg = order[hi - 1]
        p0 = seq_info[order[lo], POS_START]
        n_new = int32(seq_info[end_seg, POS_START] + seq_info[end_seg, Q_LEN] - p0)
        row = rows[warp * dk:]
        s_row, s_col = int32(tid // bv), int32(tid % bv)
        columns = ptx.elements_from(state, ((col * state.shape[1] + h) * dk) * dv + j0)
        mine = ptx.elements_from(state, (((col * state.shape[1] + h) * dk + s_row) * dv
                                         + j0 + s_col))
        c0 = int32(0)
        while c0 < n_new:
            n_in = min(CHUNK, n_new - c0)
            if tid < n_in:                    # this token's row: its segment's
                seg, at = lo, c0 + tid
                while at >= seq_info[order[seg], Q_LEN]:
                    at -= seq_info[order[seg], Q_LEN]
                    seg += 1
                tok[tid] = seq_info[order[seg], Q_START] + at
            cuda.syncthreads()
            # ---- inputs: q, k (the log's k), v, g, beta; the state's float16 copy
            i = int32(0)
            while i < warp_rows:
                t = warp + i * WARPS
                if t < n_in:
                    token, at = tok[t], storage_row(p0 + c0 + t, log_rows)
                    stage_row(k, token, h, k_h, t, row, lane, qk_l2norm, log_k, col, at,
                              vb == 0)
                    stage_row(q, token, h, q_h, t, row, lane, qk_l2norm, log_k, col, at,
                              False)
                    r = int32(0)
                    while r < lane_rows:      # the gate; a channel's log: one block's
                        x = r * WARP + lane
                        if dk % WARP == 0 or x < dk:
                            y = ptx.to_f32(g[token, h, x])
                            if x % blocks == vb:
                                log_g[col, at, h, x] = y
                            g_f[t * gp + x] = y
                        r = int32(r + 1)
                else:
                    r = int32(0)
                    while r < lane_rows:
                        x = r * WARP + lane
                        if dk % WARP == 0 or x < dk:
                            k_h[t * kp + x] = ptx.from_f32(ZERO, k_h)
                            q_h[t * kp + x] = ptx.from_f32(ZERO, q_h)
                            g_f[t * gp + x] = ZERO
                        r = int32(r + 1)
                i = int32(i + 1)
            i = int32(0)
            while i < v_rounds:
                x = i * THREADS + tid
                t, c = int32(x // bv), int32(x % bv)
                y = ZERO
                if t < n_in:
                    y = ptx.to_f32(v[tok[t], h, j0 + c])
                    log_v[col, storage_row(p0 + c0 + t, log_rows), h, j0 + c] = y
                v_f[x] = y
                i = int32(i + 1)
            if tid < CHUNK:
                b = ZERO
                if tid < n_in:
                    b = ptx.to_f32(beta[tok[tid], h]) if has_beta else ONE
                    if vb == 0:
                        log_b[col, storage_row(p0 + c0 + tid, log_rows), h] = b
                b_f[tid] = b
            for i in range(s_rounds):
                s_h[(s_row + i * s_step) * sp + s_col] = ptx.from_f32(
                    ptx.to_f32(mine[i * s_step * dv]), s_h)
            cuda.syncthreads()
            if tid < dk:                      # G: channel tid's cumulative log-decay,
                y = ZERO                      # in base-2 units
                t = int32(0)
                while t < CHUNK:
                    y = float32(y + g_f[t * gp + tid])
                    g_f[t * gp + tid] = float32(y * LOG2E)
                    t = int32(t + 1)
            cuda.syncthreads()
            # ---- A (read with beta only) and P, exact float32 sums: a thread a pair
            # (t, s), their upper triangles zeros (a pair there sums its transpose's)
            i = int32(0)
            while i < pair_rounds:
                x = i * THREADS + tid
                t, s = int32(x // CHUNK), int32(x % CHUNK)
                a, y = pair_sums(q_h, k_h, g_f, max(t, s), min(t, s))
                a_f[t * CHUNK + s] = float32(b_f[t] * a) if s < t else ZERO
                p_h[t * tp + s] = ptx.from_f32(y if s <= t else ZERO, p_h)
                i = int32(i + 1)
            cuda.syncthreads()
            # ---- T; the scaled operands, in place (each thread its own elements)
            if has_beta and tid < CHUNK:
                substitute(a_f, x_f, t_h, b_f, tid)
            i = int32(0)
            while i < g_rounds:
                x = i * THREADS + tid
                t, c = int32(x // dk), int32(x % dk)
                at, gt = t * kp + c, g_f[t * gp + c]
                kt, b = ptx.to_f32(k_h[at]), ptx.exp2_approx(gt)
                k_h[at] = ptx.from_f32(float32(kt * b), k_h)
                q_h[at] = ptx.from_f32(float32(ptx.to_f32(q_h[at]) * b), q_h)
                e_h[at] = ptx.from_f32(
                    float32(kt * ptx.exp2_approx(float32(g_f[last + c] - gt))), e_h)
                i = int32(i + 1)
            cuda.syncthreads()
            # ---- D: the chunk's additions (warp w: value columns 16 w ..)
            n0 = int32(warp * TILE)
            if has_beta:
                if warp < v_tiles:             # R = V - (K . exp(G)) S
                    acc = k_s(k_h, kp, s_h, sp, 0, n0, lane)
                    e = int32(0)
                    while e < 8:
                        r, c = tile_row(e, lane), n0 + tile_col(e, lane)
                        r_h[r * sp + c] = ptx.from_f32(float32(v_f[r * bv + c] - acc[e]), r_h)
                        e = int32(e + 1)
                cuda.syncthreads()
                if warp < v_tiles:             # D = T diag(beta) R
                    acc = t_r(t_h, tp, r_h, sp, 0, n0, lane)
                    e = int32(0)
                    while e < 8:
                        d_h[tile_row(e, lane) * sp + n0 + tile_col(e, lane)] = \
                            ptx.from_f32(acc[e], d_h)
                        e = int32(e + 1)
            else:
                i = int32(0)
                while i < v_rounds:            # D = V
                    x = i * THREADS + tid
                    d_h[(x // bv) * sp + x % bv] = ptx.from_f32(v_f[x], d_h)
                    i = int32(i + 1)
            cuda.syncthreads()
            # ---- O = scale ((Q . exp(G)) S + P D); S' = diag(exp(G_C)) S + (K . e)^T D
            if warp < v_tiles:
                qs = k_s(q_h, kp, s_h, sp, 0, n0, lane)
                pd = t_r(p_h, tp, d_h, sp, 0, n0, lane)
                e = int32(0)
                while e < 8:
                    r = tile_row(e, lane)
                    if r < n_in:
                        out[tok[r], h, j0 + n0 + tile_col(e, lane)] = ptx.from_f32(
                            float32(float32(qs[e] + pd[e]) * scale), out)
                    e = int32(e + 1)
            i = int32(0)
            while i < tall_rounds:
                tile = warp + i * WARPS
                if tile < tall:
                    m0, n1 = int32(tile // v_tiles * TILE), int32(tile % v_tiles * TILE)
                    acc = kt_d(e_h, kp, d_h, sp, m0, n1, lane)
                    e = int32(0)
                    while e < 8:
                        r = m0 + tile_row(e, lane)
                        at = r * dv + n1 + tile_col(e, lane)
                        columns[at] = ptx.from_f32(float32(float32(
                            ptx.exp2_approx(g_f[last + r]) * ptx.to_f32(columns[at]))
                            + acc[e]), columns)
                        e = int32(e + 1)
                i = int32(i + 1)
            cuda.syncthreads()
            c0 += CHUNK

    return Specialised(chunk_kernel)


kernel = lru_cache(maxsize=None)(_kernels)
