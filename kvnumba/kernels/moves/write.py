"""Write a step's K and V into their sequences' pages, wrapping ring layers (one launch
per layer).

A layer's K (and V) is slot storage `[n_pages * page_size, n_kv_heads, head_dim]`: its
page pool seen as slots. Storage row `r` of sequence `seq` (its position on a flat
layer, the position modulo `ring_rows` on a ring, `masks.storage_row`) is slot
`masks.page_slot(pages, seq, r, page_bits)`, `pages` the layer kind's device page table.
A token's K (all heads) is one contiguous run of `n_kv_heads * head_dim` elements in the
input and one in storage (its slot). Each block row (`threadIdx.y`) takes tokens in a
grid stride; its `blockDim.x` lanes (`run_block`) move the token's run, so a token's
sequence, position, row and slot are read and computed once per token.

The wide path moves 16-byte vectors, `TRIP_VECTORS` of K and as many of V per lane
and trip, all eight loaded before any is stored. A run of `R` vectors takes `lanes`
= the smallest power of two >= `R / TRIP_VECTORS` (at most a block), so a lane
usually makes one trip per token and the token's lookups are shared by eight vectors
(a 2 KiB run: 32 lanes; a 256-byte run: 4). A lane's vectors are `lane`, `lane +
lanes`, ... (a warp reads whole lines); those past the run's last vector are clamped
to it, so every load and store is unconditional and the last vector may be stored
more than once, always with its own bytes. It needs the input in the storage dtype,
C-contiguous and 16-byte aligned, and a run length that is a whole number of
vectors; anything else (a float32 input into float16 storage, a strided view) takes
the element-wise path.

Index ranges: tokens (`< max_step`), positions and rows (`< capacity`), sequences and
slots (`n_pages * page_size`) are below 2**31 (`CacheConfig` bounds each by
`INT32_MAX`), so the ring modulo is a 32-bit division, a slot is an int32, and a
token's index arithmetic is 32-bit (`_slot`). A run's bytes are below 2**32
(`WIDE_RUN_BYTES`; a longer one takes the element-wise path), so a vector's offset in
its run is 32-bit too. Nothing bounds a layer's `slots * n_kv_heads * head_dim`
elements below 2**31, so a run's start is a 32 x 32 -> 64-bit product, once per
token, and a vector's address one multiply-add on it.
"""
from __future__ import annotations

import numpy as np

from ...device import cuda
from ..intrinsics import ptx
from . import write_fp8
from ..launch.constants import FP8_FORMATS
from ..launch.calling import (MAX_BLOCKS, PER_CALL, VECTOR_BYTES, Specialised, aligned,
                              ceil_div, run_block)
from ..masks import (clamped_trip, divmod32, page_slot, seq_and_position, step_on, storage_row,
                     token_runs)

from numba import uint32, uint64  # noqa: E402  (after kvnumba.device chose the target)

#: 16-byte vectors of each of two runs (K and V) a lane moves per trip of the wide
#: loops: all loads of a trip go out before its stores, and a token's (or a page
#: pair's) lookups are shared by 2 * TRIP_VECTORS vectors a lane
TRIP_VECTORS = 4
#: the reciprocal scale of storage that is not 8-bit floats
ONE = np.float32(1.0)
#: a run longer than this many bytes takes the element-wise path (vector offsets in a
#: run are 32-bit)
WIDE_RUN_BYTES = 2**32 - VECTOR_BYTES


def vector_lanes(vectors: int) -> tuple[int, int]:
    """`run_block` for runs of `vectors` 16-byte vectors moved `TRIP_VECTORS` a lane and
    trip: `lanes` at least `vectors / TRIP_VECTORS`."""
    return run_block(ceil_div(vectors, TRIP_VECTORS))


def run_grid(runs: int, rows: int) -> int:
    """Blocks of `rows` runs each for a grid-stride loop over `runs` runs."""
    return min(MAX_BLOCKS, ceil_div(runs, rows))


_trip_at = clamped_trip(TRIP_VECTORS)


