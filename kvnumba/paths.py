"""Which attention kernel serves which segments of a step: planned in `prepare_step`,
launched in `attend` (a FlashInfer-style plan / run split).

A step's segments fall in two groups by length (contract §8): *decode* segments
(`q_len <= DECODE_MAX_Q_LEN`: a token, or a short speculative draft) and *prefill*
segments. Each group runs on its own path, over its own list of segments, so a
step launches at most two attention kernels (plus the decode path's combine) and a
segment's output never depends on what shares its step:

* decode: `kernels.decode` (16-byte loads, key chunks of `decode.CHUNK`) where it
  serves the storage, else `kernels.attention` split-K in chunks of the same length;
* prefill: `kernels.prefill` (tensor cores: 16-bit storage, scale > 0) where it serves
  the storage, else `kernels.attention` (CUDA cores, exact for float32).

`plan` turns the host segment table into int32 sections for the step's one upload:
the two segment lists, and for the decode path one work / combine table per
distinct layer window (the window decides which keys a chunk covers). `run` then
launches with nothing left to plan.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from .kernels import attention as generic, decode, prefill
from .kernels.attention import DECODE_MAX_Q_LEN, AttentionWorkspace
from .plan import POS_START, Q_LEN, SEQ_INFO_FIELDS

_max = np.maximum.reduce
_min = np.minimum.reduce


class Group(NamedTuple):
    """The segments one path serves in a step: how many, their longest q_len and the
    furthest position + 1 they reach (the generic kernel sizes its grid from these)."""

    n: int
    max_q_len: int
    max_kv_len: int


_NONE = Group(0, 0, 0)


@lru_cache(maxsize=None)
def plan_sections(window: int) -> tuple:
    """The names, in a step's upload, of the decode plan of layers of `window`: its work
    table and its combine table."""
    return f"work {window}", f"combine {window}"


class StepPaths:
    """A prepared step's routing: the two groups, the decode plans by window, and (once
    `place`d in the uploaded tables) the launch arguments each path takes for every layer
    of the step, so a layer adds only its own arrays and scalars."""

    __slots__ = ("decode", "prefill", "decode_plans", "decode_args", "prefill_args",
                 "buffers")

    def __init__(self, decode_group, prefill_group, decode_plans):
        self.decode = decode_group
        self.prefill = prefill_group
        self.decode_plans = decode_plans
        self.decode_args = self.prefill_args = None
        self.buffers = tuple    # the cache's: the addresses of the buffers launches use

    def place(self, offsets: dict) -> None:
        """Fix the launch arguments, given where each uploaded section starts (`offsets`,
        by the names `AttentionPaths.plan` gave them): the decode path's by layer window
        (its fast kernel reads a plan per window), the prefill path's for all layers."""
        info = offsets["seq_info"]
        d, p = self.decode, self.prefill
        if self.decode_plans:
            self.decode_args = {}
            for window, found in self.decode_plans.items():
                work, combine = plan_sections(window)
                self.decode_args[window] = dict(
                    seq_info_off=info, work_off=offsets[work], n_items=found.n_items,
                    combine_off=offsets[combine], n_combine=found.n_combine,
                    n_parts=found.n_parts, max_q_len=found.max_q_len)
        elif d.n:
            self.decode_args = dict(seq_info_off=info, segments_off=offsets["decode_segments"],
                                    n_segments=d.n, max_q_len=d.max_q_len,
                                    max_kv_len=d.max_kv_len)
        if p.n:
            self.prefill_args = dict(seq_info_off=info, segments_off=offsets["prefill_segments"],
                                     n_segments=p.n, max_q_len=p.max_q_len)

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
            decode_key = (d.n, d.max_q_len, -(-d.max_kv_len // decode.CHUNK))
        return decode_key, (p.n, p.max_q_len), self.buffers()


class AttentionPaths:
    """The attention paths of one cache (chosen once from its config) and their workspace."""

    def __init__(self, config):
        self.decode_fast = decode.supports(config.head_dim, config.storage_dtype)
        self.prefill_fast = prefill.supports(config.head_dim, config.storage_dtype)
        self.windows = sorted({spec.window or 0 for spec in config.layers})
        self.workspace = AttentionWorkspace()
        self._ramp = np.arange(0, dtype=np.int32)    # every segment's index, grown on demand

    # ------------------------------------------------------------------ host, per step
    def plan(self, seq_info: np.ndarray, max_q_len: int, max_kv_len: int):
        """`(StepPaths, sections)`: the routing of the step whose segment table is
        `seq_info` (its longest segment `max_q_len`, its furthest reach `max_kv_len`),
        and the int32 arrays to upload, by name, in upload order."""
        n = len(seq_info)
        q_len = seq_info[:, Q_LEN]
        if n > self._ramp.size:
            self._ramp = np.arange(max(n, 2 * self._ramp.size), dtype=np.int32)
            self._ramp.setflags(write=False)
        if max_q_len <= DECODE_MAX_Q_LEN:                   # a decode step: one group
            decode_segs, prefill_segs = self._ramp[:n], self._ramp[:0]
            decode_group, prefill_group = Group(n, max_q_len, max_kv_len), _NONE
        elif _min(q_len) > DECODE_MAX_Q_LEN:                # a prefill step: the other
            decode_segs, prefill_segs = self._ramp[:0], self._ramp[:n]
            decode_group, prefill_group = _NONE, Group(n, max_q_len, max_kv_len)
        else:
            is_decode = q_len <= DECODE_MAX_Q_LEN
            decode_segs = np.flatnonzero(is_decode).astype(np.int32)
            prefill_segs = np.flatnonzero(~is_decode).astype(np.int32)
            decode_group = _group(seq_info, decode_segs)
            prefill_group = _group(seq_info, prefill_segs)
        sections, plans = {}, {}
        if decode_group.n and self.decode_fast:     # a work list per window; no segment list
            for window in self.windows:
                work, combine = plan_sections(window)
                plans[window] = found = decode.plan(seq_info, decode_segs, window=window)
                sections[work] = found.work
                sections[combine] = found.combine
        elif decode_group.n:
            sections["decode_segments"] = decode_segs
        if prefill_group.n:
            sections["prefill_segments"] = prefill_segs
        return StepPaths(decode_group, prefill_group, plans), sections

    # ------------------------------------------------------------------ device, per layer
    def run(self, paths: StepPaths, q, k_store, v_store, tables, out, *, ring_rows, window,
            scale, softcap, stream) -> None:
        """Launch the step's paths for one layer: each writes its segments' rows of `out`."""
        if paths.decode.n and self.decode_fast:
            decode.run(q, k_store, v_store, tables, out=out, workspace=self.workspace,
                       ring_rows=ring_rows, window=window, scale=scale, softcap=softcap,
                       stream=stream, **paths.decode_args[window])
        elif paths.decode.n:
            generic.attend(q, k_store, v_store, tables, out, workspace=self.workspace,
                           path="decode", kv_chunk=decode.CHUNK, ring_rows=ring_rows,
                           window=window, scale=scale, softcap=softcap, stream=stream,
                           **paths.decode_args)
        if not paths.prefill.n:
            return
        if self.prefill_fast and scale > 0:
            prefill.run(q, k_store, v_store, tables, out=out, ring_rows=ring_rows,
                        window=window, scale=scale, softcap=softcap, stream=stream,
                        **paths.prefill_args)
        else:
            generic.attend(q, k_store, v_store, tables, out, workspace=self.workspace,
                           path="prefill", max_kv_len=paths.prefill.max_kv_len,
                           ring_rows=ring_rows, window=window, scale=scale, softcap=softcap,
                           stream=stream, **paths.prefill_args)


def tables_size(config) -> int:
    """int32 entries the staged tables of a usual step take: per token its column and
    position, a segment (at most one per token) and its place in a path's list; per
    layer window a decode plan of one chunk per segment plus the chunks of `max_seqs`
    sequences at capacity. A step that needs more grows the buffer (`staging`)."""
    per_token = 2 + SEQ_INFO_FIELDS + 1
    chunks = config.max_step + min(config.max_step, config.max_seqs) * \
        -(-config.capacity // decode.CHUNK)
    windows = len({spec.window for spec in config.layers})
    return per_token * config.max_step + windows * (decode.WORK_FIELDS * chunks +
                                                   decode.COMBINE_FIELDS * config.max_step)


def _group(seq_info, segments) -> Group:
    if segments.size == 0:
        return _NONE
    rows = seq_info[segments]
    return Group(int(segments.size), int(_max(rows[:, Q_LEN])),
                 int(_max(rows[:, POS_START] + rows[:, Q_LEN])))
