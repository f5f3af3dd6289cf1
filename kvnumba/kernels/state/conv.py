"""A state layer's causal convolution: its input ring written (`write_window`) and the
convolution read back from it (`apply`), one launch each per layer and step.

Storage: `ring [cols, R, C]` (float16, float32, or bfloat16 held as uint16 bits), one
column per sequence slot plus a last, scratch column that padding tokens write to.
Position `p` of column `col` is ring row `p % R` (`masks.storage_row`): the ring holds a
sequence's last `R` inputs.

A step's tokens table `tokens` (int32, `[2 * width]`) is the write tables' layout
(`masks.seq_and_position`): `tokens[t]` the column of token `t`, `tokens[width + t]`
its position; a padding token (`t >= n_tokens`) names the scratch column and position 0.

`write_window` stores input row `x[t]` (`[width, C]`) at `ring[col, p % R]` for every
token, padding included (the scratch column absorbs those). `apply` then reads, for
each real token `t < n_tokens` and channel `c`, the `K = weight.shape[1]` inputs of
positions `p - K + 1 .. p` (row `q % R`, a position `q < 0` reading as 0), all of them
from the ring, the token's own too: so several spans of one sequence in a step read each
other's inputs as a single span would. `out[t, c] = act(sum_j weight[c, j] *
inp(p - K + 1 + j) + bias[c])` in float32, `act` SiLU (`x / (1 + exp(-x))`) or the
identity; rows `t >= n_tokens` of `out` become 0. The caller guarantees `R >= K - 1 +`
the most tokens a sequence writes in one step, so no input a token reads was overwritten
by a later token of the step.

Launch shape (both kernels): a block has `lanes` threads along the channels and `rows`
tokens side by side (`launch.calling.run_block(C)`), the tokens taken in a grid stride.
Index ranges: tokens, positions, rows and columns are int32; a ring's elements may pass
2**31, which Numba's 64-bit array indexing covers.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from ...device import SIMULATOR, cuda
from ..intrinsics import ptx
from ..launch.calling import MAX_BLOCKS, PER_CALL, Specialised, ceil_div, run_block
from ..masks import seq_and_position, storage_row

from numba import float32, int32  # noqa: E402  (after kvnumba.device chose the target)

ZERO = np.float32(0.0)
ONE = np.float32(1.0)


@cuda.jit(device=True)
def silu(x):
    """`x / (1 + exp(-x))` in float32 (the state layers' SiLU, shared by their kernels)."""
    return float32(x / float32(ONE + float32(math.exp(-x))))


@cuda.jit(device=True)
def tap(ring, col, q, c):
    """Input `q` of channel `c` of column `col` as float32: ring row `q % R`, or 0 for a
    position before the sequence's first (`q < 0`)."""
    if q < 0:
        return ZERO
    return ptx.to_f32(ring[col, storage_row(q, ring.shape[1]), c])


@cuda.jit
def _write_window(ring, x, tokens, width):
    """Token `blockIdx.x * blockDim.y + threadIdx.y` (and on, a grid stride): its lanes
    store channels `threadIdx.x`, `+ blockDim.x`, ... of `x[t]` into its ring row,
    converted to the ring's dtype."""
    n_channels = ring.shape[2]
    t = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
    while t < width:
        col, position = seq_and_position(tokens, width, t)
        row = storage_row(position, ring.shape[1])
        c = cuda.threadIdx.x
        while c < n_channels:
            ring[col, row, c] = ptx.from_f32(ptx.to_f32(x[t, c]), ring)
            c += cuda.blockDim.x
        t += cuda.gridDim.x * cuda.blockDim.y


@cuda.jit
def _apply(ring, weight, bias, out, tokens, width, n_tokens, act_silu):
    """As `_write_window`'s threads, each (token, channel) computes one output: the taps
    of positions `p - K + 1 .. p` (`tap`) times `weight[c]`, summed in order, plus
    `bias[c]` when `bias` has entries, through SiLU when `act_silu`; 0 for a padding
    token."""
    n_channels, taps = out.shape[1], weight.shape[1]
    has_bias = bias.shape[0] > 0
    t = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
    while t < width:
        if t < n_tokens:
            col, position = seq_and_position(tokens, width, t)
            first = int32(position - taps + 1)
            c = cuda.threadIdx.x
            while c < n_channels:
                acc = ZERO
                for j in range(taps):
                    acc = float32(acc + float32(ptx.to_f32(weight[c, j])
                                                * tap(ring, col, int32(first + j), c)))
                if has_bias:
                    acc = float32(acc + ptx.to_f32(bias[c]))
                if act_silu:
                    acc = silu(acc)
                out[t, c] = ptx.from_f32(acc, out)
                c += cuda.blockDim.x
        else:
            c = cuda.threadIdx.x
            while c < n_channels:
                out[t, c] = ptx.from_f32(ZERO, out)
                c += cuda.blockDim.x
        t += cuda.gridDim.x * cuda.blockDim.y


#: the lanes of the simulator's one block (`_shape`)
SIMULATED_LANES = 32

_write = Specialised(_write_window)
_conv = Specialised(_apply)


@lru_cache(maxsize=None)
def _no_bias():
    """A float32 device array of no entries, passed for `bias=None` (made once)."""
    return cuda.device_array(0, np.float32)


def _shape(width: int, channels: int):
    """`(grid, block)` of both kernels: `run_block(channels)`, tokens in a grid stride
    (on the simulator, whose threads are Python threads, one block of a warp's lanes at
    most, striding over every token)."""
    lanes, rows = run_block(channels)
    if SIMULATOR:
        return 1, (min(lanes, SIMULATED_LANES), 1)
    return min(MAX_BLOCKS, ceil_div(width, rows)), (lanes, rows)


class ConvStep:
    """The convolution launches of one step (`prepare`): its tokens table, width, real
    tokens and stream fixed, each launch bound once per channel count, so a layer's
    calls (`write(ring, x)`, then `apply(ring, weight, bias, out, silu)`) pass only
    their arrays."""

    def __init__(self, tokens, width: int, n_tokens: int, stream):
        self.tokens, self.width, self.n_tokens, self.stream = tokens, width, n_tokens, stream
        self._writes, self._applies = {}, {}

    def write(self, ring, x) -> None:
        """`write_window` of this step."""
        channels = ring.shape[2]
        if self.width == 0 or channels == 0:
            return
        launch = self._writes.get(channels)
        if launch is None:
            grid, block = _shape(self.width, channels)
            launch = self._writes[channels] = _write.bind(
                grid, block, self.stream, PER_CALL, PER_CALL, self.tokens, self.width)
        launch(ring, x)

    def apply(self, ring, weight, bias, out, silu: bool) -> None:
        """`apply` of this step."""
        channels = out.shape[1]
        if self.width == 0 or channels == 0:
            return
        launch = self._applies.get(channels)
        if launch is None:
            grid, block = _shape(self.width, channels)
            launch = self._applies[channels] = _conv.bind(
                grid, block, self.stream, PER_CALL, PER_CALL, PER_CALL, PER_CALL,
                self.tokens, self.width, self.n_tokens, PER_CALL)
        launch(ring, weight, _no_bias() if bias is None else bias, out, bool(silu))


def prepare(tokens, width: int, n_tokens: int, stream=0) -> ConvStep:
    """The launches of a step of `width` tokens (`n_tokens` real) with the int32 tokens
    table `tokens` (module doc), bound for its layers' calls (`ConvStep`)."""
    return ConvStep(tokens, int(width), int(n_tokens), stream)


def write_window(ring, x, tokens, width: int, stream=0) -> None:
    """`ring[tokens[t], tokens[width + t] % R, :] = x[t, :]` for every `t < width`, cast
    to the ring's dtype. `ring [cols, R, C]`, `x [width, C]` (float16, float32 or
    bfloat16 as uint16 bits), `tokens` an int32 device array `[2 * width]` (module doc).
    One launch, none for an empty step."""
    prepare(tokens, width, 0, stream).write(ring, x)


def apply(ring, weight, bias, out, tokens, width: int, n_tokens: int, silu: bool,
          stream=0) -> None:
    """The convolution of every real token (`t < n_tokens`) from the ring (module doc):
    `out[t, c] = act(bias[c] + sum_{j < K} weight[c, j] * inp(p - K + 1 + j))`, `out
    [width, C]` (float16, float32 or bfloat16 bits), rows `t >= n_tokens` zeroed.
    `weight [C, K]`, `bias [C]` or None (any of the storage dtypes); `tokens` as
    `write_window`'s, whose launch for this step must come first. One launch."""
    prepare(tokens, width, n_tokens, stream).apply(ring, weight, bias, out, silu)
