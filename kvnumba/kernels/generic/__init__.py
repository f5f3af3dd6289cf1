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
  c. one thread per row: online-softmax update (`softmax.rescaling`: running max /
     sum, rescale factor), probabilities written back in place; meanwhile all
     threads stage V over K;
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
  to the workspace; `combine_kernel` merges them (log-sum-exp) into `out`. With a
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

This package is the path's host face (`GenericRun`, `prepare`, `attend`); `generic.shape`
holds the tile shapes and works out the launch geometry (`launch_shape`),
`generic.kernel` the kernel body and `generic.combine` the merge of split-K partials.
"""
from __future__ import annotations

import numpy as np

from ..launch.calling import PER_CALL, no_output
from ..sinks import no_sinks
from .combine import combine_kernel
from .kernel import attention_kernel
from .shape import (COMBINE_THREADS, DECODE_MAX_Q_LEN, DECODE_MIN_CHUNK,  # noqa: F401  (re-exported)
                    DECODE_TILES, HEAD_DIM_BUCKETS, MAX_OWN, MAX_QUERY_ROWS, PREFILL_TILES,
                    V_SLICES, head_dim_bucket, launch_shape)


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
        kernel = attention_kernel(shape["dpad"], shape["block_rows"], shape["block_keys"],
                                   shape["key_lanes"], shape["threads"], shape["v_slice"])
        attention = kernel.bind(
            shape["grid"], shape["threads"], stream, PER_CALL, PER_CALL, PER_CALL, PER_CALL,
            int(self.page_bits), self.tables, int(self.seq_info_off), int(self.segments_off),
            PER_CALL, PER_CALL, PER_CALL, part_acc, part_ml, shape["n_row_tiles"], n_splits,
            shape["chunk"],
            shape["group"], PER_CALL, int(mask_code), PER_CALL, PER_CALL)
        merge = None
        if n_splits > 1:
            merge = combine_kernel.bind(
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
