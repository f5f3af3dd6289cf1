"""Write a step's K and V into their sequences' pages, wrapping ring layers (one launch
per layer).

A layer's K (and V) is slot storage `[n_pages * page_size, n_kv_heads, head_dim]`: its
page pool seen as slots. Storage row `r` of sequence `seq` (its position on a flat
layer, the position modulo `ring_rows` on a ring, `masks.storage_row`) is slot
`masks.page_slot(pages, seq, r, page_bits)`, `pages` the layer kind's device page table.
A token's K (all heads) is one contiguous run of `n_kv_heads * head_dim` elements in the
input and one in storage (its slot). Each block row (`threadIdx.y`) takes tokens in a
grid stride; its `blockDim.x` lanes (`run_block`) move the token's run, so a token's
sequence, position, row and slot are read and computed once per token, and the loop
over a run's items only adds a stride.

The wide path moves 16-byte vectors. It needs the input in the storage dtype,
C-contiguous and 16-byte aligned, and a run length that is a whole number of
vectors; anything else (a float32 input into float16 storage, a strided view)
takes the element-wise path.

Index ranges: tokens (`< max_step`), positions and rows (`< capacity`), sequences and
slots (`n_pages * page_size`) are below 2**31 (`CacheConfig` bounds each by
`INT32_MAX`), so the ring modulo is a 32-bit division (`masks.storage_row`) and a slot
is an int32. Nothing bounds a layer's `slots * n_kv_heads * head_dim` elements below
2**31, so flat element indices stay int64: they are made by multiplication only, once
per token.
"""
from __future__ import annotations

import numpy as np

from ..device import cuda
from . import ptx
from .launch import (MAX_BLOCKS, PER_CALL, STRIDE_THREADS, VECTOR_BYTES, Specialised, aligned,
                     ceil_div)
from .masks import div32, divmod32, page_slot, step_on, storage_row

from numba import int64, uint32  # noqa: E402  (after kvnumba.device chose the target)

#: 16-byte vectors a lane moves per trip of the wide loops (written for a pair: both
#: loads go out before the stores, and the per-run work is shared by twice the bytes)
PAIR = 2


def run_block(items: int) -> tuple[int, int]:
    """`(lanes, rows)`: a block of `STRIDE_THREADS` threads for runs of `items` items,
    `lanes` (a power of two, at least `items` up to `STRIDE_THREADS`) along a run and
    `rows` runs side by side."""
    lanes = min(STRIDE_THREADS, 1 << max(0, items - 1).bit_length())
    return lanes, STRIDE_THREADS // lanes


def run_grid(runs: int, rows: int) -> int:
    """Blocks of `rows` runs each for a grid-stride loop over `runs` runs."""
    return min(MAX_BLOCKS, ceil_div(runs, rows))


@cuda.jit(device=True)
def _seq_and_position(tables, width, token):
    """`(sequence, position)` of `token` in the write tables. The indices are uint32 (Numba
    adds no negative-index fix-up to an unsigned index): `token < width <= max_step`."""
    return tables[uint32(token)], tables[uint32(width + token)]


@cuda.jit
def _write_vectors(k_store, v_store, k, v, tables, width, ring_rows, pages, page_bits):
    """Lane `threadIdx.x` of a block row moves vectors `lane`, `lane + blockDim.x`, ... of
    each of the row's tokens, K and V, `PAIR` of them a trip (all loads before the stores).

    `tables[token]` is the token's sequence (its row of `pages`; negative: write
    nowhere), `tables[width + token]` its position. Indices are in elements of a flat
    view of each array.
    """
    run = k.shape[1] * k.shape[2]                  # elements per token
    elems = div32(VECTOR_BYTES, k.itemsize)        # elements per vector (itemsize: a field)
    first = cuda.threadIdx.x * elems
    step = cuda.blockDim.x * elems
    token = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
    while token < width:
        seq, position = _seq_and_position(tables, width, token)
        if seq >= 0:
            slot = page_slot(pages, seq, storage_row(position, ring_rows), page_bits)
            last = token * run + run - elems              # the token's last vector
            shift = (int64(slot) - token) * run           # storage index - input index
            e = token * run + first
            while e <= last:                              # not `range`: it divides by its step
                far = min(e + step, last)                 # past the run: loaded, not stored
                a, b, c, d = ptx.ld_nc_v4(k, e)
                w, x, y, z = ptx.ld_nc_v4(v, e)
                a2, b2, c2, d2 = ptx.ld_nc_v4(k, far)
                w2, x2, y2, z2 = ptx.ld_nc_v4(v, far)
                ptx.st_v4(k_store, shift + e, a, b, c, d)
                ptx.st_v4(v_store, shift + e, w, x, y, z)
                if e + step <= last:
                    ptx.st_v4(k_store, shift + far, a2, b2, c2, d2)
                    ptx.st_v4(v_store, shift + far, w2, x2, y2, z2)
                e += PAIR * step
        token += cuda.gridDim.x * cuda.blockDim.y


