"""The gated delta rule's chunked form for long segments (a prefill), its products on
the tensor cores: the same recurrence as `delta_rule`'s per-token kernel (its module
doc), over chunks of `C` new tokens of one sequence at a time, a per-head gate.

Within a chunk of tokens `1..C` from the state `S` (`[Dk, Dv]`, float32), with `G_t`
the cumulative log-decay of tokens `1..t` (`b_t = exp(G_t)`), the state after token `t`
is `b_t S + sum_{s<=t} exp(G_t - G_s) k_s d_s^T`, where `d_s` is what token `s` adds
(`d_s = beta_s (v_s - (decayed S)^T k_s)` with beta, `v_s` without). Written out:

    A = strictly-lower(diag(beta) (K K^T . Gamma)),  Gamma[t, s] = exp(G_t - G_s)
    T = (I + A)^{-1} diag(beta)                        (forward substitution, float32)
    D = T (V - diag(b) K S)                            (without beta: D = V)
    O = scale (diag(b) Q S + (Q K^T . Gamma . causal) D)
    S' = b_C S + K^T diag(exp(G_C - G)) D

(`D = U - W S` of the WY form with `U = T V`, `W = T diag(b) K`, multiplied out in the
other order: a `[C, Dv]` product in place of a `[C, Dk]` one). `K K^T`, `K S`, `T (..)`,
`Q K^T`, `Q S`, `(..) D` and `K^T (..)` are `mma.m16n8k16` products of float16 tiles
into float32 (`tiles`); the state stays float32 in `state`, read once a chunk (its
float16 copy the products take) and updated in place; the gates, the decays and `T`
are float32. A sequence's tokens past its last chunk's end are zero rows (`beta = g =
0`): they add nothing and decay nothing.

Column `j` of the state evolves alone, so a block is (run, head, block of `BV` value
columns): grid `(n_runs, H, Dv / BV)`, `THREADS` threads. Every block of a run writes
the log rows of its new positions as the per-token kernel would have (`log_v` of its
columns; block 0 `log_k`, `log_g` and `log_b`), bit for bit: k normalised by the
lanes' own `rnorm` over the same float32 values, so replays (rewinds, clones, prefix
snapshots) from the log stay exact. The state it leaves is the float32 one of the
chunked order of sums (float16 operands), not the per-token kernel's bits.

The caller (`delta_rule.DeltaStep`) first runs the per-token kernel over these runs up
to their first new position (`replay_only`: the base advance and a rewind's replay,
from the log), leaving the state at `p0` in `state`, then this kernel, then the marks.
It takes per-head gates, `Dk` and `Dv` multiples of 16, `Dk <= 128`, `C` a multiple
of 16 (`fits`); everything else stays on the per-token kernel.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ...arith.positions import POS_START, Q_LEN, Q_START
from ...arith.state_runs import RUN_COL, RUN_HI, RUN_LO
from ...device import SIMULATOR, cuda
from ..intrinsics import ptx
from ..launch.calling import Specialised
from ..masks import storage_row
from .lanes import WARP, lane_functions
from .tiles import TILE, product, tile_col, tile_row

from numba import float32, int32  # noqa: E402  (after kvnumba.device chose the target)
from numba.core.types import float16  # noqa: E402

#: tokens a chunk: 32 keeps a d128 block's tiles within the 48 KiB of static shared
#: memory a Numba kernel may have (`shared_bytes`), 64 would need 76 KiB
CHUNK = 32
WARPS = 4
THREADS = WARPS * WARP
#: float16 elements padding every tile row, so the 8 rows an ldmatrix reads fall in
#: different bank groups
PAD = 8
SHARED_LIMIT = 48 * 1024
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
MAX_DK = 128


def value_block(dv: int) -> int:
    """Value columns of a block: 32 where they divide `Dv`, else 16."""
    return 32 if dv % 32 == 0 else TILE


def shared_bytes(dk: int, dv: int, chunk: int) -> int:
    """Static shared memory of a block (the kernel's arrays)."""
    bv = value_block(dv)
    halves = 2 * chunk * (dk + PAD) + dk * (bv + PAD) + 3 * chunk * (bv + PAD) + \
        chunk * (chunk + PAD)
    words = chunk * bv + chunk * chunk + WARPS * dk + 3 * chunk + 2
    return 2 * halves + 4 * words


def fits(dk: int, dv: int, per_channel: bool, chunk: int) -> bool:
    """Whether the chunked kernel takes heads of `dk` x `dv` with this gate and chunk."""
    return (not per_channel and dk % TILE == 0 and dv % TILE == 0 and dk <= MAX_DK
            and chunk % TILE == 0 and chunk > 0
            and shared_bytes(dk, dv, chunk) <= SHARED_LIMIT)


@cuda.jit(device=True)
def _exp(x):
    return float32(math.exp(x))


def _kernels(dk: int, dv: int, chunk: int):
    """The chunked kernel of heads of `dk` keys and `dv` values, chunks of `chunk`
    tokens (module doc)."""
    bv = value_block(dv)
    kp, sp, tp = dk + PAD, bv + PAD, chunk + PAD        # pitches of the float16 tiles
    rnorm = lane_functions(dk, dv, False, 1).rnorm
    ab_t = product(False, True)        # A @ B^T: K K^T, Q K^T
    ab = product(False, False)         # A @ B: K S, T R, Q S, P D
    at_b = product(True, False)        # A^T @ B: K^T D
    c_tiles, v_tiles, k_tiles = chunk // TILE, bv // TILE, dk // TILE
    bounds = {} if SIMULATOR else {"launch_bounds": (THREADS,)}

    @cuda.jit(device=True)
    def stage_rows(x, token, h, x_h, t, row, lane, qk_l2norm, log_k, col, log_row, log):
        """Row `t` of a float16 tile from token `token`'s q or k (normalised with the
        per-token kernel's `rnorm` when asked; into the log when `log`); one warp, each
        lane reading back only the elements of `row` it wrote."""
        i = lane
        while i < dk:
            row[i] = ptx.to_f32(x[token, h, i])
            i += WARP
        r = rnorm(row) if qk_l2norm else ONE
        i = lane
        while i < dk:
            y = float32(row[i] * r) if qk_l2norm else row[i]
            x_h[t * kp + i] = ptx.from_f32(y, x_h)
            if log:
                log_k[col, log_row, h, i] = y
            i += WARP

    @cuda.jit(**bounds)
    def chunk_kernel(state, log_k, log_v, log_g, log_b, q, k, v, g, beta, out, runs, order,
                     seq_info, first, scale, qk_l2norm, has_beta):
        """Block (run, head, value block): the run's new positions, chunk by chunk."""
        run, h, vb = first + cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = int32(cuda.threadIdx.x)
        warp, lane = int32(tid // WARP), int32(tid % WARP)
        j0 = int32(vb * bv)
        log_rows = log_k.shape[1]
        k_h = cuda.shared.array(chunk * kp, float16, alignment=16)
        q_h = cuda.shared.array(chunk * kp, float16, alignment=16)
        s_h = cuda.shared.array(dk * sp, float16, alignment=16)
        r_h = cuda.shared.array(chunk * sp, float16, alignment=16)    # V - b K S
        d_h = cuda.shared.array(chunk * sp, float16, alignment=16)    # D
        e_h = cuda.shared.array(chunk * sp, float16, alignment=16)    # exp(G_C - G) D
        t_h = cuda.shared.array(chunk * tp, float16, alignment=16)    # T, then Q K^T
        v_f = cuda.shared.array(chunk * bv, float32)
        a_f = cuda.shared.array(chunk * chunk, float32)               # A, then T
        rows = cuda.shared.array(WARPS * dk, float32)
        g_f = cuda.shared.array(chunk, float32)                       # G
        b_f = cuda.shared.array(chunk, float32)                       # beta
        tok = cuda.shared.array(chunk, int32)
        cursor = cuda.shared.array(2, int32)
        col = runs[run, RUN_COL]
        lo, last = runs[run, RUN_LO], order[runs[run, RUN_HI] - 1]
        p0 = seq_info[order[lo], POS_START]
        n_new = int32(seq_info[last, POS_START] + seq_info[last, Q_LEN] - p0)
        if tid == 0:
            cursor[0], cursor[1] = lo, 0
        c0 = int32(0)
        while c0 < n_new:
            n_in = min(chunk, n_new - c0)
            if tid == 0:                      # the chunk's tokens, segment by segment
                seg, offset = cursor[0], cursor[1]
                for t in range(chunk):
                    if t < n_in:
                        segment = order[seg]
                        while offset >= seq_info[segment, Q_LEN]:
                            seg += 1
                            offset = 0
                            segment = order[seg]
                        tok[t] = seq_info[segment, Q_START] + offset
                        offset += 1
                cursor[0], cursor[1] = seg, offset
            cuda.syncthreads()
            # ---- inputs: q, k (the log's k), v, g, beta; the state's float16 copy
            row = rows[warp * dk:]
            t = warp
            while t < chunk:
                if t < n_in:
                    token, at = tok[t], storage_row(p0 + c0 + t, log_rows)
                    stage_rows(k, token, h, k_h, t, row, lane, qk_l2norm, log_k, col, at,
                               vb == 0)
                    stage_rows(q, token, h, q_h, t, row, lane, qk_l2norm, log_k, col, at,
                               False)
                else:
                    i = lane
                    while i < dk:
                        k_h[t * kp + i] = ptx.from_f32(ZERO, k_h)
                        q_h[t * kp + i] = ptx.from_f32(ZERO, q_h)
                        i += WARP
                t += WARPS
            i = tid
            while i < chunk * bv:
                t, c = int32(i // bv), int32(i % bv)
                x = ZERO
                if t < n_in:
                    x = ptx.to_f32(v[tok[t], h, j0 + c])
                    log_v[col, storage_row(p0 + c0 + t, log_rows), h, j0 + c] = x
                v_f[i] = x
                i += THREADS
            if tid < chunk:
                x, b = ZERO, ZERO
                if tid < n_in:
                    token, at = tok[tid], storage_row(p0 + c0 + tid, log_rows)
                    x = ptx.to_f32(g[token, h])
                    b = ptx.to_f32(beta[token, h]) if has_beta else ONE
                    if vb == 0:
                        log_g[col, at, h, 0] = x
                        log_b[col, at, h] = b
                g_f[tid], b_f[tid] = x, b
            i = tid
            while i < dk * bv:
                r, c = int32(i // bv), int32(i % bv)
                s_h[r * sp + c] = ptx.from_f32(state[col, h, r, j0 + c], s_h)
                i += THREADS
            cuda.syncthreads()
            if tid == 0:                      # G: the cumulative log-decay
                acc = ZERO
                for t in range(chunk):
                    acc = float32(acc + g_f[t])
                    g_f[t] = acc
            cuda.syncthreads()
            g_last = g_f[chunk - 1]
            # ---- D: the chunk's additions
            if has_beta:
                tile = warp
                while tile < c_tiles * c_tiles:         # A, the lower tiles
                    m0, n0 = int32(tile // c_tiles * TILE), int32(tile % c_tiles * TILE)
                    if n0 <= m0:
                        acc8 = ab_t(k_h, kp, k_h, kp, m0, n0, dk, lane)
                        for e in range(8):
                            r, c = m0 + tile_row(e, lane), n0 + tile_col(e, lane)
                            if c < r:
                                a_f[r * chunk + c] = float32(
                                    float32(b_f[r] * _exp(float32(g_f[r] - g_f[c]))) * acc8[e])
                    tile += WARPS
                tile = warp
                while tile < c_tiles * v_tiles:         # R = V - diag(b) K S
                    m0, n0 = int32(tile // v_tiles * TILE), int32(tile % v_tiles * TILE)
                    acc8 = ab(k_h, kp, s_h, sp, m0, n0, dk, lane)
                    for e in range(8):
                        r, c = m0 + tile_row(e, lane), n0 + tile_col(e, lane)
                        r_h[r * sp + c] = ptx.from_f32(
                            float32(v_f[r * bv + c] - float32(_exp(g_f[r]) * acc8[e])), r_h)
                    tile += WARPS
                cuda.syncthreads()
                for r in range(1, chunk):               # T = (I + A)^{-1}, row by row
                    x = ZERO
                    if tid < r:
                        x = a_f[r * chunk + tid]
                        for j in range(tid + 1, r):
                            x = float32(x + float32(a_f[r * chunk + j] * a_f[j * chunk + tid]))
                    cuda.syncthreads()
                    if tid < r:
                        a_f[r * chunk + tid] = -x
                    cuda.syncthreads()
                i = tid
                while i < chunk * chunk:                # T diag(beta), float16
                    r, c = int32(i // chunk), int32(i % chunk)
                    x = ZERO
                    if c < r:
                        x = float32(a_f[i] * b_f[c])
                    elif c == r:
                        x = b_f[c]
                    t_h[r * tp + c] = ptx.from_f32(x, t_h)
                    i += THREADS
                cuda.syncthreads()
                tile = warp
                while tile < c_tiles * v_tiles:         # D = T diag(beta) R
                    m0, n0 = int32(tile // v_tiles * TILE), int32(tile % v_tiles * TILE)
                    acc8 = ab(t_h, tp, r_h, sp, m0, n0, m0 + TILE, lane)
                    for e in range(8):
                        r, c = m0 + tile_row(e, lane), n0 + tile_col(e, lane)
                        d_h[r * sp + c] = ptx.from_f32(acc8[e], d_h)
                        e_h[r * sp + c] = ptx.from_f32(
                            float32(acc8[e] * _exp(float32(g_last - g_f[r]))), e_h)
                    tile += WARPS
            else:
                i = tid
                while i < chunk * bv:                   # D = V
                    r, c = int32(i // bv), int32(i % bv)
                    d_h[r * sp + c] = ptx.from_f32(v_f[i], d_h)
                    e_h[r * sp + c] = ptx.from_f32(
                        float32(v_f[i] * _exp(float32(g_last - g_f[r]))), e_h)
                    i += THREADS
            cuda.syncthreads()
            # ---- P = Q K^T . Gamma . causal, into t_h's lower tiles
            tile = warp
            while tile < c_tiles * c_tiles:
                m0, n0 = int32(tile // c_tiles * TILE), int32(tile % c_tiles * TILE)
                if n0 <= m0:
                    acc8 = ab_t(q_h, kp, k_h, kp, m0, n0, dk, lane)
                    for e in range(8):
                        r, c = m0 + tile_row(e, lane), n0 + tile_col(e, lane)
                        x = ZERO
                        if c <= r:
                            x = float32(acc8[e] * _exp(float32(g_f[r] - g_f[c])))
                        t_h[r * tp + c] = ptx.from_f32(x, t_h)
                tile += WARPS
            cuda.syncthreads()
            # ---- O = scale (diag(b) Q S + P D); S' = b_C S + K^T diag(exp(G_C - G)) D
            tile = warp
            while tile < c_tiles * v_tiles:
                m0, n0 = int32(tile // v_tiles * TILE), int32(tile % v_tiles * TILE)
                qs = ab(q_h, kp, s_h, sp, m0, n0, dk, lane)
                pd = ab(t_h, tp, d_h, sp, m0, n0, m0 + TILE, lane)
                for e in range(8):
                    r, c = m0 + tile_row(e, lane), n0 + tile_col(e, lane)
                    if r < n_in:
                        o = float32(float32(_exp(g_f[r]) * qs[e]) + pd[e])
                        out[tok[r], h, j0 + c] = ptx.from_f32(float32(o * scale), out)
                tile += WARPS
            decay = _exp(g_last)
            tile = warp
            while tile < k_tiles * v_tiles:
                m0, n0 = int32(tile // v_tiles * TILE), int32(tile % v_tiles * TILE)
                acc8 = at_b(k_h, kp, e_h, sp, m0, n0, chunk, lane)
                for e in range(8):
                    r, c = m0 + tile_row(e, lane), j0 + n0 + tile_col(e, lane)
                    state[col, h, r, c] = float32(float32(decay * state[col, h, r, c]) + acc8[e])
                tile += WARPS
            cuda.syncthreads()
            c0 += chunk

    return Specialised(chunk_kernel)


kernel = lru_cache(maxsize=None)(_kernels)
