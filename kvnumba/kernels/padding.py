"""Zero the padding rows of an attention output (rows past the step's tokens), and set
those of its log-sum-exp output, when there is one, to -inf (a row over no key)."""
from __future__ import annotations

from ..device import cuda
from .intrinsics import ptx
from .launch.constants import NEG_INF
from .launch.calling import PER_CALL, Specialised, no_output
from .masks import divmod32, step_on

THREADS = 128


@cuda.jit
def _zero_rows(out, lse, first_token):
    """Block `b` zeroes row `first_token + b` of `out` (all heads); its threads stride over
    the row's (head, dim) elements. Row `first_token + b` of `lse` (`[width, n_heads]`),
    when it has rows, becomes -inf."""
    token = first_token + cuda.blockIdx.x
    n_heads, head_dim = out.shape[1], out.shape[2]
    if lse.shape[0] > 0:
        for h in range(cuda.threadIdx.x, n_heads, THREADS):
            lse[token, h] = NEG_INF
    head, dim = divmod32(cuda.threadIdx.x, head_dim)
    skip_heads, skip_dims = divmod32(THREADS, head_dim)
    while head < n_heads:
        out[token, head, dim] = ptx.from_f32(0.0, out)
        head, dim = step_on(head, dim, skip_heads, skip_dims, head_dim)


_zero = Specialised(_zero_rows)


def prepare(width: int, first_token: int, stream=0):
    """The prepared half of `zero_rows` for outputs of `width` rows: the launch bound once per
    step (`launch(out, lse)`, `lse` of no rows for none: `launch.calling.no_output()`), or
    None when there is nothing to zero."""
    n_rows = width - first_token
    if n_rows <= 0:
        return None
    return _zero.bind(n_rows, THREADS, stream, PER_CALL, PER_CALL, int(first_token))


def zero_rows(out, first_token: int, stream=0, *, lse=None) -> None:
    """`out[first_token:] = 0` for a `[width, n_heads, head_dim]` device array, and
    `lse[first_token:] = -inf` for a float32 `[width, n_heads]` one if given; one launch,
    none when there is nothing to zero."""
    launch = prepare(out.shape[0], first_token, stream)
    if launch is not None:
        launch(out, no_output() if lse is None else lse)
