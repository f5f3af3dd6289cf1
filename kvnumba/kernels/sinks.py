"""Attention sinks (contract §15): a per-query-head logit that joins every row's softmax
as one more term of its denominator, `exp(sink - m)`, with no value: a row's output is
`sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))` and its log-sum-exp
`log(exp(sink) + sum_j exp(s_j))`.

A kernel keeps a row's online softmax as (max, sum, unnormalised accumulator); the sink
folds into that state once, where the row is normalised (`with_sink`): a cost per row,
not per key. A split row folds it where its partials are merged, never in a partial.
Kernels take `sinks` as a float32 `[n_q_heads]` device array, or `no_sinks()` (no
elements) for none, and fold only when it has elements.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..device import cuda
from .softmax import merge

from numba import float32  # noqa: E402  (after kvnumba.device chose the target)

ONE = float32(1.0)


@cuda.jit(device=True, inline="always")
def with_sink(best, total, sink):
    """`(best', weight, total')`: a row's softmax state (`best` its max, -inf for none;
    `total` the sum of `2**(s - best)` over its keys) with a base-2 `sink` logit joined:
    `best' = max(best, sink)`, `total' = total * weight + 2**(sink - best')`, and the
    row's unnormalised accumulator scales by `weight = 2**(best - best')` (so its output
    is `acc * weight / total'`, its log-sum-exp `ln 2 * (best' + log2 total')`). Base 2
    throughout: natural-log states convert with `LOG2E` in and `LN2` out."""
    new, total, weight, _ = merge(best, total, sink, ONE, ONE)
    return new, weight, total


@lru_cache(maxsize=None)
def no_sinks():
    """A float32 device array of no elements (`[0]`), passed as `sinks` for none: one
    launch serves both cases. Made once, on first use; it holds no memory."""
    return cuda.device_array((0,), np.float32)
