"""The decode kernel's loaded words as float32 values: K/V storage words (`WIDEN`) and
the query's row slices (`query_loader`).

A 16-byte load gives four uint32 words. A 16-bit type holds two values per word, the
lower element in the low half (`ptx` conventions); bfloat16 arrays hold its bit
patterns as uint16. An 8-bit float type holds four, lowest byte first (e4m3 bits as
uint8, e5m2 as int8: `fp8`); their scales are applied outside the kernel.
"""
from __future__ import annotations

import numpy as np

from ...device import cuda
from ..launch.constants import FP8_FORMATS
from . import fp8, ptx

from numba import uint32, uint64  # noqa: E402  (after kvnumba.device chose the target)

#: bytes of one vector load (of q, and of K/V of 16- and 32-bit types)
LOAD_BYTES = 16
#: bytes of one K/V load of 8-bit floats: 8, so that a key row takes as many lanes as a
#: 16-bit one and a lane widens as many values a load (registers for 4 rows a block)
FP8_LOAD_BYTES = 8


def load_bytes(itemsize: int) -> int:
    """Bytes of one K/V load for storage of `itemsize`-byte values."""
    return FP8_LOAD_BYTES if itemsize == 1 else LOAD_BYTES

#: a 16-bit dtype -> the device function splitting a word into its two values
PAIRS = {np.dtype(np.float16): ptx.f16x2_to_f32, np.dtype(np.uint16): ptx.bf16x2_to_f32}


def _widen_pairs(pair_to_f32):
    """Widening for a 16-bit type: each word holds two values (`pair_to_f32`)."""
    @cuda.jit(device=True)
    def widen(w0, w1, w2, w3):
        a0, a1 = pair_to_f32(w0)
        b0, b1 = pair_to_f32(w1)
        c0, c1 = pair_to_f32(w2)
        d0, d1 = pair_to_f32(w3)
        return a0, a1, b0, b1, c0, c1, d0, d1
    return widen


@cuda.jit(device=True)
def _widen_float32(w0, w1, w2, w3):
    return ptx.u32_as_f32(w0), ptx.u32_as_f32(w1), ptx.u32_as_f32(w2), ptx.u32_as_f32(w3)


#: an 8-bit float dtype (its bits: uint8 e4m3, int8 e5m2) -> the device function
#: splitting a word into its four values
QUADS = {np.dtype(name): getattr(fp8, f"{fmt}x4_to_f32") for name, fmt in FP8_FORMATS.items()}


def _widen_quads(quad_to_f32):
    """Widening for an 8-bit type's 8-byte loads: each word holds four values
    (`quad_to_f32`: through float16, exact)."""
    @cuda.jit(device=True)
    def widen(w0, w1):
        a0, a1, a2, a3 = quad_to_f32(w0)
        b0, b1, b2, b3 = quad_to_f32(w1)
        return a0, a1, a2, a3, b0, b1, b2, b3
    return widen


#: dtype -> device function `widen(w0, ...)`: the words of one K/V load (`load_bytes`:
#: four, two for 8-bit floats) as a tuple of float32 values, lowest address first
WIDEN = {np.dtype(np.float32): _widen_float32,
         **{dtype: _widen_pairs(pair) for dtype, pair in PAIRS.items()},
         **{dtype: _widen_quads(quad) for dtype, quad in QUADS.items()}}


def query_loader(dtype: np.dtype, head_dim: int, vec: int, vectors: bool):
    """Device function `load(q, q_row, first, dest, j, at)`: `dest[j, at + e] =` element
    `first + e` of q's row `q_row` (token * n_q_heads + head) as float32, for e < vec.

    q: `[width, n_q_heads, head_dim]` of `dtype`, C-contiguous, fewer than 2**32 rows;
    `first` a multiple of `vec`. With `vectors` (q 16-byte aligned: its rows, whole
    multiples of 16 elements, are then too) the elements come in 16-byte loads: one or
    two whole ones, or for a 16-bit q beside float32 storage (vec 4, 8 bytes) the half
    of one that holds them. Otherwise element by element.
    """
    if not vectors:
        @cuda.jit(device=True, inline="always")
        def load_elements(q, q_row, first, dest, j, at):
            n_heads = uint32(q.shape[1])
            token = uint32(q_row) // n_heads              # one 32-bit division
            head = uint32(q_row) - token * n_heads
            for e in range(vec):
                dest[j, at + e] = ptx.to_f32(q[uint64(token), uint64(head), uint64(first + e)])
        return load_elements

    itemsize = dtype.itemsize
    row_bytes = head_dim * itemsize

    @cuda.jit(device=True, inline="always")
    def byte_offset(q_row, first):
        """Offset of element `first` of q's row `q_row` from q's start."""
        return ptx.mul_wide_u32(q_row, row_bytes) + first * itemsize

    if vec * itemsize < LOAD_BYTES:
        pair_to_f32 = PAIRS[dtype]

        @cuda.jit(device=True, inline="always")
        def load_half(q, q_row, first, dest, j, at):
            # the 16-byte aligned vector of 8 elements holding them
            w0, w1, w2, w3 = ptx.ld_nc_v4(ptx.bytes_from(q, 0), byte_offset(q_row, first & ~7))
            upper = (first & 4) != 0
            a0, a1 = pair_to_f32(w2 if upper else w0)
            b0, b1 = pair_to_f32(w3 if upper else w1)
            dest[j, at] = a0
            dest[j, at + 1] = a1
            dest[j, at + 2] = b0
            dest[j, at + 3] = b1
        return load_half

    widen = WIDEN[dtype]          # q is never 8-bit: its loads are 16 bytes
    per_load = LOAD_BYTES // itemsize
    loads = vec // per_load

    @cuda.jit(device=True, inline="always")
    def load_vectors(q, q_row, first, dest, j, at):
        start = byte_offset(q_row, first)
        for n in range(loads):
            w0, w1, w2, w3 = ptx.ld_nc_v4(ptx.bytes_from(q, 0), start + n * LOAD_BYTES)
            values = widen(w0, w1, w2, w3)
            for e in range(per_load):
                dest[j, at + n * per_load + e] = values[e]
    return load_vectors
