"""A state layer's gated delta rule on the shared recurrence (`recurrence`: storage,
plan, lanes, log and replay): how a new token enters it and its output leaves.

Per token and head, `S [Dk, Dv]` stored `[cols, H, Dk, Dv]`: `S <- diag(exp(g)) S`
(per head: `exp(g) S`); with beta, `S <- S + beta k (v - S^T k)^T`; without, `S <- S +
k v^T`; `o = scale S^T q`, q and k first l2-normalised (`x * rsqrt(sum(x^2) + 1e-6)`)
when `qk_l2norm`: the norms are each warp's own butterfly over its lanes' strided
squares. The log keeps k as the recurrence used it (normalised), v, the log-decay
(`log_g`, entry 0 for a gate a head) and beta.

A plan's runs of at least its `chunk` new tokens (a prefill, `arith.state_runs`) take
a chunked kernel on the tensor cores where it fits the layer's heads (`chunked` for a
gate a head, `chunked_channel` for a gate per key channel): the step kernel's
`replay_only` variant first brings their states to their first new position, then the
chunked kernel takes their new tokens
(`recurrence.RecurrentStep.launch`). It writes the same log rows, so replays from the
log stay bit for bit the per-token kernel's; its outputs and states match the per-token
kernel's within float16 products' rounding.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ...device import cuda
from ..intrinsics import ptx
from . import chunked, chunked_channel
from .lanes import lane_functions
from .recurrence import block_threads, decay, dk_cap, lanes_per_column, prepare, \
    recurrence_kernel

from numba import float32, int32  # noqa: E402  (after kvnumba.device chose the target)

ONE = np.float32(1.0)
ZERO = np.float32(0.0)


@cuda.jit(device=True)
def _gate_head(g, t, h, i):
    """Token `t`'s gate of head `h` from a per-head `g [width, H]`."""
    return ptx.to_f32(g[t, h])


@cuda.jit(device=True)
def _gate_channel(g, t, h, i):
    """Token `t`'s gate of key channel `i` of head `h` from `g [width, H, Dk]`."""
    return ptx.to_f32(g[t, h, i])


@cuda.jit(device=True)
def _scaled(o, extra, scale):
    """The output: `scale S^T q`."""
    return float32(o * scale)


def _kernels(dk: int, dv: int, per_channel: bool, replay_only: bool = False):
    """The step kernel for heads of `dk` keys and `dv` values and a gate `[width, H, Dk]`
    (`per_channel`) or `[width, H]`, or its `replay_only` variant
    (`recurrence.recurrence_kernel`)."""
    gate = _gate_channel if per_channel else _gate_head
    rnorm = lane_functions(dk, dv, per_channel, lanes_per_column(dk, dv)).rnorm

    @cuda.jit(device=True)
    def taken(log_k, log_v, log_g, log_b, q, k, v, g, beta, unused5, unused6, col, row, h,
              token, q_s, k_s, d_s, scale, unused_f1, qk_l2norm, has_beta, tid, threads, j,
              p, mine):
        """A new token's inputs: q, k (normalised) and decays into shared memory, k, v, g
        and beta into the log row; returns `(v[j], beta, 0)`."""
        i = tid
        while i < dk:
            q_s[i] = ptx.to_f32(q[token, h, i])
            k_s[i] = ptx.to_f32(k[token, h, i])
            i = int32(i + threads)
        if qk_l2norm:
            cuda.syncthreads()
            rq, rk = rnorm(q_s), rnorm(k_s)
            cuda.syncthreads()
            i = tid
            while i < dk:
                q_s[i] = float32(q_s[i] * rq)
                k_s[i] = float32(k_s[i] * rk)
                i = int32(i + threads)
        i = tid
        while i < dk:
            log_k[col, row, h, i] = k_s[i]
            if per_channel:
                x = gate(g, token, h, i)
                log_g[col, row, h, i] = x
                d_s[i] = decay(x)
            i = int32(i + threads)
        if not per_channel and tid == 0:
            x = gate(g, token, h, 0)
            log_g[col, row, h, 0] = x
            d_s[0] = decay(x)
        vj = float32(0.0)
        if mine:
            vj = ptx.to_f32(v[token, h, j])
            if p == 0:
                log_v[col, row, h, j] = vj
        b = ptx.to_f32(beta[token, h]) if has_beta else ONE
        if tid == 0:
            log_b[col, row, h] = b
        return vj, b, float32(0.0)

    return recurrence_kernel(dk, dv, per_channel, False, taken, _scaled, replay_only)


_kernel = lru_cache(maxsize=None)(_kernels)


