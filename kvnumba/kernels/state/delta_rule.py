"""A state layer's gated delta rule: each sequence's recurrent state advanced over its
step's tokens, with an input log to rebuild any state from a base (`run`).

Storage, one column per sequence slot plus a scratch column (`cols`), float32 but the
marks:

* `state [cols, H, Dk, Dv]`: the live state, after consuming positions `[0, live)`;
* `base [cols, H, Dk, Dv]`: a base state after `[0, bp)` (`bp == 0`: the zero state,
  never read);
* the input log, a ring of `Rl` rows by position (`p % Rl`, `masks.storage_row`):
  `log_k [cols, Rl, H, Dk]` (k as the recurrence used it: l2-normalised when asked),
  `log_v [cols, Rl, H, Dv]`, `log_g [cols, Rl, H, Dk]` (the log-decay; a per-head gate
  uses entry 0) and `log_b [cols, Rl, H]` (beta);
* `marks [cols, 2]` int32: `(live, bp)`.

The recurrence of one head, `S [Dk, Dv]`, per token: `S <- diag(exp(g)) S` (per head:
`exp(g) S`); with beta, `u = S^T k`, `S <- S + beta k (v - u)^T`; without, `S <- S + k
v^T`; `o = scale S^T q` (q and k first l2-normalised, `x * rsqrt(sum(x^2) + 1e-6)`, when
`qk_l2norm`). Column `j` of `S` evolves alone given `k`, `g`, beta, `v[j]`: `parts`
adjacent lanes of a block hold it (`lanes_per_column`: Dk / `ROWS`, a power of two, 4
at d128), lane `p` its rows `r * parts + p`, `ceil(Dk / parts)` floats in registers
(the kernel is built for the head's exact `Dk` and `Dv`, so every loop over them is
unrolled and the rows sit at compile-time offsets from one address, `ptx.elements_from`).
They read `q`, `k` and the decays from shared memory; `S^T k` and `S^T q` are summed over
a column's lanes by a butterfly of shuffles, so every lane gets the same float. Lanes of
columns `j >= Dv` (up to a whole warp) hold zeros, take every shuffle and store nothing.
The norms of q and k are each warp's own butterfly over its lanes' strided squares.
The state is read once at a run's start and written once at its end.

The work plan (`arith.state_runs`): `runs [n_runs, 4]` int32 `(col, floor, lo, hi)`,
`order [n_segments]` int32, `seq_info [n_segments, SEQ_INFO_FIELDS]` int32 (all 2-D /
1-D device arrays as built there). Block `(blockIdx.x, blockIdx.y)` = (run, head); its
sequence's positions run from `p0` (its first segment's POS_START) to `end` (its last
segment's end), its segments `order[lo:hi]` taking them in turn. `_plan` says where the
block starts (`start`) and from which state:

* `p0 == 0`: the zero state; the base becomes position 0;
* `floor - bp > advance_after`: the base advances: from the base (zero if `bp == 0`) at
  `bp`, replaying log rows up to `floor`, where it stores the state to `base` (`bp =
  floor`); then on from the live state if `live == p0`, else replaying on to `p0`;
* else `live == p0`: the live state;
* else (a rewind): the base, replayed from `bp` to `p0`.

Each position `pos` of `[start, end)` loads its inputs into shared memory, from the log
row (`pos < p0`, `_logged`) or from the step's inputs (`taken`: the token of its
segment, normalised, written to the log row), then takes one `_step`: one call site for
replayed and new tokens, so a replayed state is bit-identical to the one computed
directly (every logged value is the float32 the recurrence used). Afterwards each
thread stores its column of `state`. The marks of the run, `(end, new bp)`, are written
by a second launch (`_set_marks`): the blocks of a sequence's other heads read them
until the first launch ends.

A block replays log rows `[bp, p0)` before it writes rows `[p0, end)`, its barriers
ordering the two, so a new token may take the row of a position the same step replayed
(`end - bp > Rl`, which `Rl = 3 M` allows): hence one block per (sequence, head), all
`Dv` columns in it. Splitting a head's columns over blocks would let one block's log
writes overtake another's replay.

A run of many new tokens (a prefill) may take the chunked kernel (`chunked`) instead:
the step kernel then runs it with `replay_only` (its positions `[start, p0)`: the base
advance and a rewind's replay, from the log, ending with the state at `p0` in `state`,
or, where the live state is at `p0`, leaving it there), and the chunked kernel takes
its new tokens. A launch takes runs `first ..` of the plan (`DeltaStep` orders them).

Output rows of tokens in no segment (padding) are not written by the step kernel; `run(...,
n_tokens=...)` zeroes rows `n_tokens ..` after it (`padding.zero_rows`).

The caller guarantees: `Rl >= 3 * M`, `M = advance_after` the most tokens a sequence
writes in one step; `bp <= floor <= p0`; the log holds every position a rewind replays
(`[bp, p0)`, so `p0 - bp <= Rl`); `Dk, Dv <= 256` (`ROWS` on the registers of the
largest); each sequence at most one run. The
scratch column is never touched (padding tokens are in no segment). Index ranges: positions,
rows, tokens and columns are int32; array offsets are Numba's 64-bit indexing.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ...arith.positions import POS_START, Q_LEN, Q_START
from ...arith.state_runs import RUN_COL, RUN_FLOOR, RUN_HI, RUN_LO
from ...device import SIMULATOR, cuda
from ..intrinsics import ptx
from ..launch.calling import PER_CALL, Specialised, ceil_div, no_output
from ..masks import storage_row
from .. import padding
from . import chunked
from .lanes import WARP, lane_functions

from numba import float32, int32, uint32  # noqa: E402  (after kvnumba.device chose the target)

#: the key widths taken: the largest bounds `Dk` (`dk_cap`)
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
ONE = np.float32(1.0)
EPS = np.float32(1e-6)
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
def _decay(x):
    """`exp(x)` in float32: a logged gate and a new one decay alike."""
    return float32(math.exp(x))


@cuda.jit(device=True)
def _logged(log_k, log_v, log_g, log_b, col, row, h, k_s, d_s, dk, per_channel, tid,
            threads, j, mine):
    """A replayed position's inputs: its log row's k and decays into shared memory
    (threads strided over `Dk`); returns `(v[j], beta)`."""
    i = tid
    while i < dk:
        k_s[i] = log_k[col, row, h, i]
        if per_channel:
            d_s[i] = _decay(log_g[col, row, h, i])
        i = int32(i + threads)
    if not per_channel and tid == 0:
        d_s[0] = _decay(log_g[col, row, h, 0])
    vj = log_v[col, row, h, j] if mine else ZERO
    return vj, log_b[col, row, h]


@cuda.jit(device=True)
def _gate_head(g, t, h, i):
    """Token `t`'s gate of head `h` from a per-head `g [width, H]`."""
    return ptx.to_f32(g[t, h])


