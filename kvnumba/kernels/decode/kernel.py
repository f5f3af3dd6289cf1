"""The decode attention kernel, built for memory bandwidth (`decode` plans and launches it).

Decode segments (at most `DECODE_MAX_Q_LEN` queries each) read every key of their
history once per step and do little arithmetic with it, so the kernel is shaped to
stream K and V at the chip's bandwidth with few instructions per key.

* Work (`chunk_tables`, host, in `decode.chunks`): each served segment's key range, the union
  of its queries' visible intervals, is cut into chunks of `CHUNK_KEYS` keys (the last
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
  (page_size - 1))` (`masks.page_slot`), `seq` being the sequence field of the
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
  row and writes it to `out` (in out's dtype; the row's sink folded in first when
  `sinks` has elements: `kernels.sinks`) or to the partial (acc, max, sum); with
  `out` goes the row's log-sum-exp (natural log, from the base-2 max and sum) when
  an `lse` array with rows is passed.

Index arithmetic is 32-bit (positions, offsets and slots are int32; a slot's byte
offset is one 32 x 32 -> 64-bit multiply) with no 64-bit division, and the key loop
is the kernel's only loop with a runtime trip count. Specialised per head_dim,
storage dtype, rows per block, softcap on / off, sinks on / off and q's dtype and
alignment (`decode_kernel`); q and out may each be float16, float32 or bfloat16 (as uint16
bits).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ...config import INT32_MAX
from ...device import cuda
from ...arith.positions import FLAG_BLOCK, FLAGS, POS_START, SEQ_INFO_FIELDS
from ..intrinsics import ptx
from ..launch.constants import LN2, LOG2E, NEG_INF, WARP
from .chunks import (WORK_SEQ, WORK_FIELDS, WORK_KEY_HI, WORK_KEY_LO, WORK_PART, WORK_Q_LEN,
                     WORK_Q_START, WORK_SEG)
from .shape import LAUNCH_BOUNDS, THREADS, UNROLL, KernelShape
from .trip import NO_KEY, ONE, ZERO, trip_functions
from ..intrinsics.words import WIDEN, query_loader
from ..launch.calling import Specialised
from ..masks import key_range_of
from ..sinks import with_sink
from ..softmax import rescaling

from numba import float32, int32, uint32, uint64  # noqa: E402  (after kvnumba.device)


@cuda.jit(device=True, inline="always")
def _reciprocal(x):
    """`1 / x` for a normal float32 `x > 0`, within 2 ulp: a first guess from the bit
    pattern (relative error at most about 5%) and three Newton steps, each squaring the
    error. A rounded division would add a subroutine for inputs this never sees."""
    r = ptx.u32_as_f32(uint32(0x7EF311C3) - ptx.f32_as_u32(x))
    for _ in range(3):
        r = r * (float32(2.0) - x * r)
    return r

@lru_cache(maxsize=None)
def decode_kernel(head_dim: int, storage: str, rows: int, capped: bool,
                  query: str | None = None, query_vectors: bool = True, sunk: bool = False,
                  chunks: bool = False):
    """The decode kernel for one head_dim, storage dtype (name), rows per block,
    softcap on / off, q's dtype (name; None: the storage dtype), whether q may be
    read in 16-byte vectors, sinks on / off (`sunk`: the kernel reads `sinks`;
    without, it never does), and chunked layers or the others (`chunks`: only its
    variant compiles the chunk's division, `masks.key_range_of`) (module doc)."""
    key_range = key_range_of(chunks)
    shape = KernelShape.of(head_dim, np.dtype(storage).itemsize, rows)
    load_query = query_loader(np.dtype(query or storage), head_dim, shape.vec, query_vectors)
    (_look_up, _key_slots, _after, _load_keys, _widen_words, _split_rows, _gather_rows,
     _online_softmax, _rescale, _accumulate) = trip_functions(shape, WIDEN[np.dtype(storage)],
                                                               capped)
    VEC, PIECES, LANES, PER_LANE = shape.vec, shape.pieces, shape.lanes, shape.per_lane
    WORDS = shape.words
    ELEMENTS, KEY_SLOTS, LANE_BITS, VEC_BITS = (shape.elements, shape.key_slots,
                                                shape.lane_bits, shape.vec_bits)
    IDLE_PIECES, ROWS, HELD, COPY_BITS = shape.idle_pieces, rows, shape.held, shape.copy_bits
    COPIES = (1 << COPY_BITS) - 1
    CAPPED = capped
    SUNK = sunk
    WARP_KEYS, LOOKUPS, BLOCK_KEYS = shape.warp_keys, shape.lookups, shape.block_keys
    TRIP_BITS = BLOCK_KEYS.bit_length() - 1
    SLOTS, ROW_WORDS, SLOT_WORDS = shape.slots, shape.row_words, shape.slot_words
    MERGE_WORDS = SLOTS * SLOT_WORDS
    PER_THREAD, ROW_THREADS, DIM_STEP = shape.per_thread, shape.row_threads, shape.dim_step
    ROW_THREAD_BITS = ROW_THREADS.bit_length() - 1
    ALL_MERGE = ROWS * ROW_THREADS == THREADS  # every thread merges a slice
    # step apart (0: work each one out)
    DIM_STEP = ROW_THREADS // LANES if PER_LANE == 1 and ROW_THREADS % LANES == 0 else 0
    # the block's fields the merge reads from shared memory: per row its index in the
    # segment, token and q head, then the partial slot and the segment's queries
    ROW_INDEX, ROW_TOKEN, ROW_HEAD = 0, ROWS, 2 * ROWS
    PART, Q_LEN, BLOCK_FIELDS = 3 * ROWS, 3 * ROWS + 1, 3 * ROWS + 2

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
            weight, _ = rescaling(slot_ml[0, r, s], best, ONE)
            weights[s] = weight
            total += weight * slot_ml[1, r, s]
        return best, total

    @cuda.jit(**LAUNCH_BOUNDS)
    def decode(q, k_store, v_store, tables, pages, out, lse, sinks, part_acc, part_ml,
               seq_info_off,
               work_off, max_q_len, group, row_group_bits, ring_rows, mask_code, page_bits, scale,
               softcap, most_rows):
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
        seq = tables[uint64(item + WORK_SEQ)]
        q_len = tables[uint64(item + WORK_Q_LEN)]
        first_row = row_group * ROWS
        # a row group this segment does not fill, or a segment of more rows than this
        # kernel takes (the tensor cores serve it: `decode.shape.grouped`)
        if first_row >= group * q_len or group * q_len > most_rows:
            return

        # storage: key position p lives in row p (flat) or p % ring_rows (ring), row r
        # of the sequence (`seq`, its page-table row) in slot pages[seq, r >> page_bits]
        # | (r & in_page). A chunk lies in one segment's visible keys, at most ring_rows
        # of them, so the row of the key at chunk offset o, store_lo + o, passes the
        # ring's end at most once.
        wrap = int32(ring_rows if ring_rows > 0 else INT32_MAX)
        store_lo = uint32(uint32(key_lo) % uint32(wrap))
        last = int32(key_hi - key_lo - 1)
        store_last = uint32(store_lo + last)
        seq_pages = uint32(seq * pages.shape[1])
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
        k_words = cuda.local.array((UNROLL, PER_LANE, WORDS), uint32)
        v_words = cuda.local.array((UNROLL, PER_LANE, WORDS), uint32)
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
        q_scale = scale if CAPPED else scale * LOG2E
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
            lo, hi = key_range(min(i, q_len - 1), q_len, pos_start, in_block, mask_code)
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
            weight = float32(1.0)
            if SUNK:                           # the row's sink joins its softmax (`sinks`)
                best, weight, total = with_sink(best, total, sinks[uint64(head)] * LOG2E)
            inverse = _reciprocal(total) * weight
            for k in range(PER_THREAD):
                dim, real = _word_dim(first_word, k)
                if real:
                    out[token, uint64(head), uint64(dim)] = \
                        ptx.from_f32(merged[k] * inverse, out)
            if tid & (ROW_THREADS - 1) == 0 and lse.shape[0] > 0:
                lse[token, uint64(head)] = best * LN2 + math.log(total)
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
