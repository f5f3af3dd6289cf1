"""The lanes of a recurrence block (`recurrence`, `capture`): `parts` adjacent lanes hold
one value channel's column of a head's state `S [Dk, Dv]` (stored float32 or bfloat16
bits, held float32), each `rows = ceil(Dk / parts)` of its rows in registers (row `r * parts + p` of lane `p`), and the
device functions that load, store and clear them and take one token of the recurrence
(`step`: decay, delta-rule or plain update, `S^T q`, the column sums a butterfly of
shuffles, so every lane gets the same float), built once per head shape, gate kind,
split and layout (`lane_functions`). The state is stored `[cols, H, Dk, Dv]` (the delta
rule's: a column's rows `Dv` apart) or `transposed`, `[cols, H, Dv, Dk]` (Mamba2's
`[heads, head_dim, d_state]`: a column's rows adjacent). One definition, so that a
replayed state (the step kernel's rewinds, a prefix snapshot's capture) is
bit-identical to the one computed directly.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..intrinsics import ptx
from ..launch.calling import ceil_div
from ...device import cuda

from numba import float32, int32  # noqa: E402  (after kvnumba.device chose the target)

WARP = 32
ZERO = np.float32(0.0)
ONE = np.float32(1.0)
EPS = np.float32(1e-6)


class Lanes(NamedTuple):
    """What `lane_functions` builds: `rows` a lane holds, and its device functions."""

    rows: int
    load: object
    store: object
    clear: object
    step: object
    rnorm: object


@lru_cache(maxsize=None)
def lane_functions(dk: int, dv: int, per_channel: bool, parts: int,
                   transposed: bool = False) -> Lanes:
    """The device functions of heads of `dk` keys and `dv` values, a gate per key channel
    (`per_channel`) or per head, `parts` lanes a column, the state stored `[H, Dk, Dv]`
    or `transposed` `[H, Dv, Dk]` (module doc)."""
    rows = ceil_div(dk, parts)
    whole = dk % parts == 0                     # every lane's rows are in the head
    rounds = parts.bit_length() - 1             # shuffle rounds of a column's sum
    row_step = 1 if transposed else dv          # elements from a column's row to its next
    column_step = dk if transposed else 1       # elements from a row's column to its next
    stride = parts * row_step                   # elements from a lane's row to its next
    norm_rows = ceil_div(dk, WARP)              # a lane's squares in a norm's sum

    @cuda.jit(device=True)
    def load(s, src, col, h, j, p):
        """This lane's rows `r * parts + p` of column `j` of `src[col, h]` (0 past `Dk` or
        `Dv`), at compile-time offsets from one address: every load in bounds (the
        column clamped), none behind a branch."""
        first = ((col * src.shape[1] + h) * dk * dv + p * row_step
                 + min(j, dv - 1) * column_step)
        at = ptx.elements_from(src, first)
        for r in range(rows):
            x = ptx.to_f32(at[r * stride]) if whole or r * parts + p < dk else ZERO
            s[r] = x if j < dv else ZERO

    @cuda.jit(device=True)
    def store(s, dst, col, h, j, p):
        if j < dv:
            at = ptx.elements_from(dst, (col * dst.shape[1] + h) * dk * dv + p * row_step
                                   + j * column_step)
            for r in range(rows):
                if whole or r * parts + p < dk:
                    at[r * stride] = ptx.from_f32(s[r], dst)

    @cuda.jit(device=True)
    def clear(s):
        for r in range(rows):
            s[r] = ZERO

    @cuda.jit(device=True)
    def column_sum(x):
        """The sum of `x` over a column's `parts` lanes (adjacent lanes, a butterfly: each
        lane adds the same pairs, so all get the same float)."""
        for m in range(rounds):
            x = float32(x + ptx.shfl_xor(x, 1 << m))
        return x

    @cuda.jit(device=True)
    def step(s, q_s, k_s, d_s, p, has_beta, vj, b, want):
        """One token of the recurrence on this lane's rows `s` of its column (module doc):
        decay, delta-rule (or plain) update, and, when `want`, `S^T q` (unscaled). Every
        lane of the block takes it (the sums shuffle over whole warps)."""
        kp, qp = k_s[p:], q_s[p:]         # this lane's rows at compile-time offsets
        u = ZERO
        if per_channel:
            dp = d_s[p:]
            for r in range(rows):
                x = float32(s[r] * dp[r * parts])
                s[r] = x
                u = float32(u + float32(x * kp[r * parts]))
        else:
            d = d_s[0]
            for r in range(rows):
                x = float32(s[r] * d)
                s[r] = x
                u = float32(u + float32(x * kp[r * parts]))
        if has_beta:
            w = float32(b * float32(vj - column_sum(u)))
        else:
            w = vj
        o = ZERO
        if want:
            for r in range(rows):
                x = float32(s[r] + float32(kp[r * parts] * w))
                s[r] = x
                o = float32(o + float32(x * qp[r * parts]))
            o = column_sum(o)
        else:
            for r in range(rows):
                s[r] = float32(s[r] + float32(kp[r * parts] * w))
        return o

    @cuda.jit(device=True)
    def rnorm(x_s):
        """`rsqrt(sum(x^2) + 1e-6)` over `x_s[:dk]`: each warp sums its lanes' strided
        squares and adds them up in a butterfly (every lane of every warp alike)."""
        lane = int32(cuda.laneid)
        acc = ZERO
        for r in range(norm_rows):
            i = r * WARP + lane
            if dk % WARP == 0 or i < dk:
                acc = float32(acc + float32(x_s[i] * x_s[i]))
        for m in range(5):
            acc = float32(acc + ptx.shfl_xor(acc, 16 >> m))
        return float32(ONE / float32(math.sqrt(float32(acc + EPS))))

    return Lanes(rows, load, store, clear, step, rnorm)
