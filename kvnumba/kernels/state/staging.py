"""What both chunked kernels (`chunked`, `chunked_channel`) stage a chunk with: a run's
extent (`run_extent`), the step's token row of each of a chunk's tokens
(`chunk_tokens`), a row of q or k into a float16 tile, l2-normalised with the per-token
kernel's own `rnorm` (`row_stager`), the chunk's values (`value_stager`), each logged
as the per-token kernel logs it, so that replays from the log stay bit for bit the
per-token kernel's, and the float16 copy of a block's columns of the state
(`state_stager`)."""
from __future__ import annotations

from ...arith.positions import POS_START, Q_LEN, Q_START
from ...arith.state_runs import RUN_COL, RUN_HI, RUN_LO
from ...device import cuda
from ..intrinsics import ptx
from ..launch.calling import ceil_div
from ..masks import storage_row
from .lanes import ONE, WARP, ZERO

from numba import float32, int32  # noqa: E402  (after kvnumba.device chose the target)


@cuda.jit(device=True)
def run_extent(runs, order, seq_info, run):
    """`(col, lo, p0, n_new)` of plan run `run` (`recurrence`'s work plan): its column,
    its first segment's index in `order`, its first new position and its new tokens."""
    col, lo, hi = runs[run, RUN_COL], runs[run, RUN_LO], runs[run, RUN_HI]
    last = order[hi - 1]
    p0 = seq_info[order[lo], POS_START]
    return col, lo, p0, int32(seq_info[last, POS_START] + seq_info[last, Q_LEN] - p0)


@cuda.jit(device=True)
def chunk_tokens(tok, tid, n_in, c0, lo, order, seq_info):
    """Thread `tid < n_in`: the step's token row of the run's new token `c0 + tid` (its
    segment's, the segments `order[lo ..]` taking the run's tokens in turn) into
    `tok[tid]`."""
    if tid < n_in:
        seg, at = lo, c0 + tid
        while at >= seq_info[order[seg], Q_LEN]:
            at -= seq_info[order[seg], Q_LEN]
            seg += 1
        tok[tid] = seq_info[order[seg], Q_START] + at


@cuda.jit(device=True)
def qk_row(q, k, in2, in3, in4, in5, in6, token, h, i, query):
    """Entry `i` of token `token`'s q (`query`) or k of head `h`, from the delta rule's
    first two inputs."""
    return ptx.to_f32(q[token, h, i]) if query else ptx.to_f32(k[token, h, i])


@cuda.jit(device=True)
def v_value(in0, in1, v, in3, in4, in5, in6, token, h, j, unused_w):
    """Value `j` of token `token`'s v of head `h`, the delta rule's third input."""
    return ptx.to_f32(v[token, h, j])


def row_stager(dk: int, pitch: int, row_in, rnorm):
    """The device function staging row `t` of a float16 tile of `pitch` elements a row
    from a token's q or k of `dk` entries, each read by `row_in(in0 .. in6, token, h, i,
    query)` (module doc); `rnorm` the lanes' (`lanes.lane_functions`)."""
    lane_rows = ceil_div(dk, WARP)

    @cuda.jit(device=True)
    def stage_row(in0, in1, in2, in3, in4, in5, in6, query, token, h, x_h, t, row, lane,
                  normalise, log_k, col, log_row, log):
        """Row `t` of tile `x_h` from token `token`'s q (`query`) or k (normalised with
        the per-token kernel's `rnorm` when `normalise`; into the log row when `log`);
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
                x_h[t * pitch + i] = ptx.from_f32(y, x_h)
                if log:
                    log_k[col, log_row, h, i] = y
            r = int32(r + 1)

    return stage_row


def value_stager(chunk: int, bv: int, threads: int, value_in, weighted: bool):
    """The device function staging a chunk's values of a block's `bv` columns into `v_f
    [chunk, bv]` (float32; zeros past the chunk's tokens) and the log, each read by
    `value_in(in0 .. in6, token, h, j, w)`, `w` the token's factor in `w_f` when
    `weighted` (else 1); `threads` threads."""
    rounds = ceil_div(chunk * bv, threads)

    @cuda.jit(device=True)
    def stage_values(in0, in1, in2, in3, in4, in5, in6, tok, n_in, tid, h, j0, p, log_rows,
                     log_v, col, v_f, w_f):
        """Values `j0 ..` of the chunk's tokens (at positions `p ..`) into `v_f` and their
        log rows."""
        i = int32(0)
        while i < rounds:
            x = i * threads + tid
            t, c = int32(x // bv), int32(x % bv)
            y = ZERO
            if t < n_in:
                y = value_in(in0, in1, in2, in3, in4, in5, in6, tok[t], h, j0 + c,
                             w_f[t] if weighted else ONE)
                log_v[col, storage_row(p + t, log_rows), h, j0 + c] = y
            if (chunk * bv) % threads == 0 or x < chunk * bv:
                v_f[x] = y
            i = int32(i + 1)

    return stage_values


def state_stager(dk: int, dv: int, bv: int, pitch: int, threads: int, transposed: bool):
    """`(first, stage)`: the device functions of a block's `bv` columns of a head's state
    (`[Dk, Dv]`, or `transposed` `[Dv, Dk]`), `threads` threads: `first(state, col, h,
    j0, tid)` the offset of the first element this thread stages, `stage(mine, s_h,
    tid)` their float16 copy (`mine` the elements from there) into `s_h [Dk, pitch]`. Thread `tid` stages rows `tid // bv + i * (threads / bv)` of
    column `tid % bv` (transposed: `threads` floats a round, a column's rows adjacent),
    the loop counted in int64: LLVM unrolls it in part, fewer loads in flight than
    registers."""
    rounds, step = dk * bv // threads, threads // bv

    @cuda.jit(device=True)
    def first(state, col, h, j0, tid):
        head = (col * state.shape[1] + h) * dk * dv
        if transposed:                        # the block's columns: one run of floats
            return head + j0 * dk + tid
        return head + int32(tid // bv) * dv + j0 + int32(tid % bv)

    @cuda.jit(device=True)
    def stage(mine, s_h, tid):
        row, column = int32(tid // bv), int32(tid % bv)
        for i in range(rounds):
            if transposed:
                x = i * threads + tid
                s_h[(x % dk) * pitch + x // dk] = ptx.from_f32(ptx.to_f32(mine[i * threads]),
                                                               s_h)
            else:
                s_h[(row + i * step) * pitch + column] = ptx.from_f32(
                    ptx.to_f32(mine[i * step * dv]), s_h)

    return first, stage
