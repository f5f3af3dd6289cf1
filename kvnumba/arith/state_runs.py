"""A state layer's work plan for one step: its segments grouped by sequence (the delta
rule kernel's runs).

The step's segment table `seq_info [n_segments, SEQ_INFO_FIELDS]` (`positions`) lists
segments in token order; a sequence may have several (spans), which take consecutive
positions in token order. A recurrent state is advanced by one block per (sequence,
head), through all of that sequence's segments in order, so the plan is:

* `order [n_segments]` int32: segment indices, grouped by sequence, the sequences in
  the order of their first segment, each sequence's segments in token order;
* `runs [n_runs, RUN_FIELDS]` int32, one row per distinct sequence, in the same order:
  `(col, floor, lo, hi)`: its column (the segment table's SEQ), its floor
  (`floors[col]`) and `order[lo:hi]`, its segments.

Given a chunk size, the runs of at least that many new tokens (prefills) come last, the
others first, each group in first-appearance order: the delta rule's chunked kernel
takes the last `n_chunked` runs.

Pure NumPy: nothing here touches a device.
"""
from __future__ import annotations

import numpy as np

from .positions import Q_LEN, SEQ

# --- a run's fields: runs[run, field] (int32) ---
RUN_COL = 0      # the sequence's column of the state storage (its SEQ)
RUN_FLOOR = 1    # its floor: the lowest position it may resume at
RUN_LO = 2       # order[lo:hi]: its segments, in token order
RUN_HI = 3
RUN_FIELDS = 4


def state_runs(seq_info, floors, chunk: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """`(runs, order, n_chunked)` of the segment table `seq_info` (module doc): one run
    per distinct sequence (`seq_info[:, SEQ]`) in first-appearance order, `floors`
    indexed by sequence, except that with `chunk > 0` the `n_chunked` runs of at least
    `chunk` new tokens (a prefill, for the delta rule's chunked kernel) come last, in
    that order too. `runs` and `order` int32, C-contiguous; `runs` is `[0, RUN_FIELDS]`
    for no segments."""
    table = np.asarray(seq_info, dtype=np.int64).reshape(-1, np.shape(seq_info)[-1])
    seqs = table[:, SEQ]
    n = seqs.size
    if n == 0:
        return np.zeros((0, RUN_FIELDS), np.int32), np.zeros(0, np.int32), 0
    distinct, first, run_of = np.unique(seqs, return_index=True, return_inverse=True)
    run_of = run_of.reshape(-1)
    rank = np.empty(distinct.size, np.int64)          # run index of each distinct sequence
    rank[np.argsort(first, kind="stable")] = np.arange(distinct.size)
    n_chunked = 0
    if chunk > 0:
        long = np.bincount(run_of, weights=table[:, Q_LEN], minlength=distinct.size) >= chunk
        n_chunked = int(np.count_nonzero(long))
        rank = np.argsort(np.argsort(rank + long * distinct.size, kind="stable"),
                          kind="stable")
    seg_run = rank[run_of]
    order = np.argsort(seg_run, kind="stable").astype(np.int32)   # token order kept within
    counts = np.bincount(seg_run, minlength=distinct.size)
    hi = np.cumsum(counts)
    runs = np.empty((distinct.size, RUN_FIELDS), np.int32)
    cols = seqs[order[hi - 1]]
    runs[:, RUN_COL] = cols
    runs[:, RUN_FLOOR] = np.asarray(floors)[cols]
    runs[:, RUN_LO] = hi - counts
    runs[:, RUN_HI] = hi
    return runs, order, n_chunked
