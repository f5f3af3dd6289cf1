"""Decode attention built for memory bandwidth: a host `plan()` and a device `run()`.

Decode segments (at most `DECODE_MAX_Q_LEN` queries each) read every key of their
history once per step and do little arithmetic with it, so the kernel is shaped to
stream K and V at the chip's bandwidth with few instructions per key.

* Work (`plan`, host, in `decode_plan`): each served segment's key range, the union
  of its queries' visible intervals, is cut into chunks of `CHUNK` keys (the last
  one taking a remainder under half a chunk), one block each per kv head and row
  group. Long sequences get many chunks, short ones one, so a skewed batch is
  balanced; the cut depends on the segment alone, so its arithmetic never depends on
  what else shares its step. A work row holds (segment, key chunk, partial slot) and
  the segment fields the first loads need; a segment of several chunks writes
  unnormalised partials that `combine.run` merges (log-sum-exp) into `out`, a
  single chunk writes `out` itself.
* Blocks: grid (work item x row group, kv head), `WARPS` warps, row groups adjacent
  in the grid so they meet the same K/V in L2. A block's *rows* are (query token, q
  head of the kv head's GQA group) pairs, token-major: row `r` -> token `r // group`,
  q head `kv_head * group + r % group`. Every K/V byte a block loads serves all its
  rows; the rows of a segment that do not fit one block's registers
  (`Geometry.max_rows`) go to further row groups.
* Start: one round trip reads the work row, which holds all the first page-table
  lookups need, and a second their slots; the first K and V loads go out before
  anything waits for the query (16-byte loads) or the segment's visibility fields.
* Storage: K and V are slot storage `[n_slots, n_kv_heads, head_dim]`, a cache's
  page pool; the layer kind's page table `pages [n_seq_rows, pages_per_seq]` (int32,
  each entry a page's first slot) puts storage row r of a sequence (its position,
  or on a ring `position % ring_rows`) in slot `pages[seq, r >> page_bits] | (r &
  (page_size - 1))` (`masks.page_slot`), `seq` being the sequence's column in the
  segment table. A key's 16-byte pieces lie together in its slot, so a key takes
  one lookup: the lanes that load the same keys of a trip share out their lookups
  and pass the slots on with shuffles, one lookup per lane per trip.
* Lanes: a key row (`head_dim * itemsize` bytes) is split into 16-byte pieces over
  `lanes` lanes, loaded with `ld.global.nc.v4` straight from storage (two pieces
  per lane past 32 lanes), so a warp takes `32 / lanes` keys per step and each
  lane `UNROLL` keys per trip. A trip's V is loaded as the trip starts and the next
  trip's K once this trip's scores are summed, so loads overlap the arithmetic
  while a lane never holds more than one trip of K and one of V. A lane keeps its
  slice of every row's query and accumulator in registers as float32, in its own
  row order (`_split_rows`).
* Scores: a lane's partial dot products meet over the key's lanes in butterfly
  rounds (`shfl_xor`) that also split the rows, so each lane ends with whole
  scores of a few *held* rows, runs their online softmax (float32, base 2,
  against a reference max that moves only by more than `RESCALE_SLACK`), and
  more butterflies bring every row's probabilities and rescale factor back to
  all lanes for the accumulators.
* End of a chunk: the states of the block's (warp, key slot) pairs meet in shared
  memory (a layout without bank conflicts), and each thread merges a slice of one
  row and writes it to `out` (in out's dtype) or to the partial (acc, max, sum); with
  `out` goes the row's log-sum-exp (natural log, from the base-2 max and sum) when
  an `lse` array with rows is passed.

Index arithmetic is 32-bit (positions, offsets and slots are int32; a slot's byte
offset is one 32 x 32 -> 64-bit multiply) with no 64-bit division, and the key loop
is the kernel's only loop with a runtime trip count. Specialised per head_dim,
storage dtype, rows per block, softcap on / off and q's dtype and alignment
(`_decode_kernel`); q and out may each be float16, float32 or bfloat16 (as uint16
bits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..arrays import aligned
from ..config import INT32_MAX, MAX_HEAD_DIM
from ..device import SIMULATOR, cuda
from ..plan import FLAG_BLOCK, FLAGS, POS_START, SEQ_INFO_FIELDS
from . import combine, ptx
from .decode_plan import (  # noqa: F401  (the decode path's planning, re-exported)
    CHUNK, COMBINE_FIELDS, COMBINE_PART, COMBINE_PARTS, COMBINE_SEG, KEY_TILE, WORK_COL,
    WORK_FIELDS, WORK_KEY_HI, WORK_KEY_LO, WORK_PART, WORK_Q_LEN, WORK_Q_START, WORK_SEG,
    DecodePlan, PlacedPlan, chunk_count, plan, plan_into)
from .decode_words import LOAD_BYTES, WIDEN, query_loader
from .launch import PER_CALL, Specialised, no_output
from .masks import key_range, read_segment

from numba import float32, int32, uint32, uint64  # noqa: E402  (after kvnumba.device)

WARP = 32
WARPS = 4
THREADS = WARPS * WARP
#: keys per lane per trip: UNROLL to 2 x UNROLL 16-byte loads of a lane in flight
UNROLL = 4
#: registers per lane for the big arrays, each row's query and accumulator slices
#: and the K and V words of a trip, and a cap on rows per block (scores and
#: probabilities grow with rows too)
REGISTER_BUDGET = 96
MAX_ROWS = 4
#: blocks of THREADS the kernel must fit per SM: ptxas keeps it to 168 registers
BLOCKS_PER_SM = 3
#: (the simulator takes no launch bounds)
LAUNCH_BOUNDS = {} if SIMULATOR else {"launch_bounds": (THREADS, BLOCKS_PER_SM)}

#: a row's reference max moves only when a score passes it by this much (base 2):
#: probabilities stay <= 2**RESCALE_SLACK and the accumulators are rescaled rarely
RESCALE_SLACK = 8.0
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG_INF = float32(-math.inf)
#: a row's reference max before its first visible key: below every finite score, and
#: finite, so that a masked score (-inf) minus it is -inf (probability 0), not NaN
NO_KEY = float32(-np.finfo(np.float32).max)
ZERO = float32(0.0)
ONE = float32(1.0)


@cuda.jit(device=True, inline="always")
def _reciprocal(x):
    """`1 / x` for a normal float32 `x > 0`, within 2 ulp: a first guess from the bit
    pattern (relative error at most about 5%) and three Newton steps, each squaring the
    error. A rounded division would add a subroutine for inputs this never sees."""
    r = ptx.u32_as_f32(uint32(0x7EF311C3) - ptx.f32_as_u32(x))
    for _ in range(3):
        r = r * (float32(2.0) - x * r)
    return r


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


# --- the kernel ---------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _decode_kernel(head_dim: int, storage: str, rows: int, capped: bool,
                   query: str | None = None, query_vectors: bool = True):
    """The decode kernel for one head_dim, storage dtype (name), rows per block,
    softcap on / off, q's dtype (name; None: the storage dtype) and whether q may be
    read in 16-byte vectors (module doc)."""
    g = Geometry.of(head_dim, np.dtype(storage).itemsize)
    widen = WIDEN[np.dtype(storage)]
    load_query = query_loader(np.dtype(query or storage), head_dim, g.vec, query_vectors)
    VEC, PIECES, LANES, PER_LANE, ELEMENTS = g.vec, g.pieces, g.lanes, g.per_lane, g.elements
    KEY_SLOTS = g.key_slots
    LANE_BITS = LANES.bit_length() - 1
    VEC_BITS = VEC.bit_length() - 1
    IDLE_PIECES = PIECES % LANES != 0          # some lanes hold no piece of a key row
    LEVELS = LANE_BITS                         # shuffle rounds over a key's lanes
    ROWS = rows
    SPLITS = min(LEVELS, ROWS.bit_length() - 1)   # rounds that also split the rows
    HELD = ROWS >> SPLITS                      # rows whose softmax a lane keeps
    COPY_BITS = LEVELS - SPLITS                # low piece bits of lanes holding the same rows
    COPIES = (1 << COPY_BITS) - 1
    CAPPED = capped
    WARP_KEYS = UNROLL * KEY_SLOTS             # keys per warp per trip
    LOOKUPS = max(1, UNROLL // LANES)          # page-table lookups per lane per trip
    BLOCK_KEYS = WARPS * WARP_KEYS             # keys per block per trip
    TRIP_BITS = BLOCK_KEYS.bit_length() - 1
    PIECE_BYTES = LANES * LOAD_BYTES           # from a lane's piece c to its piece c + 1
    SLOTS = WARPS * KEY_SLOTS                  # softmax states merged at the end
    # The merge's shared layout: per slot, per row, word ((c * VEC + e) * LANES + sub)
    # holds element e of piece c * LANES + sub, so a warp's lanes store consecutive
    # words; a slot's block is padded so that the key slots of a warp start LANES
    # banks apart. Each merging thread sums PER_THREAD words of one row, ROW_THREADS
    # apart, so a warp's lanes read consecutive words too.
    ROW_WORDS = ELEMENTS * LANES
    SLOT_WORDS = ROWS * ROW_WORDS + (LANES if KEY_SLOTS > 1 else 0)
    MERGE_WORDS = SLOTS * SLOT_WORDS
    PER_THREAD = max(1, ROWS * ROW_WORDS // THREADS)
    ROW_THREADS = ROW_WORDS // PER_THREAD      # merging threads per row
    ROW_THREAD_BITS = ROW_THREADS.bit_length() - 1
    ALL_MERGE = ROWS * ROW_THREADS == THREADS  # every thread merges a slice
    # with one piece per lane and whole rounds of LANES words between a thread's words,
    # they are elements e, e + ROW_THREADS / LANES, ... of one piece: dims a constant
    # step apart (0: work each one out)
    DIM_STEP = ROW_THREADS // LANES if PER_LANE == 1 and ROW_THREADS % LANES == 0 else 0
    # the block's fields the merge reads from shared memory: per row its index in the
    # segment, token and q head, then the partial slot and the segment's queries
    ROW_INDEX, ROW_TOKEN, ROW_HEAD = 0, ROWS, 2 * ROWS
    PART, Q_LEN, BLOCK_FIELDS = 3 * ROWS, 3 * ROWS + 1, 3 * ROWS + 2
    assert ROWS <= g.max_rows

    # Every loop over a compile-time range is unrolled, so the local arrays (indexed
    # by those loops only) live in registers. Array indices are cast to unsigned
    # where a signed one would cost a negative-index check.
    @cuda.jit(device=True, inline="always")
    def _row(first, group, r):
        """`(index in the segment, index in the GQA group)` of the block's row `r`
        (runtime, `< ROWS`), given the first row's: stepped over the rows and picked
        by selects, with no division and no array indexed at run time."""
        index, in_group = first
        found_index, found_in_group = first
        for k in range(1, ROWS):
            in_group = int32(in_group + 1)
            if in_group == group:
                in_group = int32(0)
                index = int32(index + 1)
            if r == k:
                found_index = index
                found_in_group = in_group
        return found_index, found_in_group

    # A key slot's UNROLL keys of a trip share the page-table lookups out among the
    # slot's LANES lanes: lane `sub` looks up keys u = sub + s * LANES (s < LOOKUPS) and
    # the others take their slots with one shuffle each, so a trip costs a lane one
    # lookup (a shift, an address, one load, one logical operation), not UNROLL.
    @cuda.jit(device=True, inline="always")
    def _look_up(looked, look, store_last, wrap, pages, seq_pages, shift, in_page):
        """Slots of the keys this lane looks up (`looked[s]`: its key slot's key u = sub
        + s * LANES of the trip), the first named by `look`, its storage row before the
        ring wraps. A key named r is in row r, or r - wrap once r reaches `wrap` (`min(r,
        r - wrap)` unsigned), and row r in slot `pages.flat[seq_pages + (r >> shift)] |
        (r & in_page)` (`masks.page_slot`, `seq_pages` the sequence's first table entry,
        `shift` page_bits). Keys past the chunk's last one (`store_last`) look up the
        last one (held, finite; masked)."""
        for s in range(LOOKUPS):
            at = min(uint32(look + s * LANES * KEY_SLOTS), store_last)
            row = min(at, uint32(at - wrap))
            page = uint32(seq_pages + uint32(row >> shift))
            looked[s] = int32(pages.flat[page] | int32(row & in_page))

    @cuda.jit(device=True, inline="always")
    def _key_slots(key_slots, looked, first_lane):
        """Slots of this lane's UNROLL keys of the trip, from the lanes of its key slot
        (`first_lane` on) that looked them up (`_look_up`): one shuffle each."""
        for u in range(UNROLL):
            key_slots[u] = ptx.shfl_idx(looked[u // LANES], first_lane | (u % LANES))

    @cuda.jit(device=True, inline="always")
    def _after(value, x):
        """`x` (an int32), as a value the compiler must compute after float32 `value`:
        `min(x, x + isnan(value))` is `x`, which it cannot see. Loads whose addresses
        use it are not issued before `value` exists, however free the compiler is to
        move loads: this keeps it from fetching the next trip's keys into registers
        while this trip's are still being used."""
        return min(x, int32(x + int32(value != value)))

    @cuda.jit(device=True, inline="always")
    def _load_keys(lane_bytes, words, key_slots, slot_bytes, sub):
        """Load this lane's pieces of the keys in `key_slots` (`lane_bytes`: K or V
        storage from this lane's first piece of slot 0 on) into `words`."""
        for u in range(UNROLL):
            at = ptx.mul_wide_u32(key_slots[u], slot_bytes)
            for c in range(PER_LANE):
                if not IDLE_PIECES or c * LANES + sub < PIECES:
                    w0, w1, w2, w3 = ptx.ld_nc_v4(lane_bytes, at + c * PIECE_BYTES)
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
    def _split_rows(score):
        """Sum `score[u, j]` over the LANES lanes of a key, splitting the rows as it goes.

        A lane keeps its rows in its own order: its local row j is row `j ^ own`,
        `own = (sub >> COPY_BITS) * HELD`. The first SPLITS butterfly rounds each keep
        the lower half of the local rows and add the partner's upper half, which
        (the partners' `own` differing in just that bit) are the same rows; the
        remaining rounds add over the last lane bits. A lane ends with the full
        scores of rows `own + j` in `score[u, j]`, `j < HELD`: ROWS * UNROLL *
        (1 - 1 / 2**SPLITS) fewer shuffles than summing every row, and no selects.
        """
        for level in range(SPLITS):
            half = ROWS >> (level + 1)
            for j in range(half):
                for u in range(UNROLL):
                    score[u, j] += ptx.shfl_xor(score[u, j + half], LANES >> (level + 1))
        for level in range(SPLITS, LEVELS):
            for j in range(HELD):
                for u in range(UNROLL):
                    score[u, j] += ptx.shfl_xor(score[u, j], LANES >> (level + 1))

    @cuda.jit(device=True, inline="always")
    def _gather_rows(prob, alpha):
        """Give every lane `prob[u, j]` and `alpha[j]` of its every local row j (row
        `j ^ own`): the lane holding that row at `j % HELD` differs from it in the
        split bits by `j // HELD`, so one butterfly each, none for a lane's own rows."""
        for j in range(HELD, ROWS):
            holder = (j // HELD) << COPY_BITS
            for u in range(UNROLL):
                prob[u, j] = ptx.shfl_xor(prob[u, j % HELD], holder)
            alpha[j] = ptx.shfl_xor(alpha[j % HELD], holder)

    @cuda.jit(device=True, inline="always")
    def _online_softmax(score, alpha, run_max, run_sum, rel, held_span, softcap):
        """The held rows' softmax over this trip's keys: scores become probabilities
        (base 2), `alpha[j]` the rescale factor of the row's earlier sums. `rel[j]`:
        chunk offset of key u = 0 minus the row's first visible offset."""
        for j in range(HELD):
            best = NEG_INF
            for u in range(UNROLL):
                s = _cap(score[u, j], softcap) if CAPPED else score[u, j]
                # one unsigned compare: off - lo < span  <=>  lo <= off < lo + span
                if uint32(rel[j] + u * KEY_SLOTS) >= held_span[j]:
                    s = NEG_INF
                score[u, j] = s
                best = max(best, s)
            # the reference max moves only when a score passes it by RESCALE_SLACK
            # (also at the row's first visible key: the reference is NO_KEY until then)
            ref = run_max[j]
            alpha[j] = ONE
            if best > ref + float32(RESCALE_SLACK):
                alpha[j] = ptx.exp2_approx(ref - best)
                ref = best
            total = run_sum[j] * alpha[j]
            for u in range(UNROLL):
                score[u, j] = ptx.exp2_approx(score[u, j] - ref)
                total += score[u, j]
            run_max[j] = ref
            run_sum[j] = total

    @cuda.jit(device=True, inline="always")
    def _rescale(acc, alpha):
        """Rescale the accumulators of the rows whose reference moved (rarely)."""
        rescale = False
        for j in range(ROWS):
            rescale = rescale or alpha[j] != ONE
        if rescale:
            for j in range(ROWS):
                for e in range(ELEMENTS):
                    acc[j, e] *= alpha[j]

    @cuda.jit(device=True, inline="always")
    def _accumulate(acc, prob, values):
        """Add this trip's probability-weighted values to the accumulators."""
        for e in range(ELEMENTS):
            for j in range(ROWS):
                for u in range(UNROLL):
                    acc[j, e] += prob[u, j] * values[u, e]

    @cuda.jit(device=True, inline="always")
    def _stash_state(slot_ml, slot_acc, slot, own, sub, run_max, run_sum, acc):
        """This lane's part of its slot's state into shared memory (one lane of each
        set of copies writes the held rows' max and sum)."""
        if sub & COPIES == 0:
            for j in range(HELD):
                slot_ml[0, uint64(own + j), uint64(slot)] = run_max[j]
                slot_ml[1, uint64(own + j), uint64(slot)] = run_sum[j]
        for j in range(ROWS):
            base = slot * SLOT_WORDS + (j ^ own) * ROW_WORDS + sub
            for c in range(PER_LANE):
                if not IDLE_PIECES or c * LANES + sub < PIECES:
                    for e in range(VEC):
                        slot_acc[uint64(base + (c * VEC + e) * LANES)] = acc[j, c * VEC + e]

    @cuda.jit(device=True, inline="always")
    def _word_dim(word, k):
        """`(dim, real)` of the k-th word a merging thread sums, `word` its first one
        (see ROW_WORDS); `real` is False for an idle lane's word."""
        if DIM_STEP:                 # the k-th word is DIM_STEP * k dims on
            word_k = word
        else:
            word_k = word + k * ROW_THREADS
        sub = word_k & (LANES - 1)
        c = (word_k >> (LANE_BITS + VEC_BITS)) & (PER_LANE - 1)
        piece = c * LANES + sub
        dim = piece * VEC + ((word_k >> LANE_BITS) & (VEC - 1)) + DIM_STEP * k
        return dim, not IDLE_PIECES or piece < PIECES

    @cuda.jit(device=True, inline="always")
    def _merge_weights(slot_ml, r, weights):
        """Row `r`'s slot weights against the slots' common max; returns (max, total)."""
        best = slot_ml[0, r, 0]
        for s in range(1, SLOTS):
            best = max(best, slot_ml[0, r, s])
        total = ZERO
        for s in range(SLOTS):
            weights[s] = ptx.exp2_approx(slot_ml[0, r, s] - best)
            total += weights[s] * slot_ml[1, r, s]
        return best, total

    @cuda.jit(**LAUNCH_BOUNDS)
    def decode(q, k_store, v_store, tables, pages, out, lse, part_acc, part_ml, seq_info_off,
               work_off, max_q_len, group, row_group_bits, ring_rows, window, page_bits, scale,
               softcap):
        tid = int32(cuda.threadIdx.x)
        warp = tid >> 5
        lane = tid & (WARP - 1)
        sub = lane & (LANES - 1)               # which 16-byte pieces of a key row
        key_slot = lane >> LANE_BITS           # which key of the warp's step
        own = (sub >> COPY_BITS) * HELD        # local row j is row j ^ own (_split_rows)
        group = int32(group)
        groups = int32(cuda.blockIdx.x)
        row_group = groups & int32((1 << row_group_bits) - 1)
        item = int32(work_off + (groups >> row_group_bits) * WORK_FIELDS)
        kv_head = int32(cuda.blockIdx.y)
        kv_heads = k_store.shape[1]
        key_lo = tables[uint64(item + WORK_KEY_LO)]
        key_hi = tables[uint64(item + WORK_KEY_HI)]
        col = tables[uint64(item + WORK_COL)]
        q_len = tables[uint64(item + WORK_Q_LEN)]
        first_row = row_group * ROWS
        if first_row >= group * q_len:         # a row group this segment does not fill
            return

        # storage: key position p lives in row p (flat) or p % ring_rows (ring), row r
        # of the sequence (`col`, its page-table row) in slot pages[col, r >> page_bits]
        # | (r & in_page). A chunk lies in one segment's visible keys, at most ring_rows
        # of them, so the row of the key at chunk offset o, store_lo + o, passes the
        # ring's end at most once.
        wrap = int32(ring_rows if ring_rows > 0 else INT32_MAX)
        store_lo = uint32(uint32(key_lo) % uint32(wrap))
        last = int32(key_hi - key_lo - 1)
        store_last = uint32(store_lo + last)
        seq_pages = uint32(col * pages.shape[1])
        shift = uint32(page_bits)
        in_page = uint32((1 << shift) - 1)
        slot_bytes = uint32(kv_heads * head_dim * k_store.itemsize)
        lane_first = kv_head * head_dim + sub * VEC
        k_lane = ptx.bytes_from(k_store, lane_first)
        v_lane = ptx.bytes_from(v_store, lane_first)
        # the trip's first key this lane looks up (its key slot's key u = sub), named by
        # its row before the ring wraps: `lead` on from the chunk offset of this lane's
        # own key u = 0 (warp * WARP_KEYS + key_slot on the first trip)
        look = uint32(store_lo + warp * WARP_KEYS + key_slot + sub * KEY_SLOTS)
        lead = int32(store_lo + sub * KEY_SLOTS)
        first_lane = lane & (WARP - LANES)     # the key slot's lane sub = 0
        looked = cuda.local.array(LOOKUPS, int32)
        key_slots = cuda.local.array(UNROLL, int32)
        k_words = cuda.local.array((UNROLL, PER_LANE, 4), uint32)
        v_words = cuda.local.array((UNROLL, PER_LANE, 4), uint32)
        _look_up(looked, look, store_last, wrap, pages, seq_pages, shift, in_page)
        _key_slots(key_slots, looked, first_lane)
        _load_keys(k_lane, k_words, key_slots, slot_bytes, sub)

        # the block's rows: lane k < ROWS of every warp works out row k's index in the
        # segment and q row (token * n_q_heads + head; a padding row reads the last real
        # query), stepped on from the first row's (one division); shuffles hand them on
        part = tables[uint64(item + WORK_PART)]
        q_start = tables[uint64(item + WORK_Q_START)]
        seg_info = seq_info_off + tables[uint64(item + WORK_SEG)] * SEQ_INFO_FIELDS
        pos_start = tables[uint64(seg_info + POS_START)]
        in_block = (tables[uint64(seg_info + FLAGS)] & FLAG_BLOCK) != 0
        first_index = int32(uint32(first_row) // uint32(group))
        index, in_group = _row((first_index, int32(first_row - first_index * group)), group,
                               lane & (ROWS - 1))
        head = int32(kv_head * group + in_group)
        q_row = int32((q_start + min(index, q_len - 1)) * int32(q.shape[1]) + head)
        # what the end of the chunk needs waits in shared memory, not in registers
        fields = cuda.shared.array(BLOCK_FIELDS, int32)
        if tid < ROWS:
            fields[ROW_INDEX + tid] = index
            fields[ROW_TOKEN + tid] = q_start + index
            fields[ROW_HEAD + tid] = head
        if tid == 0:
            fields[PART] = part
            fields[Q_LEN] = q_len

        # this lane's slice of each local row's query, scaled so that scores come out
        # in base 2 (after the cap, when capped); a lane past the key row (IDLE_PIECES)
        # reads any piece: its K words are zeros
        q_scale = scale if CAPPED else scale * float32(LOG2E)
        qr = cuda.local.array((ROWS, ELEMENTS), float32)
        for j in range(ROWS):
            row = ptx.shfl_idx(q_row, j ^ own)
            for c in range(PER_LANE):
                piece = min(c * LANES + sub, PIECES - 1) if IDLE_PIECES else c * LANES + sub
                load_query(q, row, piece * VEC, qr, j, c * VEC)
        for j in range(ROWS):
            for e in range(ELEMENTS):
                qr[j, e] *= q_scale

        # the rows this lane keeps the softmax of, own + j (j < HELD), see the chunk's
        # keys at offsets [lo, lo + span) from key_lo (none for a padding row); held_lo
        # is lo + lead, so that `look - held_lo` is this lane's key u = 0 offset from lo
        held_lo = cuda.local.array(HELD, int32)
        held_span = cuda.local.array(HELD, uint32)
        run_max = cuda.local.array(HELD, float32)    # reference max (base 2) and sum
        run_sum = cuda.local.array(HELD, float32)
        for j in range(HELD):
            i = ptx.shfl_idx(index, own + j)
            lo, hi = key_range(min(i, q_len - 1), q_len, pos_start, in_block, window)
            lo = max(lo, key_lo)
            hi = min(hi, key_hi)
            held_lo[j] = int32(lo - key_lo + lead)
            held_span[j] = uint32(max(hi - lo, 0)) if i < q_len else uint32(0)
            run_max[j] = NO_KEY
            run_sum[j] = ZERO

        acc = cuda.local.array((ROWS, ELEMENTS), float32)
        for j in range(ROWS):
            for e in range(ELEMENTS):
                acc[j, e] = ZERO
        values = cuda.local.array((UNROLL, ELEMENTS), float32)
        score = cuda.local.array((UNROLL, ROWS), float32)   # then probabilities
        alpha = cuda.local.array(ROWS, float32)
        rel = cuda.local.array(HELD, int32)

        # A trip's V is loaded as it starts, with the page-table lookups of the next
        # trip's keys, and the next trip's K once this trip's scores are summed (past
        # the chunk's last trip they re-read its last key: no branch in the loop);
        # `_after` holds the K loads back from the scores' registers.
        trips = int32((last + BLOCK_KEYS) >> TRIP_BITS)
        for _ in range(trips):
            _load_keys(v_lane, v_words, key_slots, slot_bytes, sub)
            _look_up(looked, uint32(look + BLOCK_KEYS), store_last, wrap, pages, seq_pages,
                     shift, in_page)
            # this lane's partial dot products of every local row with its keys
            _widen_words(k_words, values)
            for u in range(UNROLL):
                for j in range(ROWS):
                    score[u, j] = ZERO
            for e in range(ELEMENTS):
                for j in range(ROWS):
                    for u in range(UNROLL):
                        score[u, j] += qr[j, e] * values[u, e]
            _split_rows(score)
            for s in range(LOOKUPS):
                looked[s] = _after(score[UNROLL - 1, 0], looked[s])
            _key_slots(key_slots, looked, first_lane)
            _load_keys(k_lane, k_words, key_slots, slot_bytes, sub)
            for j in range(HELD):
                rel[j] = int32(look - held_lo[j])
            _online_softmax(score, alpha, run_max, run_sum, rel, held_span, softcap)
            _gather_rows(score, alpha)
            _rescale(acc, alpha)
            _widen_words(v_words, values)
            _accumulate(acc, score, values)
            look = uint32(look + BLOCK_KEYS)

        # merge the (warp, key slot) states of the block, then write out or the partial
        slot_ml = cuda.shared.array((2, ROWS, SLOTS), float32)    # reference max, sum
        slot_acc = cuda.shared.array(MERGE_WORDS, float32)
        _stash_state(slot_ml, slot_acc, warp * KEY_SLOTS + key_slot, own, sub, run_max,
                     run_sum, acc)
        cuda.syncthreads()

        r = tid >> ROW_THREAD_BITS             # the row this thread merges a slice of
        if not ALL_MERGE and r >= ROWS:
            return
        i = fields[ROW_INDEX + r]
        if i >= fields[Q_LEN]:                 # a padding row
            return
        weights = cuda.local.array(SLOTS, float32)
        best, total = _merge_weights(slot_ml, uint64(r), weights)
        merged = cuda.local.array(PER_THREAD, float32)
        first_word = r * ROW_WORDS + (tid & (ROW_THREADS - 1))
        for k in range(PER_THREAD):
            merged[k] = ZERO
            for s in range(SLOTS):
                at = uint64(s * SLOT_WORDS + first_word + k * ROW_THREADS)
                merged[k] += weights[s] * slot_acc[at]
        token = uint64(fields[ROW_TOKEN + r])
        head = fields[ROW_HEAD + r]
        part = fields[PART]
        if part < 0:
            inverse = _reciprocal(total)
            for k in range(PER_THREAD):
                dim, real = _word_dim(first_word, k)
                if real:
                    out[token, uint64(head), uint64(dim)] = \
                        ptx.from_f32(merged[k] * inverse, out)
            if tid & (ROW_THREADS - 1) == 0 and lse.shape[0] > 0:
                lse[token, uint64(head)] = best * float32(LN2) + math.log(total)
            return
        at = (part * max_q_len + i) * q.shape[1] + head
        for k in range(PER_THREAD):
            dim, real = _word_dim(first_word, k)
            if real:
                part_acc[uint64(at * head_dim + dim)] = merged[k]
        if tid & (ROW_THREADS - 1) == 0:
            part_ml[uint64(2 * at)] = best if total > ZERO else NEG_INF
            part_ml[uint64(2 * at + 1)] = total

    return Specialised(decode)


_FLOAT32 = np.float32


def check_storage(head_dim: int, k_store, v_store) -> None:
    """Refuse (`ValueError`) K/V storage this path does not serve: a head_dim or dtype
    outside `supports`, K and V of different dtypes, or storage that is not slot
    storage `[n_slots, n_kv_heads, head_dim]`."""
    storage = np.dtype(k_store.dtype)
    if not supports(head_dim, storage) or v_store.dtype != storage:
        raise ValueError(f"decode.run: head_dim {head_dim} with {storage} / {v_store.dtype} "
                         f"storage is not served (see decode.supports)")
    for store in (k_store, v_store):
        if len(store.shape) != 3 or store.shape[2] != head_dim:
            raise ValueError(f"decode.run: storage of shape {tuple(store.shape)} is not slot "
                             f"storage [n_slots, n_kv_heads, {head_dim}]")


class DecodeRun:
    """The decode launches of one step for the layers of one window (`prepare`): the
    step's tables (their device buffer, where the segment table sits in it, the window's
    placed plan: `PlacedPlan`), the window's ring rows, its layer kind's page table
    (`pages`, int32 `[n_seq_rows, pages_per_seq]` on the device, and `page_bits`) and
    the stream fixed.

    A call (`run(q, k_store, v_store, out, lse, scale, softcap)`, once per layer; `lse`
    a float32 `[width, n_q_heads]` device array, or one of no rows for none) looks its
    signature up: q's dtype, q heads and 16-byte alignment, and softcap on or off. The
    first call of a signature checks the storage (`check_storage`), works out the block
    rows, row groups and grid, sizes the partials, picks the kernel variant and binds it
    and the combine (`combine.prepare`); later calls pack their arrays and scalars only.
    One `DecodeRun` serves the layers of one cache that share the page table: their
    storage shares a dtype and a slot shape.
    """

    def __init__(self, tables, seq_info_off: int, placed: PlacedPlan, workspace,
                 ring_rows: int, window: int, pages, page_bits: int, stream=0):
        self.tables, self.seq_info_off, self.placed = tables, seq_info_off, placed
        self.workspace, self.ring_rows, self.window = workspace, ring_rows, window
        self.pages, self.page_bits, self.stream = pages, page_bits, stream
        self.n_items = placed.n_items
        self._launches = {}    # (decode launch, combine launch or None) by signature

    def __call__(self, q, k_store, v_store, out, lse, scale, softcap) -> None:
        if not self.n_items:
            return
        key = (q.dtype, q.shape[1], aligned(q, LOAD_BYTES), softcap > 0)
        launches = self._launches.get(key)
        if launches is None:
            launches = self._launches[key] = self._bind(q, k_store, v_store, *key)
        decode, merge = launches
        # the kernel takes float32 scalars: converted only when they are not (a conversion
        # costs more host time than the rest of a scalar's launch work)
        decode(q, k_store, v_store, out, lse,
               scale if type(scale) is _FLOAT32 else _FLOAT32(scale),
               softcap if type(softcap) is _FLOAT32 else _FLOAT32(softcap))
        if merge is not None:
            merge(out, lse)

    def check(self, q, k_store, v_store) -> None:
        """Refuse storage this path does not serve (`check_storage`) when there is work."""
        if self.n_items:
            check_storage(q.shape[2], k_store, v_store)

    def _bind(self, q, k_store, v_store, dtype, n_q_heads, vectors, capped) -> tuple:
        self.check(q, k_store, v_store)
        head_dim, n_kv_heads = q.shape[2], k_store.shape[1]
        storage = np.dtype(k_store.dtype)
        placed, seq_info_off = self.placed, self.seq_info_off
        max_q_len, n_parts = placed.max_q_len, placed.n_parts
        group = n_q_heads // n_kv_heads
        rows = block_rows(group * max_q_len, head_dim, storage)
        # row groups are rounded up to a power of two (the extra ones return at once), so
        # the kernel splits its block index with a shift
        row_group_bits = (-(-group * max_q_len // rows) - 1).bit_length()
        if n_parts > 0:
            part_acc, part_ml = self.workspace.partials(
                n_parts * max_q_len * n_q_heads * head_dim, n_parts * max_q_len * n_q_heads * 2,
                self.stream)
        else:
            part_acc = part_ml = self.workspace.dummy
        kernel = _decode_kernel(head_dim, storage.name, rows, bool(capped),
                                np.dtype(dtype).name, vectors)
        decode = kernel.bind((self.n_items << row_group_bits, n_kv_heads), THREADS,
                             self.stream, PER_CALL, PER_CALL, PER_CALL, self.tables, self.pages,
                             PER_CALL, PER_CALL, part_acc, part_ml, seq_info_off,
                             placed.work_off, max_q_len, group, row_group_bits, self.ring_rows,
                             self.window, self.page_bits, PER_CALL, PER_CALL)
        merge = combine.prepare(self.tables, part_acc, part_ml, seq_info_off=seq_info_off,
                                combine_off=placed.combine_off, n_combine=placed.n_combine,
                                max_q_len=max_q_len, n_q_heads=n_q_heads, head_dim=head_dim,
                                stream=self.stream)
        return decode, merge


def prepare(tables, *, seq_info_off, work_off, n_items, combine_off, n_combine, n_parts,
            max_q_len, workspace, ring_rows, window, pages, page_bits, stream=0) -> DecodeRun:
    """The plan side of `run`: what a step fixes for its layers of one window, once
    (`DecodeRun`); the arguments are `run`'s."""
    placed = PlacedPlan(int(work_off), int(n_items), int(combine_off), int(n_combine),
                        int(n_parts), int(max_q_len))
    return DecodeRun(tables, int(seq_info_off), placed, workspace, int(ring_rows),
                     int(window), pages, int(page_bits), stream)


def run(q, k_store, v_store, tables, *, pages=None, page_bits=None, out, scale, softcap,
        lse=None, stream=0, planned=None, **step):
    """Attention of the planned segments' queries; writes their rows of `out`.

    q, out: [width, n_q_heads, head_dim] device arrays, float16, float32 or bfloat16
    (uint16 bits); q is read in 16-byte vectors when it is 16-byte aligned, else element
    by element. k_store, v_store: slot storage [n_slots, n_kv_heads, head_dim]
    (C-contiguous, n_slots = n_pages * page_size under 2**31), float16, float32 or
    bfloat16 as uint16 (`supports`). pages: the layer kind's page table, an int32
    [n_seq_rows, pages_per_seq] device array whose entries are pages' first slots (page
    id * page_size), page_bits: log2 page_size (a power of two, 8 to 256): storage row
    r (a position, or on a ring its slot `position % ring_rows`) of the sequence in
    column `col` of the segment table lives in slot `pages[col, r >> page_bits] | (r &
    (page_size - 1))` (`masks.page_slot`). tables: int32 device array holding the
    segment table at `seq_info_off`, the plan's work table at `work_off` (`n_items`
    rows) and its combine table at `combine_off` (`n_combine` rows), each flat
    row-major. softcap: 0 = off. lse: None, or a float32 `[width, n_q_heads]` device array
    that receives each served row's natural-log log-sum-exp of its scores.

    `step`: the step's `seq_info_off`, `work_off`, `n_items`, `combine_off`,
    `n_combine`, `n_parts` and `max_q_len` (the plan's), the `workspace`, `ring_rows`
    (0: flat, or R) and `window` (0 or W), as `prepare` takes them with `pages` and
    `page_bits`; or `planned`, what `prepare` returned for this step and window (a cache
    plans once per step, and its layers pass their own storage only: `pages` and
    `page_bits` are the plan's then).

    Writes exactly `out[token, head, :]` for every query token of a planned segment
    and every head: no padding row, no other segment's row. Partials (float32, in
    `workspace`): acc `[n_parts, max_q_len, n_q_heads, head_dim]`, (max, sum) pairs
    `[n_parts, max_q_len, n_q_heads, 2]`. Launches on `stream` only; no
    synchronisation, no device allocation once `workspace` is warm.
    """
    if planned is None:
        if pages is None or page_bits is None:
            raise TypeError("decode.run: pages and page_bits are needed without `planned`")
        planned = prepare(tables, pages=pages, page_bits=page_bits, stream=stream, **step)
        planned.check(q, k_store, v_store)       # refused before q itself is read
    planned(q, k_store, v_store, out, no_output() if lse is None else lse, scale, softcap)
    return out
