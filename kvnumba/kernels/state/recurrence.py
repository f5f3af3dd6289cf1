"""A state layer's linear recurrence (the gated delta rule, Mamba2's SSD): each
sequence's recurrent state advanced over its step's tokens, with an input log to rebuild
any state from a base. The ops (`delta_rule`, `ssd`) differ only in how a new token's
inputs reach the recurrence (`taken`) and how its output leaves (`emit`); the plan, the
lanes, the log, the replay and the marks are this module's.

Storage, one column per sequence slot plus a scratch column (`cols`): the states float32
or bfloat16 (uint16 bits, rounded to nearest even each time one is stored; the lanes
hold them in float32), the logs float32, in the lanes' terms (`lanes`: a head's state `S [Dk, Dv]`, `Dk` the rows a column
sums over, `Dv` the columns):

* `state [cols, H, Dk, Dv]` (or `transposed`, `[cols, H, Dv, Dk]`): the live state, after
  consuming positions `[0, live)`;
* `base`, alike: a base state after `[0, bp)` (`bp == 0`: the zero state, never read);
* the input log, a ring of `Rl` rows by position (`p % Rl`, `masks.storage_row`):
  `log_k [cols, Rl, H, Dk]` (the row inputs, `k` as the recurrence used it), `log_v
  [cols, Rl, H, Dv]` (the column inputs), `log_g [cols, Rl, H, >= 1]` (the log-decay;
  a per-head gate uses entry 0) and `log_b [cols, Rl, H]` (beta);
* `marks [cols, 2]` int32: `(live, bp)`.

The recurrence of one head per token: `S <- diag(exp(g)) S` (per head: `exp(g) S`); with
beta, `u = S^T k`, `S <- S + beta k (v - u)^T`; without, `S <- S + k v^T`; `o = S^T q`,
which `emit` finishes. Column `j` of `S` evolves alone given `k`, `g`, beta, `v[j]`:
`parts` adjacent lanes of a block hold it (`lanes_per_column`: Dk / `ROWS`, a power of
two, 4 at d128), lane `p` its rows `r * parts + p`, `ceil(Dk / parts)` floats in
registers (the kernel is built for the head's exact `Dk` and `Dv`, so every loop over
them is unrolled and the rows sit at compile-time offsets from one address). They read
`q`, `k` and the decays from shared memory; `S^T k` and `S^T q` are summed over a
column's lanes by a butterfly of shuffles, so every lane gets the same float. Lanes of
columns `j >= Dv` (up to a whole warp) hold zeros, take every shuffle and store nothing.
The state is read once at a run's start and written once at its end.

The work plan (`arith.state_runs`): `runs [n_runs, 4]` int32 `(col, floor, lo, hi)`,
`order [n_segments]` int32, `seq_info [n_segments, SEQ_INFO_FIELDS]` int32. Block
`(blockIdx.x, blockIdx.y)` = (run, head); its sequence's positions run from `p0` (its
first segment's POS_START) to `end` (its last segment's end), its segments `order[lo:hi]`
taking them in turn. `_plan` says where the block starts (`start`) and from which state:

* `p0 == 0`: the zero state; the base becomes position 0;
* `floor - bp > advance_after`: the base advances: from the base (zero if `bp == 0`) at
  `bp`, replaying log rows up to `floor`, where it stores the state to `base` (`bp =
  floor`); then on from the live state if `live == p0`, else replaying on to `p0`;
* else `live == p0`: the live state;
* else (a rewind): the base, replayed from `bp` to `p0`.

Each position `pos` of `[start, end)` loads its inputs into shared memory, from the log
row (`pos < p0`, `_logged`) or from the step's inputs (the op's `taken`: the token of
its segment, written to the log row as the recurrence takes it), then takes one `step`:
one call site for replayed and new tokens, so a replayed state is bit-identical to the
one computed directly (every logged value is the float32 the recurrence used).
Afterwards each thread stores its column of `state`. The marks of the run, `(end, new
bp)`, are written by a second launch (`_set_marks`): the blocks of a sequence's other
heads read them until the first launch ends.

A block replays log rows `[bp, p0)` before it writes rows `[p0, end)`, its barriers
ordering the two, so a new token may take the row of a position the same step replayed
(`end - bp > Rl`, which `Rl = 3 M` allows): hence one block per (sequence, head), all
`Dv` columns in it.

Output rows of tokens in no segment (padding) are not written by the step kernel; a
plan made with `n_tokens` zeroes rows `n_tokens ..` after it (`padding.zero_rows`).

A prefill takes its tokens one position at a time through the same loop, unless the
op's chunked kernel fits the layer (`chunked`, which both ops enter): the plan's
last `n_chunked` runs (`arith.state_runs` puts those of at least `chunk` new tokens
there) then take three launches in place of one, bound under the op's key
(`RecurrentStep.launch`): the step kernel's `replay_only` variant (a compile-time
variant, so the per-token kernel keeps its code) over them, its positions `[start,
p0)`: the base advance and a rewind's replay from the log, leaving the state at `p0`
in `state` (where the live state is at `p0`, leaving it there); then the chunked
kernel over their new tokens, writing the same log rows and the state; then the marks.
Replays of those rows, which this loop takes, match the chunked kernel's states within
its rounding, not bit for bit. A launch takes runs `first ..` of the plan.

The caller guarantees: `Rl >= 3 * M`, `M = advance_after` the most tokens a sequence
writes in one step; `bp <= floor <= p0`; the log holds every position a rewind replays
(`[bp, p0)`, so `p0 - bp <= Rl`); `Dk, Dv <= 256`; each sequence at most one run; a
layer's steps all run one op with one gate kind and rule. The scratch column is never
touched (padding tokens are in no segment). Index ranges: positions, rows, tokens and
columns are int32; array offsets are Numba's 64-bit indexing.
"""
from __future__ import annotations

