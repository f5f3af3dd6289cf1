"""The recurrence's chunked form for long segments (a prefill), its products on the
tensor cores: the same recurrence as the per-token step kernel (`recurrence`'s module
doc), over chunks of `C` new tokens of one sequence at a time, a per-head gate. Both
ops take it: the gated delta rule (`delta_rule`) and Mamba2's SSD (`ssd`: the
decay-only recurrence, `k = B_g`, `q = C_g`, `v = d x_h`, its state transposed); an
`Entry` of device functions says how an op's tokens enter and its output leaves, as
the step kernel's `taken` and `emit` do.

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
into float32 (`tiles`); the state stays in `state` (float32, or bfloat16 rounded at
each update), read once a chunk (its float16 copy the products take) and updated in
place; the gates, the decays and `T`
are float32. A sequence's tokens past its last chunk's end are zero rows (`beta = g =
0`): they add nothing and decay nothing.

Column `j` of the state evolves alone, so a block is (run, head, block of `BV` value
columns): grid `(n_runs, H, Dv / BV)`, `THREADS` threads. Every block of a run writes
the log rows of its new positions as the per-token kernel would have (`log_v` of its
columns; block 0 `log_k`, `log_g` and, where the op logs beta, `log_b`), bit for bit:
k normalised by the lanes' own `rnorm` over the same float32 values, so replays
(rewinds, clones, prefix snapshots) from the log stay exact. The state it leaves is
that of the chunked order of sums (float16 operands), not the per-token kernel's bits.

The caller (`recurrence.RecurrentStep`, for the op's `apply`) first runs the
per-token kernel over these runs up to their first new position (`replay_only`: the
base advance and a rewind's replay, from the log), leaving the state at `p0` in
`state`, then this kernel, then the marks.
It takes per-head gates, `Dk` and `Dv` multiples of 16, `Dk <= 128`, `C` a multiple
of 16 up to `THREADS` (`fits`); everything else stays on the per-token kernel, except
Kimi's per-channel gate (its `Gamma` differs per key channel), which the delta rule
takes on a chunked kernel of its own (`chunked_channel`).
"""
from __future__ import annotations

import math
from typing import NamedTuple

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


class Entry(NamedTuple):
    """How an op's new tokens enter the chunked kernel and its output leaves: device
    functions over the step kernel's seven inputs `in0 .. in6` (`recurrence`), and what
    the op's per-token kernel logs and how it keeps its state, so that both write the
    same log rows and state layout.

    `gate(in0 .. in6, token, h, f0, f1, option, has_beta) -> (g, beta, w)`: the token's
    log-decay, beta (1 without) and the factor its values enter with; `row(in0 .. in6,
    token, h, i, query) -> float32`: entry `i` of its k (q when `query`); `value(in0 ..
    in6, token, h, j, w) -> float32`: its value `j` (`w` from `gate`); `emit(o, in0 ..
    in6, token, h, j, f0) -> float32`: output `j` from `o = S^T q` (with its decay).
    `normalises`: q and k l2-normalised when `option`; `logs_beta`: beta into `log_b`;
    `weighted`: `w` is read (values wait for the gates); `transposed`: the state stored
    `[H, Dv, Dk]`."""

    gate: object
    row: object
    value: object
    emit: object
    normalises: bool
    logs_beta: bool
    weighted: bool
    transposed: bool


def value_block(dv: int) -> int:
    """Value columns of a block: 32 where they divide `Dv`, else 16."""
    return 32 if dv % 32 == 0 else TILE


def shared_bytes(dk: int, dv: int, chunk: int) -> int:
    """Static shared memory of a block (the kernel's arrays)."""
    bv = value_block(dv)
    halves = 2 * chunk * (dk + PAD) + dk * (bv + PAD) + 3 * chunk * (bv + PAD) + \
        chunk * (chunk + PAD)
    words = chunk * bv + chunk * chunk + WARPS * dk + 4 * chunk
    return 2 * halves + 4 * words


