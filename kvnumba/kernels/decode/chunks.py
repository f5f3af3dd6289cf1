"""The decode path's host planning: each served segment's keys cut into chunks, one
work item per chunk, as int32 tables for `decode.run` (module doc of `decode`).

A chunk's length depends only on its own segment's key range, never on what else
shares the step: the order in which a segment's scores are summed, and so its output
bits, are the same alone or in any batch (contract §8).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, uint64

from ...arith.positions import SEQ, POS_START, Q_LEN, Q_START
from ..generic.shape import DECODE_MAX_Q_LEN

# --- the chunk tables (int32), packed by the caller into the step's `tables` -----------
#: work table: one row per (segment, key chunk); it carries the segment fields the
#: kernel's first loads need, so its K, V and q loads go out after one round trip
WORK_SEG = 0        # index of the segment in the step's segment table
WORK_KEY_LO = 1     # first key position of the chunk
WORK_KEY_HI = 2     # one past its last key position
WORK_PART = 3       # partial slot, or -1: the segment's only chunk writes `out` itself
WORK_SEQ = 4        # the segment's sequence (the row of its page tables)
WORK_Q_START = 5    # its first token on the step's token axis
WORK_Q_LEN = 6      # its number of queries
WORK_FIELDS = 7
#: combine table: one row per segment cut into several chunks
COMBINE_SEG = 0     # index of the segment in the step's segment table
COMBINE_PART = 1    # partial slot of its first chunk (its chunks take consecutive slots)
COMBINE_PARTS = 2   # how many chunks
COMBINE_FIELDS = 3

#: nominal chunks are powers of two and multiples of this many keys
KEY_TILE = 64
#: the nominal chunk (keys): few enough that a long sequence spreads over many blocks,
#: enough that a block's fixed costs stay small against its loads. Every chunk of a
#: segment but its last has this length; the last also takes the keys left over past
#: the whole chunks when they are fewer than half a chunk, so it holds CHUNK_KEYS / 2 to
#: 3 * CHUNK_KEYS / 2 - 1 keys, and a segment of fewer than 3 * CHUNK_KEYS / 2 keys is one
#: chunk.
#: A segment of n keys never has more than ceil(n / CHUNK_KEYS) chunks.
CHUNK_KEYS = 256


class ChunkTables(NamedTuple):
    """One step's decode work, as int32 tables for the device.

    work: [n_items, WORK_FIELDS] (fields WORK_*); combine: [n_combine,
    COMBINE_FIELDS] (fields COMBINE_*); n_parts: partial slots the work uses;
    chunk: the nominal chunk length (keys); max_q_len / min_q_len: the longest and
    shortest served segment.
    """

    work: np.ndarray
    combine: np.ndarray
    n_parts: int
    chunk: int
    max_q_len: int
    min_q_len: int = 1

    @property
    def n_items(self) -> int:
        return len(self.work)

    @property
    def n_combine(self) -> int:
        return len(self.combine)


@njit(cache=True)
def chunk_count(keys, chunk=CHUNK_KEYS):
    """Chunks `chunk_tables` cuts a segment of `keys` keys into: its whole chunks, the remainder
    a chunk of its own only when it holds at least half a chunk, and at least one."""
    return max(1, (keys + chunk // 2) // chunk)


def chunk_tables(seq_info, segments, *, mask_code: int, chunk: int = CHUNK_KEYS) -> ChunkTables:
    """Cut the served segments' key ranges into chunks of `chunk` keys (host only, one
    compiled pass).

    seq_info: host [n_segments, SEQ_INFO_FIELDS] int32 segment table; segments: the
    indices of the segments this path serves (each `Q_LEN <= DECODE_MAX_Q_LEN`).
    mask_code: the layer's mask code (`masks.key_range`: 0 none, W, or -C). chunk: the nominal chunk, a power of two and a
    multiple of KEY_TILE.

    A segment's chunks are `chunk` keys each but the last, which also takes a
    remainder shorter than half a chunk (`chunk_count`). So a skewed batch's long
    sequences spread over many blocks while short ones take one, and no block pays
    its fixed costs for a sliver of keys. The lengths follow from the segment's own
    key range alone, never from the rest of the step: its chunks, and so the order in
    which its scores are summed, are the same in any batch, and its output the same
    bits.
    """
    bits = _chunk_bits(chunk)
    segments = np.asarray(segments, np.int32).reshape(-1)
    work, combine, n_parts, shortest, longest = _cut(np.asarray(seq_info, np.int32),
                                                     segments, mask_code, bits)
    _check_queries(shortest, longest)
    return ChunkTables(work, combine, n_parts, chunk, longest, shortest)


class PlacedChunks(NamedTuple):
    """A step's chunk tables written into a flat int32 buffer (`chunks_into`): where its work
    table starts and its rows, where its combine table starts and its rows, the partial
    slots it uses and its longest and shortest segment (the fields of `ChunkTables`,
    placed)."""

    work_off: int
    n_items: int
    combine_off: int
    n_combine: int
    n_parts: int
    max_q_len: int
    min_q_len: int = 1


def chunks_into(seq_info, segments, *, mask_code: int, staging, at: int,
              chunk: int = CHUNK_KEYS) -> PlacedChunks:
    """`chunk_tables`, its work and combine tables written straight into the host buffer of
    `staging` (a `Staging`) from entry `at`, back to back (one compiled call; the buffer
    grows first in the rare step whose tables do not fit). `seq_info` and `segments`:
    int32 arrays, as `chunk_tables` takes them."""
    bits = _CHUNK_BITS if chunk == CHUNK_KEYS else _chunk_bits(chunk)
    n_items, n_split, n_parts, shortest, longest = _cut_into(
        seq_info, segments, mask_code, bits, staging.host, at)
    if n_parts < 0:             # no room: grow, keeping what the step wrote before `at`
        staging.reserve(at + n_items * WORK_FIELDS + n_split * COMBINE_FIELDS, at)
        n_items, n_split, n_parts, shortest, longest = _cut_into(
            seq_info, segments, mask_code, bits, staging.host, at)
    _check_queries(shortest, longest)
    combine_off = at + n_items * WORK_FIELDS
    return PlacedChunks(at, n_items, combine_off, n_split, n_parts, longest, shortest)


def _chunk_bits(chunk: int) -> int:
    """`log2(chunk)`, once `chunk` is checked: a power of two and a multiple of KEY_TILE."""
    if chunk <= 0 or chunk % KEY_TILE or chunk & (chunk - 1):
        raise ValueError(f"decode: chunk {chunk} must be a power of two and a multiple of "
                         f"{KEY_TILE}")
    return int(chunk).bit_length() - 1


_CHUNK_BITS = _chunk_bits(CHUNK_KEYS)


def _check_queries(shortest: int, longest: int) -> None:
    if shortest < 1 or longest > DECODE_MAX_Q_LEN:
        raise ValueError(f"decode segments hold 1..{DECODE_MAX_Q_LEN} queries, got "
                         f"{shortest}..{longest}")


@njit(cache=True)
def _key_span(seq_info, seg, mask_code):
    """`(lo, hi)`: the keys any query of segment `seg` sees. Its queries' intervals move
    forward (`masks.key_range`), so their union runs from the first query's lo (a
    draft block's too: its lo never passes pos_start) to pos_start + q_len."""
    pos_start = seq_info[seg, POS_START]
    lo = 0
    if mask_code > 0:
        lo = max(pos_start - (mask_code - 1), 0)
    elif mask_code < 0:
        lo = pos_start - pos_start % -mask_code
    return lo, pos_start + seq_info[seg, Q_LEN]


