"""Decode attention built for memory bandwidth: host chunk tables (`chunk_tables`) and a device `run()`.

Decode segments (at most `DECODE_MAX_Q_LEN` queries each) read every key of their
history once per step and do little arithmetic with it, so the kernel
(`decode_kernel`, whose doc tells how it streams K and V) is shaped to run at the
chip's bandwidth with few instructions per key. This module is the path's host face:

* `chunk_tables` / `chunks_into` (from `decode.chunks`): each served segment's key range cut into
  chunks of `CHUNK_KEYS` keys, one work item each, and the combine table of the
  segments cut into several;
* `prepare` (a `DecodeRun`, once per step and mask code) and `run` (per layer):
  the launch bound once per signature, then only each layer's arrays and scalars;
* `supports` / `block_rows` (from `decode.shape`): what the path serves, rows per
  block.
"""
from __future__ import annotations

import numpy as np

from . import combine
from .kernel import decode_kernel
from .chunks import (CHUNK_KEYS, COMBINE_FIELDS, COMBINE_PART, COMBINE_PARTS, COMBINE_SEG,  # noqa: F401  (the decode path's planning, re-exported)
                     KEY_TILE, WORK_SEQ, WORK_FIELDS, WORK_KEY_HI, WORK_KEY_LO, WORK_PART,
                     WORK_Q_LEN, WORK_Q_START, WORK_SEG, ChunkTables, PlacedChunks, chunk_count,
                     chunk_tables, chunks_into)
from . import shape as decode_shape
from .shape import THREADS, block_rows, grouped, supports  # noqa: F401  (grouped re-exported)
from ..prefill.shape import supports as tensor_cores_serve
from .. import prefill
from ..intrinsics.words import LOAD_BYTES
from ..launch.calling import PER_CALL, aligned, no_output
from ..sinks import no_sinks


_FLOAT32 = np.float32
#: a row count past every segment's: the CUDA-core kernel serves all
ALL_ROWS = 2**31 - 1


def check_storage(head_dim: int, k_store, v_store, v_dim: int | None = None) -> None:
    """Refuse (`ValueError`) K/V storage this path does not serve: a head_dim or dtype
    outside `supports`, K and V of different dtypes, or storage that is not slot
    storage `[n_slots, n_kv_heads, head_dim]`. `v_dim`: V's width where it is not K's,
    or K past 256: the tensor cores' wide tile serves them (`prefill.supports_wide`;
    V in its own storage, or K's rows themselves)."""
    storage = np.dtype(k_store.dtype)
    v_dim = head_dim if v_dim is None else v_dim
    if prefill.is_wide(head_dim, v_dim):
        if not prefill.supports_wide(head_dim, v_dim, storage) or v_store.dtype != storage:
            raise ValueError(f"decode.run: head_dim {head_dim} with V of {v_dim} over "
                             f"{storage} / {v_store.dtype} storage is not served (see "
                             f"prefill.supports_wide)")
        prefill.check_storage(head_dim, v_dim, k_store, v_store)
        return
    if not supports(head_dim, storage) or v_store.dtype != storage:
        raise ValueError(f"decode.run: head_dim {head_dim} with {storage} / {v_store.dtype} "
                         f"storage is not served (see decode.supports)")
    for store in (k_store, v_store):
        if len(store.shape) != 3 or store.shape[2] != head_dim:
            raise ValueError(f"decode.run: storage of shape {tuple(store.shape)} is not slot "
                             f"storage [n_slots, n_kv_heads, {head_dim}]")


