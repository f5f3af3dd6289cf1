"""One trip of the decode kernel's key loop, as device functions of one
specialisation (`trip_functions`): page-table lookups shared out among a key's lanes,
16-byte K/V loads, widening, the dot products' butterfly sums that split the rows, the
online softmax of the held rows, and the accumulation (`decode_kernel`'s doc tells
how they fit together).

Every loop over a compile-time range is unrolled, so the local arrays (indexed by
those loops only) live in registers. Array indices are cast to unsigned where a signed
one would cost a negative-index check.
"""
from __future__ import annotations

import math

import numpy as np

from ...device import cuda
from ..intrinsics import ptx
from ..launch.constants import LOG2E, NEG_INF
from .shape import UNROLL, KernelShape

from numba import float32, int32, uint32  # noqa: E402  (after kvnumba.device)

#: a row's reference max moves only when a score passes it by this much (base 2):
#: probabilities stay <= 2**RESCALE_SLACK and the accumulators are rescaled rarely
RESCALE_SLACK = 8.0
#: a row's reference max before its first visible key: below every finite score, and
#: finite, so that a masked score (-inf) minus it is -inf (probability 0), not NaN
NO_KEY = float32(-np.finfo(np.float32).max)
ZERO = float32(0.0)
ONE = float32(1.0)


@cuda.jit(device=True)
def _cap(score, softcap):
    """`softcap * tanh(score / softcap)`, in base 2 (the score came in natural units)."""
    return softcap * LOG2E * math.tanh(score / softcap)


def trip_functions(shape: KernelShape, widen, capped: bool) -> tuple:
    """The key loop's device functions for one kernel `shape`, `widen` (16-byte words to
    float32 elements of the storage dtype) and softcap on or off: `(look_up, key_slots,
    after, load_keys, widen_words, split_rows, gather_rows, online_softmax, rescale,
    accumulate)`."""
    ROWS, LANES, KEY_SLOTS, VEC = shape.rows, shape.lanes, shape.key_slots, shape.vec
    PIECES, PER_LANE, ELEMENTS = shape.pieces, shape.per_lane, shape.elements
    IDLE_PIECES, LOOKUPS, LEVELS = shape.idle_pieces, shape.lookups, shape.levels
    SPLITS, HELD, COPY_BITS = shape.splits, shape.held, shape.copy_bits
    PIECE_BYTES = LANES * shape.load           # from a lane's piece c to its piece c + 1
    WORDS = shape.words
    CAPPED = capped

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
    def _load_keys_16(lane_bytes, words, key_slots, slot_bytes, sub):
        """Load this lane's pieces of the keys in `key_slots` (`lane_bytes`: K or V
        storage from this lane's first piece of slot 0 on) into `words`, 16 bytes a
        piece."""
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
    def _load_keys_8(lane_bytes, words, key_slots, slot_bytes, sub):
        """As `_load_keys_16`, 8 bytes a piece (8-bit floats)."""
        for u in range(UNROLL):
            at = ptx.mul_wide_u32(key_slots[u], slot_bytes)
            for c in range(PER_LANE):
                if not IDLE_PIECES or c * LANES + sub < PIECES:
                    w0, w1 = ptx.ld_nc_v2(lane_bytes, at + c * PIECE_BYTES)
                else:
                    w0 = w1 = uint32(0)
                words[u, c, 0] = w0
                words[u, c, 1] = w1

    @cuda.jit(device=True, inline="always")
    def _widen_words_16(words, values):
        """The trip's loaded words as float32: `values[u, e]`, element e of key slot u."""
        for u in range(UNROLL):
            for c in range(PER_LANE):
                f = widen(words[u, c, 0], words[u, c, 1], words[u, c, 2], words[u, c, 3])
                for e in range(VEC):
                    values[u, c * VEC + e] = f[e]

    @cuda.jit(device=True, inline="always")
    def _widen_words_8(words, values):
        """As `_widen_words_16`, from 8-byte loads."""
        for u in range(UNROLL):
            for c in range(PER_LANE):
                f = widen(words[u, c, 0], words[u, c, 1])
                for e in range(VEC):
                    values[u, c * VEC + e] = f[e]

    _load_keys = _load_keys_16 if WORDS == 4 else _load_keys_8
    _widen_words = _widen_words_16 if WORDS == 4 else _widen_words_8

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
            # (also at the row's first visible key: the reference is NO_KEY until then).
            # Not `softmax.rescaling`: the reference is never -inf, and that guard would
            # add two instructions to the trip's hot path
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

    return (_look_up, _key_slots, _after, _load_keys, _widen_words, _split_rows,
            _gather_rows, _online_softmax, _rescale, _accumulate)
