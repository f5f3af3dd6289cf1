"""Inline PTX for 8-bit float K/V storage (`float8_e4m3` held as uint8 bits,
`float8_e5m2` as int8 bits): four stored values of a 32-bit word to float32 or to two
float16 pairs, and four float32 (scaled) or float16 values to a word, rounded to
nearest even with saturation.

Widening goes through float16 (`cvt.rn.f16x2.e4m3x2` / `.e5m2x2`, then `cvt.f32.f16`):
every e4m3 and e5m2 value is exact in float16, so the result is exact. Narrowing is
`cvt.rn.satfinite.e4m3x2.f32` / `.e5m2x2.f32`: a magnitude past the format's largest
finite (448 / 57344), infinity included, becomes it; NaN stays NaN. Both need sm_89 or
newer (PTX 7.8). Narrowing here is what K/V storage holds (`ptx.to_storage`, one value
at a time): a non-finite input is made NaN before the conversion, so a finite input
never becomes NaN and a non-finite one stays non-finite.

Byte order follows `ptx`'s conventions: the value at the lowest address is the lowest
byte of a word. On Numba's CUDA simulator the same names are bound to `fp8sim`'s.
"""
from __future__ import annotations

from ...device import SIMULATOR
from .ptxgen import F32, I32, asm, cast, check_integers, check_numbers, named, stored_value

from numba.cuda import types  # noqa: E402  (after kvnumba.device chose the target)

def _from_word(name: str, doc: str, code: str, constraints: str, register, element, n: int):
    """The intrinsic `name(u) -> n values` of type `element` (PTX registers `register`)
    from uint32 word `u`, computed by PTX `code` (its outputs `$0 .. $n-1`, the word
    `$n`), documented by `doc`."""
    def unpack(typingctx, u):
        check_integers(name, u)

        def codegen(context, builder, sig, args):
            (word,) = cast(context, builder, args, sig.args, types.uint32)
            values = asm(builder, code, constraints, [register] * n, [word])
            return context.make_tuple(builder, sig.return_type, values)

        return types.UniTuple(element, n)(u), codegen

    return named(name, doc, unpack)


def _widen4(name, fmt):
    return _from_word(name, f"""
        `{name}(u) -> (a, b, c, d)` float32, exact: the four {fmt} bytes of uint32 `u`,
        lowest byte first (`cvt.rn.f16x2.{fmt}x2` twice, then `cvt.f32.f16`).
        """, "{ .reg .b16 lo, hi, h0, h1, h2, h3; .reg .b32 w0, w1; "
             "mov.b32 {lo, hi}, $4; "
             f"cvt.rn.f16x2.{fmt}x2 w0, lo; cvt.rn.f16x2.{fmt}x2 w1, hi; "
             "mov.b32 {h0, h1}, w0; mov.b32 {h2, h3}, w1; "
             "cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1; "
             "cvt.f32.f16 $2, h2; cvt.f32.f16 $3, h3; }",
        "=f,=f,=f,=f,r", F32, types.float32, 4)


def _narrow4(name, fmt):
    def narrow(typingctx, a, b, c, d, inv_scale):
        check_numbers(name, a, b, c, d, inv_scale)

        def codegen(context, builder, sig, args):
            values = cast(context, builder, args, sig.args, types.float32)
            inv = values.pop()
            scaled = [stored_value(builder, x, inv) for x in values]
            # `cvt.rn.satfinite.<fmt>x2.f32 d, x, y` puts x in the UPPER byte of d
            (word,) = asm(builder, "{ .reg .b16 lo, hi; "
                                   f"cvt.rn.satfinite.{fmt}x2.f32 lo, $2, $1; "
                                   f"cvt.rn.satfinite.{fmt}x2.f32 hi, $4, $3; "
                                   "mov.b32 $0, {lo, hi}; }",
                          "=r,f,f,f,f", [I32], scaled)
            return word

        return types.uint32(a, b, c, d, inv_scale), codegen

    return named(name, f"""
        `{name}(a, b, c, d, inv_scale) -> u` uint32: four {fmt} bytes, `a` lowest, as K/V
        storage holds them (`ptx.to_storage`): each value `x * 0 + x` (NaN when not
        finite, `x` otherwise) times `inv_scale`, rounded to nearest even with saturation
        (`cvt.rn.satfinite.{fmt}x2.f32`). Arguments taken as float32.
        """, narrow)


def _f16_narrow4(name, fmt):
    def narrow(typingctx, lo, hi):
        check_integers(name, lo, hi)

        def codegen(context, builder, sig, args):
            words = cast(context, builder, args, sig.args, types.uint32)
            # `x * 0 + x` in one fma.f16x2 a pair: NaN for a non-finite x, x otherwise
            (word,) = asm(builder, "{ .reg .b32 z, y0, y1; .reg .b16 b0, b1; mov.b32 z, 0; "
                                   "fma.rn.f16x2 y0, $1, z, $1; fma.rn.f16x2 y1, $2, z, $2; "
                                   f"cvt.rn.satfinite.{fmt}x2.f16x2 b0, y0; "
                                   f"cvt.rn.satfinite.{fmt}x2.f16x2 b1, y1; "
                                   "mov.b32 $0, {b0, b1}; }",
                          "=r,r,r", [I32], words)
            return word

        return types.uint32(lo, hi), codegen

    return named(name, f"""
        `{name}(lo, hi) -> u` uint32: the four float16 of two pairs (`lo`'s low half
        lowest) as {fmt} bytes with a scale of 1, as `f32x4_to_{fmt}x4` would store them:
        `x * 0 + x` in float16 pairs (NaN when not finite), then
        `cvt.rn.satfinite.{fmt}x2.f16x2` (every float16 is a float32: the same rounding).
        """, narrow)


def _to_f16x4(name, fmt):
    return _from_word(name, f"""
        `{name}(u) -> (lo, hi)` uint32: the four {fmt} bytes of uint32 `u` as two float16
        pairs, exactly (`lo` holds bytes 0 and 1, byte 0 in its low half).
        """, "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
             f"cvt.rn.f16x2.{fmt}x2 $0, lo; cvt.rn.f16x2.{fmt}x2 $1, hi; }}",
        "=r,=r,r", I32, types.uint32, 2)


f16x4_to_e4m3x4 = _f16_narrow4("f16x4_to_e4m3x4", "e4m3")
f16x4_to_e5m2x4 = _f16_narrow4("f16x4_to_e5m2x4", "e5m2")
e4m3x4_to_f16x4 = _to_f16x4("e4m3x4_to_f16x4", "e4m3")
e5m2x4_to_f16x4 = _to_f16x4("e5m2x4_to_f16x4", "e5m2")
e4m3x4_to_f32 = _widen4("e4m3x4_to_f32", "e4m3")
e5m2x4_to_f32 = _widen4("e5m2x4_to_f32", "e5m2")
f32x4_to_e4m3x4 = _narrow4("f32x4_to_e4m3x4", "e4m3")
f32x4_to_e5m2x4 = _narrow4("f32x4_to_e5m2x4", "e5m2")


if SIMULATOR:
    from .fp8sim import (e4m3x4_to_f16x4, e4m3x4_to_f32, e5m2x4_to_f16x4, e5m2x4_to_f32,  # noqa: E402,F401,F811  (same names, simulated)
                         f16x4_to_e4m3x4, f16x4_to_e5m2x4, f32x4_to_e4m3x4, f32x4_to_e5m2x4)