@cuda.jit
def _write_elements(k_store, v_store, k, v, tables, width, ring_rows, pages, page_bits):
    """As `_write_vectors`, one (head, dim) element per lane and trip, converting to the
    storage dtype (float16, float32, or bfloat16 held as uint16 bits)."""
    n_heads, head_dim = k.shape[1], k.shape[2]
    first_head, first_dim = divmod32(cuda.threadIdx.x, head_dim)
    skip_heads, skip_dims = divmod32(cuda.blockDim.x, head_dim)
    token = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
    while token < width:
        seq, position = _seq_and_position(tables, width, token)
        if seq >= 0:
            slot = uint32(page_slot(pages, seq, storage_row(position, ring_rows), page_bits))
            head, dim = first_head, first_dim
            while head < n_heads:
                k_store[slot, head, dim] = ptx.from_f32(ptx.to_f32(k[token, head, dim]),
                                                        k_store)
                v_store[slot, head, dim] = ptx.from_f32(ptx.to_f32(v[token, head, dim]),
                                                        v_store)
                head, dim = step_on(head, dim, skip_heads, skip_dims, head_dim)
        token += cuda.gridDim.x * cuda.blockDim.y


_vectors = Specialised(_write_vectors)
_elements = Specialised(_write_elements)


def wide_ok(store, array) -> bool:
    """Whether `array` can be moved into `store` as 16-byte vectors."""
    return (whole_vectors(array.shape[1] * array.shape[2], store.dtype)
            and vectors_fit(array, store.dtype))


def whole_vectors(run: int, dtype) -> bool:
    """Whether a token's run of `run` elements of `dtype` is whole 16-byte vectors."""
    return run * dtype.itemsize % VECTOR_BYTES == 0


def vectors_fit(array, dtype) -> bool:
    """Whether `array` holds `dtype` elements, C-contiguous from a 16-byte boundary (its
    runs can be read as 16-byte vectors when they are whole vectors)."""
    return array.dtype == dtype and array.is_c_contiguous() and aligned(array, VECTOR_BYTES)


class WriteRun:
    """The writes of one step into paged storage of one dtype and page size (`prepare`):
    its tables, width bound and `page_bits`, and for each input layout (16-byte vectors
    or elements) the launch shape worked out once, so a call (`run(k_store, v_store, k,
    v, ring_rows, pages)`, once per layer, `pages` its layer kind's page table) only
    tells its inputs' layout (`vectors_fit`) and packs its arrays."""

    def __init__(self, tables, width: int, run: int, dtype, page_bits: int, stream):
        self.tables, self.width, self.run, self.dtype = tables, width, run, dtype
        self.page_bits, self.stream = page_bits, stream
        self._any = width * run > 0
        self._whole = whole_vectors(run, dtype)
        self._launches = {}      # the bound launch by layout: True for vectors

    def __call__(self, k_store, v_store, k, v, ring_rows: int, pages) -> None:
        if not self._any:
            return
        dtype = self.dtype
        vectors = (self._whole and k.dtype == dtype and v.dtype == dtype       # `vectors_fit`
                   and k.is_c_contiguous() and v.is_c_contiguous()
                   and aligned(k, VECTOR_BYTES) and aligned(v, VECTOR_BYTES))
        launch = self._launches.get(vectors)
        if launch is None:
            launch = self._launches[vectors] = self._bind(vectors)
        launch(k_store, v_store, k, v, ring_rows, pages)

    def _bind(self, vectors: bool):
        if vectors:                                  # items: pairs of vectors
            items = ceil_div(self.run * self.dtype.itemsize // VECTOR_BYTES, PAIR)
            kernel = _vectors
        else:
            items, kernel = self.run, _elements
        lanes, rows = run_block(items)
        return kernel.bind(run_grid(self.width, rows), (lanes, rows), self.stream,
                           PER_CALL, PER_CALL, PER_CALL, PER_CALL, self.tables, self.width,
                           PER_CALL, PER_CALL, self.page_bits)


def prepare(tables, width: int, run: int, dtype, page_bits: int, stream=0) -> WriteRun:
    """The plan side of `write_kv` for a step of `width` tokens of `run` elements each
    (`n_kv_heads * head_dim`) into storage of `dtype` in pages of `2**page_bits` slots:
    what `write_kv` works out per call, once per step and input layout."""
    return WriteRun(tables, int(width), int(run), np.dtype(dtype), int(page_bits), stream)


def write_kv(k_store, v_store, k, v, tables, ring_rows: int, pages, page_bits: int,
             stream=0) -> None:
    """Scatter `k`, `v` `[width, n_kv_heads, head_dim]` into slot storage `[n_slots,
    n_kv_heads, head_dim]` through the page table `pages` (int32 `[sequences, pages per
    sequence]`, page-aligned slot bases; pages of `2**page_bits` slots).

    `tables`: int32 device array: `[0, width)` the sequence of each token (negative:
    none), `[width, 2 * width)` its position. One launch, on `stream`.
    """
    prepare(tables, k.shape[0], k.shape[1] * k.shape[2], k_store.dtype, page_bits, stream)(
        k_store, v_store, k, v, int(ring_rows), pages)