def loop_trips(dk: int, dv: int, chunk: int, entry: Entry) -> tuple:
    """The most trips of each loop inside a chunk the compiled kernel of the op entering
    through `entry` keeps (LLVM unrolls the rest), in address order: a count, or
    `(opcode, n)`: `n` of that instruction in all, over those a trip holds. The walk
    over a run's segments (one segment: no trip past its test, counted as one); the q/k
    rows a warp stages; the v elements a thread stages, in two versions (one log store
    an element), of which a chunk runs one; the state elements it stages (`n` loads; a
    `transposed` state: `n` float16 stores); the rows of `T`'s forward substitution and
    the sum each takes (at most `chunk` terms, one FFMA each); a `transposed` op's
    outputs (one store each: its `emit` reads more inputs); the state's tiles a warp
    updates."""
    bv = value_block(dv)
    values, staged = _rounds(chunk * bv, THREADS), dk * bv // THREADS
    outputs = (("STG", 8 * _rounds(chunk // TILE * (bv // TILE), WARPS)),) \
        if entry.transposed else ()
    return (1, _rounds(chunk, WARPS), ("STG", values), ("STG", values),
            ("STS" if entry.transposed else "LD", staged), chunk, ("FFMA", chunk),
            *outputs, _rounds(dk // TILE * (bv // TILE), WARPS))


def fits(dk: int, dv: int, per_channel: bool, chunk: int) -> bool:
    """Whether the chunked kernel takes heads of `dk` x `dv` with this gate and chunk."""
    return (not per_channel and dk % TILE == 0 and dv % TILE == 0 and dk <= MAX_DK
            and chunk % TILE == 0 and 0 < chunk <= THREADS
            and shared_bytes(dk, dv, chunk) <= SHARED_LIMIT)


@cuda.jit(device=True)
def _exp(x):
    return float32(math.exp(x))


def _rounds(n: int, per: int) -> int:
    return -(-n // per)


def build(dk: int, dv: int, chunk: int, entry: Entry):
    """The chunked kernel of heads of `dk` keys and `dv` values, chunks of `chunk`
    tokens, for the op whose tokens enter through `entry` (module doc). Every loop inside
    a chunk but the walk over a run's segments has a compile-time trip count, counted in
    int32 where LLVM should unroll it whole (`loop_trips` lists those it keeps)."""
    bv = value_block(dv)
    kp, sp, tp = dk + PAD, bv + PAD, chunk + PAD        # pitches of the float16 tiles
    qk_size, s_size, v_size, t_size = chunk * kp, dk * sp, chunk * sp, chunk * tp
    vf_size, a_size, rows_size = chunk * bv, chunk * chunk, WARPS * dk
    rnorm = lane_functions(dk, dv, False, 1).rnorm
    gate, row_in, value_in, emit = entry.gate, entry.row, entry.value, entry.emit
    normalises, logs_beta, weighted = entry.normalises, entry.logs_beta, entry.weighted
    transposed = entry.transposed
    kk_t = product(False, True, dk)       # K K^T, Q K^T
    k_s = product(False, False, dk)       # K S, Q S
    t_r = product(False, False, chunk)    # T R, P D
    kt_d = product(True, False, chunk)    # K^T D
    c_tiles, v_tiles, k_tiles = chunk // TILE, bv // TILE, dk // TILE
    square, wide, tall = c_tiles * c_tiles, c_tiles * v_tiles, k_tiles * v_tiles
    lane_rows, warp_rows = _rounds(dk, WARP), _rounds(chunk, WARPS)
    v_rounds, s_rounds = _rounds(chunk * bv, THREADS), dk * bv // THREADS
    s_step = THREADS // bv                # rows of the state a round stages
    square_rounds, wide_rounds = _rounds(square, WARPS), _rounds(wide, WARPS)
    tall_rounds = _rounds(tall, WARPS)
    bounds = {} if SIMULATOR else {"launch_bounds": (THREADS,)}

    @cuda.jit(device=True)
    def stage_row(in0, in1, in2, in3, in4, in5, in6, query, token, h, x_h, t, row, lane,
                  normalise, log_k, col, log_row, log):
        """Row `t` of a float16 tile from token `token`'s q (`query`) or k (normalised
        with the per-token kernel's `rnorm` when `normalise`; into the log when `log`);
        one warp, each lane reading back only the elements of `row` it wrote."""
        r = int32(0)
        while r < lane_rows:
            i = r * WARP + lane
            if dk % WARP == 0 or i < dk:
                row[i] = row_in(in0, in1, in2, in3, in4, in5, in6, token, h, i, query)
            r = int32(r + 1)
        f = rnorm(row) if normalise else ONE
        r = int32(0)
        while r < lane_rows:
            i = r * WARP + lane
            if dk % WARP == 0 or i < dk:
                y = float32(row[i] * f) if normalise else row[i]
                x_h[t * kp + i] = ptx.from_f32(y, x_h)
                if log:
                    log_k[col, log_row, h, i] = y
            r = int32(r + 1)

    @cuda.jit(device=True)
    def stage_gates(in0, in1, in2, in3, in4, in5, in6, tok, n_in, tid, vb, p, log_rows,
                    log_g, log_b, col, h, g_f, b_f, w_f, f0, f1, option, has_beta):
        """The log-decay, beta and values' factor of the chunk's token `tid` (from
        position `p`; zeros past `n_in`), into the log row (block 0)."""
        if tid < chunk:
            y, b, w = ZERO, ZERO, ZERO
            if tid < n_in:
                token, at = tok[tid], storage_row(p + tid, log_rows)
                y, b, w = gate(in0, in1, in2, in3, in4, in5, in6, token, h, f0, f1, option,
                               has_beta)
                if vb == 0:
                    log_g[col, at, h, 0] = y
                    if logs_beta:
                        log_b[col, at, h] = b
            g_f[tid], b_f[tid], w_f[tid] = y, b, w

    @cuda.jit(device=True)
    def cell(r, c):
        """Element (row `r`, column `c`) of a head's block of columns, from its first."""
        return c * dk + r if transposed else r * dv + c

    @cuda.jit(**bounds)
    def chunk_kernel(state, base, log_k, log_v, log_g, log_b, marks, in0, in1, in2, in3,
                     in4, in5, in6, out, runs, order, seq_info, first, f0, f1, option,
                     has_beta):
        """Block (first + run, head, value block): the run's new positions, chunk by
        chunk (module doc); the step kernel's arguments (`recurrence.RecurrentStep`),
        `base` and `marks` unread."""
        run, h, vb = first + cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        tid = int32(cuda.threadIdx.x)
        warp, lane = int32(tid // WARP), int32(tid % WARP)
        j0 = int32(vb * bv)
        log_rows = log_k.shape[1]
        k_h = cuda.shared.array(qk_size, np.float16, alignment=16)
        q_h = cuda.shared.array(qk_size, np.float16, alignment=16)
        s_h = cuda.shared.array(s_size, np.float16, alignment=16)
        r_h = cuda.shared.array(v_size, np.float16, alignment=16)    # V - b K S
        d_h = cuda.shared.array(v_size, np.float16, alignment=16)    # D
        e_h = cuda.shared.array(v_size, np.float16, alignment=16)    # exp(G_C - G) D
        t_h = cuda.shared.array(t_size, np.float16, alignment=16)    # T, then P
        v_f = cuda.shared.array(vf_size, float32)
        a_f = cuda.shared.array(a_size, float32)                      # A; T above
        rows = cuda.shared.array(rows_size, float32)
        g_f = cuda.shared.array(chunk, float32)                       # G
        b_f = cuda.shared.array(chunk, float32)                       # beta
        w_f = cuda.shared.array(chunk, float32)                       # values' factors
        tok = cuda.shared.array(chunk, int32)
        col, lo, hi = runs[run, RUN_COL], runs[run, RUN_LO], runs[run, RUN_HI]
        last = order[hi - 1]
        p0 = seq_info[order[lo], POS_START]
        n_new = int32(seq_info[last, POS_START] + seq_info[last, Q_LEN] - p0)
        row = rows[warp * dk:]
        s_row, s_col = int32(tid // bv), int32(tid % bv)
        head = (col * state.shape[1] + h) * dk * dv
        columns = ptx.elements_from(state, head + cell(0, j0))
        if transposed:                        # the block's columns: one run of floats
            mine = ptx.elements_from(state, head + j0 * dk + tid)
        else:
            mine = ptx.elements_from(state, head + cell(s_row, j0 + s_col))
        c0 = int32(0)
        while c0 < n_new:
            n_in = min(chunk, n_new - c0)
            if tid < n_in:                    # this token's row: its segment's
                seg, at = lo, c0 + tid
                while at >= seq_info[order[seg], Q_LEN]:
                    at -= seq_info[order[seg], Q_LEN]
                    seg += 1
                tok[tid] = seq_info[order[seg], Q_START] + at
            cuda.syncthreads()
            # ---- inputs: g, beta (and the values' factors), q, k (the log's k), v; the
            # state's float16 copy
            stage_gates(in0, in1, in2, in3, in4, in5, in6, tok, n_in, tid, vb, p0 + c0,
                        log_rows, log_g, log_b, col, h, g_f, b_f, w_f, f0, f1, option,
                        has_beta)
            if weighted:
                cuda.syncthreads()
            normalise = normalises and option
            i = int32(0)
            while i < warp_rows:
                t = warp + i * WARPS
                if t < n_in:
                    token, at = tok[t], storage_row(p0 + c0 + t, log_rows)
                    stage_row(in0, in1, in2, in3, in4, in5, in6, False, token, h, k_h, t,
                              row, lane, normalise, log_k, col, at, vb == 0)
                    stage_row(in0, in1, in2, in3, in4, in5, in6, True, token, h, q_h, t,
                              row, lane, normalise, log_k, col, at, False)
                elif t < chunk:
                    r = int32(0)
                    while r < lane_rows:
                        x = r * WARP + lane
                        if dk % WARP == 0 or x < dk:
                            k_h[t * kp + x] = ptx.from_f32(ZERO, k_h)
                            q_h[t * kp + x] = ptx.from_f32(ZERO, q_h)
                        r = int32(r + 1)
                i = int32(i + 1)
            i = int32(0)
            while i < v_rounds:
                x = i * THREADS + tid
                t, c = int32(x // bv), int32(x % bv)
                y = ZERO
                if t < n_in:
                    y = value_in(in0, in1, in2, in3, in4, in5, in6, tok[t], h, j0 + c,
                                 w_f[t] if weighted else ONE)
                    log_v[col, storage_row(p0 + c0 + t, log_rows), h, j0 + c] = y
                if (chunk * bv) % THREADS == 0 or x < chunk * bv:
                    v_f[x] = y
                i = int32(i + 1)
            # the state's rows s_row + s_step i, column s_col (transposed: THREADS
            # floats a round, a column's rows adjacent), counted in int64: LLVM unrolls
            # the loop in part, fewer loads in flight than registers
            for i in range(s_rounds):
                if transposed:
                    x = i * THREADS + tid
                    s_h[(x % dk) * sp + x // dk] = ptx.from_f32(
                        ptx.to_f32(mine[i * THREADS]), s_h)
                else:
                    s_h[(s_row + i * s_step) * sp + s_col] = ptx.from_f32(
                        ptx.to_f32(mine[i * s_step * dv]), s_h)
            cuda.syncthreads()
            if tid == 0:                      # G: the cumulative log-decay
                y = ZERO
                t = int32(0)
                while t < chunk:
                    y = float32(y + g_f[t])
                    g_f[t] = y
                    t = int32(t + 1)
            cuda.syncthreads()
            g_last = g_f[chunk - 1]
            # ---- D: the chunk's additions
            if has_beta:
                i = int32(0)
                while i < square_rounds:     # A, its lower tiles
                    tile = warp + i * WARPS
                    m0, n0 = int32(tile // c_tiles * TILE), int32(tile % c_tiles * TILE)
                    if tile < square and n0 <= m0:
                        acc = kk_t(k_h, kp, k_h, kp, m0, n0, lane)
                        e = int32(0)
                        while e < 8:
                            r, c = m0 + tile_row(e, lane), n0 + tile_col(e, lane)
                            if c < r:
                                a_f[r * chunk + c] = float32(float32(
                                    b_f[r] * _exp(float32(g_f[r] - g_f[c]))) * acc[e])
                            e = int32(e + 1)
                    i = int32(i + 1)
                i = int32(0)
                while i < wide_rounds:       # R = V - diag(b) K S
                    tile = warp + i * WARPS
                    if tile < wide:
                        m0, n0 = int32(tile // v_tiles * TILE), int32(tile % v_tiles * TILE)
                        acc = k_s(k_h, kp, s_h, sp, m0, n0, lane)
                        e = int32(0)
                        while e < 8:
                            r, c = m0 + tile_row(e, lane), n0 + tile_col(e, lane)
                            r_h[r * sp + c] = ptx.from_f32(
                                float32(v_f[r * bv + c] - float32(_exp(g_f[r]) * acc[e])), r_h)
                            e = int32(e + 1)
                    i = int32(i + 1)
                cuda.syncthreads()
                if tid < chunk:       # column tid of T = (I + A)^{-1}: its rows below
                    r = int32(0)      # the diagonal into a_f's row tid (A's empty upper
                    while r < chunk:  # triangle); T diag(beta) into t_h
                        y = ZERO
                        j = int32(0)
                        while j < chunk:
                            if tid < j and j < r:
                                y = float32(y + float32(a_f[r * chunk + j]
                                                        * a_f[tid * chunk + j]))
                            j = int32(j + 1)
                        x = ONE if r == tid else ZERO
                        if r > tid:
                            x = -float32(a_f[r * chunk + tid] + y)
                            a_f[tid * chunk + r] = x
                        t_h[r * tp + tid] = ptx.from_f32(float32(x * b_f[tid]), t_h)
                        r = int32(r + 1)
                cuda.syncthreads()
                i = int32(0)
                while i < wide_rounds:       # D = T diag(beta) R
                    tile = warp + i * WARPS
                    if tile < wide:
                        m0, n0 = int32(tile // v_tiles * TILE), int32(tile % v_tiles * TILE)
                        acc = t_r(t_h, tp, r_h, sp, m0, n0, lane)
                        e = int32(0)
                        while e < 8:
                            r, c = m0 + tile_row(e, lane), n0 + tile_col(e, lane)
                            d_h[r * sp + c] = ptx.from_f32(acc[e], d_h)
                            e_h[r * sp + c] = ptx.from_f32(
                                float32(acc[e] * _exp(float32(g_last - g_f[r]))), e_h)
                            e = int32(e + 1)
                    i = int32(i + 1)
            else:
                i = int32(0)
                while i < v_rounds:   # D = V
                    x = i * THREADS + tid
                    if (chunk * bv) % THREADS == 0 or x < chunk * bv:
                        r, c = int32(x // bv), int32(x % bv)
                        d_h[r * sp + c] = ptx.from_f32(v_f[x], d_h)
                        e_h[r * sp + c] = ptx.from_f32(
                            float32(v_f[x] * _exp(float32(g_last - g_f[r]))), e_h)
                    i = int32(i + 1)
            cuda.syncthreads()
            # ---- P = Q K^T . Gamma . causal into t_h
            i = int32(0)
            while i < square_rounds:
                tile = warp + i * WARPS
                m0, n0 = int32(tile // c_tiles * TILE), int32(tile % c_tiles * TILE)
                if tile < square and n0 <= m0:
                    acc = kk_t(q_h, kp, k_h, kp, m0, n0, lane)
                    e = int32(0)
                    while e < 8:
                        r, c = m0 + tile_row(e, lane), n0 + tile_col(e, lane)
                        y = ZERO
                        if c <= r:
                            y = float32(acc[e] * _exp(float32(g_f[r] - g_f[c])))
                        t_h[r * tp + c] = ptx.from_f32(y, t_h)
                        e = int32(e + 1)
                elif tile < square:
                    e = int32(0)
                    while e < 8:
                        t_h[(m0 + tile_row(e, lane)) * tp + n0 + tile_col(e, lane)] = \
                            ptx.from_f32(ZERO, t_h)
                        e = int32(e + 1)
                i = int32(i + 1)
            cuda.syncthreads()
            # ---- O = scale (diag(b) Q S + P D); S' = b_C S + K^T diag(exp(G_C - G)) D
            i = int32(0)
            while i < wide_rounds:
                tile = warp + i * WARPS
                if tile < wide:
                    m0, n0 = int32(tile // v_tiles * TILE), int32(tile % v_tiles * TILE)
                    qs = k_s(q_h, kp, s_h, sp, m0, n0, lane)
                    pd = t_r(t_h, tp, d_h, sp, m0, n0, lane)
                    e = int32(0)
                    while e < 8:
                        r, c = m0 + tile_row(e, lane), n0 + tile_col(e, lane)
                        if r < n_in:
                            o = float32(float32(_exp(g_f[r]) * qs[e]) + pd[e])
                            out[tok[r], h, j0 + c] = ptx.from_f32(
                                emit(o, in0, in1, in2, in3, in4, in5, in6, tok[r], h, j0 + c,
                                     f0), out)
                        e = int32(e + 1)
                i = int32(i + 1)
            decay = _exp(g_last)
            i = int32(0)
            while i < tall_rounds:
                tile = warp + i * WARPS
                if tile < tall:
                    m0, n0 = int32(tile // v_tiles * TILE), int32(tile % v_tiles * TILE)
                    acc = kt_d(k_h, kp, e_h, sp, m0, n0, lane)
                    e = int32(0)
                    while e < 8:
                        at = cell(m0 + tile_row(e, lane), n0 + tile_col(e, lane))
                        columns[at] = ptx.from_f32(float32(
                            float32(decay * ptx.to_f32(columns[at])) + acc[e]), columns)
                        e = int32(e + 1)
                i = int32(i + 1)
            cuda.syncthreads()
            c0 += chunk

    return Specialised(chunk_kernel)
