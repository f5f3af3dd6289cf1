"""`fp8`'s conversions for Numba's CUDA simulator: the same names and semantics, in
NumPy, without ml_dtypes.

The two formats (OCP 8-bit floats, as PTX's `.e4m3` / `.e5m2`): a sign bit, then
`e4m3` 4 exponent bits (bias 7) and 3 mantissa bits, largest finite 448, no
infinity, NaN `0x7F` / `0xFF`; `e5m2` 5 exponent bits (bias 15) and 2 mantissa bits,
largest finite 57344, infinities `0x7C` / `0xFC`, NaN past them. Both have
subnormals. Every value of either is exact in float16 (and float32).

Narrowing (`cvt.rn.satfinite.<fmt>x2.f32`) rounds to nearest even and saturates: a
magnitude past the largest finite (infinity included) becomes it, NaN becomes the
canonical NaN `0x7F`.
"""
from __future__ import annotations

import numpy as np

#: format -> (exponent bits, mantissa bits, bias)
LAYOUT = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}
NAN_BITS = 0x7F


def _decode_table(fmt: str) -> np.ndarray:
    """float32 `[256]`: the value of every bit pattern of `fmt`."""
    exp_bits, man_bits, bias = LAYOUT[fmt]
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> man_bits) & ((1 << exp_bits) - 1)
    mantissa = codes & ((1 << man_bits) - 1)
    normal = (1 + mantissa / (1 << man_bits)) * np.exp2(exponent.astype(float) - bias)
    subnormal = mantissa / (1 << man_bits) * 2.0 ** (1 - bias)
    values = sign * np.where(exponent == 0, subnormal, normal)
    top = exponent == (1 << exp_bits) - 1
    if fmt == "e4m3":            # only mantissa 111 at the top exponent is special: NaN
        values[top & (mantissa == 7)] = np.nan
    else:                        # IEEE-like: infinities, then NaNs
        values[top & (mantissa == 0)] = sign[top & (mantissa == 0)] * np.inf
        values[top & (mantissa != 0)] = np.nan
    return values.astype(np.float32)


DECODE = {fmt: _decode_table(fmt) for fmt in LAYOUT}
#: the non-negative finite values of each format in code order (codes 0 .. largest)
_FINITE = {fmt: table[:int(np.nanargmax(np.where(np.isfinite(table[:128]), table[:128],
                                                    -1))) + 1].astype(np.float64)
           for fmt, table in DECODE.items()}
#: the largest finite value of each format
LARGEST = {fmt: float(values[-1]) for fmt, values in _FINITE.items()}


def narrow(value, fmt: str) -> int:
    """The `fmt` bit pattern of float32 `value`: round to nearest even, saturate to the
    largest finite, NaN -> `NAN_BITS`."""
    x = float(np.float32(value))
    if x != x:
        return NAN_BITS
    sign = 0x80 if np.signbit(x) else 0
    finite = _FINITE[fmt]
    a = min(abs(x), finite[-1])
    above = int(np.searchsorted(finite, a))           # the first code >= a
    if finite[above] != a:
        below = above - 1
        lo, hi = a - finite[below], finite[above] - a
        above = below if lo < hi or (lo == hi and below % 2 == 0) else above
    return sign | above


def widen(code, fmt: str) -> np.float32:
    """float32 of one `fmt` bit pattern (the low 8 bits of `code`)."""
    return DECODE[fmt][int(code) & 0xFF]


def _widen_word(u, fmt):
    u = int(u)
    table = DECODE[fmt]
    return tuple(table[(u >> shift) & 0xFF] for shift in (0, 8, 16, 24))


def e4m3x4_to_f32(u):
    """The four e4m3 bytes of uint32 `u` (lowest byte first) as float32, exactly."""
    return _widen_word(u, "e4m3")


def e5m2x4_to_f32(u):
    """The four e5m2 bytes of uint32 `u` (lowest byte first) as float32, exactly."""
    return _widen_word(u, "e5m2")


def _f16x4(u, fmt):
    halves = np.array(_widen_word(u, fmt), np.float16).view(np.uint32)
    return np.uint32(halves[0]), np.uint32(halves[1])


def e4m3x4_to_f16x4(u):
    """Two uint32 of float16 pairs: the four e4m3 bytes of `u`, lowest first, exactly."""
    return _f16x4(u, "e4m3")


def e5m2x4_to_f16x4(u):
    """Two uint32 of float16 pairs: the four e5m2 bytes of `u`, lowest first, exactly."""
    return _f16x4(u, "e5m2")


def stored(value, inv_scale, fmt: str) -> int:
    """The `fmt` bits K/V storage holds for `value`: `value * 0 + value` (NaN when not
    finite, the value otherwise, -0 too) times `inv_scale`, in float32, then `narrow`."""
    x = np.float32(value)
    with np.errstate(invalid="ignore", over="ignore"):
        x = (x * np.float32(0) + x) * np.float32(inv_scale)
    return narrow(x, fmt)


def _narrow_word(values, inv_scale, fmt):
    word = 0
    for i, value in enumerate(values):
        word |= stored(value, inv_scale, fmt) << (8 * i)
    return np.uint32(word)


def f32x4_to_e4m3x4(a, b, c, d, inv_scale):
    """uint32 of four e4m3 bytes, `a` lowest, as storage holds them (`stored`)."""
    return _narrow_word((a, b, c, d), inv_scale, "e4m3")


def f32x4_to_e5m2x4(a, b, c, d, inv_scale):
    """uint32 of four e5m2 bytes, `a` lowest, as storage holds them (`stored`)."""
    return _narrow_word((a, b, c, d), inv_scale, "e5m2")


def _f16_word(lo, hi, fmt):
    halves = np.array([int(lo) & 0xFFFFFFFF, int(hi) & 0xFFFFFFFF], np.uint32).view(np.float16)
    return _narrow_word(halves.astype(np.float32), 1.0, fmt)


def f16x4_to_e4m3x4(lo, hi):
    """uint32 of four e4m3 bytes from two float16 pairs (`lo`'s low half lowest), scale 1."""
    return _f16_word(lo, hi, "e4m3")


def f16x4_to_e5m2x4(lo, hi):
    """uint32 of four e5m2 bytes from two float16 pairs (`lo`'s low half lowest), scale 1."""
    return _f16_word(lo, hi, "e5m2")
