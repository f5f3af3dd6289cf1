"""The generic path's combine (`combine_kernel`): the split-K partials of a row merged
(`softmax.merge`) into `out`, its sink joined, its log-sum-exp into `lse`.
"""
from __future__ import annotations

import math

from ...device import cuda
from ..intrinsics import ptx
from ..launch.constants import LN2, LOG2E, NEG_INF
from ..launch.calling import Specialised
from ..masks import div32, divmod32, key_range, read_segment, step_on
from ..sinks import with_sink
from ..softmax import merge
from .shape import COMBINE_THREADS

from numba import float32  # noqa: E402  (after kvnumba.device chose the target)


@cuda.jit
def _combine(tables, seq_info_off, segments_off, part_acc, part_ml, out, lse, sinks,
             max_q_len, group, block_rows, chunk, mask_code):
    """Merge split-K partials of one query token (all heads), split by split in order
    (`softmax.merge` of natural-log states), each head's sink joined when `sinks` has
    elements, and each row's log-sum-exp into `lse` when it has rows.

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
        total = float32(0.0)
        value = float32(0.0)
        for split in range(split_first, split_last + 1):
            base = (split * width + token) * n_heads + head
            best, total, w_run, w_part = merge(best, total, part_ml[base * 2],
                                               part_ml[base * 2 + 1], LOG2E)
            value = value * w_run + w_part * part_acc[base * head_dim + d]
        if sinks.shape[0] > 0:
            best, weight, total = with_sink(best * LOG2E, total, sinks[head] * LOG2E)
            best *= LN2
            value *= weight
        out[token, head, d] = ptx.from_f32(value / total, out)
        if d == 0 and lse.shape[0] > 0:
            lse[token, head] = best + math.log(total)
        head, d = step_on(head, d, skip_heads, skip_dims, head_dim)


combine_kernel = Specialised(_combine)