@njit(cache=True)
def _chunks(keys, half, bits):
    """`chunk_count(keys, chunk)` for a chunk of `1 << bits` keys (`half`: half a chunk), by
    a shift rather than a division."""
    return max(1, (keys + half) >> bits)


@njit(cache=True)
def _count(seq_info, segments, mask_code, half, bits):
    """`(n_items, n_split, shortest, longest)`: the work rows and split segments of the
    cut into chunks of `1 << bits` keys, and the shortest and longest segment (1 and 0
    when there are none)."""
    n_items = 0
    n_split = 0
    shortest = 1
    longest = 0
    for seg in segments:
        q_len = seq_info[seg, Q_LEN]
        shortest = min(shortest, q_len)
        longest = max(longest, q_len)
        lo, hi = _key_span(seq_info, seg, mask_code)
        chunks = _chunks(hi - lo, half, bits)
        n_items += chunks
        n_split += chunks > 1
    return n_items, n_split, shortest, longest


@njit(cache=True)
def _fill(seq_info, segments, mask_code, bits, out, work_at, combine_at):
    """Write the work rows (from `out[work_at]`) and combine rows (from `out[combine_at]`,
    see the module constants) of the cut `_count` sized, flat row-major; returns the
    partial slots used.

    A step of long histories writes thousands of work rows, so the loop is kept lean: the
    buffer is indexed unsigned (Numba adds no negative-index fix-up to an unsigned
    index), a segment of one chunk takes its own branch, and the chunks of a split one
    are written alike, its last chunk's end set after them."""
    chunk = 1 << bits
    half = chunk >> 1
    item = uint64(work_at)
    split = uint64(combine_at)
    part = 0
    for seg in segments:
        lo, hi = _key_span(seq_info, seg, mask_code)
        chunks = _chunks(hi - lo, half, bits)
        seq, q_start, q_len = seq_info[seg, SEQ], seq_info[seg, Q_START], seq_info[seg, Q_LEN]
        if chunks == 1:
            out[item + _WORK_SEG] = seg
            out[item + _WORK_KEY_LO] = lo
            out[item + _WORK_KEY_HI] = hi
            out[item + _WORK_PART] = -1        # the segment's only chunk writes `out` itself
            out[item + _WORK_SEQ] = seq
            out[item + _WORK_Q_START] = q_start
            out[item + _WORK_Q_LEN] = q_len
            item += _WORK_FIELDS
            continue
        out[split + _COMBINE_SEG] = seg
        out[split + _COMBINE_PART] = part
        out[split + _COMBINE_PARTS] = chunks
        split += _COMBINE_FIELDS
        key = lo
        for _ in range(chunks):
            out[item + _WORK_SEG] = seg
            out[item + _WORK_KEY_LO] = key
            key += chunk
            out[item + _WORK_KEY_HI] = key
            out[item + _WORK_PART] = part
            part += 1
            out[item + _WORK_SEQ] = seq
            out[item + _WORK_Q_START] = q_start
            out[item + _WORK_Q_LEN] = q_len
            item += _WORK_FIELDS
        out[item - _WORK_FIELDS + _WORK_KEY_HI] = hi     # the last chunk takes the rest
    return part


