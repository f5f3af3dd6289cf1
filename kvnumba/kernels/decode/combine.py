"""The decode path's combine: merge a split segment's chunk partials into `out`, with
many independent loads in flight rather than one dependent load per part.

Inputs are exactly what `decode.run` leaves in its workspace and tables:

* `part_acc`: flat float32 `[n_parts, max_q_len, n_q_heads, head_dim]`, unnormalised
  accumulators; `part_ml`: flat float32 `[n_parts, max_q_len, n_q_heads, 2]`,
  (max in base 2, sum). Element `at = (part * max_q_len + i) * n_q_heads + head`
  holds query `i`, q head `head` of partial slot `part` (acc at `at * head_dim + dim`,
  the pair at `2 * at`). A chunk in which a row sees no key holds max -inf, sum 0,
  acc 0.
* the combine table (`decode.COMBINE_*`, `COMBINE_FIELDS` int32 per row, at
  `combine_off` in `tables`): a split segment, the slot of its first chunk (its chunks
  take consecutive slots) and how many chunks. Query `i` of the segment
  (`masks.read_segment`) gets `out[q_start + i, head, :] = sum_p 2**(m_p - M) acc_p /
  sum_p 2**(m_p - M) s_p`, `M = max_p m_p`, in out's dtype, and, given an `lse` with
  rows, `lse[q_start + i, head] = ln 2 * (M + log2 sum_p 2**(m_p - M) s_p)`: the
  row's natural-log log-sum-exp. Given `sinks` with elements, head `head`'s sink joins
  the merged state before it is normalised (`kernels.sinks.with_sink`): the partials
  never hold it.

Shape (`_combine_kernel(head_dim)`): one block per (combine row, query, q head):
`part_groups * lanes` threads, `lanes` (the smallest power of two >= head_dim / 4)
over the 16-byte pieces of a float32 accumulator row and `part_groups` (`PART_GROUPS`;
4 at head_dim 512) part groups over the parts (part `k` of the segment to group `k %
part_groups`). A thread keeps a
running (max, sum, 4 accumulators) of its group's parts for its piece. Per loop trip
it loads `UNROLL` parts: each part's (max, sum) (two 4-byte loads, the same for every
lane of the group) and its 16-byte piece of the accumulator (`ptx.ld_nc_v4`), all
`3 * UNROLL` loads issued before any is used (indices past the segment re-read its
last part and are masked to weight 0), then folds them into the running state with
one base-2 rescale. So a trip is one dependent global round trip for
`PARTS_PER_TRIP = PART_GROUPS * UNROLL` parts, however many parts there are.
The part groups then meet: butterfly shuffles (`ptx.shfl_xor`) between the groups
that share a warp, then shared memory across warps, where one thread per output
element merges the `slots` states left and writes `out`.

Round trips: a thread waits on global memory twice for its tables (the combine row,
then the segment's fields, which it names) and once per loop trip, whatever head_dim:
for the 129 chunks of a 32K-key segment (`decode.CHUNK_KEYS` = 256), 2 + 3 = 5, where
walking the parts one dependent load at a time would take hundreds. `python -m
bench.sass` counts them in the compiled code (a wait wherever a load's result is first
used while it is outstanding) and budgets them.

Determinism: which thread takes which part, the order in which a thread folds its
parts and the order in which states meet depend only on the part's index within
the segment, `head_dim` and the constants here: a segment's output is the same bits
whatever else shares the launch (and whichever slots and `max_q_len` the step
gives it). Index arithmetic is int32 (the caller keeps the partials under
`INT32_MAX` elements); no float64.
"""
from __future__ import annotations

import math
from functools import lru_cache

from ...device import SIMULATOR, cuda
from ..intrinsics import ptx
from ..launch.constants import LN2, LOG2E, NEG_INF, WARP
from ..launch.calling import PER_CALL, Specialised, no_output
from ..sinks import no_sinks, with_sink
from ..softmax import merge, rescaling
from .chunks import COMBINE_FIELDS, COMBINE_PART, COMBINE_PARTS, COMBINE_SEG
from ..masks import read_segment

from numba import float32, int32, uint32  # noqa: E402  (after kvnumba.device)

