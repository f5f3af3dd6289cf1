"""Which attention kernel serves which segments of a step: planned in `prepare_step`,
launched in `attend` (a FlashInfer-style plan / run split).

A step's segments fall in two groups by length (contract §8): *decode* segments
(`q_len <= DECODE_MAX_Q_LEN`: a token, or a short speculative draft) and *prefill*
segments. Each group runs on its own path, over its own list of segments, so a
step launches at most two attention kernels (plus the decode path's combine) and a
segment's output never depends on what shares its step:

* decode: `kernels.decode` (16-byte loads, key chunks of `decode.CHUNK_KEYS`) where it
  serves the storage, else `kernels.attention` split-K in chunks of the same length;
* prefill: `kernels.prefill` (tensor cores: 16-bit storage, scale > 0) where it serves
  the storage, else `kernels.attention` (CUDA cores, exact for float32).

`plan` writes the step's int32 sections straight into its one upload: the two
segment lists, and for the decode path one work / combine table per distinct layer
window (the window decides which keys a chunk covers); and it fixes what each path
launches for the step's layers. `run` then launches with nothing left to plan.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .kernels import attention as generic, decode, prefill
from .kernels.attention import DECODE_MAX_Q_LEN, AttentionWorkspace
from .kernels.decode import COMBINE_FIELDS
from .plan import POS_START, Q_LEN, SEQ_INFO_FIELDS, layer_rows

_max = np.maximum.reduce
_min = np.minimum.reduce


class Group(NamedTuple):
    """The segments one path serves in a step: how many, their longest q_len and the
    furthest position + 1 they reach (the generic kernel sizes its grid from these)."""

    n: int
    max_q_len: int
    max_kv_len: int


_NONE = Group(0, 0, 0)


class StepPaths:
    """A prepared step's routing (`AttentionPaths.plan`): the two groups, the decode plans
    by window (`decode.PlacedPlan`), and what each path launches for every layer of the
    step, so a layer adds only its own arrays and scalars: the fast decode path's
    `decode.DecodeRun` by layer window, the other paths' launch arguments."""

    __slots__ = ("decode", "prefill", "decode_plans", "decode_runs", "decode_args",
                 "prefill_args", "buffers")

    def __init__(self, decode_group, prefill_group):
        self.decode = decode_group
        self.prefill = prefill_group
        self.decode_plans = {}
        self.decode_runs = self.decode_args = self.prefill_args = None
        self.buffers = tuple    # the cache's: the addresses of the buffers launches use

    def launch_key(self) -> tuple:
        """What the launches' grids and buffers depend on, besides the step's width: the
        decode plans' sizes (or, on the generic path, the split-K chunks of the longest
        history), the prefill group's size, and where the buffers every launch uses
        (storage, step tables, partials) are now, read when the key is: a buffer that
        grows moves. Two steps with equal keys (and widths) launch the same grids on the
        same buffers, so a CUDA graph of one replays the other (the positions and columns
        it reads are the staged tables' contents)."""
        d, p = self.decode, self.prefill
        if self.decode_plans:
            decode_key = tuple((window, f.n_items, f.n_combine, f.n_parts, f.max_q_len)
                               for window, f in sorted(self.decode_plans.items()))
        else:
            decode_key = (d.n, d.max_q_len, -(-d.max_kv_len // decode.CHUNK_KEYS))
        return decode_key, (p.n, p.max_q_len), self.buffers()


class AttentionPaths:
    """The attention paths of one cache (chosen once from its config) and their workspace."""

    def __init__(self, config, stream, pages: dict, page_bits: int):
        self.decode_fast = decode.supports(config.head_dim, config.storage_dtype)
        self.prefill_fast = prefill.supports(config.head_dim, config.storage_dtype)
        self.windows = sorted({spec.window or 0 for spec in config.layers})
        # R of the ring layers of each window (0: flat), as the pool sizes them
        self.ring_rows = {window: int(rows) for window, rows in zip(
            self.windows, layer_rows([w or None for w in self.windows], config.max_write,
                                     config.capacity))}
        # the device page table of the layers of each window, by window
        self.pages = {window: pages[rows] for window, rows in self.ring_rows.items()}
        self.page_bits = page_bits
        self.stream = stream
        self.workspace = AttentionWorkspace()
        self._ramp = np.arange(0, dtype=np.int32)    # every segment's index, grown on demand
        self._all_last = self._ramp
        self._runs = {}       # the last step's decode runs, by window

    # ------------------------------------------------------------------ host, per step
    def plan(self, seq_info: np.ndarray, max_q_len: int, max_kv_len: int, staging, *,
             info_at: int, at: int):
        """`(StepPaths, end)`: the routing of the step whose segment table is `seq_info`
        (its longest segment `max_q_len`, its furthest reach `max_kv_len`), staged at
        entry `info_at` of the step's tables in `staging` (a `Staging`). Its sections
        (the fast decode path's plan per layer window, the other paths' segment lists)
        are written into the host buffer from entry `at` up to `end`, and what each path
        launches for every layer of the step is fixed: the fast decode path's
        `decode.DecodeRun` by window, the other paths' launch arguments."""
        n = len(seq_info)
        if max_q_len <= DECODE_MAX_Q_LEN:                   # a decode step: one group
            paths = StepPaths(Group(n, max_q_len, max_kv_len), _NONE)
            decode_segs = self._all(n)
        elif _min(seq_info[:, Q_LEN]) > DECODE_MAX_Q_LEN:    # a prefill step: the other
            paths = StepPaths(_NONE, Group(n, max_q_len, max_kv_len))
            prefill_segs = self._all(n)
        else:
            is_decode = seq_info[:, Q_LEN] <= DECODE_MAX_Q_LEN
            decode_segs = np.flatnonzero(is_decode).astype(np.int32)
            prefill_segs = np.flatnonzero(~is_decode).astype(np.int32)
            paths = StepPaths(_group(seq_info, decode_segs), _group(seq_info, prefill_segs))
        decode_group, prefill_group = paths.decode, paths.prefill
        if decode_group.n and self.decode_fast:     # a work list per window; no segment list
            for window in self.windows:
                paths.decode_plans[window] = found = decode.plan_into(
                    seq_info, decode_segs, window=window, staging=staging, at=at)
                at = found.combine_off + found.n_combine * COMBINE_FIELDS
        elif decode_group.n:
            segments_at, at = at, staging.put(decode_segs, at)
            paths.decode_args = dict(seq_info_off=info_at, segments_off=segments_at,
                                     n_segments=decode_group.n,
                                     max_q_len=decode_group.max_q_len,
                                     max_kv_len=decode_group.max_kv_len)
        if prefill_group.n:
            segments_at, at = at, staging.put(prefill_segs, at)
            paths.prefill_args = dict(seq_info_off=info_at, segments_off=segments_at,
                                      n_segments=prefill_group.n,
                                      max_q_len=prefill_group.max_q_len)
        if paths.decode_plans:    # the device buffer, once the sections no longer grow it
            paths.decode_runs = self._decode_runs(paths.decode_plans, staging.device, info_at)
        return paths, at

    def _all(self, n: int) -> np.ndarray:
        """Every segment's index, `[0, n)` (int32, read-only; the last one made is kept:
        a decode loop's steps ask for the same)."""
        found = self._all_last
        if found.size == n:
            return found
        if n > self._ramp.size:
            self._ramp = np.arange(max(n, 2 * self._ramp.size), dtype=np.int32)
            self._ramp.setflags(write=False)
        self._all_last = found = self._ramp[:n]
        return found

    def _decode_runs(self, plans: dict, tables, info_at: int) -> dict:
        """A `decode.DecodeRun` per window of the step's placed `plans`. One the last step
        made for the same tables, placed alike, is taken again, with the launches it has
        bound (a steady decode loop binds them once)."""
        runs = self._runs
        for window, found in plans.items():
            run = runs.get(window)
            if run is None or run.tables is not tables or run.seq_info_off != info_at or \
                    run.placed != found:
                runs[window] = decode.DecodeRun(tables, info_at, found, self.workspace,
                                                self.ring_rows[window], window,
                                                self.pages[window], self.page_bits,
                                                self.stream)
        return runs.copy()

    # ------------------------------------------------------------------ device, per layer
    def run(self, paths: StepPaths, q, k_store, v_store, tables, out, lse, *, ring_rows,
            window, pages, scale, softcap, stream) -> None:
        """Launch the step's paths for one layer (`k_store`, `v_store`: its slot storage,
        `pages`: its kind's device page table): each writes its segments' rows of `out`,
        and of `lse` (float32 `[width, n_q_heads]`) their log-sum-exps unless it has no
        rows (`launch.no_output()`)."""
        page_bits = self.page_bits
        if paths.decode.n and self.decode_fast:
            decode.run(q, k_store, v_store, tables, out=out, lse=lse, scale=scale,
                       softcap=softcap, stream=stream, planned=paths.decode_runs[window])
        elif paths.decode.n:
            generic.attend(q, k_store, v_store, tables, out, lse=lse, workspace=self.workspace,
                           pages=pages, page_bits=page_bits,
                           path="decode", kv_chunk=decode.CHUNK_KEYS, ring_rows=ring_rows,
                           window=window, scale=scale, softcap=softcap, stream=stream,
                           **paths.decode_args)
        if not paths.prefill.n:
            return
        if self.prefill_fast and scale > 0:
            prefill.run(q, k_store, v_store, tables, pages=pages, page_bits=page_bits,
                        out=out, lse=lse, ring_rows=ring_rows,
                        window=window, scale=scale, softcap=softcap, stream=stream,
                        **paths.prefill_args)
        else:
            generic.attend(q, k_store, v_store, tables, out, lse=lse, workspace=self.workspace,
                           pages=pages, page_bits=page_bits, path="prefill", max_kv_len=paths.prefill.max_kv_len,
                           ring_rows=ring_rows, window=window, scale=scale, softcap=softcap,
                           stream=stream, **paths.prefill_args)


def tables_size(config) -> int:
    """int32 entries the staged tables of a usual step take: per token its column and
    position, a segment (at most one per token) and its place in a path's list; per
    layer window a decode plan of one chunk per segment plus the chunks of `max_seqs`
    sequences at capacity. A step that needs more grows the buffer (`staging`)."""
    per_token = 2 + SEQ_INFO_FIELDS + 1
    chunks = config.max_step + min(config.max_step, config.max_seqs) * \
        -(-config.capacity // decode.CHUNK_KEYS)
    windows = len({spec.window for spec in config.layers})
    return per_token * config.max_step + windows * (decode.WORK_FIELDS * chunks +
                                                   decode.COMBINE_FIELDS * config.max_step)


def _group(seq_info, segments) -> Group:
    if segments.size == 0:
        return _NONE
    rows = seq_info[segments]
    return Group(int(segments.size), int(_max(rows[:, Q_LEN])),
                 int(_max(rows[:, POS_START] + rows[:, Q_LEN])))
