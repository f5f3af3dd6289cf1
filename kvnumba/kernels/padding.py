"""Zero the padding rows of an attention output (rows past the step's tokens)."""
from __future__ import annotations

from ..device import cuda
from . import ptx
from .launch import Specialised

THREADS = 128


@cuda.jit
def _zero_rows(out, first_token):
    """Block `b` zeroes row `first_token + b` of `out` (all heads)."""
    token = first_token + cuda.blockIdx.x
    n_heads, head_dim = out.shape[1], out.shape[2]
    for e in range(cuda.threadIdx.x, n_heads * head_dim, THREADS):
        head = e // head_dim
        out[token, head, e - head * head_dim] = ptx.from_f32(0.0, out)


_zero = Specialised(_zero_rows)


def zero_rows(out, first_token: int, stream=0) -> None:
    """`out[first_token:] = 0` for a `[width, n_heads, head_dim]` device array; one launch,
    none when there is nothing to zero."""
    n_rows = out.shape[0] - first_token
    if n_rows > 0:
        _zero(n_rows, THREADS, stream, out, int(first_token))
