"""Write a step's K and V into 8-bit float storage (e4m3 bits as uint8, e5m2 as int8)
in 16-byte vectors: each lane narrows 16 values of a token's K row and as many of its V
row per trip (`narrow_kernel`), the element-wise write's semantics (`ptx.to_storage`).

A token's run of `n_kv_heads * head_dim` values (a multiple of 16) is `run / 16`
stored vectors of 16 bytes; the input (float16, bfloat16 bits or float32,
C-contiguous, 16-byte aligned) gives each of them 32 or 64 bytes, two or four 16-byte
loads. Input of float16 into storage of scale 1 is narrowed in float16 pairs
(`fp8.f16x4_to_e4m3x4`: a non-finite fix-up and one conversion per pair, no float32
at all); anything else is widened to float32, scaled and narrowed four values a
conversion (`fp8.f32x4_to_e4m3x4`). Lookups, slots and index ranges are
`write._write_vectors`': a token's sequence, position and slot once per token, its
vectors `lane`, `lane + lanes`, ... (a warp reads whole lines).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ...device import cuda
from ..intrinsics import fp8, ptx
from ..intrinsics.words import WIDEN
from ..launch.calling import Specialised, ceil_div, run_block
from ..masks import clamped_trip, token_runs

from numba import float32, uint32, uint64  # noqa: E402  (after kvnumba.device chose the target)

#: stored values per 16-byte vector
VALUES = 16
#: 16-byte input loads of K (and as many of V) a lane has in flight per trip: 4 stored
#: vectors from 16-bit input, 2 from float32
TRIP_LOADS = 8
#: input dtype names a vector write takes (bfloat16 as uint16 bits)
INPUTS = ("float16", "uint16", "float32")
NARROW = {"e4m3": (fp8.f32x4_to_e4m3x4, fp8.f16x4_to_e4m3x4),
          "e5m2": (fp8.f32x4_to_e5m2x4, fp8.f16x4_to_e5m2x4)}


def _packed_words(f16_narrow):
    """Stored vector `j`'s 4 words from the float16 words of its two 16-byte loads
    (`words[j, n, w]`, word w of load n), scale 1."""
    @cuda.jit(device=True, inline="always")
    def narrow_words(words, j, inv):
        return (f16_narrow(words[j, 0, 0], words[j, 0, 1]),
                f16_narrow(words[j, 0, 2], words[j, 0, 3]),
                f16_narrow(words[j, 1, 0], words[j, 1, 1]),
                f16_narrow(words[j, 1, 2], words[j, 1, 3]))
    return narrow_words


def _widened_words(f32_narrow, widen, loads: int):
    """Stored vector `j`'s 4 words from the words of its `loads` 16-byte loads
    (`words[j, n, w]`), widened to float32 by `widen`, times `inv`."""
    per_load = VALUES // loads

    @cuda.jit(device=True, inline="always")
    def narrow_words(words, j, inv):
        values = cuda.local.array(VALUES, float32)
        for n in range(loads):
            got = widen(words[j, n, 0], words[j, n, 1], words[j, n, 2], words[j, n, 3])
            for e in range(per_load):
                values[n * per_load + e] = got[e]
        return (f32_narrow(values[0], values[1], values[2], values[3], inv),
                f32_narrow(values[4], values[5], values[6], values[7], inv),
                f32_narrow(values[8], values[9], values[10], values[11], inv),
                f32_narrow(values[12], values[13], values[14], values[15], inv))
    return narrow_words


def lanes_for(stored: int, source: str) -> tuple[int, int]:
    """`(lanes, rows)` of a block for token runs of `stored` stored vectors from `source`
    input: lanes enough for one trip of `trip_vectors` each."""
    return run_block(ceil_div(stored, trip_vectors(source)))


def trip_vectors(source: str) -> int:
    """Stored vectors of K (and of V) a lane narrows per trip from `source` input."""
    return TRIP_LOADS // np.dtype(source).itemsize


@lru_cache(maxsize=None)
def narrow_kernel(source: str, fmt: str, scaled: bool):
    """The vector write from `source` values (a name of `INPUTS`) into `fmt` ("e4m3" or
    "e5m2") storage, its scales other than 1 (`scaled`) or not (module doc)."""
    itemsize = np.dtype(source).itemsize
    f32_narrow, f16_narrow = NARROW[fmt]
    LOADS = itemsize                                 # 16-byte loads of a stored vector
    if source == "float16" and not scaled:
        narrow_words = _packed_words(f16_narrow)
    else:
        narrow_words = _widened_words(f32_narrow, WIDEN[np.dtype(source)], LOADS)
    SOURCE_BYTES = VALUES * itemsize                 # input bytes of one stored vector
    TRIP = trip_vectors(source)
    trip_at = clamped_trip(TRIP)

    @cuda.jit(device=True, inline="always")
    def narrow_run(k_to, v_to, k_from, v_from, first, step, last, k_inv, v_inv):
        """Stored vectors `first`, `first + step`, ... up to `last` of a token's K and V
        runs (byte views from each run's start, input and storage), TRIP of each a trip:
        the trip's loads, then its conversions and stores. Vectors past `last` are
        clamped to it (stored again, with its own bytes), as `write.move_vectors` does;
        the loops have compile-time counts, so the local arrays live in registers."""
        at = cuda.local.array(TRIP, uint64)                  # the trip's stored vectors
        k_words = cuda.local.array((TRIP, LOADS, 4), uint32)
        v_words = cuda.local.array((TRIP, LOADS, 4), uint32)
        e = first
        while e <= last:
            vector = trip_at(at, e, step, last, uint64(1))
            for j in range(TRIP):
                for n in range(LOADS):
                    k_words[j, n, 0], k_words[j, n, 1], k_words[j, n, 2], k_words[j, n, 3] = \
                        ptx.ld_nc_v4(k_from, at[j] * uint64(SOURCE_BYTES) + uint64(16 * n))
            for j in range(TRIP):
                for n in range(LOADS):
                    v_words[j, n, 0], v_words[j, n, 1], v_words[j, n, 2], v_words[j, n, 3] = \
                        ptx.ld_nc_v4(v_from, at[j] * uint64(SOURCE_BYTES) + uint64(16 * n))
            for j in range(TRIP):
                w0, w1, w2, w3 = narrow_words(k_words, j, k_inv)
                ptx.st_v4(k_to, at[j] * uint64(16), w0, w1, w2, w3)
            for j in range(TRIP):
                w0, w1, w2, w3 = narrow_words(v_words, j, v_inv)
                ptx.st_v4(v_to, at[j] * uint64(16), w0, w1, w2, w3)
            e = uint32(vector + step)

    narrow_tokens = token_runs(narrow_run)

    @cuda.jit
    def write_fp8(k_store, v_store, k, v, tables, width, ring_rows, pages, page_bits, k_inv,
                  v_inv):
        """Lane `threadIdx.x` of a block row narrows stored vectors `lane`, `lane +
        blockDim.x`, ... of each of the row's tokens, K and V (`narrow_run`, over
        `masks.token_runs`). `tables` as `write._write_vectors`'."""
        run = uint32(k.shape[1] * k.shape[2])                      # values per token
        last = uint32(uint32(run >> uint32(4)) - uint32(1))        # its last stored vector
        narrow_tokens(k_store, v_store, k, v, tables, width, ring_rows, pages, page_bits,
                      run, last, k_inv, v_inv)

    return Specialised(write_fp8)