#: part groups per block: threads over parts (each group `lanes` threads over head_dim)
PART_GROUPS = 8
#: parts a thread loads per loop trip, all before it uses any (a compile-time unroll)
UNROLL = 8
#: parts a block loads per loop trip: one dependent global round trip each (up to
#: head_dim 256; half as many at 512, where a block has half as many part groups)
PARTS_PER_TRIP = PART_GROUPS * UNROLL
#: threads a block: part groups times lanes stay within it
MAX_THREADS = 512
#: the widest rows merged: a latent layer's V (its decode runs on the tensor cores)
MAX_HEAD_DIM = 512
#: float32 accumulator elements per 16-byte load
VEC = 4

#: grid extents: (combine row, query, q head) on x, y, z
MAX_GRID_Y = MAX_GRID_Z = 65535

ZERO = float32(0.0)
ONE = float32(1.0)

assert PART_GROUPS & (PART_GROUPS - 1) == 0 and UNROLL & (UNROLL - 1) == 0


def lanes(head_dim: int) -> int:
    """Threads over one accumulator row: the smallest power of two >= `head_dim / VEC`
    (those past it are idle, re-reading the last piece and writing nothing)."""
    pieces = head_dim // VEC
    return 1 << (pieces - 1).bit_length()


def part_groups(head_dim: int) -> int:
    """Part groups per block: `PART_GROUPS`, fewer where their lanes would pass
    `MAX_THREADS` (4 at head_dim 512)."""
    return min(PART_GROUPS, MAX_THREADS // lanes(head_dim))


def threads(head_dim: int) -> int:
    """Threads per block: `part_groups(head_dim) * lanes(head_dim)` (32 at head_dim 16,
    256 at 128, 512 at 256 and 512)."""
    return part_groups(head_dim) * lanes(head_dim)


def supports(head_dim: int) -> bool:
    """head_dim a multiple of 16 up to `MAX_HEAD_DIM`: what the decode paths write
    (whole 16-byte float32 pieces, at most `MAX_THREADS` threads a block)."""
    return head_dim % 16 == 0 and 16 <= head_dim <= MAX_HEAD_DIM


@lru_cache(maxsize=None)
def _combine_kernel(head_dim: int):
    """The combine kernel for one head_dim (module doc); out's dtype (float16, float32,
    bfloat16 as uint16) is the launch's own specialisation."""
    if not supports(head_dim):
        raise ValueError(f"combine: head_dim {head_dim} must be a multiple of 16 in "
                         f"[16, {MAX_HEAD_DIM}]")
    HEAD_DIM = head_dim
    GROUPS = part_groups(head_dim)
    TRIP = GROUPS * UNROLL                    # parts a block loads per loop trip
    PIECES = head_dim // VEC                  # 16-byte pieces of a float32 row
    LANES = lanes(head_dim)
    LANE_SHIFT = LANES.bit_length() - 1
    IDLE = PIECES != LANES                    # lanes past the row (head_dim 48, 80, ...)
    THREADS = GROUPS * LANES
    # butterfly masks between part groups in one warp (LANES < WARP); the lanes of a
    # warp's first group then hold its merged states
    ROUNDS = max(0, (WARP // LANES).bit_length() - 1)   # masks LANES, 2 LANES, ..., 16
    SPAN = max(LANES, WARP)                   # threads per state left after the shuffles
    SLOTS = THREADS // SPAN                   # states per piece merged in shared memory
    SPAN_SHIFT = SPAN.bit_length() - 1
    SLOT_ROW = LANES * VEC                    # a state's accumulators (idle lanes' too)

    @cuda.jit(device=True, inline="always")
    def _fold(run_m, run_s, a0, a1, a2, a3, m, s, b0, b1, b2, b3):
        """Merge state (m, s, b) into (run_m, run_s, a): base-2 log-sum-exp."""
        best, total, wa, wb = merge(run_m, run_s, m, s, ONE)
        return (best, total, a0 * wa + b0 * wb, a1 * wa + b1 * wb, a2 * wa + b2 * wb,
                a3 * wa + b3 * wb)

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (THREADS, 1)}))
    def combine(tables, part_acc, part_ml, out, lse, sinks, seq_info_off, combine_off,
                max_q_len):
        tid = int32(cuda.threadIdx.x)
        piece = tid & int32(LANES - 1)
        group = tid >> int32(LANE_SHIFT)
        entry = int32(combine_off) + int32(cuda.blockIdx.x) * int32(COMBINE_FIELDS)
        i = int32(cuda.blockIdx.y)
        head = int32(cuda.blockIdx.z)
        seg = tables[uint32(entry + COMBINE_SEG)]
        first = tables[uint32(entry + COMBINE_PART)]
        n = tables[uint32(entry + COMBINE_PARTS)]
        q_start, q_len, _, _, _ = read_segment(tables, int32(seq_info_off), seg)
        # the head's sink (base 2), loaded with the combine row: no round trip of its own
        sunk = sinks.shape[0] > 0
        sink = sinks[head] * LOG2E if sunk else NEG_INF
        # a query past the segment's merges nothing and writes nothing; no early return,
        # so that the combine row's three loads go out together, before the segment's
        if i >= q_len:
            n = int32(0)
        # int32 throughout (Numba widens int32 arithmetic to int64: every step is cast
        # back); unsigned indices skip Numba's negative-index wraparound
        n_heads = int32(out.shape[1])
        part_stride = int32(int32(max_q_len) * n_heads)  # `at` per partial slot
        group_step = int32(GROUPS * part_stride)    # `at` between a group's parts
        lane_piece = min(piece, int32(PIECES - 1)) if IDLE else piece
        lane_dim = int32(lane_piece * int32(VEC))
        # `at` of the thread's first part, and of the segment's last (what a part index
        # past the segment re-reads, at weight 0)
        at_first = int32(int32(int32(first + group) * part_stride) + int32(i * n_heads) + head)
        at_last = int32(at_first + int32(int32(n - int32(1) - group) * part_stride))

        m = cuda.local.array(UNROLL, float32)
        s = cuda.local.array(UNROLL, float32)
        w = cuda.local.array((UNROLL, VEC), float32)
        run_m = NEG_INF
        run_s = ZERO
        a0 = a1 = a2 = a3 = ZERO
        k0 = group                             # the thread's part of the trip's first u
        at0 = at_first
        while k0 < n:
            # every load of the trip first (independent of each other and of the state)
            for u in range(UNROLL):
                inside = int32(k0 + int32(u * GROUPS)) < n
                at = int32(at0 + int32(u * group_step)) if inside else at_last
                mu = part_ml[uint32(int32(2) * at)]
                s[u] = part_ml[uint32(int32(int32(2) * at) + int32(1))]
                w0, w1, w2, w3 = ptx.ld_nc_v4(part_acc, int32(int32(at * int32(HEAD_DIM))
                                                              + lane_dim))
                # past the segment: max -inf, weight 0. An added -inf (chosen before
                # the loads) rather than a select on the loaded value, so no predicate
                # has to stay live until the loads land (sm_90 has 7)
                m[u] = mu + (ZERO if inside else NEG_INF)
                w[u, 0] = ptx.u32_as_f32(w0)
                w[u, 1] = ptx.u32_as_f32(w1)
                w[u, 2] = ptx.u32_as_f32(w2)
                w[u, 3] = ptx.u32_as_f32(w3)
            # then one rescale of the running state to the trip's max, and the sums
            best = run_m
            for u in range(UNROLL):
                best = max(best, m[u])
            alpha, _ = rescaling(run_m, best, ONE)       # 0 while nothing is seen yet
            run_s *= alpha
            a0 *= alpha
            a1 *= alpha
            a2 *= alpha
            a3 *= alpha
            for u in range(UNROLL):
                weight, _ = rescaling(m[u], best, ONE)
                run_s += weight * s[u]
                a0 += weight * w[u, 0]
                a1 += weight * w[u, 1]
                a2 += weight * w[u, 2]
                a3 += weight * w[u, 3]
            run_m = best
            k0 = int32(k0 + int32(TRIP))
            at0 = int32(at0 + int32(UNROLL * group_step))

        # the part groups of a warp meet in butterfly rounds, then the warps' states in
        # shared memory. Partners may differ in the last bits (FMA contraction makes the
        # fold asymmetric), but only the lanes of a warp's first group (or, past 32
        # lanes, every lane of a slot) go on: a fixed choice, so a fixed order
        for r in range(ROUNDS):
            mask = LANES << r
            run_m, run_s, a0, a1, a2, a3 = _fold(
                run_m, run_s, a0, a1, a2, a3, ptx.shfl_xor(run_m, mask),
                ptx.shfl_xor(run_s, mask), ptx.shfl_xor(a0, mask), ptx.shfl_xor(a1, mask),
                ptx.shfl_xor(a2, mask), ptx.shfl_xor(a3, mask))
        slot_m = cuda.shared.array(SLOTS, float32)
        slot_s = cuda.shared.array(SLOTS, float32)
        slot_acc = cuda.shared.array((SLOTS, SLOT_ROW), float32)
        slot = tid >> int32(SPAN_SHIFT)
        if tid & int32(SPAN - 1) < LANES:      # a holder of its slot's merged state
            if piece == 0:
                slot_m[slot] = run_m
                slot_s[slot] = run_s
            slot_acc[slot, piece * VEC] = a0
            slot_acc[slot, piece * VEC + 1] = a1
            slot_acc[slot, piece * VEC + 2] = a2
            slot_acc[slot, piece * VEC + 3] = a3
        cuda.syncthreads()
        if tid < HEAD_DIM and i < q_len:       # one thread per output element
            best = NEG_INF
            for j in range(SLOTS):
                best = max(best, slot_m[j])
            total = ZERO
            value = ZERO
            for j in range(SLOTS):
                weight, _ = rescaling(slot_m[j], best, ONE)
                total += weight * slot_s[j]
                value += weight * slot_acc[j, tid]
            if sunk:
                best, weight, total = with_sink(best, total, sink)
                value *= weight
            out[q_start + i, head, tid] = ptx.from_f32(value / total, out)
            if tid == 0 and lse.shape[0] > 0:
                lse[q_start + i, head] = best * LN2 + math.log(total)

    return Specialised(combine)