@cuda.jit(device=True, inline="always")
def move_vectors(k_to, v_to, k_from, v_from, first, step, last):
    """Copy 16-byte vectors `first`, `first + step`, ... up to `last` (uint32 vector
    indices) of two runs, `k_from` to `k_to` and `v_from` to `v_to` (byte views from each
    run's start), `TRIP_VECTORS` of each a trip: the trip's loads, then its stores.
    Indices past `last` are clamped to it (the last vector is stored again, as itself).
    The loads are coherent (`ld_v4`), so the stores cannot be moved between them. The
    loops over a trip's vectors have a compile-time count: unrolled, their local arrays
    live in registers."""
    at = cuda.local.array(TRIP_VECTORS, uint64)       # byte offsets of the trip's vectors
    k_words = cuda.local.array((TRIP_VECTORS, 4), uint32)
    v_words = cuda.local.array((TRIP_VECTORS, 4), uint32)
    e = first
    while e <= last:
        vector = _trip_at(at, e, step, last, uint64(VECTOR_BYTES))   # one multiply-add each
        for j in range(TRIP_VECTORS):
            k_words[j, 0], k_words[j, 1], k_words[j, 2], k_words[j, 3] = ptx.ld_v4(k_from, at[j])
        for j in range(TRIP_VECTORS):
            v_words[j, 0], v_words[j, 1], v_words[j, 2], v_words[j, 3] = ptx.ld_v4(v_from, at[j])
        for j in range(TRIP_VECTORS):
            ptx.st_v4(k_to, at[j], k_words[j, 0], k_words[j, 1], k_words[j, 2], k_words[j, 3])
        for j in range(TRIP_VECTORS):
            ptx.st_v4(v_to, at[j], v_words[j, 0], v_words[j, 1], v_words[j, 2], v_words[j, 3])
        e = uint32(vector + step)


@cuda.jit(device=True, inline="always")
def _move_token(k_to, v_to, k_from, v_from, first, step, last, k_inv, v_inv):
    """`move_vectors` of a token's runs, which are not scaled (`token_runs`' move)."""
    move_vectors(k_to, v_to, k_from, v_from, first, step, last)


_vector_tokens = token_runs(_move_token)


@cuda.jit
def _write_vectors(k_store, v_store, k, v, tables, width, ring_rows, pages, page_bits):
    """Lane `threadIdx.x` of a block row moves vectors `lane`, `lane + blockDim.x`, ... of
    each of the row's tokens, K and V (`move_vectors`, over `masks.token_runs`).

    `tables[token]` is the token's sequence (its row of `pages`; negative: write
    nowhere), `tables[width + token]` its position.
    """
    run = uint32(k.shape[1] * k.shape[2])                          # elements per token
    last = uint32(uint32(uint32(run * uint32(k.itemsize)) >> uint32(4)) - uint32(1))
    _vector_tokens(k_store, v_store, k, v, tables, width, ring_rows, pages, page_bits, run,
                   last, ONE, ONE)


@cuda.jit
def _write_elements(k_store, v_store, k, v, tables, width, ring_rows, pages, page_bits, k_inv,
                    v_inv):
    """As `_write_vectors`, one (head, dim) element per lane and trip, converting to the
    storage dtype (float16, float32, bfloat16 held as uint16 bits, or 8-bit floats as
    uint8 / int8 bits, divided by their scales: times `k_inv`, `v_inv`; `ptx.to_storage`)."""
    n_heads, head_dim = k.shape[1], k.shape[2]
    first_head, first_dim = divmod32(cuda.threadIdx.x, head_dim)
    skip_heads, skip_dims = divmod32(cuda.blockDim.x, head_dim)
    token = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
    while token < width:
        seq, position = seq_and_position(tables, width, token)
        if seq >= 0:
            slot = uint32(page_slot(pages, seq, storage_row(position, ring_rows), page_bits))
            head, dim = first_head, first_dim
            while head < n_heads:
                k_store[slot, head, dim] = ptx.to_storage(ptx.to_f32(k[token, head, dim]),
                                                          k_inv, k_store)
                v_store[slot, head, dim] = ptx.to_storage(ptx.to_f32(v[token, head, dim]),
                                                          v_inv, v_store)
                head, dim = step_on(head, dim, skip_heads, skip_dims, head_dim)
        token += cuda.gridDim.x * cuda.blockDim.y


_vectors = Specialised(_write_vectors)
_elements = Specialised(_write_elements)


def whole_vectors(run: int, dtype) -> bool:
    """Whether a run of `run` elements of `dtype` is whole 16-byte vectors, at most
    `WIDE_RUN_BYTES`."""
    size = run * dtype.itemsize
    return size % VECTOR_BYTES == 0 and size <= WIDE_RUN_BYTES


