"""Multiply an attention output by a layer's fp8 `v_scale` (contract §3: attention reads
`scale * stored`): K's scale folds into the softmax scale, V's multiplies the output,
as FlashInfer does. One launch after the layer's attention, none for a scale of 1.

The output is in q's dtype, so a 16-bit output is rounded twice (by the attention, then
here): at most one more unit in its last place than storage without a V scale."""
from __future__ import annotations

import numpy as np

from ..device import cuda
from .intrinsics import ptx
from .launch.calling import Specialised
from .masks import divmod32, step_on

THREADS = 128


@cuda.jit
def _scale_rows(out, factor):
    """Block `b` multiplies row `b` of `out` (all heads) by `factor` (float32); its threads
    stride over the row's (head, dim) elements."""
    token = cuda.blockIdx.x
    n_heads, head_dim = out.shape[1], out.shape[2]
    head, dim = divmod32(cuda.threadIdx.x, head_dim)
    skip_heads, skip_dims = divmod32(THREADS, head_dim)
    while head < n_heads:
        out[token, head, dim] = ptx.from_f32(ptx.to_f32(out[token, head, dim]) * factor, out)
        head, dim = step_on(head, dim, skip_heads, skip_dims, head_dim)


_scale = Specialised(_scale_rows)


def scale_out(out, factor, stream=0) -> None:
    """`out *= factor` for a `[width, n_heads, head_dim]` device array (float16, float32 or
    bfloat16 bits), `factor` a float32; nothing for a factor of 1 or no rows."""
    factor = np.float32(factor)
    if factor != 1 and out.shape[0] > 0:
        _scale(out.shape[0], THREADS, stream, out, factor)
