"""Warp-level products of float16 tiles in shared memory on the tensor cores, for the
delta rule's chunked kernel (`chunked`): one warp computes a 16 x 16 float32 tile of
`A @ B` with `mma.m16n8k16` (two of them a 16-deep slice), its fragments read by
`ldmatrix` from row-major float16 arrays of any pitch (a multiple of 8 elements, 16-byte
aligned rows).

`A` is either stored as is (`[M, depth]`, row-major) or transposed (stored `[depth,
M]`: the product takes its transpose); `B` either as is (`[depth, N]`) or transposed
(stored `[N, depth]`, e.g. keys when the product is `Q K^T`). Each choice is one
`ldmatrix` form (tensorcore's table); `product(a_transposed, b_transposed, depth)`
builds the device function of one pair and depth.

A tile's 8 accumulators per lane, `c[e]`, sit at row `m0 + g + 8 * ((e % 4) // 2)`,
column `n0 + 8 * (e // 4) + 2 t + e % 2` (`g = lane // 4`, `t = lane % 4`):
`tile_row`, `tile_col`.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ...device import cuda
from ..intrinsics import tensorcore

from numba import int32  # noqa: E402  (after kvnumba.device chose the target)

TILE = 16
ZERO = np.float32(0.0)


@cuda.jit(device=True)
def tile_row(e, lane):
    """The row within its tile of accumulator `e` of `lane`."""
    return int32(lane // 4 + 8 * ((e % 4) // 2))


@cuda.jit(device=True)
def tile_col(e, lane):
    """The column within its tile of accumulator `e` of `lane`."""
    return int32(8 * (e // 4) + 2 * (lane % 4) + e % 2)


@lru_cache(maxsize=None)
def product(a_transposed: bool, b_transposed: bool, depth: int):
    """`tile(a_s, a_pitch, b_s, b_pitch, m0, n0, lane) -> (c0 .. c7)`: this lane's
    accumulators of the 16 x 16 tile at `(m0, n0)` of `A @ B` over `depth` (a multiple
    of 16, its loop unrolled), `A` and `B` float16 shared arrays stored as the module
    doc says."""
    steps = depth // TILE

    @cuda.jit(device=True)
    def tile(a_s, a_pitch, b_s, b_pitch, m0, n0, lane):
        c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = ZERO
        half, eighth, quarter = lane // 16, lane % 8, (lane // 8) % 2
        step = int32(0)
        while step < steps:                 # int32 counts: LLVM unrolls the loop whole
            k0 = step * TILE
            if a_transposed:      # matrices: A^T at (k0 + 8 (l // 16), m0 + 8 ((l // 8) % 2))
                a0, a1, a2, a3 = tensorcore.ldmatrix_x4_trans(
                    a_s, (k0 + eighth + 8 * half) * a_pitch + m0 + 8 * quarter)
            else:                 # rows m0 + l % 16, columns k0 + 8 (l // 16)
                a0, a1, a2, a3 = tensorcore.ldmatrix_x4(
                    a_s, (m0 + lane % 16) * a_pitch + k0 + 8 * half)
            if b_transposed:      # B^T rows n0 + l % 8 + 8 (l // 16), columns k0 + 8 ((l // 8) % 2)
                b0, b1, b2, b3 = tensorcore.ldmatrix_x4(
                    b_s, (n0 + eighth + 8 * half) * b_pitch + k0 + 8 * quarter)
            else:                 # rows k0 + l % 16, columns n0 + 8 (l // 16)
                b0, b1, b2, b3 = tensorcore.ldmatrix_x4_trans(
                    b_s, (k0 + lane % 16) * b_pitch + n0 + 8 * half)
            c0, c1, c2, c3 = tensorcore.mma_f16_f32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
            c4, c5, c6, c7 = tensorcore.mma_f16_f32(a0, a1, a2, a3, b2, b3, c4, c5, c6, c7)
            step = int32(step + 1)
        return c0, c1, c2, c3, c4, c5, c6, c7

    return tile