class WriteRun:
    """The writes of one step into paged storage of one dtype and page size (`prepare`):
    its tables, width bound and `page_bits`, and for each input layout (16-byte vectors
    or elements) the launch shape worked out once, so a call (`run(k_store, v_store, k,
    v, ring_rows, pages, k_inv, v_inv)`, once per layer, `pages` its layer kind's page
    table, `k_inv` / `v_inv` the float32 reciprocals of its fp8 scales, 1.0 for other
    dtypes) only tells its inputs' layout (16-byte vectors: both of the storage dtype,
    C-contiguous from a 16-byte boundary, in whole vectors a token) and packs its arrays.

    8-bit float storage takes its own vector write (`write_fp8`), from float16, bfloat16
    or float32 inputs of one dtype, C-contiguous, 16-byte aligned, whole vectors of 16
    stored values a token."""

    def __init__(self, tables, width: int, run: int, dtype, page_bits: int, stream):
        self.tables, self.width, self.run, self.dtype = tables, width, run, dtype
        self.page_bits, self.stream = page_bits, stream
        self._any = width * run > 0
        self._fp8 = FP8_FORMATS.get(dtype.name)
        self._whole = (run % write_fp8.VALUES == 0 and 4 * run <= WIDE_RUN_BYTES
                       if self._fp8 else whole_vectors(run, dtype))
        self._launches = {}      # the bound launch by layout (and, for fp8, input and scale)

    def __call__(self, k_store, v_store, k, v, ring_rows: int, pages, k_inv=ONE,
                 v_inv=ONE) -> None:
        if not self._any:
            return
        if self._fp8:
            self._narrow(k_store, v_store, k, v, ring_rows, pages, k_inv, v_inv)
            return
        dtype = self.dtype
        vectors = (self._whole and k.dtype == dtype and v.dtype == dtype
                   and k.is_c_contiguous() and v.is_c_contiguous()
                   and aligned(k, VECTOR_BYTES) and aligned(v, VECTOR_BYTES))
        launch = self._launches.get(vectors)
        if launch is None:
            launch = self._launches[vectors] = self._bind(vectors)
        if vectors:          # the bytes as they are: nothing to scale
            launch(k_store, v_store, k, v, ring_rows, pages)
        else:
            launch(k_store, v_store, k, v, ring_rows, pages, k_inv, v_inv)

    def _narrow(self, k_store, v_store, k, v, ring_rows, pages, k_inv, v_inv) -> None:
        """A write into 8-bit float storage: 16-byte vectors where the inputs allow
        (`write_fp8`), else elements."""
        source = k.dtype.name
        vectors = (self._whole and v.dtype == k.dtype and source in write_fp8.INPUTS
                   and k.is_c_contiguous() and v.is_c_contiguous()
                   and aligned(k, VECTOR_BYTES) and aligned(v, VECTOR_BYTES))
        key = (source, bool(k_inv != 1 or v_inv != 1)) if vectors else False
        launch = self._launches.get(key)
        if launch is None:
            if vectors:
                lanes, rows = write_fp8.lanes_for(self.run // write_fp8.VALUES, source)
                kernel = write_fp8.narrow_kernel(source, self._fp8, key[1])
                launch = kernel.bind(run_grid(self.width, rows), (lanes, rows), self.stream,
                                     PER_CALL, PER_CALL, PER_CALL, PER_CALL, self.tables,
                                     self.width, PER_CALL, PER_CALL, self.page_bits, PER_CALL,
                                     PER_CALL)
            else:
                launch = self._bind(False)
            self._launches[key] = launch
        launch(k_store, v_store, k, v, ring_rows, pages, k_inv, v_inv)

    def _bind(self, vectors: bool):
        if vectors:
            lanes, rows = vector_lanes(self.run * self.dtype.itemsize // VECTOR_BYTES)
            return _vectors.bind(run_grid(self.width, rows), (lanes, rows), self.stream,
                                 PER_CALL, PER_CALL, PER_CALL, PER_CALL, self.tables,
                                 self.width, PER_CALL, PER_CALL, self.page_bits)
        lanes, rows = run_block(self.run)
        return _elements.bind(run_grid(self.width, rows), (lanes, rows), self.stream,
                              PER_CALL, PER_CALL, PER_CALL, PER_CALL, self.tables, self.width,
                              PER_CALL, PER_CALL, self.page_bits, PER_CALL, PER_CALL)


def prepare(tables, width: int, run: int, dtype, page_bits: int, stream=0) -> WriteRun:
    """The prepared half of `write_kv` for a step of `width` tokens of `run` elements each
    (`n_kv_heads * head_dim`) into storage of `dtype` in pages of `2**page_bits` slots:
    what `write_kv` works out per call, once per step and input layout."""
    return WriteRun(tables, int(width), int(run), np.dtype(dtype), int(page_bits), stream)


def write_kv(k_store, v_store, k, v, tables, ring_rows: int, pages, page_bits: int,
             stream=0, k_inv=ONE, v_inv=ONE) -> None:
    """Scatter `k`, `v` `[width, n_kv_heads, head_dim]` into slot storage `[n_slots,
    n_kv_heads, head_dim]` through the page table `pages` (int32 `[sequences, pages per
    sequence]`, page-aligned slot bases; pages of `2**page_bits` slots); 8-bit float
    storage takes `k * k_inv`, `v * v_inv` (float32: the reciprocals of its scales).

    `tables`: int32 device array: `[0, width)` the sequence of each token (negative:
    none), `[width, 2 * width)` its position. One launch, on `stream`.
    """
    prepare(tables, k.shape[0], k.shape[1] * k.shape[2], k_store.dtype, page_bits, stream)(
        k_store, v_store, k, v, int(ring_rows), pages, np.float32(k_inv), np.float32(v_inv))