def prepare(tables, part_acc, part_ml, *, seq_info_off, combine_off, n_combine, max_q_len,
            n_q_heads, head_dim, stream=0):
    """The prepared half of `run`: the merge of one step's split segments into outputs of
    `n_q_heads` q heads and `head_dim`, bound to its tables and partials (the kernel,
    grid and block worked out once); `launch(out, lse, sinks)` merges into `out` (and
    `lse`, unless it has no rows: `launch.calling.no_output()`; with the heads' `sinks`
    unless it has no elements: `sinks.no_sinks()`). None when there is nothing to merge."""
    if n_combine <= 0:
        return None
    if n_q_heads > MAX_GRID_Z or max_q_len > MAX_GRID_Y:
        raise ValueError(f"combine.run: {n_q_heads} q heads / max_q_len {max_q_len} past "
                         f"the grid's {MAX_GRID_Z} / {MAX_GRID_Y}")
    kernel = _combine_kernel(int(head_dim))
    return kernel.bind((int(n_combine), int(max_q_len), int(n_q_heads)), threads(head_dim),
                       stream, tables, part_acc, part_ml, PER_CALL, PER_CALL, PER_CALL,
                       int(seq_info_off),
                       int(combine_off), int(max_q_len))


def run(tables, part_acc, part_ml, out, *, seq_info_off, combine_off, n_combine, max_q_len,
        lse=None, sinks=None, stream=0):
    """Merge the partials of the `n_combine` split segments listed at `combine_off` in
    `tables` into their rows of `out` (see the module doc for the layouts).

    tables: int32 device array (segment table at `seq_info_off`, combine table at
    `combine_off`, flat row-major). part_acc, part_ml: the float32 partials `decode.run`
    wrote, laid out for `max_q_len` and `out.shape[1]` q heads. out: [width, n_q_heads,
    head_dim] float16, float32 or bfloat16 (uint16 bits); head_dim a multiple of 16 up
    to `MAX_HEAD_DIM`. Writes exactly `out[q_start + i, head, :]` for every query `i`
    of a listed segment and every head, and, with `lse` (float32 `[width, n_q_heads]`),
    `lse[q_start + i, head]`; with `sinks` (float32 `[n_q_heads]`), each head's sink in
    its rows' softmax. Launches on `stream` only; no synchronisation, no allocation.
    """
    if n_combine <= 0:
        return out
    _, n_q_heads, head_dim = out.shape
    prepare(tables, part_acc, part_ml, seq_info_off=seq_info_off, combine_off=combine_off,
            n_combine=n_combine, max_q_len=max_q_len, n_q_heads=n_q_heads,
            head_dim=head_dim, stream=stream)(out, no_output() if lse is None else lse,
                                              no_sinks() if sinks is None else sinks)
    return out
