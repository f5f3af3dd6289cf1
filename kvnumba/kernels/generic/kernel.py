"""The generic attention kernel's body (`attention_kernel`, one per padded head_dim and
tile shape): staging, scores, the online softmax (`softmax.rescaling`) and the
accumulation of one row tile over one key range, writing `out` or split-K partials (the
package doc tells the steps).
"""
from __future__ import annotations

import math
from functools import lru_cache

from ...device import cuda
from ..intrinsics import ptx
from ..launch.constants import LN2, LOG2E, NEG_INF
from ..launch.calling import Specialised
from ..masks import div32, divmod32, key_range, page_slot, read_segment, storage_row, store_row
from ..sinks import with_sink
from ..softmax import rescaling
from .shape import MAX_OWN

from numba import float32, int32  # noqa: E402  (after kvnumba.device chose the target)


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
def attention_kernel(dpad: int, block_rows: int, block_keys: int, key_lanes: int,
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
                new_max = run_max
                for c in range(n_keys):
                    new_max = max(new_max, probs[tid, c])
                alpha, base = rescaling(run_max, new_max, LOG2E)
                tile_sum = float32(0.0)
                for c in range(n_keys):
                    p = ptx.exp2_approx(probs[tid, c] * LOG2E - base)
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

        # write out (one split) or partials (split-K, merged by `combine.combine_kernel`)
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