@cuda.jit(device=True)
def _gate_channel(g, t, h, i):
    """Token `t`'s gate of key channel `i` of head `h` from `g [width, H, Dk]`."""
    return ptx.to_f32(g[t, h, i])


def _kernels(dk: int, dv: int, per_channel: bool, replay_only: bool = False):
    """The step kernel for heads of `dk` keys and `dv` values and a gate `[width, H, Dk]`
    (`per_channel`) or `[width, H]`: `parts = lanes_per_column(dk, dv)` lanes a column,
    each holding `ceil(dk / parts)` rows of it in registers, blocks of `block_threads(dv,
    parts)` threads (its launch bound); with `replay_only`, a run's positions up to its
    first new one only (the chunked kernel's runs)."""

    gate = _gate_channel if per_channel else _gate_head
    parts = lanes_per_column(dk, dv)
    threads = block_threads(dv, parts)
    lane = lane_functions(dk, dv, per_channel, parts)
    rows, load, store, clear, step, rnorm = (lane.rows, lane.load, lane.store, lane.clear,
                                             lane.step, lane.rnorm)

    @cuda.jit(device=True)
    def taken(log_k, log_v, log_g, log_b, q, k, v, g, beta, col, row, h, token, q_s, k_s,
              d_s, dk, qk_l2norm, has_beta, tid, threads, j, p, mine):
        """A new token's inputs: q, k (normalised) and decays into shared memory, k, v, g
        and beta into the log row; returns `(v[j], beta)`."""
        i = tid
        while i < dk:
            q_s[i] = ptx.to_f32(q[token, h, i])
            k_s[i] = ptx.to_f32(k[token, h, i])
            i = int32(i + threads)
        if qk_l2norm:
            cuda.syncthreads()
            rq, rk = rnorm(q_s), rnorm(k_s)
            cuda.syncthreads()
            i = tid
            while i < dk:
                q_s[i] = float32(q_s[i] * rq)
                k_s[i] = float32(k_s[i] * rk)
                i = int32(i + threads)
        i = tid
        while i < dk:
            log_k[col, row, h, i] = k_s[i]
            if per_channel:
                x = gate(g, token, h, i)
                log_g[col, row, h, i] = x
                d_s[i] = _decay(x)
            i = int32(i + threads)
        if not per_channel and tid == 0:
            x = gate(g, token, h, 0)
            log_g[col, row, h, 0] = x
            d_s[0] = _decay(x)
        vj = ZERO
        if mine:
            vj = ptx.to_f32(v[token, h, j])
            if p == 0:
                log_v[col, row, h, j] = vj
        b = ptx.to_f32(beta[token, h]) if has_beta else ONE
        if tid == 0:
            log_b[col, row, h] = b
        return vj, b

    bounds = {} if SIMULATOR else {"launch_bounds": (threads,)}

    @cuda.jit(**bounds)
    def step_kernel(state, base, log_k, log_v, log_g, log_b, marks, q, k, v, g, beta, out,
                    runs, order, seq_info, first, scale, qk_l2norm, has_beta, advance_after):
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
            want = pos >= p0
            if want:
                segment = order[seg]
                while offset >= seq_info[segment, Q_LEN]:
                    seg += 1
                    offset = int32(0)
                    segment = order[seg]
                token = int32(seq_info[segment, Q_START] + offset)
                offset += 1
                vj, b = taken(log_k, log_v, log_g, log_b, q, k, v, g, beta, col, row, h,
                              token, q_s, k_s, d_s, dk, qk_l2norm, has_beta, tid, n_threads,
                              j, p, mine)
            else:
                vj, b = _logged(log_k, log_v, log_g, log_b, col, row, h, k_s, d_s, dk,
                                per_channel, tid, n_threads, j, mine)
            cuda.syncthreads()
            o = step(s, q_s, k_s, d_s, p, has_beta, vj, b, want)
            if want and mine and p == 0:
                out[token, h, j] = ptx.from_f32(float32(o * scale), out)
            cuda.syncthreads()
            pos += 1
        if replay_only:
            if advance:               # the base advancing to p0 (= floor)
                store(s, base, col, h, j, p)
            if not (advance and live == p0):   # else the live state at p0 stays
                store(s, state, col, h, j, p)
        else:
            store(s, state, col, h, j, p)

    return Specialised(step_kernel)


