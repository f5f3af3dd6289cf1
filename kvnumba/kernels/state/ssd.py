"""A state layer's Mamba2 SSD on the shared recurrence (`recurrence`: storage, plan,
lanes, log and replay): how a new token enters it and its output leaves.

Per token and head `h` of group `g = h // (H / G)`: `d = clamp(softplus(dt + dt_bias),
lo, hi)` (softplus skipped when not asked; `softplus(x) = x` past 20, as Mamba2's),
`S_h <- exp(d A_h) S_h + d x_h B_g^T`, `y_h = S_h C_g + D_h x_h`, the state `S_h
[head_dim, d_state]` stored `[cols, H, head_dim, d_state]`. In the lanes' terms
(`recurrence`) that is the decay-only recurrence with `Dk = d_state` rows and `Dv =
head_dim` columns, the state `transposed`: k = `B_g`, q = `C_g`, v = `d x_h`, a
log-decay per head `d A_h`. The log keeps what a replay takes: `B_g` in the row
inputs' log (`log_k` of the lanes, `[.., H, d_state]`), `d x_h` in the column inputs'
(`[.., H, head_dim]`) and `d A_h` (entry 0 of `log_g`).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ...device import cuda
from ..intrinsics import ptx
from . import chunked
from .recurrence import block_threads, decay, dk_cap, lanes_per_column, recurrence_kernel

from numba import float32, int32, uint32  # noqa: E402  (after kvnumba.device chose the target)

#: past this, `softplus(x)` is `x` (float32 `log1p(exp(x)) - x` is below its ulp there)
SOFTPLUS_LINEAR = np.float32(20.0)
ZERO = np.float32(0.0)
ONE = np.float32(1.0)


@cuda.jit(device=True)
def step_size(dt, dt_bias, t, h, lo, hi, softplus):
    """Token `t`'s step of head `h`: `clamp(softplus(dt + dt_bias), lo, hi)` in float32
    (no bias when `dt_bias` has no rows, no softplus unless `softplus`)."""
    d = ptx.to_f32(dt[t, h])
    if dt_bias.shape[0] > 0:
        d = float32(d + ptx.to_f32(dt_bias[h]))
    if softplus and d <= SOFTPLUS_LINEAR:
        d = float32(math.log1p(math.exp(d)))
    return min(max(d, lo), hi)


@cuda.jit(device=True, inline="always")
def group(x, B, h):
    """Head `h`'s group of `B`'s (and `C`'s): `h // (H / G)`."""
    return int32(uint32(h) // (uint32(x.shape[1]) // uint32(B.shape[1])))


@cuda.jit(device=True)
def _skipped(o, extra, unused):
    """The output: `S C + D x`."""
    return float32(o + extra)


def _kernels(d_state: int, head_dim: int, replay_only: bool = False):
    """The step kernel of heads `[head_dim, d_state]`, or its `replay_only` variant
    (`recurrence.recurrence_kernel`)."""

    @cuda.jit(device=True)
    def taken(log_k, log_v, log_g, log_b, x, dt, A, B, C, D, dt_bias, col, row, h, token,
              q_s, k_s, d_s, lo, hi, softplus, has_beta, tid, threads, j, p, mine):
        """A new token's inputs: `C_g`, `B_g` and the decay into shared memory, `B_g`, `d
        x_h` and `d A_h` into the log row; returns `(d x_h[j], 1, D_h x_h[j])`."""
        g = group(x, B, h)
        i = tid
        while i < d_state:
            b = ptx.to_f32(B[token, g, i])
            q_s[i] = ptx.to_f32(C[token, g, i])
            k_s[i] = b
            log_k[col, row, h, i] = b
            i = int32(i + threads)
        d = step_size(dt, dt_bias, token, h, lo, hi, softplus)
        if tid == 0:
            a = float32(d * ptx.to_f32(A[h]))
            log_g[col, row, h, 0] = a
            d_s[0] = decay(a)
        vj = extra = float32(0.0)
        if mine:
            xj = ptx.to_f32(x[token, h, j])
            vj = float32(d * xj)
            if p == 0:
                log_v[col, row, h, j] = vj
            if D.shape[0] > 0:
                extra = float32(ptx.to_f32(D[h]) * xj)
        return vj, float32(1.0), extra

    return recurrence_kernel(d_state, head_dim, False, True, taken, _skipped, replay_only)


_kernel = lru_cache(maxsize=None)(_kernels)


@cuda.jit(device=True)
def _chunk_gate(x, dt, A, B, C, D, dt_bias, token, h, lo, hi, softplus, unused_beta):
    """A token's log-decay `d A_h` in the chunked kernel, no beta, its values entering
    times its step `d`."""
    d = step_size(dt, dt_bias, token, h, lo, hi, softplus)
    return float32(d * ptx.to_f32(A[h])), ONE, d


@cuda.jit(device=True)
def _chunk_row(x, dt, A, B, C, D, dt_bias, token, h, i, query):
    """Entry `i` of a token's `C_g` (`query`) or `B_g`."""
    g = group(x, B, h)
    return ptx.to_f32(C[token, g, i]) if query else ptx.to_f32(B[token, g, i])


@cuda.jit(device=True)
def _chunk_value(x, dt, A, B, C, D, dt_bias, token, h, j, d):
    """A token's value `j`: `d x_h[j]`."""
    return float32(d * ptx.to_f32(x[token, h, j]))


@cuda.jit(device=True)
def _chunk_emit(o, x, dt, A, B, C, D, dt_bias, token, h, j, unused_lo):
    """The output: `S C + D x`."""
    extra = ZERO
    if D.shape[0] > 0:
        extra = float32(ptx.to_f32(D[h]) * ptx.to_f32(x[token, h, j]))
    return _skipped(o, extra, unused_lo)


#: how the ssd's tokens enter the chunked kernel (`chunked.Entry`): the decay-only
#: recurrence over a transposed state
CHUNK_ENTRY = chunked.Entry(_chunk_gate, _chunk_row, _chunk_value, _chunk_emit,
                            normalises=False, logs_beta=False, weighted=True,
                            transposed=True)


def _chunked_kernels(dk: int, dv: int, chunk: int):
    """The ssd's chunked kernel of heads `[dv, dk]` (`head_dim`, `d_state`), chunks of
    `chunk` tokens (`chunked`)."""
    return chunked.build(dk, dv, chunk, CHUNK_ENTRY)


chunked_kernel = lru_cache(maxsize=None)(_chunked_kernels)


@lru_cache(maxsize=None)
def no_vector():
    """A float32 device vector of no entries, passed for `D` or `dt_bias` not given (a
    kernel reads them only when `shape[0] > 0`)."""
    return cuda.device_array(0, np.float32)


def apply(plan, state, base, log_x, log_b, log_g, log_beta, marks, x, dt, A, B, C, D,
          dt_bias, out, softplus: bool, lo, hi) -> None:
    """Mamba2's SSD of one layer over the step `plan` (`recurrence.prepare`): `x [width,
    H, head_dim]`, `dt [width, H]`, `A [H]`, `B, C [width, G, d_state]` (`H % G == 0`),
    `D [H]` or None, `dt_bias [H]` or None, each float16, float32 or bfloat16 as uint16
    bits; `out [width, H, head_dim]` of those; the storage `state`, `base` `[cols, H,
    head_dim, d_state]`, `log_x [cols, Rl, H, head_dim]` (`d x`), `log_b [cols, Rl, H,
    d_state]` (`B`), `log_g [cols, Rl, H, >= 1]` (`d A`), `log_beta [cols, Rl, H]`
    (unused), `marks`; `dt` clamped to `[lo, hi]` after the softplus (`softplus`)."""
    n_heads, head_dim, d_state = state.shape[1], state.shape[2], state.shape[3]
    if n_heads % B.shape[1]:
        raise ValueError(f"ssd: {n_heads} heads over {B.shape[1]} groups")
    lo, hi, softplus = np.float32(lo), np.float32(hi), bool(softplus)

    def build(replay_only):
        dk_cap(d_state)
        return (_kernel(d_state, head_dim, replay_only), n_heads,
                block_threads(head_dim, lanes_per_column(d_state, head_dim)))

    def build_chunked():
        return (chunked_kernel(d_state, head_dim, plan.chunk),
                (n_heads, head_dim // chunked.value_block(head_dim)), chunked.THREADS)

    fits = chunked.fits(d_state, head_dim, False, plan.chunk)
    plan.launch(("ssd", n_heads, head_dim, d_state, softplus, lo, hi), build,
                (state, base, log_b, log_x, log_g, log_beta, marks),
                (x, dt, A, B, C, no_vector() if D is None else D,
                 no_vector() if dt_bias is None else dt_bias), out, lo, hi, softplus, False,
                build_chunked if fits else None)
