"""Decode attention built for memory bandwidth: a host `plan()` and a device `run()`.

Decode segments (at most `DECODE_MAX_Q_LEN` queries each) read every key of their
history once per step and do little arithmetic with it, so the kernel is shaped to
stream K and V at the chip's bandwidth with few instructions per key.

* Work (`plan`, host): each served segment's key range, the union of its queries'
  visible intervals, is cut into chunks of `CHUNK` keys, one block each (per kv head
  and row group). Long sequences get many chunks, short ones one, so a skewed batch
  is balanced; the length is fixed, so a segment's arithmetic never depends on what
  else shares its step. The work table lists (segment, key chunk, partial slot); a segment of
  several chunks writes unnormalised partials that `_combine_kernel` merges
  (log-sum-exp) into `out`, a single chunk writes `out` itself.
* Blocks: one per (work item, kv head, row group), `WARPS` warps, row groups
  adjacent in the grid so they meet the same K/V in L2. A block's *rows* are
  (query token, q head of the kv head's GQA group) pairs, token-major: row `r` ->
  token `r // group`, q head `kv_head * group + r % group`. Every K/V byte a block
  loads serves all its rows; the rows of a segment that do not fit one block's
  registers (`Geometry.max_rows`) go to further row groups.
* Lanes: a key row (`head_dim * itemsize` bytes) is split into 16-byte pieces over
  `lanes` lanes, loaded with `ld.global.nc.v4` straight from storage (two pieces
  per lane past 32 lanes), so a warp takes `32 / lanes` keys per step and each
  lane `UNROLL` keys per trip. Loads run a phase ahead: the next trip's K is
  loaded once this trip's scores are made, its V once this trip's V is
  accumulated, so a lane computes with one to two trips of loads in flight. A
  lane keeps its slice of every row's query and accumulator in registers as
  float32.
* Scores: a lane's partial dot products meet over the key's lanes in butterfly
  rounds (`shfl_xor`) that also split the rows, so each lane ends with whole
  scores of a few *held* rows, runs their online softmax (float32, base 2,
  against a reference max that moves only by more than `RESCALE_SLACK`), and
  `shfl_idx` brings every row's probabilities and rescale factor back to all
  lanes for the accumulators.
* End of a chunk: the states of the block's (warp, key slot) pairs merge through
  shared memory; the block writes its rows of `out` (in out's dtype) or its
  partial (acc, max, sum).

Specialised per head_dim, storage dtype, rows per block and softcap on / off
(`_decode_kernel`); q and out may each be float16, float32 or bfloat16 (as uint16 bits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..config import INT32_MAX, MAX_HEAD_DIM
from ..device import SIMULATOR, cuda
from ..plan import POS_START, Q_LEN
from . import ptx
from .attention import DECODE_MAX_Q_LEN
from .launch import Specialised
from .masks import key_range, read_segment

from numba import float32, int32, njit, uint32  # noqa: E402  (after kvnumba.device)

# --- the plan's tables (int32), packed by the caller into the step's `tables` -----------
#: work table: one row per (segment, key chunk)
WORK_SEG = 0        # index of the segment in the step's segment table
WORK_KEY_LO = 1     # first key position of the chunk
WORK_KEY_HI = 2     # one past its last key position
WORK_PART = 3       # partial slot, or -1: the segment's only chunk writes `out` itself
WORK_FIELDS = 4
#: combine table: one row per segment cut into several chunks
COMBINE_SEG = 0     # index of the segment in the step's segment table
COMBINE_PART = 1    # partial slot of its first chunk (its chunks take consecutive slots)
COMBINE_PARTS = 2   # how many chunks
COMBINE_FIELDS = 3

#: chunks are whole multiples of this many keys (whole block trips for head_dim >= 64)
KEY_TILE = 64
#: keys per chunk (a block's work): few enough that a long sequence spreads over many
#: blocks, enough that a block's fixed costs stay small against its loads
CHUNK = 256

WARP = 32
WARPS = 4
THREADS = WARPS * WARP
#: keys per lane per trip: UNROLL to 2 x UNROLL 16-byte loads of a lane in flight
UNROLL = 4
#: registers per lane for the big arrays, each row's query and accumulator slices
#: and the K and V words of a trip, and a cap on rows per block (scores and
#: probabilities grow with rows too): 4 rows at head_dim 128 float16 take 168
#: registers in all
REGISTER_BUDGET = 96
MAX_ROWS = 4
#: blocks of THREADS the kernel must fit per SM: ptxas keeps it to 168 registers
BLOCKS_PER_SM = 3
#: (the simulator takes no launch bounds)
LAUNCH_BOUNDS = {} if SIMULATOR else {"launch_bounds": (THREADS, BLOCKS_PER_SM)}
COMBINE_THREADS = 128

#: a row's reference max moves only when a score passes it by this much (base 2):
#: probabilities stay <= 2**RESCALE_SLACK and the accumulators are rescaled rarely
RESCALE_SLACK = 8.0
LOAD_BYTES = 16
LOG2E = 1.4426950408889634
NEG_INF = float32(-math.inf)
ZERO = float32(0.0)


# --- storage widening: 16 loaded bytes (4 uint32 words) -> float32 values ------------------
# One entry per storage dtype; bfloat16 storage holds its bit patterns as uint16.

def _widen_pairs(pair_to_f32):
    """Widening for a 16-bit storage type: each word holds two values (`pair_to_f32`)."""
    @cuda.jit(device=True)
    def widen(w0, w1, w2, w3):
        a0, a1 = pair_to_f32(w0)
        b0, b1 = pair_to_f32(w1)
        c0, c1 = pair_to_f32(w2)
        d0, d1 = pair_to_f32(w3)
        return a0, a1, b0, b1, c0, c1, d0, d1
    return widen


@cuda.jit(device=True)
def _widen_float32(w0, w1, w2, w3):
    return ptx.u32_as_f32(w0), ptx.u32_as_f32(w1), ptx.u32_as_f32(w2), ptx.u32_as_f32(w3)


WIDEN = {np.dtype(np.float16): _widen_pairs(ptx.f16x2_to_f32),
         np.dtype(np.float32): _widen_float32,
         np.dtype(np.uint16): _widen_pairs(ptx.bf16x2_to_f32)}


@cuda.jit(device=True)
def _cap(score, softcap):
    """`softcap * tanh(score / softcap)`, in base 2 (the score came in natural units)."""
    return softcap * float32(LOG2E) * math.tanh(score / softcap)


def supports(head_dim: int, storage_dtype) -> bool:
    """Whether this path serves K/V storage of `head_dim` and `storage_dtype`.

    It needs a storage dtype it can widen (float16, float32, bfloat16 as uint16 bits)
    and key rows that are whole 16-byte loads; it is built for the head dims models
    use, multiples of 16 up to `MAX_HEAD_DIM` (those rows are whole 16-byte loads at
    any 2- or 4-byte dtype). Anything else takes the generic kernel.
    """
    dtype = np.dtype(storage_dtype)
    return dtype in WIDEN and head_dim % 16 == 0 and 16 <= head_dim <= MAX_HEAD_DIM


@dataclass(frozen=True)
class Geometry:
    """How a key row of `head_dim` elements of `itemsize` bytes maps onto a warp.

    vec: elements per 16-byte load; pieces: loads per key row; lanes: lanes per key
    (a power of two, idle lanes when `pieces` is not); per_lane: loads per lane
    per key; elements: key elements per lane; key_slots: keys a warp takes at once;
    max_rows: rows per block within REGISTER_BUDGET and MAX_ROWS (a power of two).
    """

    vec: int
    pieces: int
    lanes: int
    per_lane: int
    elements: int
    key_slots: int
    max_rows: int

    @classmethod
    def of(cls, head_dim: int, itemsize: int) -> "Geometry":
        vec = LOAD_BYTES // itemsize
        pieces = head_dim // vec
        lanes = min(WARP, 1 << (pieces - 1).bit_length())
        per_lane = -(-pieces // lanes)
        elements = vec * per_lane
        words = 2 * UNROLL * per_lane * 4          # K and V words of a trip
        rows = max(1, min(MAX_ROWS, (REGISTER_BUDGET - words) // (2 * elements)))
        return cls(vec, pieces, lanes, per_lane, elements, WARP // lanes,
                   1 << (rows.bit_length() - 1))


@lru_cache(maxsize=None)
def block_rows(rows: int, head_dim: int, storage_dtype) -> int:
    """Rows per block for `rows` rows per segment: the smallest power of two holding
    them, at most what fits the registers."""
    cap = Geometry.of(head_dim, np.dtype(storage_dtype).itemsize).max_rows
    return min(cap, 1 << (max(rows, 1) - 1).bit_length())


# --- host planning ----------------------------------------------------------------------

class DecodePlan(NamedTuple):
    """One step's decode work, as int32 tables for the device.

    work: [n_items, WORK_FIELDS] (fields WORK_*); combine: [n_combine,
    COMBINE_FIELDS] (fields COMBINE_*); n_parts: partial slots the work uses;
    chunk: the common chunk length (keys); max_q_len: longest served segment.
    """

    work: np.ndarray
    combine: np.ndarray
    n_parts: int
    chunk: int
    max_q_len: int

    @property
    def n_items(self) -> int:
        return len(self.work)

    @property
    def n_combine(self) -> int:
        return len(self.combine)


def plan(seq_info, segments, *, window: int, chunk: int = CHUNK) -> DecodePlan:
    """Cut the served segments' key ranges into chunks of `chunk` keys (host only, one
    compiled pass).

    seq_info: host [n_segments, SEQ_INFO_FIELDS] int32 segment table; segments: the
    indices of the segments this path serves (each `Q_LEN <= DECODE_MAX_Q_LEN`).
    window: the layer's W (0: none). chunk: a multiple of KEY_TILE.

    Every block walks at most `chunk` keys, so a skewed batch's long sequences are
    spread over many blocks while short ones take one. The length is fixed rather
    than fitted to the step's total keys: a segment's chunks, and so the order in
    which its scores are summed, then never depend on what else is in the step, and
    its output is the same bits alone or in any batch.
    """
    if chunk <= 0 or chunk % KEY_TILE or chunk & (chunk - 1):
        raise ValueError(f"decode: chunk {chunk} must be a power of two and a multiple of "
                         f"{KEY_TILE}")
    segments = np.asarray(segments, np.int32).reshape(-1)
    work, combine, n_parts, shortest, longest = _cut(np.asarray(seq_info, np.int32),
                                                     segments, window, chunk.bit_length() - 1)
    if shortest < 1 or longest > DECODE_MAX_Q_LEN:
        raise ValueError(f"decode segments hold 1..{DECODE_MAX_Q_LEN} queries, got "
                         f"{shortest}..{longest}")
    return DecodePlan(work, combine, n_parts, chunk, longest)


@njit(cache=True)
def _cut(seq_info, segments, window, shift):
    """The work and combine tables (see the module constants), the partial slots used,
    and the shortest and longest segment (1 and 0 when there are none).

    One compiled pass over the segments: a step's plan costs a few µs of host time
    however many segments it has. A segment's queries' intervals move forward
    (`masks.key_range`), so their union runs from the first query's lo (a draft
    block's too: its lo never passes pos_start) to pos_start + q_len.
    """
    chunk = 1 << shift                  # a power of two: no division per segment
    n_items = 0
    n_split = 0
    shortest = 1
    longest = 0
    for seg in segments:
        q_len = seq_info[seg, Q_LEN]
        shortest = min(shortest, q_len)
        longest = max(longest, q_len)
        pos_start = seq_info[seg, POS_START]
        lo = max(pos_start - (window - 1), 0) if window > 0 else 0
        chunks = (pos_start + q_len - lo + chunk - 1) >> shift
        n_items += chunks
        n_split += chunks > 1
    work = np.empty((n_items, WORK_FIELDS), np.int32)
    combine = np.empty((n_split, COMBINE_FIELDS), np.int32)
    item = 0
    part = 0
    split = 0
    for seg in segments:
        pos_start = seq_info[seg, POS_START]
        hi = pos_start + seq_info[seg, Q_LEN]
        lo = max(pos_start - (window - 1), 0) if window > 0 else 0
        chunks = (hi - lo + chunk - 1) >> shift
        if chunks > 1:
            combine[split, COMBINE_SEG] = seg
            combine[split, COMBINE_PART] = part
            combine[split, COMBINE_PARTS] = chunks
            split += 1
        for c in range(chunks):
            work[item, WORK_SEG] = seg
            work[item, WORK_KEY_LO] = lo + c * chunk
            work[item, WORK_KEY_HI] = min(lo + (c + 1) * chunk, hi)
            work[item, WORK_PART] = part + c if chunks > 1 else -1
            item += 1
        if chunks > 1:
            part += chunks
    return work, combine, part, shortest, longest


# --- kernels ----------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _decode_kernel(head_dim: int, storage: str, rows: int, capped: bool):
    """The decode kernel for one head_dim, storage dtype (name), rows per block and
    softcap on / off (module doc)."""
    g = Geometry.of(head_dim, np.dtype(storage).itemsize)
    widen = WIDEN[np.dtype(storage)]
    VEC, PIECES, LANES, PER_LANE, ELEMENTS = g.vec, g.pieces, g.lanes, g.per_lane, g.elements
    KEY_SLOTS = g.key_slots
    IDLE_PIECES = PIECES % LANES != 0          # some lanes hold no piece of a key row
    LEVELS = LANES.bit_length() - 1            # shuffle rounds over a key's lanes
    ROWS = rows
    SPLITS = min(LEVELS, ROWS.bit_length() - 1)   # rounds that also split the rows
    HELD = ROWS >> SPLITS                      # rows whose softmax a lane keeps
    COPIES = (LANES >> SPLITS) - 1             # lane bits of lanes holding the same rows
    CAPPED = capped
    WARP_KEYS = UNROLL * KEY_SLOTS             # keys per warp per trip
    BLOCK_KEYS = WARPS * WARP_KEYS             # keys per block per trip
    SLOTS = WARPS * KEY_SLOTS                  # softmax states merged at the end
    assert ROWS <= g.max_rows

    # Every loop over a compile-time range is unrolled, so the local arrays (indexed
    # by those loops only) live in registers.
    @cuda.jit(device=True, inline="always")
    def _load_keys(store, words, t, geometry):
        """Load this lane's pieces of its UNROLL keys of trip `t` from `store` (K or V)
        into `words`. `geometry`: (store_lo, wrap, last, lane_first, row_stride,
        lane_offset, sub) as `decode` computes them."""
        store_lo, wrap, last, lane_first, row_stride, lane_offset, sub = geometry
        for u in range(UNROLL):
            # keys past the chunk re-read its last key (held, finite) and are masked
            row = int32(store_lo + min(int32(lane_first + t * BLOCK_KEYS + u * KEY_SLOTS),
                                       last))
            if row >= wrap:
                row = int32(row - wrap)
            at = row * row_stride + lane_offset
            for c in range(PER_LANE):
                if not IDLE_PIECES or c * LANES + sub < PIECES:
                    w0, w1, w2, w3 = ptx.ld_nc_v4(store, at + c * LANES * VEC)
                else:
                    w0 = w1 = w2 = w3 = uint32(0)
                words[u, c, 0] = w0
                words[u, c, 1] = w1
                words[u, c, 2] = w2
                words[u, c, 3] = w3

    @cuda.jit(device=True, inline="always")
    def _widen_words(words, values):
        """The trip's loaded words as float32: `values[u, e]`, element e of key slot u."""
        for u in range(UNROLL):
            for c in range(PER_LANE):
                f = widen(words[u, c, 0], words[u, c, 1], words[u, c, 2], words[u, c, 3])
                for e in range(VEC):
                    values[u, c * VEC + e] = f[e]

    @cuda.jit(device=True, inline="always")
    def _split_rows(score, sub):
        """Sum `score[u, r]` over the LANES lanes of a key, splitting the rows as it goes.

        The first SPLITS butterfly rounds each halve the rows a lane keeps (the lane
        with the round's bit set keeps the upper half) and add the partner's partial
        sums of those rows; the remaining rounds add over the last lane bits. A lane
        ends with the full scores of rows `own + j` in `score[u, j]`, `j < HELD`:
        ROWS * UNROLL * (1 - 1 / 2**SPLITS) fewer shuffles than summing every row.
        """
        for level in range(SPLITS):
            half = ROWS >> (level + 1)
            upper = (sub & (LANES >> (level + 1))) != 0
            for j in range(ROWS // 2):
                if j < half:
                    for u in range(UNROLL):
                        lower_rows, upper_rows = score[u, j], score[u, j + half]
                        keep = upper_rows if upper else lower_rows
                        give = lower_rows if upper else upper_rows
                        score[u, j] = keep + ptx.shfl_xor(give, LANES >> (level + 1))
        for level in range(SPLITS, LEVELS):
            for j in range(HELD):
                for u in range(UNROLL):
                    score[u, j] += ptx.shfl_xor(score[u, j], LANES >> (level + 1))

    @cuda.jit(device=True, inline="always")
    def _gather_rows(prob, alpha, lane):
        """Undo `_split_rows`' row split for `prob[u, r]` and `alpha[r]`: row r comes
        from the lane of this key whose split bits (the top SPLITS bits of its piece
        index) select rows `r - r % HELD ...`, where it is held at `r % HELD`."""
        others = lane & ~(((1 << SPLITS) - 1) * (COPIES + 1))   # split bits cleared
        for step in range(ROWS):
            r = ROWS - 1 - step                # downwards: held rows move up, not over
            source = others | (r // HELD) * (COPIES + 1)
            for u in range(UNROLL):
                prob[u, r] = ptx.shfl_idx(prob[u, r % HELD], source)
            alpha[r] = ptx.shfl_idx(alpha[r % HELD], source)

    @cuda.jit(**LAUNCH_BOUNDS)
    def decode(q, k_store, v_store, tables, out, part_acc, part_ml, seq_info_off, work_off,
               max_q_len, group, n_row_groups, ring_rows, window, scale, softcap):
        tid = cuda.threadIdx.x
        warp = tid // WARP
        lane = tid % WARP
        sub = lane % LANES                     # which 16-byte pieces of a key row
        key_slot = lane // LANES               # which key of the warp's step
        row_group = cuda.blockIdx.x % n_row_groups
        kv_heads = k_store.shape[2]
        kv_head = (cuda.blockIdx.x // n_row_groups) % kv_heads
        item = work_off + (cuda.blockIdx.x // (n_row_groups * kv_heads)) * WORK_FIELDS
        seg = tables[item + WORK_SEG]
        key_lo = tables[item + WORK_KEY_LO]
        key_hi = tables[item + WORK_KEY_HI]
        part = tables[item + WORK_PART]
        q_start, q_len, col, pos_start, block = read_segment(tables, seq_info_off, seg)
        first_row = row_group * ROWS
        if first_row >= group * q_len:         # a row group this segment does not fill
            return

        # this lane's slice of every row's query, scaled so that scores come out in
        # base 2 (after the cap, when capped); padding rows read a real query, and a
        # lane past the key row (IDLE_PIECES) any piece: its K words are zeros
        q_scale = scale if CAPPED else scale * float32(LOG2E)
        qr = cuda.local.array((ROWS, ELEMENTS), float32)
        for r in range(ROWS):
            row = first_row + r
            token = q_start + min(row // group, q_len - 1)
            head = kv_head * group + row % group
            for c in range(PER_LANE):
                piece = min(c * LANES + sub, PIECES - 1) if IDLE_PIECES else c * LANES + sub
                for e in range(VEC):
                    qr[r, c * VEC + e] = ptx.to_f32(q[token, head, piece * VEC + e]) * q_scale

        # the rows this lane keeps the softmax of: own + j, j < HELD (see _split_rows);
        # held row j sees the chunk's keys at offsets [lo, lo + span) from key_lo (none
        # for a padding row)
        own = sub // (COPIES + 1) * HELD
        held_lo = cuda.local.array(HELD, int32)
        held_span = cuda.local.array(HELD, uint32)
        run_max = cuda.local.array(HELD, float32)    # reference max (base 2) and sum
        run_sum = cuda.local.array(HELD, float32)
        for j in range(HELD):
            row = first_row + own + j
            lo, hi = key_range(min(row // group, q_len - 1), q_len, pos_start, block, window)
            lo = max(lo, key_lo)
            hi = min(hi, key_hi)
            held_lo[j] = lo - key_lo
            held_span[j] = max(hi - lo, 0) if row < group * q_len else 0
            run_max[j] = NEG_INF
            run_sum[j] = ZERO

        # storage: key position p lives in row p (flat) or p % ring_rows (ring). A chunk
        # lies in one segment's visible keys, at most ring_rows of them, so the row of
        # the key at offset `off` wraps at most once past `store_lo`, the row of key_lo.
        # Offsets and rows are int32 (one IMAD.WIDE makes the element index).
        row_stride = int32(k_store.shape[1] * kv_heads * head_dim)
        lane_offset = (col * kv_heads + kv_head) * head_dim + sub * VEC
        wrap = int32(ring_rows if ring_rows > 0 else INT32_MAX)
        store_lo = int32(key_lo % wrap)
        last = int32(key_hi - key_lo - 1)
        lane_first = int32(warp * WARP_KEYS + key_slot)   # offset of this lane's key u = 0

        acc = cuda.local.array((ROWS, ELEMENTS), float32)
        for r in range(ROWS):
            for e in range(ELEMENTS):
                acc[r, e] = ZERO
        k_words = cuda.local.array((UNROLL, PER_LANE, 4), uint32)
        v_words = cuda.local.array((UNROLL, PER_LANE, 4), uint32)
        values = cuda.local.array((UNROLL, ELEMENTS), float32)
        score = cuda.local.array((UNROLL, ROWS), float32)   # then probabilities
        alpha = cuda.local.array(ROWS, float32)

        # Loads run one phase ahead: the next trip's K is loaded once this trip's
        # scores are made, its V once this trip's V is accumulated.
        geometry = (store_lo, wrap, last, lane_first, row_stride, lane_offset, sub)
        _load_keys(k_store, k_words, 0, geometry)
        _load_keys(v_store, v_words, 0, geometry)
        trips = (key_hi - key_lo + BLOCK_KEYS - 1) // BLOCK_KEYS
        for t in range(trips):
            # this lane's partial dot products of every row with its keys
            _widen_words(k_words, values)
            for u in range(UNROLL):
                for r in range(ROWS):
                    score[u, r] = ZERO
            for e in range(ELEMENTS):
                for r in range(ROWS):
                    for u in range(UNROLL):
                        score[u, r] += qr[r, e] * values[u, e]
            if t + 1 < trips:
                _load_keys(k_store, k_words, t + 1, geometry)
            # summed over the key's lanes, each lane ending with its held rows
            _split_rows(score, sub)
            # online softmax of the held rows, against a reference max that only
            # moves when a score passes it by RESCALE_SLACK (p <= 2**RESCALE_SLACK)
            first_off = int32(lane_first + t * BLOCK_KEYS)
            for j in range(HELD):
                best = NEG_INF
                for u in range(UNROLL):
                    s = _cap(score[u, j], softcap) if CAPPED else score[u, j]
                    # one unsigned compare: off - lo < span  <=>  lo <= off < lo + span
                    if uint32(first_off + u * KEY_SLOTS - held_lo[j]) >= held_span[j]:
                        s = NEG_INF
                    score[u, j] = s
                    best = max(best, s)
                ref = run_max[j]
                alpha[j] = float32(1.0)
                if best > ref + float32(RESCALE_SLACK):   # also: first visible key
                    alpha[j] = ptx.exp2_approx(ref - best)
                    ref = best
                base = ref if ref != NEG_INF else ZERO   # no visible key yet: p = 0
                total = run_sum[j] * alpha[j]
                for u in range(UNROLL):
                    score[u, j] = ptx.exp2_approx(score[u, j] - base)
                    total += score[u, j]
                run_max[j] = ref
                run_sum[j] = total
            # every lane gets every row's probabilities and rescale factor
            _gather_rows(score, alpha, lane)
            rescale = False
            for r in range(ROWS):
                rescale = rescale or alpha[r] != float32(1.0)
            if rescale:
                for r in range(ROWS):
                    for e in range(ELEMENTS):
                        acc[r, e] *= alpha[r]
            _widen_words(v_words, values)
            for e in range(ELEMENTS):
                for r in range(ROWS):
                    for u in range(UNROLL):
                        acc[r, e] += score[u, r] * values[u, e]
            if t + 1 < trips:
                _load_keys(v_store, v_words, t + 1, geometry)

        # merge the (warp, key slot) states of the block, then write out or the partial
        slot_max = cuda.shared.array((SLOTS, ROWS), float32)
        slot_sum = cuda.shared.array((SLOTS, ROWS), float32)
        slot_acc = cuda.shared.array((SLOTS, ROWS, head_dim), float32)
        slot = warp * KEY_SLOTS + key_slot
        if sub & COPIES == 0:
            for j in range(HELD):
                slot_max[slot, own + j] = run_max[j]
                slot_sum[slot, own + j] = run_sum[j]
        for r in range(ROWS):
            for c in range(PER_LANE):
                piece = c * LANES + sub
                if not IDLE_PIECES or piece < PIECES:
                    for e in range(VEC):
                        slot_acc[slot, r, piece * VEC + e] = acc[r, c * VEC + e]
        cuda.syncthreads()
        n_heads = q.shape[1]
        for o in range(tid, ROWS * head_dim, THREADS):
            r = o // head_dim
            dim = o - r * head_dim
            row = first_row + r
            i = row // group
            if i < q_len:
                best = NEG_INF
                for s in range(SLOTS):
                    best = max(best, slot_max[s, r])
                base = best if best != NEG_INF else ZERO
                total = ZERO
                value = ZERO
                for s in range(SLOTS):
                    weight = ptx.exp2_approx(slot_max[s, r] - base)
                    total += weight * slot_sum[s, r]
                    value += weight * slot_acc[s, r, dim]
                token = q_start + i
                head = kv_head * group + row % group
                if part < 0:
                    out[token, head, dim] = ptx.from_f32(value / total, out)
                else:
                    at = (part * max_q_len + i) * n_heads + head
                    part_acc[at * head_dim + dim] = value
                    if dim == 0:
                        part_ml[2 * at] = best
                        part_ml[2 * at + 1] = total

    return Specialised(decode)


@cuda.jit
def _combine_kernel(tables, part_acc, part_ml, out, seq_info_off, combine_off, max_q_len):
    """Merge one query's chunk partials (all heads) into `out`: base-2 log-sum-exp.

    Block (combine row, query within the segment); partial layout as `run` documents.
    """
    tid = cuda.threadIdx.x
    entry = combine_off + cuda.blockIdx.x * COMBINE_FIELDS
    i = cuda.blockIdx.y
    q_start, q_len, _, _, _ = read_segment(tables, seq_info_off, tables[entry + COMBINE_SEG])
    if i >= q_len:
        return
    first = tables[entry + COMBINE_PART]
    last = first + tables[entry + COMBINE_PARTS]
    token = q_start + i
    n_heads, head_dim = out.shape[1], out.shape[2]
    for o in range(tid, n_heads * head_dim, COMBINE_THREADS):
        head = o // head_dim
        dim = o - head * head_dim
        best = NEG_INF
        for part in range(first, last):
            best = max(best, part_ml[2 * ((part * max_q_len + i) * n_heads + head)])
        total = ZERO
        value = ZERO
        for part in range(first, last):
            at = (part * max_q_len + i) * n_heads + head
            weight = ptx.exp2_approx(part_ml[2 * at] - best)
            total += weight * part_ml[2 * at + 1]
            value += weight * part_acc[at * head_dim + dim]
        out[token, head, dim] = ptx.from_f32(value / total, out)


# --- launch -----------------------------------------------------------------------------

_combine = Specialised(_combine_kernel)


def run(q, k_store, v_store, tables, *, seq_info_off, work_off, n_items, combine_off,
        n_combine, n_parts, max_q_len, out, workspace, ring_rows, window, scale, softcap,
        stream=0):
    """Attention of the planned segments' queries; writes their rows of `out`.

    q, out: [width, n_q_heads, head_dim] device arrays, float16, float32 or bfloat16
    (uint16 bits). k_store, v_store: [rows, n_cols, n_kv_heads, head_dim], float16,
    float32 or bfloat16 as uint16 (`supports`). tables: int32 device array holding the
    segment table at `seq_info_off`, the plan's work table at `work_off` (`n_items`
    rows) and its combine table at `combine_off` (`n_combine` rows), each flat
    row-major.
    n_parts, max_q_len: the plan's. ring_rows: 0 (flat) or R; window: 0 or W;
    softcap: 0 = off.

    Writes exactly `out[token, head, :]` for every query token of a planned segment
    and every head: no padding row, no other segment's row. Partials (float32, in
    `workspace`): acc `[n_parts, max_q_len, n_q_heads, head_dim]`, (max, sum) pairs
    `[n_parts, max_q_len, n_q_heads, 2]`. Launches on `stream` only; no
    synchronisation, no device allocation once `workspace` is warm.
    """
    if n_items == 0:
        return out
    _, n_q_heads, head_dim = q.shape
    n_kv_heads = k_store.shape[2]
    storage = np.dtype(k_store.dtype)
    if not supports(head_dim, storage) or v_store.dtype != storage:
        raise ValueError(f"decode.run: head_dim {head_dim} with {storage} / {v_store.dtype} "
                         f"storage is not served (see decode.supports)")
    group = n_q_heads // n_kv_heads
    rows = block_rows(group * max_q_len, head_dim, storage)
    n_row_groups = -(-group * max_q_len // rows)
    if n_parts > 0:
        part_acc, part_ml = workspace.partials(n_parts * max_q_len * n_q_heads * head_dim,
                                               n_parts * max_q_len * n_q_heads * 2, stream)
    else:
        part_acc = part_ml = workspace.dummy
    kernel = _decode_kernel(head_dim, storage.name, rows, bool(softcap > 0))
    kernel(n_items * n_kv_heads * n_row_groups, THREADS, stream,
           q, k_store, v_store, tables, out, part_acc, part_ml, int(seq_info_off),
           int(work_off), int(max_q_len), group, n_row_groups, int(ring_rows), int(window),
           np.float32(scale), np.float32(softcap))
    if n_combine > 0:
        _combine((n_combine, max_q_len), COMBINE_THREADS, stream,
                 tables, part_acc, part_ml, out, int(seq_info_off), int(combine_off),
                 int(max_q_len))
    return out