# the work and combine fields as unsigned offsets, for `_fill`'s unsigned indices
(_WORK_SEG, _WORK_KEY_LO, _WORK_KEY_HI, _WORK_PART, _WORK_SEQ, _WORK_Q_START, _WORK_Q_LEN,
 _WORK_FIELDS) = map(np.uint64, (WORK_SEG, WORK_KEY_LO, WORK_KEY_HI, WORK_PART, WORK_SEQ,
                                 WORK_Q_START, WORK_Q_LEN, WORK_FIELDS))
_COMBINE_SEG, _COMBINE_PART, _COMBINE_PARTS, _COMBINE_FIELDS = map(
    np.uint64, (COMBINE_SEG, COMBINE_PART, COMBINE_PARTS, COMBINE_FIELDS))


@njit(cache=True)
def _cut(seq_info, segments, mask_code, bits):
    """The work and combine tables for nominal chunks of `1 << bits` keys, the partial
    slots used, and the shortest and longest segment (1 and 0 when there are none).

    Compiled passes over the segments (count, then fill): a step's chunk tables cost a few µs
    of host time however many segments it has.
    """
    n_items, n_split, shortest, longest = _count(seq_info, segments, mask_code,
                                                 (1 << bits) >> 1, bits)
    middle = n_items * WORK_FIELDS
    tables = np.empty(middle + n_split * COMBINE_FIELDS, np.int32)
    n_parts = _fill(seq_info, segments, mask_code, bits, tables, 0, middle)
    return (tables[:middle].reshape((n_items, WORK_FIELDS)),
            tables[middle:].reshape((n_split, COMBINE_FIELDS)), n_parts, shortest, longest)


@njit(cache=True)
def _cut_into(seq_info, segments, mask_code, bits, out, at):
    """`_cut` into the flat int32 buffer `out`, the work rows from entry `at` and the
    combine rows right after them; `(n_items, n_split, n_parts, shortest, longest)`,
    n_parts -1 (nothing written) when they do not fit."""
    n_items, n_split, shortest, longest = _count(seq_info, segments, mask_code,
                                                 (1 << bits) >> 1, bits)
    middle = at + n_items * WORK_FIELDS
    if middle + n_split * COMBINE_FIELDS > out.size:
        return n_items, n_split, -1, shortest, longest
    n_parts = _fill(seq_info, segments, mask_code, bits, out, at, middle)
    return n_items, n_split, n_parts, shortest, longest