class DecodeRun:
    """The decode launches of one step for the layers of one mask code (`prepare`): the
    step's tables (their device buffer, where the segment table sits in it, the mask code's
    placed chunk tables: `PlacedChunks`), the layers' ring rows, its layer kind's page table
    (`pages`, int32 `[n_seq_rows, pages_per_seq]` on the device, and `page_bits`) and
    the stream fixed.

    A call (`run(q, k_store, v_store, out, lse, sinks, scale, softcap)`, once per layer;
    `lse` a float32 `[width, n_q_heads]` device array, or one of no rows for none; `sinks`
    a float32 `[n_q_heads]` device array, or `sinks.no_sinks()`) looks its
    signature up: q's dtype, q heads and 16-byte alignment, softcap and sinks on or off,
    the layer's head_dim, kv heads and V's width, in out and in its storage rows (layers
    of one mask code may differ in shape; a latent layer's V rows are K's). The
    first call of a signature checks the storage (`check_storage`), works out the block
    rows, row groups and grid, sizes the partials, picks the kernel variant and binds it
    and the combine (`combine.prepare`); later calls pack their arrays and scalars only.
    One `DecodeRun` serves the layers of one cache that share the page table and mask:
    their storage shares a dtype.
    """

    def __init__(self, tables, *, seq_info_off: int, placed: PlacedChunks, workspace,
                 ring_rows: int, mask_code: int, pages, page_bits: int, stream=0,
                 tensor_cores: bool | None = None):
        self.tables, self.seq_info_off, self.placed = tables, seq_info_off, placed
        self.workspace, self.ring_rows, self.mask_code = workspace, ring_rows, mask_code
        self.pages, self.page_bits, self.stream = pages, page_bits, stream
        self.tensor_cores = tensor_cores
        self.n_items = placed.n_items
        self._launches = {}    # (decode launch, combine launch or None) by signature

    def __call__(self, q, k_store, v_store, out, lse, sinks, scale, softcap) -> None:
        if not self.n_items:
            return
        key = (q.dtype, q.shape[1], aligned(q, LOAD_BYTES), softcap > 0, sinks.shape[0] > 0,
               q.shape[2], k_store.shape[1], out.dtype, out.shape[2], v_store.shape[2],
               aligned(out, 16), scale > 0)
        launches = self._launches.get(key)
        if launches is None:
            launches = self._launches[key] = self._bind(q, k_store, v_store, out, *key[:5],
                                                        key[-1])
        decodes, merge = launches
        # the kernels take float32 scalars: converted only when they are not (a conversion
        # costs more host time than the rest of a scalar's launch work)
        scale = scale if type(scale) is _FLOAT32 else _FLOAT32(scale)
        softcap = softcap if type(softcap) is _FLOAT32 else _FLOAT32(softcap)
        for decode in decodes:
            decode(q, k_store, v_store, out, lse, sinks, scale, softcap)
        if merge is not None:
            merge(out, lse, sinks)

    def check(self, q, k_store, v_store, out=None) -> None:
        """Refuse storage this path does not serve (`check_storage`) when there is work
        (V of `out`'s width)."""
        if self.n_items:
            check_storage(q.shape[2], k_store, v_store, None if out is None else out.shape[2])

    def _bind(self, q, k_store, v_store, out, dtype, n_q_heads, vectors, capped, sunk,
              positive) -> tuple:
        self.check(q, k_store, v_store, out)
        head_dim, n_kv_heads, v_dim = q.shape[2], k_store.shape[1], out.shape[2]
        storage = np.dtype(k_store.dtype)
        placed, seq_info_off = self.placed, self.seq_info_off
        max_q_len, n_parts = placed.max_q_len, placed.n_parts
        group = n_q_heads // n_kv_heads
        if n_parts > 0:
            part_acc, part_ml = self.workspace.partials(
                n_parts * max_q_len * n_q_heads * v_dim, n_parts * max_q_len * n_q_heads * 2,
                self.stream)
        else:
            part_acc = part_ml = self.workspace.dummy
        # a segment of more than `most` rows (group times its queries) takes the tensor
        # cores, the others the CUDA-core kernel: each kernel skips the other's items,
        # and only the kernels some segment of the step needs are launched
        most = self._cuda_core_rows(head_dim, v_dim, storage, positive)
        decodes = []
        if group * placed.min_q_len <= most:
            cuda_rows = min(group * max_q_len, most)
            rows = block_rows(cuda_rows, head_dim, storage)
            # row groups are rounded up to a power of two (the extra ones return at once),
            # so the kernel splits its block index with a shift
            row_group_bits = (-(-cuda_rows // rows) - 1).bit_length()
            kernel = decode_kernel(head_dim, storage.name, rows, bool(capped),
                                   np.dtype(dtype).name, vectors, bool(sunk), self.mask_code < 0)
            decodes.append(kernel.bind(
                (self.n_items << row_group_bits, n_kv_heads), THREADS, self.stream, PER_CALL,
                PER_CALL, PER_CALL, self.tables, self.pages, PER_CALL, PER_CALL, PER_CALL,
                part_acc, part_ml, seq_info_off, placed.work_off, max_q_len, group,
                row_group_bits, self.ring_rows, self.mask_code, self.page_bits, PER_CALL,
                PER_CALL, most))
        if group * max_q_len > most:
            decodes.append(self._bind_grouped(q, k_store, v_store, out, group, bool(capped),
                                              bool(sunk), part_acc, part_ml, most))
        merge = combine.prepare(self.tables, part_acc, part_ml, seq_info_off=seq_info_off,
                                combine_off=placed.combine_off, n_combine=placed.n_combine,
                                max_q_len=max_q_len, n_q_heads=n_q_heads, head_dim=v_dim,
                                stream=self.stream)
        return tuple(decodes), merge

    def _cuda_core_rows(self, head_dim: int, v_dim: int, storage, positive: bool) -> int:
        """The most rows (group times a segment's queries) of a segment the CUDA-core
        kernel serves; the tensor cores serve the rest. The rule (`shape.grouped`:
        `CUDA_CORE_ROWS`, where the tensor-core kernel serves the layer and the scale is
        positive, else every segment), or what `tensor_cores` forces (True: none, a
        `ValueError` where the tensor-core kernel cannot serve the layer; False: all).
        A layer only the wide tile serves (`prefill.is_wide`) takes it for every segment
        (`tensor_cores=False`, or a scale that is not positive, refused)."""
        if prefill.is_wide(head_dim, v_dim):
            if self.tensor_cores is False or not positive:
                raise ValueError(f"decode.run: K of {head_dim} and V of {v_dim} are served "
                                 f"on tensor cores alone, with a positive scale "
                                 f"(tensor_cores={self.tensor_cores})")
            return 0
        serve = positive and tensor_cores_serve(head_dim, storage)
        if self.tensor_cores is None:
            return decode_shape.CUDA_CORE_ROWS.get(storage.itemsize, ALL_ROWS) if serve \
                else ALL_ROWS
        if self.tensor_cores and not serve:
            raise ValueError(f"decode.run: tensor_cores=True, but the tensor-core kernel "
                             f"does not serve head_dim {head_dim} over {storage} storage "
                             f"with this scale (prefill.supports, scale > 0)")
        return 0 if self.tensor_cores else ALL_ROWS

    def _bind_grouped(self, q, k_store, v_store, out, group: int, capped: bool, sunk: bool, part_acc,
                      part_ml, most: int):
        """The tensor-core launch of the step's segments of more than `most` rows
        (`shape.grouped`): the prefill kernel split over the same chunks, writing the
        same partials (or a one-chunk segment's rows of `out`), grid (work items, kv
        heads, row tiles)."""
        head_dim, n_kv_heads, v_dim = q.shape[2], k_store.shape[1], out.shape[2]
        placed = self.placed
        mma, stored = prefill.served(head_dim, k_store.dtype, q.dtype, out.dtype, v_dim)
        q_copy = prefill.MMA_DTYPES[mma] == np.dtype(q.dtype).name and aligned(q, 16)
        if prefill.is_wide(head_dim, v_dim):    # one warp of 16 rows a block, V in slices
            (block_rows_, block_keys), slices = prefill.WIDE_TILE, \
                prefill.v_slice(head_dim, v_dim)[1]
            kernel = prefill.prefill_kernel(head_dim, block_rows_, block_keys, mma, capped,
                                            q_copy, None, stored, sunk, True, v_dim,
                                            prefill.shares_rows(k_store, v_store),
                                            aligned(out, 16))
            warps = 1
        else:
            block_rows_, block_keys = prefill.grouped_tile(group * placed.max_q_len, head_dim)
            kernel = prefill.prefill_kernel(head_dim, block_rows_, block_keys, mma, capped,
                                            q_copy, None, stored, sunk, True,
                                            out_aligned=aligned(out, 16))
            warps, slices = block_rows_ // prefill.default_warp_rows(head_dim, block_rows_), 1
        n_row_tiles = -(-group * placed.max_q_len // block_rows_)
        return kernel.bind((self.n_items, n_kv_heads, n_row_tiles * slices), 32 * warps,
                           self.stream,
                           PER_CALL, PER_CALL, PER_CALL, self.pages, int(self.page_bits),
                           self.tables, PER_CALL, PER_CALL, PER_CALL, int(self.seq_info_off),
                           int(placed.work_off), n_row_tiles, group, int(self.ring_rows),
                           int(self.mask_code), PER_CALL, PER_CALL, part_acc, part_ml,
                           int(placed.max_q_len), int(most))


def prepare(tables, *, seq_info_off, work_off, n_items, combine_off, n_combine, n_parts,
            max_q_len, workspace, ring_rows, mask_code, pages, page_bits, stream=0,
            tensor_cores=None, min_q_len=1) -> DecodeRun:
    """The prepared half of `run`: what a step fixes for its layers of one mask code, once
    (`DecodeRun`); the arguments are `run`'s."""
    placed = PlacedChunks(int(work_off), int(n_items), int(combine_off), int(n_combine),
                          int(n_parts), int(max_q_len), int(min_q_len))
    return DecodeRun(tables, seq_info_off=int(seq_info_off), placed=placed,
                     workspace=workspace, ring_rows=int(ring_rows), mask_code=int(mask_code),
                     pages=pages, page_bits=int(page_bits), stream=stream,
                     tensor_cores=tensor_cores)


def run(q, k_store, v_store, tables, *, pages=None, page_bits=None, out, scale, softcap,
        lse=None, sinks=None, stream=0, planned=None, **step):
    """Attention of the planned segments' queries; writes their rows of `out`.

    q, out: [width, n_q_heads, head_dim] device arrays, float16, float32 or bfloat16
    (uint16 bits); q is read in 16-byte vectors when it is 16-byte aligned, else element
    by element. k_store, v_store: slot storage [n_slots, n_kv_heads, head_dim]
    (C-contiguous, n_slots = n_pages * page_size under 2**31), float16, float32 or
    bfloat16 as uint16 (`supports`). pages: the layer kind's page table, an int32
    [n_seq_rows, pages_per_seq] device array whose entries are pages' first slots (page
    id * page_size), page_bits: log2 page_size (a power of two, 8 to 256): storage row
    r (a position, or on a ring its slot `position % ring_rows`) of the sequence in
    field `SEQ` of the segment table lives in slot `pages[seq, r >> page_bits] | (r &
    (page_size - 1))` (`masks.page_slot`). tables: int32 device array holding the
    segment table at `seq_info_off`, the chunk tables' work table at `work_off` (`n_items`
    rows) and its combine table at `combine_off` (`n_combine` rows), each flat
    row-major. softcap: 0 = off. lse: None, or a float32 `[width, n_q_heads]` device array
    that receives each served row's natural-log log-sum-exp of its scores. sinks: None,
    or a float32 `[n_q_heads]` device array: each q head's logit joins every softmax of
    that head (`kernels.sinks`; `lse` includes it).

    `step`: the step's `seq_info_off`, `work_off`, `n_items`, `combine_off`,
    `n_combine`, `n_parts`, `max_q_len` and `min_q_len` (the chunk tables'; `min_q_len`
    1 unless given), the `workspace`, `ring_rows`
    (0: flat, or R) and `mask_code` (the layer's mask code: 0, W or -C), as `prepare` takes them with `pages` and
    `page_bits`; or `planned`, what `prepare` returned for this step and mask code (a cache
    plans once per step, and its layers pass their own storage only: `pages` and
    `page_bits` are the chunk tables' then). `step` may also hold `tensor_cores`: None
    (the rule, `shape.grouped`: a segment of more rows, group times its queries, than
    `CUDA_CORE_ROWS` goes to the tensor-core kernel, each segment by its own rows), True
    or False (that kernel, or the CUDA-core one, for every segment).

    Writes exactly `out[token, head, :]` for every query token of a planned segment
    and every head: no padding row, no other segment's row. Partials (float32, in
    `workspace`): acc `[n_parts, max_q_len, n_q_heads, head_dim]`, (max, sum) pairs
    `[n_parts, max_q_len, n_q_heads, 2]`. Launches on `stream` only; no
    synchronisation, no device allocation once `workspace` is warm.
    """
    if planned is None:
        if pages is None or page_bits is None:
            raise TypeError("decode.run: pages and page_bits are needed without `planned`")
        planned = prepare(tables, pages=pages, page_bits=page_bits, stream=stream, **step)
        planned.check(q, k_store, v_store)       # refused before q itself is read
    planned(q, k_store, v_store, out, no_output() if lse is None else lse,
            no_sinks() if sinks is None else sinks, scale, softcap)
    return out
