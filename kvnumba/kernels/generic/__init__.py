"""Variable-length attention over each segment's own history (contract §8): the generic
CUDA-core kernel, serving what the fast kernels (`decode`, `prefill`) do not (float32
storage, head_dims they do not take, `scale <= 0`; `kvnumba.data.routing` routes each group).

One kernel body does the work: a block takes a tile of *rows* of one segment and
one kv head, where a row is a (query token, query head of the kv head's GQA group)
pair, token-major (row `r` -> token `r // group`, head `kv_head * group + r % group`).
So every K/V tile a block stages in shared memory serves all the query heads that
read it (packed GQA). For its rows the block walks one key range in tiles of
`block_keys` keys; per tile (4 barriers):

  a. stage K (float32, rows padded by one to dodge bank conflicts);
  b. scores: each thread a `PR x PK` micro-tile of (row, key) pairs, dot products
     over head_dim from shared memory; scale, softcap, mask -> -inf;
  c. one thread per row: online-softmax update (running max / sum, rescale
     factor), probabilities written back in place; meanwhile all threads stage V
     over K;
  d. each thread rescales and accumulates its `OWN` (row, dim) output elements
     (dims below v_head_dim).

Keys live in paged slot storage `[n_pages * page_size, n_kv_heads, head_dim]`, values in
`[n_pages * page_size, n_kv_heads, v_head_dim]` (V narrower than K, as wide or wider; q
has K's head_dim, out V's): storage row `r` of a sequence (its position on a flat layer,
`position % ring_rows` on a ring) is slot
`pages[seq, r >> page_bits] | (r & (page_size - 1))` of its layer kind's page table
(`masks.page_slot`), looked up as each key is staged, so a tile may straddle pages and a
ring's wrap alike.

Every query's visible keys form one interval `[lo, hi)` (see `masks.key_range`), and
these intervals only move forward with the token, so a row tile needs exactly the
keys `[lo(first row), hi(last row))`: tiles outside the causal / window / chunk mask are
never loaded.

Two paths, named by the caller (`kvnumba.data.routing` passes the group's; by default chosen
from `max_q_len`):

* decode (`max_q_len <= DECODE_MAX_Q_LEN`): `DECODE_TILES` (few rows, wide key
  tiles) and split-K (flash-decoding): the key range of each row tile is cut into
  `n_splits` chunks, one block each (the cache fixes the chunk at `decode.CHUNK_KEYS` keys,
  so a segment's result never depends on the rest of the step; without `kv_chunk`
  `launch_shape` sizes it to fill the GPU), writing unnormalised partials (acc, max, sum)
  to the workspace; `_combine_kernel` merges them (log-sum-exp) into `out`. With a
  single split the block writes `out` directly and no combine runs.
* prefill: `PREFILL_TILES` (tall row tiles), one block per (segment, row tile,
  kv head) over the whole key range, writing `out` directly.

Each served row's natural-log log-sum-exp of its scores (running max + log of the
running sum; merged across splits by the combine) goes to `lse` when the caller passes
one with rows. Given `sinks` with elements, each row's sink joins its softmax where the
row is normalised (`kernels.sinks.with_sink`): after the last tile with a single split,
in the combine with several.

Tiles are padded to the head-dim bucket of `max(head_dim, v_head_dim)` (`dpad`, at most
576: a latent layer's rows), each bucket with its own tile shapes. Where a block cannot
hold a row's whole output (`V_SLICES`), the grid's y runs over kv heads times slices of
V's dims: each block computes the scores over all of K and accumulates its own slice.

Softmax and accumulation are float32; storage, q and out may each be float16,
float32 or bfloat16 (held as uint16 bits; `ptx.to_f32` / `ptx.from_f32`), one compiled
specialisation per combination, made on first use.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ..device import cuda
from .intrinsics import ptx
from .launch.constants import LN2, LOG2E, NEG_INF
from .launch.calling import PER_CALL, Specialised, ceil_div, no_output
from .masks import (div32, divmod32, key_range, page_slot, read_segment, step_on, storage_row,
                    store_row)
from .sinks import no_sinks, with_sink

from numba import float32, int32  # noqa: E402  (after kvnumba.device chose the target)

#: max(head_dim, v_head_dim) is padded up to one of these; each gets its own compiled
#: tile shapes
HEAD_DIM_BUCKETS = (16, 32, 64, 128, 256, 512, 576)
#: padded head_dim -> tile shapes (block_rows, block_keys, key_lanes, threads):
#: key_lanes threads run along keys and threads // key_lanes along rows. Shared
#: memory, (block_rows + block_keys) * (dpad + 1) + block_rows * (block_keys + 1)
#: floats, stays under the 48 KiB static limit, and a thread's output elements, block_rows
#: * dpad / threads, stay at most 32 (`MAX_OWN`: more are kept in local memory). Tiny
#: head dims use 2 warps, and so does 512: one tile of 4 rows and 16 keys (8 rows on 4
#: warps would take 16-key tiles, 12,448 floats, over the limit; 8 rows on 2 warps, 64
#: output elements a thread).
#: Decode offers one shape per row count (group * max_q_len rows are packed in a
#: tile): the host takes the smallest that holds them all, else the largest, so
#: threads are not left idle on a 1-row decode.
DECODE_TILES = {
    16: ((4, 32, 16, 64), (16, 32, 4, 64)),
    32: ((4, 64, 32, 128), (8, 64, 16, 128), (16, 64, 8, 128)),
    64: ((4, 64, 32, 128), (8, 64, 16, 128), (16, 64, 8, 128)),
    128: ((4, 64, 32, 128), (8, 64, 16, 128), (16, 64, 8, 128)),
    256: ((4, 32, 32, 128), (8, 32, 16, 128)),
    512: ((4, 16, 16, 64),),
    576: ((4, 16, 16, 64),),
}
PREFILL_TILES = {16: (32, 32, 8, 64), 32: (64, 64, 16, 128), 64: (64, 32, 16, 128),
                 128: (32, 32, 16, 128), 256: (16, 16, 16, 128), 512: (4, 16, 16, 64),
                 576: (4, 16, 16, 64)}
#: padded head_dim -> the V dims one block accumulates, where a block cannot hold a row's
#: whole output (a latent layer's 576-wide rows, V their first 512: four blocks of 128
#: each compute the scores and accumulate their own slice); else all of them
V_SLICES = {576: 128}
#: the most (row, dim) output elements one thread accumulates (kept in registers)
MAX_OWN = 32
#: segments no longer than this (all of them) take the split-K decode path
DECODE_MAX_Q_LEN = 4
#: the decode path aims for this many blocks (about 2 per SM on an H100/H200), but
#: never cuts a key range into chunks shorter than DECODE_MIN_CHUNK keys or into
#: more than MAX_SPLITS pieces
TARGET_BLOCKS = 264
DECODE_MIN_CHUNK = 256
MAX_SPLITS = 64
#: threads per block of the combine kernel
COMBINE_THREADS = 128
#: most (token, query head) rows a q may have: the kernels divide row indices (and
#: block indices, positions, keys) as 32-bit integers (`masks.div32`)
MAX_QUERY_ROWS = 2**31 - 1



def head_dim_bucket(head_dim: int) -> int:
    """The padded head_dim whose tile shapes serve `head_dim` (1..576): the kernel takes
    the bucket of `max(head_dim, v_head_dim)`."""
    for dpad in HEAD_DIM_BUCKETS:
        if head_dim <= dpad:
            return dpad
    raise ValueError(f"head_dim={head_dim}: attention supports at most {HEAD_DIM_BUCKETS[-1]}")


@cuda.jit(device=True)
def _stage_keys(tile, store, pages, page_bits, seq, row0, n_keys, kv_head, head_dim, dpad,
                ring_rows, tid, threads, first):
    """Copy `n_keys` keys (or values) of sequence `seq`, from storage row `row0` on
    (wrapping a ring), into `tile` as float32, each from its slot in the page table:
    `head_dim` dims of each row from dim `first` on, into its first of `dpad` columns.

    The block's threads stride over (key, dim) pairs, dims innermost: coalesced reads
    (a page's rows are consecutive slots, so only a page boundary breaks a run).
    """
    for e in range(tid, n_keys * dpad, threads):
        c = e // dpad
        d = e - c * dpad
        if d < head_dim:
            slot = page_slot(pages, seq, store_row(row0, c, ring_rows), page_bits)
            tile[c, d] = ptx.to_f32(store[slot, kv_head, first + d])


@lru_cache(maxsize=None)
def _attention_kernel(dpad: int, block_rows: int, block_keys: int, key_lanes: int,
                      threads: int, v_slice: int | None = None):
    """The attention kernel for one padded head_dim (the bucket of K's and V's widest) and
    tile shape (see module doc); `v_slice`: the V dims a block accumulates (its grid's y
    then runs over kv heads times slices), None for all."""
    BR, BK, TX, THREADS = block_rows, block_keys, key_lanes, threads
    TY = THREADS // TX               # thread lanes along rows
    PR, PK = BR // TY, BK // TX      # micro-tile of (row, key) pairs per thread
    NSCORE = PR * PK
    SLICED = v_slice is not None
    VW = v_slice or dpad             # V dims of the block's slice (a padded width)
    OWN = BR * VW // THREADS         # (row, dim) output elements per thread
    STRIDE = dpad + 1                # padded shared rows: no bank conflicts across rows
    PSTRIDE = BK + 1
    assert TX * TY == THREADS and PR * TY == BR and PK * TX == BK and OWN * THREADS == BR * VW \
        and OWN <= MAX_OWN and VW <= dpad

    @cuda.jit
    def attention(q, k_store, v_store, pages, page_bits, tables, seq_info_off, segments_off,
                  out, lse, sinks, part_acc, part_ml, n_row_tiles, n_splits, chunk, group,
                  ring_rows, mask_code, scale, softcap):
        tid = cuda.threadIdx.x
        width, n_heads, head_dim = q.shape
        v_head_dim = out.shape[2]
        if SLICED:                       # this block's V dims: [first_v, first_v + VW)
            kv_head, v_part = divmod32(cuda.blockIdx.y, div32(v_head_dim + VW - 1, VW))
            first_v = v_part * VW
        else:
            kv_head = cuda.blockIdx.y
            first_v = 0
        v_width = min(VW, v_head_dim - first_v)
        row_tile, split = divmod32(cuda.blockIdx.x, n_splits)
        seg_index, seg_tile = divmod32(row_tile, n_row_tiles)
        seg = tables[segments_off + seg_index]
        first_row = seg_tile * BR

        q_start, q_len, seq, pos_start, block = read_segment(tables, seq_info_off, seg)
        n_rows = min(BR, group * q_len - first_row)
        if n_rows <= 0:
            return
        span_lo, _hi = key_range(div32(first_row, group), q_len, pos_start, block, mask_code)
        _lo, span_hi = key_range(div32(first_row + n_rows - 1, group), q_len, pos_start,
                                 block, mask_code)
        key_lo = span_lo + split * chunk
        key_hi = min(span_hi, key_lo + chunk)
        if key_lo >= key_hi:
            return

        q_tile = cuda.shared.array((BR, STRIDE), float32)
        kv_tile = cuda.shared.array((BK, STRIDE), float32)
        probs = cuda.shared.array((BR, PSTRIDE), float32)
        row_lo = cuda.shared.array(BR, int32)
        row_hi = cuda.shared.array(BR, int32)
        row_alpha = cuda.shared.array(BR, float32)
        row_sum = cuda.shared.array(BR, float32)

        # stage the (pre-scaled) queries and each row's key interval
        for e in range(tid, n_rows * dpad, THREADS):
            r = e // dpad
            d = e - r * dpad
            if d < head_dim:
                token, member = divmod32(first_row + r, group)
                q_tile[r, d] = ptx.to_f32(q[q_start + token, kv_head * group + member,
                                            d]) * scale
        if tid < n_rows:
            lo, hi = key_range(div32(first_row + tid, group), q_len, pos_start, block, mask_code)
            row_lo[tid] = lo
            row_hi[tid] = hi
        run_max = NEG_INF                # this thread's row (tid < n_rows): running max, sum
        run_sum = float32(0.0)
        acc = cuda.local.array(OWN, float32)
        for i in range(OWN):
            acc[i] = 0.0
        score = cuda.local.array(NSCORE, float32)
        ty = tid // TX
        tx = tid % TX
        own_first_row = tid // VW

        for key0 in range(key_lo, key_hi, BK):
            n_keys = min(BK, key_hi - key0)
            row0 = storage_row(key0, ring_rows)
            # a. stage K
            _stage_keys(kv_tile, k_store, pages, page_bits, seq, row0, n_keys, kv_head,
                        head_dim, dpad, ring_rows, tid, THREADS, 0)
            cuda.syncthreads()
            # b. scores of this thread's micro-tile (clamped indices: no stale reads)
            if ty < n_rows and tx < n_keys:
                for j in range(NSCORE):
                    score[j] = 0.0
                for d in range(head_dim):
                    for a in range(PR):
                        qa = q_tile[min(ty + a * TY, n_rows - 1), d]
                        for b in range(PK):
                            score[a * PK + b] += qa * kv_tile[min(tx + b * TX, n_keys - 1), d]
                for a in range(PR):
                    r = ty + a * TY
                    for b in range(PK):
                        c = tx + b * TX
                        if r < n_rows and c < n_keys:
                            key = key0 + c
                            s = score[a * PK + b]
                            if softcap > 0:
                                s = softcap * math.tanh(s / softcap)
                            if key < row_lo[r] or key >= row_hi[r]:
                                s = NEG_INF
                            probs[r, c] = s
            cuda.syncthreads()
            # c. online softmax, one thread per row; everyone stages V over K
            if tid < n_rows:
                tile_max = NEG_INF
                for c in range(n_keys):
                    tile_max = max(tile_max, probs[tid, c])
                new_max = max(run_max, tile_max)
                alpha = float32(1.0)
                tile_sum = float32(0.0)
                if new_max == NEG_INF:   # no visible key yet: nothing to rescale
                    for c in range(n_keys):
                        probs[tid, c] = 0.0
                else:
                    alpha = math.exp(run_max - new_max)
                    for c in range(n_keys):
                        p = math.exp(probs[tid, c] - new_max)
                        probs[tid, c] = p
                        tile_sum += p
                run_max = new_max
                run_sum = run_sum * alpha + tile_sum
                row_alpha[tid] = alpha
                row_sum[tid] = run_sum
            _stage_keys(kv_tile, v_store, pages, page_bits, seq, row0, n_keys, kv_head,
                        v_width, VW, ring_rows, tid, THREADS, first_v)
            cuda.syncthreads()
            # d. rescale and accumulate this thread's output elements
            if own_first_row < n_rows:
                for i in range(OWN):
                    acc[i] *= row_alpha[min((i * THREADS + tid) // VW, n_rows - 1)]
                for c in range(n_keys):
                    for i in range(OWN):
                        e = i * THREADS + tid
                        r = e // VW
                        d = e - r * VW
                        if r < n_rows and d < v_width:
                            acc[i] += probs[r, c] * kv_tile[c, d]
            if key0 + BK < key_hi:
                cuda.syncthreads()

        # one split: each row's sink joins its state (its factor in row_alpha), once every
        # thread is done reading the last tile's factors
        sunk = n_splits == 1 and sinks.shape[0] > 0
        if sunk:
            cuda.syncthreads()
            if tid < n_rows:
                _, member = divmod32(first_row + tid, group)
                best, weight, run_sum = with_sink(run_max * LOG2E, run_sum,
                                                  sinks[kv_head * group + member] * LOG2E)
                run_max = best * LN2
                row_alpha[tid] = weight
                row_sum[tid] = run_sum
            cuda.syncthreads()

        # write out (one split) or partials (split-K, merged by _combine_kernel)
        for i in range(OWN):
            e = i * THREADS + tid
            r = e // VW
            d = e - r * VW
            if r < n_rows and d < v_width:
                token, member = divmod32(first_row + r, group)
                token += q_start
                head = kv_head * group + member
                if n_splits == 1:
                    value = acc[i] * row_alpha[r] if sunk else acc[i]
                    out[token, head, first_v + d] = ptx.from_f32(value / row_sum[r], out)
                else:
                    part_acc[((split * width + token) * n_heads + head) * v_head_dim
                             + first_v + d] = acc[i]
        # the rows' states: one slice writes them (every slice holds the same)
        if tid < n_rows and first_v == 0 and (n_splits > 1 or lse.shape[0] > 0):
            token, member = divmod32(first_row + tid, group)
            token += q_start
            head = kv_head * group + member
            if n_splits == 1:
                lse[token, head] = run_max + math.log(run_sum)
            else:
                base = ((split * width + token) * n_heads + head) * 2
                part_ml[base] = run_max
                part_ml[base + 1] = run_sum

    return Specialised(attention)


@cuda.jit
def _combine_kernel(tables, seq_info_off, segments_off, part_acc, part_ml, out, lse, sinks,
                    max_q_len, group, block_rows, chunk, mask_code):
    """Merge split-K partials of one query token (all heads): log-sum-exp weighted sum,
    each head's sink joined when `sinks` has elements, and each row's log-sum-exp into
    `lse` when it has rows.

    Row tile and split geometry must match the attention launch that wrote them; `part_acc`
    is `[n_splits, width, n_heads, v_head_dim]` flat, v_head_dim out's (V's) width.
    """
    seg_index, i = divmod32(cuda.blockIdx.x, max_q_len)
    seg = tables[segments_off + seg_index]
    q_start, q_len, _col, pos_start, block = read_segment(tables, seq_info_off, seg)
    if i >= q_len:
        return
    token = q_start + i
    width, n_heads, head_dim = out.shape        # head_dim: V's (the partials' stride)
    lo, hi = key_range(i, q_len, pos_start, block, mask_code)
    # the threads stride over this token's (head, dim) elements
    head, d = divmod32(cuda.threadIdx.x, head_dim)
    skip_heads, skip_dims = divmod32(COMBINE_THREADS, head_dim)
    while head < n_heads:
        _, member = divmod32(head, group)                      # head % group
        first_row = div32(i * group + member, block_rows) * block_rows
        span_lo, _hi = key_range(div32(first_row, group), q_len, pos_start, block, mask_code)
        split_first = div32(lo - span_lo, chunk)
        split_last = div32(hi - 1 - span_lo, chunk)
        best = NEG_INF
        for split in range(split_first, split_last + 1):
            best = max(best, part_ml[((split * width + token) * n_heads + head) * 2])
        total = float32(0.0)
        value = float32(0.0)
        for split in range(split_first, split_last + 1):
            base = (split * width + token) * n_heads + head
            weight = math.exp(part_ml[base * 2] - best)
            total += weight * part_ml[base * 2 + 1]
            value += weight * part_acc[base * head_dim + d]
        if sinks.shape[0] > 0:
            best, weight, total = with_sink(best * LOG2E, total, sinks[head] * LOG2E)
            best *= LN2
            value *= weight
        out[token, head, d] = ptx.from_f32(value / total, out)
        if d == 0 and lse.shape[0] > 0:
            lse[token, head] = best + math.log(total)
        head, d = step_on(head, d, skip_heads, skip_dims, head_dim)


_combine = Specialised(_combine_kernel)


def launch_shape(*, n_segments, max_q_len, max_kv_len, n_q_heads, n_kv_heads, head_dim,
                 mask_code, path=None, kv_chunk=None, v_head_dim=None):
    """Host-side launch geometry: a dict with path, tiles, grid and split-K chunking.

    `path`: None (auto: "decode" when `max_q_len <= DECODE_MAX_Q_LEN`), "decode" or
    "prefill". `kv_chunk`: force the split-K chunk length (keys), any path. `v_head_dim`:
    V's width (None: head_dim); the tiles are those of `max(head_dim, v_head_dim)`'s bucket.
    """
    if path is None:
        path = "decode" if max_q_len <= DECODE_MAX_Q_LEN else "prefill"
    if path not in ("decode", "prefill"):
        raise ValueError(f"path={path!r}: must be None, 'decode' or 'prefill'")
    group = n_q_heads // n_kv_heads
    dpad = head_dim_bucket(max(head_dim, head_dim if v_head_dim is None else v_head_dim))
    if path == "decode":
        rows = group * max_q_len
        tiles = next((t for t in DECODE_TILES[dpad] if t[0] >= rows), DECODE_TILES[dpad][-1])
    else:
        tiles = PREFILL_TILES[dpad]
    block_rows, block_keys, key_lanes, threads = tiles
    n_row_tiles = ceil_div(group * max_q_len, block_rows)
    # longest key range of one row tile: the whole history, or what a window of W leaves
    # (a chunk of C reads back at most C - 1 positions, as a window of C)
    span = max_kv_len if mask_code == 0 else min(max_kv_len, abs(mask_code) + max_q_len - 1)
    span = max(span, 1)
    if kv_chunk is not None:
        chunk = int(kv_chunk)
    elif path == "decode":
        want = min(MAX_SPLITS, max(1, ceil_div(TARGET_BLOCKS,
                                                n_segments * n_row_tiles * n_kv_heads)))
        chunk = ceil_div(max(DECODE_MIN_CHUNK, ceil_div(span, want)), block_keys) * block_keys
    else:
        chunk = span
    n_splits = ceil_div(span, chunk)
    return dict(path=path, group=group, dpad=dpad, block_rows=block_rows,
                block_keys=block_keys, key_lanes=key_lanes, n_row_tiles=n_row_tiles,
                n_splits=n_splits, chunk=chunk,
                v_slice=V_SLICES.get(dpad),
                grid=(n_segments * n_row_tiles * n_splits,
                      n_kv_heads * ceil_div(v_head_dim or head_dim, V_SLICES.get(dpad, dpad))),
                threads=threads)


class GenericRun:
    """The generic kernel's launches of one step for one group of segments (`prepare`):
    the step's tables (where the segment table and the group's list are), the group's
    size, longest segment and furthest key, its path and split-K chunk, `page_bits`, the
    workspace and the stream fixed. A call (`run(q, k_store, v_store, pages, out, lse,
    sinks, ring_rows, mask_code, scale, softcap)`, once per layer) looks its signature up (q's and
    out's dtypes and heads, the storage's dtype, K's and V's slot shapes, the mask code): the
    first call of a signature works out the launch shape (`launch_shape`, from K's
    head_dim and V's v_head_dim), sizes the partials (`n_splits * width * n_q_heads *
    v_head_dim` floats) and binds the kernel (and the combine where the shape splits);
    later calls pack their arrays and scalars only. q is `[width, n_q_heads, head_dim]`,
    out `[width, n_q_heads, v_head_dim]`."""

    def __init__(self, tables, *, seq_info_off: int, segments_off: int, n_segments: int,
                 max_q_len: int, max_kv_len: int, page_bits: int, workspace, path=None,
                 kv_chunk=None, stream=0):
        self.tables, self.seq_info_off, self.segments_off = tables, seq_info_off, segments_off
        self.n_segments, self.max_q_len, self.max_kv_len = n_segments, max_q_len, max_kv_len
        self.page_bits, self.workspace, self.path, self.kv_chunk = (page_bits, workspace, path,
                                                                    kv_chunk)
        self.stream = stream
        self._launches = {}     # (attention launch, combine launch or None) by signature

    def __call__(self, q, k_store, v_store, pages, out, lse, sinks, ring_rows, mask_code, scale,
                 softcap) -> None:
        if self.n_segments == 0:
            return
        width, n_q_heads, head_dim = q.shape
        if width * n_q_heads > MAX_QUERY_ROWS:
            raise ValueError(f"q [{width}, {n_q_heads}, {head_dim}]: the attention kernels "
                             f"take at most {MAX_QUERY_ROWS} (token, head) rows")
        key = (q.dtype, q.shape, out.dtype, k_store.dtype, k_store.shape[1:],
               v_store.shape[1:], mask_code)
        launches = self._launches.get(key)
        if launches is None:
            launches = self._launches[key] = self._bind(q, k_store, v_store, out, mask_code)
        attention, merge = launches
        attention(q, k_store, v_store, pages, out, lse, sinks, int(ring_rows),
                  np.float32(scale), np.float32(softcap))
        if merge is not None:
            merge(out, lse, sinks)

    def _bind(self, q, k_store, v_store, out, mask_code: int) -> tuple:
        width, n_q_heads, head_dim = q.shape
        n_kv_heads, v_head_dim = k_store.shape[1], out.shape[2]
        assert n_q_heads % n_kv_heads == 0
        assert tuple(out.shape) == (width, n_q_heads, v_head_dim)
        # V's store is its own, or, for a latent layer, K's rows (V their first values)
        assert v_store.shape[1] == n_kv_heads and v_store.shape[2] >= v_head_dim
        shape = launch_shape(n_segments=self.n_segments, max_q_len=self.max_q_len,
                           max_kv_len=self.max_kv_len, n_q_heads=n_q_heads,
                           n_kv_heads=n_kv_heads, head_dim=head_dim, mask_code=mask_code,
                           path=self.path, kv_chunk=self.kv_chunk, v_head_dim=v_head_dim)
        n_splits, stream = shape["n_splits"], self.stream
        if n_splits > 1:
            part_acc, part_ml = self.workspace.partials(
                n_splits * width * n_q_heads * v_head_dim, n_splits * width * n_q_heads * 2,
                stream)
        else:
            part_acc = part_ml = self.workspace.dummy
        kernel = _attention_kernel(shape["dpad"], shape["block_rows"], shape["block_keys"],
                                   shape["key_lanes"], shape["threads"], shape["v_slice"])
        attention = kernel.bind(
            shape["grid"], shape["threads"], stream, PER_CALL, PER_CALL, PER_CALL, PER_CALL,
            int(self.page_bits), self.tables, int(self.seq_info_off), int(self.segments_off),
            PER_CALL, PER_CALL, PER_CALL, part_acc, part_ml, shape["n_row_tiles"], n_splits,
            shape["chunk"],
            shape["group"], PER_CALL, int(mask_code), PER_CALL, PER_CALL)
        merge = None
        if n_splits > 1:
            merge = _combine.bind(
                self.n_segments * self.max_q_len, COMBINE_THREADS, stream, self.tables,
                int(self.seq_info_off), int(self.segments_off), part_acc, part_ml, PER_CALL,
                PER_CALL, PER_CALL, self.max_q_len, shape["group"], shape["block_rows"], shape["chunk"],
                int(mask_code))
        return attention, merge


def prepare(tables, *, seq_info_off, segments_off, n_segments, max_q_len, max_kv_len,
            page_bits, workspace, path=None, kv_chunk=None, stream=0) -> GenericRun:
    """The prepared half of `attend`: what a step fixes for one group of segments, once
    (`GenericRun`); the arguments are `attend`'s."""
    return GenericRun(tables, seq_info_off=int(seq_info_off), segments_off=int(segments_off),
                      n_segments=int(n_segments), max_q_len=int(max_q_len),
                      max_kv_len=int(max_kv_len), page_bits=int(page_bits),
                      workspace=workspace, path=path, kv_chunk=kv_chunk, stream=stream)


def attend(q, k_store, v_store, tables, out, *, pages, page_bits, seq_info_off, segments_off,
           n_segments, max_q_len, max_kv_len, ring_rows, mask_code, scale, softcap, workspace,
           lse=None, sinks=None, stream=0, path=None, kv_chunk=None):
    """Attention of the served segments' queries over their own sequences' keys, into `out`.

    q: [width, n_q_heads, head_dim] device array; out: [width, n_q_heads, v_head_dim]
    (only the served segments' rows are written); each float16, float32 or bfloat16
    (uint16 bits). k_store / v_store: slot storage [n_pages * page_size, n_kv_heads,
    head_dim] / [..., n_kv_heads, v_head_dim] (a page pool [n_pages, page_size, ...]
    reshaped); head_dim and v_head_dim each 1..512, equal or not. pages: the layer kind's
    int32 device page table [seq rows, pages per sequence] of page-aligned slot bases,
    indexed by a segment's `SEQ`; page_bits: log2(page_size). Storage row r of sequence
    `seq` is slot `pages[seq, r >> page_bits] | (r & (page_size - 1))` (`masks.page_slot`).
    tables: the step's int32 device tables: segment `s`'s fields (`kvnumba.arith.positions`) at
    `seq_info_off + s * SEQ_INFO_FIELDS`, the served segments' indices at
    `segments_off .. + n_segments`. max_q_len / max_kv_len: largest q_len /
    pos_start + q_len over them.
    ring_rows: 0 (flat) or R (position p in row p % R). mask_code: the layer's mask code
    (`masks.key_range`: 0 none, W a sliding window, -C chunks of C).
    softcap: 0.0 = off. lse: None, or a float32 `[width, n_q_heads]` device array that
    receives each served row's natural-log log-sum-exp of its (scaled, capped) scores.
    sinks: None, or a float32 `[n_q_heads]` device array: each q head's logit joins its
    rows' softmax (`kernels.sinks`; `lse` includes it). All launches on `stream`; no host synchronisation, no copies,
    no device allocation once `workspace` is warm.
    path / kv_chunk: the path and its split-K chunk (see `launch_shape`); the cache
    passes both. A cache prepares a step's group once (`prepare`) and calls it per layer.
    """
    prepare(tables, seq_info_off=seq_info_off, segments_off=segments_off,
            n_segments=n_segments, max_q_len=max_q_len, max_kv_len=max_kv_len,
            page_bits=page_bits, workspace=workspace, path=path, kv_chunk=kv_chunk,
            stream=stream)(q, k_store, v_store, pages, out,
                           no_output() if lse is None else lse,
                           no_sinks() if sinks is None else sinks, ring_rows, mask_code, scale,
                           softcap)
    return out