@cuda.jit(device=True)
def _chunk_gate(q, k, v, g, beta, unused5, unused6, token, h, scale, unused_f1, qk_l2norm,
                has_beta):
    """A token's per-head gate and beta in the chunked kernel; values enter as they are."""
    return _gate_head(g, token, h, 0), ptx.to_f32(beta[token, h]) if has_beta else ONE, ONE


@cuda.jit(device=True)
def _chunk_row(q, k, v, g, beta, unused5, unused6, token, h, i, query):
    """Entry `i` of a token's q (`query`) or k."""
    return ptx.to_f32(q[token, h, i]) if query else ptx.to_f32(k[token, h, i])


@cuda.jit(device=True)
def _chunk_value(q, k, v, g, beta, unused5, unused6, token, h, j, unused_w):
    """A token's value `j`."""
    return ptx.to_f32(v[token, h, j])


@cuda.jit(device=True)
def _chunk_emit(o, q, k, v, g, beta, unused5, unused6, token, h, j, scale):
    """The output: `scale S^T q`."""
    return _scaled(o, ZERO, scale)


#: how the delta rule's tokens enter the chunked kernel (`chunked.Entry`)
CHUNK_ENTRY = chunked.Entry(_chunk_gate, _chunk_row, _chunk_value, _chunk_emit,
                            normalises=True, logs_beta=True, weighted=False,
                            transposed=False)


def _chunked_kernels(dk: int, dv: int, chunk: int):
    """The delta rule's chunked kernel of heads of `dk` keys and `dv` values, a gate a
    head, chunks of `chunk` tokens (`chunked`)."""
    return chunked.build(dk, dv, chunk, CHUNK_ENTRY)


chunked_kernel = lru_cache(maxsize=None)(_chunked_kernels)


def apply(plan, state, base, log_k, log_v, log_g, log_b, marks, q, k, v, g, beta, out,
          scale, qk_l2norm: bool) -> None:
    """The delta rule of one layer over the step `plan` (`recurrence.prepare`): `q, k
    [width, H, Dk]`, `v [width, H, Dv]`, `g [width, H]` (per head) or `[width, H, Dk]`,
    `beta [width, H]` or None (`S += k v^T`; a layer must use one rule for all its steps,
    since replay takes it from this call), each float16, float32 or bfloat16 as uint16
    bits; `out [width, H, Dv]` of those; the storage as `recurrence` lays it out;
    `scale` float32."""
    n_heads, dk, dv = state.shape[1], state.shape[2], state.shape[3]
    per_channel, has_beta = len(g.shape) == 3, beta is not None
    if per_channel and g.shape[2] != dk:
        raise ValueError(f"delta rule: a per-channel gate of {g.shape[2]} entries a head "
                         f"for Dk {dk}")
    scale, qk_l2norm = np.float32(scale), bool(qk_l2norm)

    def build(replay_only):
        dk_cap(dk)
        return (_kernel(dk, dv, per_channel, replay_only), n_heads,
                block_threads(dv, lanes_per_column(dk, dv)))

    def build_chunked():
        kernel = (chunked_channel.kernel(dk, dv) if per_channel
                  else chunked_kernel(dk, dv, plan.chunk))
        return kernel, (n_heads, dv // chunked.value_block(dv)), chunked.THREADS

    fits = (chunked_channel.fits(dk, dv, plan.chunk) if per_channel
            else chunked.fits(dk, dv, per_channel, plan.chunk))
    inputs = (q, k, v, g) + ((beta,) if has_beta else ())
    plan.launch(("delta_rule", n_heads, dk, dv, per_channel, has_beta, scale, qk_l2norm),
                build, (state, base, log_k, log_v, log_g, log_b, marks), inputs, out, scale,
                0.0, qk_l2norm, has_beta, build_chunked if fits else None)


def run(state, base, log_k, log_v, log_g, log_b, marks, q, k, v, g, beta, out, runs, order,
        seq_info, n_runs: int, scale, qk_l2norm: bool, advance_after: int, stream=0, *,
        n_tokens=None, n_chunked: int = 0, chunk: int = chunked.CHUNK) -> None:
    """Advance the state of each of the `n_runs` runs over its segments (`apply` on a plan
    of `runs`, `order`, `seq_info` made for this call, `recurrence.prepare`, its last
    `n_chunked` runs of at least `chunk` new tokens): the step (grid `(n_runs, H)`), or
    for the chunked runs where the heads allow, the step's replay and the chunked
    kernel; then the marks; a last launch zeroes `out[n_tokens:]` when `n_tokens` is
    given."""
    apply(prepare(runs, order, seq_info, n_runs, advance_after, stream, n_tokens=n_tokens,
                  n_chunked=n_chunked, chunk=chunk),
          state, base, log_k, log_v, log_g, log_b, marks, q, k, v, g, beta, out, scale,
          qk_l2norm)
