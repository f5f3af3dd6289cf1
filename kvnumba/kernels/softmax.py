"""The online softmax's two steps, as device functions every attention kernel and
combine shares: a row's running max moving on (`rescaling`), and two partial states
meeting (`merge`).

A row's state is (max `m`, sum `s` of `2**(scale (x - m))` over its scores `x`,
unnormalised accumulator). `scale` takes the kernel's units of scores and maxima to
base 2: 1 where they are base 2 already (the decode kernel and the combines of the
decode path), `LOG2E` for natural-log scores (`generic`), `scale * LOG2E` for the
unscaled scores of the tensor-core kernel. A state that has seen no key holds max
-inf and sum 0: moved on or merged, it weighs 0, and no NaN arises.
"""
from __future__ import annotations

from ..device import cuda
from .intrinsics import ptx
from .launch.constants import NEG_INF

from numba import float32  # noqa: E402  (after kvnumba.device chose the target)

ZERO = float32(0.0)


@cuda.jit(device=True, inline="always")
def rescaling(run_max, new_max, scale):
    """`(alpha, base)` of a state whose max moves from `run_max` to `new_max >= run_max`:
    `alpha = 2**(scale (run_max - new_max))` rescales what it summed against `run_max`
    (the weight of a state of max `run_max` in a merge against `new_max`), and a score
    `x`'s term is `2**(x scale - base)`, one FFMA and one `ex2.approx`. Where `new_max`
    is -inf (no visible key yet) the base is 0: alpha and every term are 0."""
    settled = new_max if new_max != NEG_INF else ZERO
    return ptx.exp2_approx((run_max - settled) * scale), settled * scale


@cuda.jit(device=True, inline="always")
def merge(m_a, s_a, m_b, s_b, scale):
    """`(m, s, w_a, w_b)`: states (m_a, s_a) and (m_b, s_b) merged, log-sum-exp: the
    common max `m`, the sum `s = s_a w_a + s_b w_b`, and the weights that scale each
    state's accumulators into the merged one."""
    best = max(m_a, m_b)
    w_a, _ = rescaling(m_a, best, scale)
    w_b, _ = rescaling(m_b, best, scale)
    return best, s_a * w_a + s_b * w_b, w_a, w_b
