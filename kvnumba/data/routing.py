"""Which attention kernel serves which segments of a step: routed once per step in
`prepare_step`, launched per layer in `attend` (FlashInfer's plan() / run() split).

A step's segments fall in two groups by length (contract §8): *decode* segments
(`q_len <= DECODE_MAX_Q_LEN`: a token, or a short speculative draft) and *prefill*
segments. Each group runs on its own path, over its own list of segments, so a
step launches at most two attention kernels (plus the decode path's combine) and a
segment's output never depends on what shares its step:

* decode: `kernels.decode` (16-byte loads, key chunks of `decode.CHUNK_KEYS`; a
  segment of many rows on tensor cores) where it serves the layer, else
  `kernels.generic` split-K in chunks of the same length;
* prefill: `kernels.prefill` (tensor cores: 16-bit or 8-bit float storage, scale > 0)
  where it serves the layer, else `kernels.generic` (CUDA cores, exact for float32).

Which path serves a layer follows from its storage dtype and shape (contract §15): the
fast paths take layers whose K and V are one width, a head_dim they are built for
(`decode.supports`, `prefill.supports`: multiples of 16 / 8 up to 256); the tensor
cores' wide tile (`prefill.supports_wide`) takes K up to 576 and V up to 512, no wider
than K (a latent layer's rows, V their first values), in decode and prefill alike,
over 16-bit and 8-bit float storage with a positive scale; every other layer (float32
storage, V wider than K) takes the generic kernel. A step whose
layers take both paths of a group stages both (the decode plans and the segment list).

`Routing.route` writes the step's sections into its upload (`upload.Upload`): for
the fast decode path one work / combine table per distinct layer mask code (the code
decides which keys a chunk covers), for the others their segment lists; and it makes
each path's run for the step (`decode.DecodeRun` per mask code, `prefill.PrefillRun`,
`attention.GenericRun`), so `run` launches with nothing left to plan: a layer adds only
its own arrays and scalars.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..config import CacheConfig
from ..kernels import generic, decode, prefill
from ..kernels.generic import DECODE_MAX_Q_LEN
from ..kernels.workspace import AttentionWorkspace
from ..arith.positions import POS_START, Q_LEN, SEQ_INFO_FIELDS
from .upload import Sections

_max = np.maximum.reduce
_min = np.minimum.reduce


class Group(NamedTuple):
    """The segments one path serves in a step: how many, their longest q_len and the
    furthest position + 1 they reach (the generic kernel sizes its grid from these)."""

    n: int
    max_q_len: int
    max_kv_len: int


_NONE = Group(0, 0, 0)


class StepRoutes:
    """A prepared step's routing (`Routing.route`): the two groups and each path's
    run for the step: the fast decode path's `decode.DecodeRun` by layer mask code
    (`decode_runs`, with their placed plans `decode_chunks`) or the generic decode run,
    and the prefill group's tensor-core run with its generic fallback (float32 storage,
    or a layer whose scale is not positive)."""

    __slots__ = ("decode", "prefill", "decode_chunks", "decode_runs", "decode_generic",
                 "prefill_fast", "prefill_generic")

    def __init__(self, decode_group, prefill_group):
        self.decode, self.prefill = decode_group, prefill_group
        self.decode_chunks, self.decode_runs = {}, {}
        self.decode_generic = self.prefill_fast = self.prefill_generic = None

    def launch_key(self) -> tuple:
        """What the launches' grids depend on, besides the step's width and the buffers'
        addresses: the decode plans' sizes (or, on the generic path, the split-K chunks
        of the longest history) and the prefill group's size. Two steps with equal keys
        (widths and addresses) launch the same grids, so a CUDA graph of one replays the
        other (the positions and sequences it reads are the upload's contents)."""
        d, p = self.decode, self.prefill
        decode_key = tuple((code, f.n_items, f.n_combine, f.n_parts, f.max_q_len)
                           for code, f in sorted(self.decode_chunks.items()))
        if self.decode_generic is not None or not self.decode_chunks:
            decode_key += ((d.n, d.max_q_len, -(-d.max_kv_len // decode.CHUNK_KEYS)),)
        return decode_key, (p.n, p.max_q_len)


class Routing:
    """The attention paths of one cache (chosen once from its config) and their workspace.

    `mask_tables`: for each distinct layer mask code (`CacheConfig.mask_codes`: 0 flat,
    W, or -C), its ring rows R (0: flat) and its page group's device page table, as the
    pool holds them; `page_bits`: log2 of the page size."""

    def __init__(self, config: CacheConfig, stream, mask_tables: dict, page_bits: int):
        dtype, shapes = config.storage_dtype, config.layer_shapes
        codes = config.mask_codes
        #: per layer: whether the tensor cores' wide tile serves it (K past 256, or V
        #: narrower than K: a latent layer's rows), decode and prefill alike
        self.wide = [prefill.is_wide(s.head_dim, s.v_head_dim)
                     and prefill.supports_wide(s.head_dim, s.v_head_dim, dtype) for s in shapes]
        #: per layer: whether the fast decode / tensor-core prefill path serves it
        self.decode_fast = [wide or (s.head_dim == s.v_head_dim and
                                     decode.supports(s.head_dim, dtype))
                            for s, wide in zip(shapes, self.wide)]
        self.prefill_fast = [wide or (s.head_dim == s.v_head_dim and
                                      prefill.supports(s.head_dim, dtype))
                             for s, wide in zip(shapes, self.wide)]
        # the generic decode: layers no fast path serves, and wide layers whose scale is
        # not positive (the tensor cores' softmax needs one); state layers attend not
        attending = [not kind.keeps_state for kind in config.kinds]
        self._decode_generic = any(a and (not fast or wide) for a, fast, wide in
                                   zip(attending, self.decode_fast, self.wide))
        self._prefill_fast = any(a and fast for a, fast in zip(attending, self.prefill_fast))
        self.mask_tables = mask_tables
        fast_codes = sorted({code for code, fast, a in zip(codes, self.decode_fast, attending)
                             if fast and a})
        self._decode_sections = [(code, Sections.decode(code)) for code in fast_codes]
        self.page_bits = page_bits
        self.stream = stream
        self.workspace = AttentionWorkspace()
        self._ramp = np.arange(0, dtype=np.int32)    # every segment's index, grown on demand
        self._all_last = self._ramp
        self._runs = {}       # the last step's decode runs, by mask code

    # ------------------------------------------------------------------ host, per step
    def route(self, seq_info: np.ndarray, max_q_len: int, max_kv_len: int, upload) -> StepRoutes:
        """The routing of the step whose segment table is `seq_info` (its longest segment
        `max_q_len`, its furthest reach `max_kv_len`), staged in `upload` (its `segments`
        section written): the paths' sections are written into it (`upload` doc) and
        each path's run made for the step."""
        n = len(seq_info)
        if max_q_len <= DECODE_MAX_Q_LEN:                   # a decode step: one group
            routes = StepRoutes(Group(n, max_q_len, max_kv_len), _NONE)
            decode_segs = self._all(n)
        elif _min(seq_info[:, Q_LEN]) > DECODE_MAX_Q_LEN:    # a prefill step: the other
            routes = StepRoutes(_NONE, Group(n, max_q_len, max_kv_len))
            prefill_segs = self._all(n)
        else:
            is_decode = seq_info[:, Q_LEN] <= DECODE_MAX_Q_LEN
            decode_segs = np.flatnonzero(is_decode).astype(np.int32)
            prefill_segs = np.flatnonzero(~is_decode).astype(np.int32)
            routes = StepRoutes(_group(seq_info, decode_segs), _group(seq_info, prefill_segs))
        if routes.decode.n:           # a work list per fast mask code, a list for the generic
            for mask_code, name in self._decode_sections:
                routes.decode_chunks[mask_code] = placed = decode.chunks_into(
                    seq_info, decode_segs, mask_code=mask_code, staging=upload, at=upload.end)
                upload.mark(name, placed.combine_off + placed.n_combine * decode.COMBINE_FIELDS)
            if self._decode_generic:
                upload.put(Sections.DECODE_LIST, decode_segs)
        if routes.prefill.n:
            upload.put(Sections.PREFILL_LIST, prefill_segs)
        return routes

    def bind(self, routes: StepRoutes, upload) -> None:
        """Each path's run for the step, on `upload`'s device buffer as it stands once
        every section is written (the buffer only grows while they are)."""
        tables, info_at = upload.device, upload.section(Sections.SEGMENTS).offset
        if routes.decode_chunks:
            routes.decode_runs = self._decode_runs(routes.decode_chunks, tables, info_at)
        if routes.decode.n and self._decode_generic:
            group = routes.decode
            routes.decode_generic = generic.prepare(
                tables, seq_info_off=info_at,
                segments_off=upload.section(Sections.DECODE_LIST).offset,
                n_segments=group.n, max_q_len=group.max_q_len, max_kv_len=group.max_kv_len,
                page_bits=self.page_bits, workspace=self.workspace, path="decode",
                kv_chunk=decode.CHUNK_KEYS, stream=self.stream)
        if routes.prefill.n:
            group, listed = routes.prefill, upload.section(Sections.PREFILL_LIST).offset
            if self._prefill_fast:
                routes.prefill_fast = prefill.prepare(
                    tables, seq_info_off=info_at, segments_off=listed, n_segments=group.n,
                    max_q_len=group.max_q_len, page_bits=self.page_bits, stream=self.stream)
            routes.prefill_generic = generic.prepare(
                tables, seq_info_off=info_at, segments_off=listed, n_segments=group.n,
                max_q_len=group.max_q_len, max_kv_len=group.max_kv_len,
                page_bits=self.page_bits, workspace=self.workspace, path="prefill",
                stream=self.stream)

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

    def _decode_runs(self, chunks: dict, tables, info_at: int) -> dict:
        """A `decode.DecodeRun` per mask code of the step's placed `chunks`. One the last step
        made for the same tables, placed alike, is taken again, with the launches it has
        bound (a steady decode loop binds them once)."""
        runs = self._runs
        for mask_code, found in chunks.items():
            run = runs.get(mask_code)
            if run is None or run.tables is not tables or run.seq_info_off != info_at or \
                    run.placed != found:
                rows, pages = self.mask_tables[mask_code]
                runs[mask_code] = decode.DecodeRun(
                    tables, seq_info_off=info_at, placed=found, workspace=self.workspace,
                    ring_rows=rows, mask_code=mask_code, pages=pages, page_bits=self.page_bits,
                    stream=self.stream)
        return runs.copy()

    # ------------------------------------------------------------------ device, per layer
    def run(self, routes: StepRoutes, layer: int, q, k_store, v_store, out, lse, sinks, *,
            ring_rows, mask_code, pages, scale, softcap) -> None:
        """Launch the step's paths for one layer (`layer`; `k_store`, `v_store`: its slot
        storage, `pages`: its page group's device page table): each writes its segments' rows
        of `out`, and of `lse` (float32 `[width, n_q_heads]`) their log-sum-exps unless it
        has no rows (`launch.no_output()`), each q head's sink in its softmax unless
        `sinks` (float32 `[n_q_heads]`) has no elements (`sinks.no_sinks()`)."""
        if routes.decode.n:
            if self.decode_fast[layer] and (scale > 0 or not self.wide[layer]):
                routes.decode_runs[mask_code](q, k_store, v_store, out, lse, sinks, scale,
                                           softcap)
            else:
                routes.decode_generic(q, k_store, v_store, pages, out, lse, sinks, ring_rows,
                                      mask_code, scale, softcap)
        if not routes.prefill.n:
            return
        run = routes.prefill_fast if self.prefill_fast[layer] and scale > 0 else \
            routes.prefill_generic
        run(q, k_store, v_store, pages, out, lse, sinks, ring_rows, mask_code, scale, softcap)


def upload_entries(config: CacheConfig) -> int:
    """int32 entries the upload of a usual step takes: per token its sequence and position,
    a segment (at most one per token) and its place in a path's list; per layer mask code a
    decode plan of one chunk per segment plus the chunks of `max_seqs` sequences at
    capacity. A step that needs more grows the buffers (`upload.Upload.reserve`)."""
    per_token = 2 + SEQ_INFO_FIELDS + 1
    chunks = config.max_step + min(config.max_step, config.max_seqs) * \
        -(-config.capacity // decode.CHUNK_KEYS)
    n_codes = len(set(config.mask_codes))
    return per_token * config.max_step + n_codes * (decode.WORK_FIELDS * chunks +
                                                   decode.COMBINE_FIELDS * config.max_step)


def _group(seq_info, segments) -> Group:
    if segments.size == 0:
        return _NONE
    rows = seq_info[segments]
    return Group(int(segments.size), int(_max(rows[:, Q_LEN])),
                 int(_max(rows[:, POS_START] + rows[:, Q_LEN])))