import math

import numpy as np

from ...arith.positions import POS_START, Q_LEN, Q_START
from ...arith.state_runs import RUN_COL, RUN_FLOOR, RUN_HI, RUN_LO
from ...device import SIMULATOR, cuda
from ..intrinsics import ptx
from ..launch.calling import PER_CALL, Specialised, ceil_div, no_output
from ..masks import storage_row
from .. import padding
from .lanes import WARP, lane_functions

from numba import float32, int32, uint32  # noqa: E402  (after kvnumba.device chose the target)

#: the row counts taken: the largest bounds `Dk` (`dk_cap`)
DK_CAPS = (16, 32, 64, 128, 256)
MAX_DV = 256
#: rows of a column a lane holds in registers: about `Dk // ROWS` lanes share a column
#: (`lanes_per_column`), while a block stays within `MAX_THREADS`; a block of more than
#: 512 lanes (Dv x lanes a column, e.g. 128 x 256) leaves 64 registers a lane, and
#: longer rows spill
ROWS = 32
MAX_THREADS = 1024
MARK_THREADS = 128
ZERO = np.float32(0.0)
#: the op's input arrays a step kernel takes (`INPUTS` slots, unused ones `no_output()`)
INPUTS = 7
#: where a block's state starts (`_plan`)
FROM_ZERO, FROM_BASE, FROM_STATE = 0, 1, 2


@cuda.jit(device=True)
def _plan(marks, runs, order, seq_info, run, advance_after):
    """`(col, live, p0, end, start, source, advance, floor, new_bp)` of run `run` (module
    doc): the block starts at position `start` from the state `source` names
    (`FROM_ZERO`, `FROM_BASE`, `FROM_STATE`), storing it to `base` at `floor` on the way
    when `advance`."""
    col, floor = runs[run, RUN_COL], runs[run, RUN_FLOOR]
    first, last = order[runs[run, RUN_LO]], order[runs[run, RUN_HI] - 1]
    live, bp = marks[col, 0], marks[col, 1]
    p0 = seq_info[first, POS_START]
    end = int32(seq_info[last, POS_START] + seq_info[last, Q_LEN])
    advance = False
    start, new_bp, source = bp, bp, FROM_BASE
    if p0 == 0:
        start, new_bp, source = int32(0), int32(0), FROM_ZERO
    elif floor - bp > advance_after:
        new_bp, advance = floor, True
    elif live == p0:
        start, source = p0, FROM_STATE
    if source == FROM_BASE and bp == 0:
        source = FROM_ZERO
    return col, live, p0, end, start, source, advance, floor, new_bp