_kernel = lru_cache(maxsize=None)(_kernels)


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
    """The smallest of `DK_CAPS` holding `dk` keys."""
    for cap in DK_CAPS:
        if dk <= cap:
            return cap
    raise ValueError(f"delta rule: Dk {dk} > {DK_CAPS[-1]}")


def lanes_per_column(dk: int, dv: int) -> int:
    """Lanes holding one value channel's column of the state: the largest power of two
    at most `dk // ROWS` (at least 1), halved while a block of them would pass
    `MAX_THREADS`."""
    if dv > MAX_DV:
        raise ValueError(f"delta rule: Dv {dv} > {MAX_DV}")
    parts = 1
    while parts * 2 * ROWS <= dk:
        parts *= 2
    while parts > 1 and _threads(dv, parts) > MAX_THREADS:
        parts //= 2
    return parts


def _threads(dv: int, parts: int) -> int:
    return max(WARP, ceil_div(dv * parts, WARP) * WARP)


def block_threads(dv: int, parts: int = 1) -> int:
    """Threads of a block: `parts` lanes per value channel, rounded up to whole warps."""
    if dv > MAX_DV:
        raise ValueError(f"delta rule: Dv {dv} > {MAX_DV}")
    return _threads(dv, parts)


class DeltaStep:
    """The delta rule's launches of one step (`prepare`): its work plan, run count,
    chunked runs, `advance_after`, padding and stream fixed, the kernels bound once per
    head shape, gate kind, beta rule and scale, so a layer's call passes its arrays
    (`__call__`, as `run` takes them).

    The last `n_chunked` runs (`arith.state_runs` puts those of at least `chunk` new
    tokens there) take the chunked kernel (`chunked`) where it fits the layer's heads
    and gate: the step kernel replays them up to their first new position
    (`replay_only`), then the chunked kernel takes their new tokens. Elsewhere every run
    takes the step kernel."""

    def __init__(self, runs, order, seq_info, n_runs: int, advance_after: int, n_tokens,
                 stream, n_chunked: int = 0, chunk: int = chunked.CHUNK):
        self.runs, self.order, self.seq_info = runs, order, seq_info
        self.n_runs, self.advance_after, self.stream = n_runs, advance_after, stream
        self.n_tokens, self.n_chunked, self.chunk = n_tokens, n_chunked, chunk
        self._steps, self._zero = {}, {}
        self._marks = (_marks.bind(ceil_div(n_runs, MARK_THREADS), MARK_THREADS, stream,
                                   PER_CALL, runs, order, seq_info, n_runs, advance_after)
                       if n_runs else None)

    def __call__(self, state, base, log_k, log_v, log_g, log_b, marks, q, k, v, g, beta,
                 out, scale, qk_l2norm: bool) -> None:
        if self.n_runs:
            n_heads, dk, dv = state.shape[1], state.shape[2], state.shape[3]
            per_channel, has_beta = len(g.shape) == 3, beta is not None
            if per_channel and g.shape[2] != dk:
                raise ValueError(f"delta rule: a per-channel gate of {g.shape[2]} entries a "
                                 f"head for Dk {dk}")
            scale, qk_l2norm = np.float32(scale), bool(qk_l2norm)
            key = (n_heads, dk, dv, per_channel, has_beta, scale, qk_l2norm)
            launches = self._steps.get(key)
            if launches is None:
                launches = self._steps[key] = self._bind(n_heads, dk, dv, per_channel,
                                                         has_beta, scale, qk_l2norm)
            beta = beta if has_beta else no_output()
            for launch in launches[:-1]:
                launch(state, base, log_k, log_v, log_g, log_b, marks, q, k, v, g, beta, out)
            if launches[-1] is not None:
                launches[-1](state, log_k, log_v, log_g, log_b, q, k, v, g, beta, out)
            self._marks(marks)
        if self.n_tokens is not None:
            width = out.shape[0]
            zero = self._zero.get(width, False)
            if zero is False:
                zero = self._zero[width] = padding.prepare(width, self.n_tokens, self.stream)
            if zero is not None:
                zero(out, no_output())

    def _bind(self, n_heads, dk, dv, per_channel, has_beta, scale, qk_l2norm) -> tuple:
        """`(step launches.., chunked launch or None)` of a layer's key."""
        dk_cap(dk)
        threads = block_threads(dv, lanes_per_column(dk, dv))
        n_chunked = self.n_chunked if chunked.fits(dk, dv, per_channel, self.chunk) else 0
        n_step = self.n_runs - n_chunked
        tables = (self.runs, self.order, self.seq_info)

        def step_launch(first, n, replay_only):
            return _kernel(dk, dv, per_channel, replay_only).bind(
                (n, n_heads), threads, self.stream, *[PER_CALL] * 13, *tables, first, scale,
                qk_l2norm, has_beta, self.advance_after)

        launches = [step_launch(0, n_step, False)] if n_step else []
        if not n_chunked:
            return (*launches, None)
        launches.append(step_launch(n_step, n_chunked, True))
        grid = (n_chunked, n_heads, dv // chunked.value_block(dv))
        return (*launches, chunked.kernel(dk, dv, self.chunk).bind(
            grid, chunked.THREADS, self.stream, *[PER_CALL] * 11, *tables, n_step, scale,
            qk_l2norm, has_beta))


def prepare(runs, order, seq_info, n_runs: int, advance_after: int, stream=0, *,
            n_tokens=None, n_chunked: int = 0, chunk: int = chunked.CHUNK) -> DeltaStep:
    """The launches of a step's delta rule layers with the work plan `runs`, `order`,
    `seq_info` (int32 device arrays, module doc) of `n_runs` runs, the last `n_chunked`
    of them chunked by `chunk` tokens where a layer's heads allow (`DeltaStep`), bound
    for its layers' calls; with `n_tokens`, each call also zeroes `out[n_tokens:]`."""
    return DeltaStep(runs, order, seq_info, int(n_runs), int(advance_after),
                     None if n_tokens is None else int(n_tokens), stream, int(n_chunked),
                     int(chunk))


def run(state, base, log_k, log_v, log_g, log_b, marks, q, k, v, g, beta, out, runs, order,
        seq_info, n_runs: int, scale, qk_l2norm: bool, advance_after: int, stream=0, *,
        n_tokens=None, n_chunked: int = 0, chunk: int = chunked.CHUNK) -> None:
    """Advance the state of each of the `n_runs` runs over its segments (module doc):
    the step kernel (grid `(n_runs, H)`, `block_threads(Dv, lanes_per_column(Dk, Dv))`
    threads), or for the last `n_chunked` runs, where the heads allow, the step kernel's
    replay and the chunked kernel (`DeltaStep`); then the marks; a last launch zeroes
    `out[n_tokens:]` when `n_tokens` is given.

    `q, k [width, H, Dk]`, `v [width, H, Dv]`, `g [width, H]` (per head) or `[width, H,
    Dk]`, `beta [width, H]` or None (`S += k v^T`; a layer must use one rule for all its
    steps, since replay takes it from this call), each float16, float32 or bfloat16 as
    uint16 bits; `out [width, H, Dv]` of those. `runs`, `order`, `seq_info`: int32
    device arrays as `arith.state_runs` and the segment table lay them out; `scale`
    float32. `prepare` binds these launches once for a step's layers."""
    prepare(runs, order, seq_info, n_runs, advance_after, stream, n_tokens=n_tokens,
            n_chunked=n_chunked, chunk=chunk)(
        state, base, log_k, log_v, log_g, log_b, marks, q, k, v, g, beta, out, scale,
        qk_l2norm)