@cuda.jit(device=True)
def decay(x):
    """`exp(x)` in float32: a logged gate and a new one decay alike."""
    return float32(math.exp(x))


@cuda.jit(device=True)
def logged(log_k, log_v, log_g, log_b, col, row, h, k_s, d_s, dk, per_channel, tid,
           threads, j, mine):
    """A replayed position's inputs: its log row's k and decays into shared memory
    (threads strided over `Dk`); returns `(v[j], beta)`."""
    i = tid
    while i < dk:
        k_s[i] = log_k[col, row, h, i]
        if per_channel:
            d_s[i] = decay(log_g[col, row, h, i])
        i = int32(i + threads)
    if not per_channel and tid == 0:
        d_s[0] = decay(log_g[col, row, h, 0])
    vj = log_v[col, row, h, j] if mine else ZERO
    return vj, log_b[col, row, h]


def recurrence_kernel(dk: int, dv: int, per_channel: bool, transposed: bool, taken, emit,
                      replay_only: bool = False):
    """The step kernel of heads of `dk` rows and `dv` columns, a decay per row
    (`per_channel`) or per head, the state `[H, Dk, Dv]` or `transposed`, for an op
    whose new tokens enter through the device function `taken` and leave through `emit`
    (with `replay_only`, a compile-time variant, each run's positions up to `p0` only:
    the replay before a chunked kernel, module doc):

    `taken(log_k, log_v, log_g, log_b, in0, .. in6, col, row, h, token, q_s, k_s, d_s,
    f0, f1, option, has_beta, tid, threads, j, p, mine) -> (v[j], beta, extra)` puts the
    token's q, k and decays into shared memory and its inputs into log row `row` (as
    `logged` reads them back); `emit(o, extra, f0)` is the float32 output of column `j`
    from `o = S^T q`. `parts = lanes_per_column(dk, dv)` lanes a column, blocks of
    `block_threads(dv, parts)` threads (its launch bound). Returns a `Specialised`."""
    parts = lanes_per_column(dk, dv)
    threads = block_threads(dv, parts)
    lane = lane_functions(dk, dv, per_channel, parts, transposed)
    rows, load, store, clear, step = lane.rows, lane.load, lane.store, lane.clear, lane.step
    bounds = {} if SIMULATOR else {"launch_bounds": (threads,)}

    @cuda.jit(**bounds)
    def step_kernel(state, base, log_k, log_v, log_g, log_b, marks, in0, in1, in2, in3, in4,
                    in5, in6, out, runs, order, seq_info, first, f0, f1, option, has_beta,
                    advance_after):
        """Block (first + run, head): the sequence's positions `[start, end)`, or with
        `replay_only` `[start, p0)` (module doc)."""
        run, h, tid = first + cuda.blockIdx.x, cuda.blockIdx.y, int32(cuda.threadIdx.x)
        n_threads = int32(cuda.blockDim.x)
        j, p = int32(uint32(tid) // parts), int32(uint32(tid) % parts)
        log_rows = log_k.shape[1]
        mine = j < dv
        q_s = cuda.shared.array(dk, float32)
        k_s = cuda.shared.array(dk, float32)
        d_s = cuda.shared.array(dk, float32)
        s = cuda.local.array(rows, float32)
        col, live, p0, end, start, source, advance, floor, new_bp = _plan(
            marks, runs, order, seq_info, run, advance_after)
        if replay_only:
            end = p0
        if source == FROM_STATE:
            load(s, state, col, h, j, p)
        elif source == FROM_BASE:
            load(s, base, col, h, j, p)
        else:
            clear(s)
        seg, offset, token = runs[run, RUN_LO], int32(0), int32(0)
        pos = start
        while pos < end:
            if advance and pos == floor:
                advance = False
                store(s, base, col, h, j, p)
                if live == p0:
                    pos = p0
                    load(s, state, col, h, j, p)
                    if replay_only and pos == end:     # nothing past p0
                        break
            row = storage_row(pos, log_rows)
            want = not replay_only and pos >= p0
            extra = ZERO
            if want:
                segment = order[seg]
                while offset >= seq_info[segment, Q_LEN]:
                    seg += 1
                    offset = int32(0)
                    segment = order[seg]
                token = int32(seq_info[segment, Q_START] + offset)
                offset += 1
                vj, b, extra = taken(log_k, log_v, log_g, log_b, in0, in1, in2, in3, in4,
                                     in5, in6, col, row, h, token, q_s, k_s, d_s, f0, f1,
                                     option, has_beta, tid, n_threads, j, p, mine)
            else:
                vj, b = logged(log_k, log_v, log_g, log_b, col, row, h, k_s, d_s, dk,
                               per_channel, tid, n_threads, j, mine)
            cuda.syncthreads()
            o = step(s, q_s, k_s, d_s, p, has_beta, vj, b, want)
            if want and mine and p == 0:
                out[token, h, j] = ptx.from_f32(emit(o, extra, f0), out)
            cuda.syncthreads()
            pos += 1
        if not replay_only:
            store(s, state, col, h, j, p)
        else:
            if advance:               # the base advancing to p0 (= floor)
                store(s, base, col, h, j, p)
            if not (advance and live == p0):   # else the live state at p0 stays
                store(s, state, col, h, j, p)

    return Specialised(step_kernel)


@cuda.jit
def _set_marks(marks, runs, order, seq_info, n_runs, advance_after):
    """Thread `run` sets its sequence's marks to `(end, new bp)` (`_plan`)."""
    run = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if run < n_runs:
        col, _, _, end, _, _, _, _, new_bp = _plan(marks, runs, order, seq_info, run,
                                                   advance_after)
        marks[col, 0] = end
        marks[col, 1] = new_bp


_marks = Specialised(_set_marks)


def dk_cap(dk: int) -> int:
    """The smallest of `DK_CAPS` holding `dk` rows."""
    for cap in DK_CAPS:
        if dk <= cap:
            return cap
    raise ValueError(f"recurrence: Dk {dk} > {DK_CAPS[-1]}")


def lanes_per_column(dk: int, dv: int) -> int:
    """Lanes holding one column of the state: the largest power of two at most `dk //
    ROWS` (at least 1), halved while a block of them would pass `MAX_THREADS`."""
    if dv > MAX_DV:
        raise ValueError(f"recurrence: Dv {dv} > {MAX_DV}")
    parts = 1
    while parts * 2 * ROWS <= dk:
        parts *= 2
    while parts > 1 and _threads(dv, parts) > MAX_THREADS:
        parts //= 2
    return parts


def _threads(dv: int, parts: int) -> int:
    return max(WARP, ceil_div(dv * parts, WARP) * WARP)


def block_threads(dv: int, parts: int = 1) -> int:
    """Threads of a block: `parts` lanes per column, rounded up to whole warps."""
    if dv > MAX_DV:
        raise ValueError(f"recurrence: Dv {dv} > {MAX_DV}")
    return _threads(dv, parts)


class RecurrentStep:
    """The recurrence launches of one step (`prepare`): its work plan, run count, chunked
    runs, `advance_after`, padding and stream fixed; each op's kernels bound once per key
    (`launch`), so a layer's call passes its arrays."""

    def __init__(self, runs, order, seq_info, n_runs: int, advance_after: int, n_tokens,
                 stream, n_chunked: int = 0, chunk: int = 0):
        if n_chunked and chunk <= 0:
            raise ValueError(f"recurrence: {n_chunked} chunked runs need a chunk of at "
                             f"least 1 token, not {chunk}")
        self.runs, self.order, self.seq_info = runs, order, seq_info
        self.n_runs, self.advance_after, self.stream = n_runs, advance_after, stream
        self.n_tokens, self.n_chunked, self.chunk = n_tokens, n_chunked, chunk
        self._steps, self._zero = {}, {}
        self._marks = (_marks.bind(ceil_div(n_runs, MARK_THREADS), MARK_THREADS, stream,
                                   PER_CALL, runs, order, seq_info, n_runs, advance_after)
                       if n_runs else None)

    def launch(self, key, build, arrays: tuple, inputs: tuple, out, f0, f1, option: bool,
               has_beta: bool, chunked=None) -> None:
        """The step kernel `build(replay_only)` makes (`(kernel, heads, threads)`, once per
        `key`, with the scalars `f0`, `f1`, `option`, `has_beta` bound then) over the
        layer's storage `arrays` (`state, base, log_k, log_v, log_g, log_b, marks`, the
        logs in the lanes' roles) and the op's `inputs` (at most `INPUTS`), then the
        marks, then the padding rows of `out` zeroed.

        With `chunked` (the op's chunked kernel fits the layer), the plan's last
        `n_chunked` runs take it: `chunked()` makes `(kernel, grid, threads)`, a kernel
        of the step kernel's arguments but `advance_after` over blocks `(n_chunked,
        *grid)`, bound under the same key; the step kernel takes the other runs, and its
        `replay_only` variant brings the chunked runs' states to their `p0` first."""
        if self.n_runs:
            bound = self._steps.get(key)
            if bound is None:
                bound = self._steps[key] = self._bind(build, chunked, f0, f1, option,
                                                      has_beta)
            unused = (no_output(),) * (INPUTS - len(inputs))
            for launch in bound:
                launch(*arrays, *inputs, *unused, out)
            self._marks(arrays[-1])
        if self.n_tokens is not None:
            width = out.shape[0]
            zero = self._zero.get(width, False)
            if zero is False:
                zero = self._zero[width] = padding.prepare(width, self.n_tokens, self.stream)
            if zero is not None:
                zero(out, no_output())

    def _bind(self, build, chunked, f0, f1, option, has_beta) -> tuple:
        """The launches of one key, in order (`launch`)."""
        n_chunked = self.n_chunked if chunked is not None else 0
        n_step = self.n_runs - n_chunked
        scalars = (np.float32(f0), np.float32(f1), bool(option), bool(has_beta))
        tables = (self.runs, self.order, self.seq_info)

        def step(first: int, n: int, replay_only: bool):
            kernel, heads, threads = build(replay_only)
            return kernel.bind((n, heads), threads, self.stream, *[PER_CALL] * 15, *tables,
                               first, *scalars, self.advance_after)

        launches = [step(0, n_step, False)] if n_step else []
        if n_chunked:
            kernel, grid, threads = chunked()
            launches += [step(n_step, n_chunked, True),
                         kernel.bind((n_chunked, *grid), threads, self.stream,
                                     *[PER_CALL] * 15, *tables, n_step, *scalars)]
        return tuple(launches)


def prepare(runs, order, seq_info, n_runs: int, advance_after: int, stream=0, *,
            n_tokens=None, n_chunked: int = 0, chunk: int = 0) -> RecurrentStep:
    """The launches of a step's recurrent layers with the work plan `runs`, `order`,
    `seq_info` (int32 device arrays, module doc) of `n_runs` runs, the last `n_chunked`
    of them of at least `chunk` new tokens (`arith.state_runs`, for an op's chunked
    kernel), bound for its layers' calls (`RecurrentStep`); with `n_tokens`, each call
    also zeroes `out[n_tokens:]`."""
    return RecurrentStep(runs, order, seq_info, int(n_runs), int(advance_after),
                         None if n_tokens is None else int(n_tokens), stream, int(n_chunked),
                         int(chunk))
