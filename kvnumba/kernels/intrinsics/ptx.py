"""Inline PTX for the fast kernels: 16-byte memory access, f16 / bf16 packing, a fast
exp2, one element to and from float32, warp shuffles, byte views and a wide multiply
(the tensor-core path's `mma`, `ldmatrix` and `cp.async` are in `tensorcore`).

Every public name is a device function for `@cuda.jit` kernels. On Numba's CUDA
simulator (`kvnumba.device.SIMULATOR`) the same names are bound to `ptxsim`'s
Python functions of identical semantics, so a kernel is written once for both.

Conventions (`tensorcore`'s too):

* A register holding two 16-bit values is a `uint32`; the value at the lower
  address (lower index) sits in the low 16 bits, as PTX packs `.f16x2`/`.bf16x2`.
* Memory functions take an array and a flat element index into it (the array
  C-contiguous, any rank and dtype). Nothing is bounds-checked. 16-byte accesses
  need a 16-byte aligned address, which the caller guarantees: a misaligned one
  faults on a GPU (the simulator raises).
* Warp-synchronous functions (`shfl_*`, `ldmatrix_*`, `mma_*`) use the full-warp
  mask 0xffffffff: every lane of the warp calls them together, converged, as
  with CUDA's `__shfl_sync(0xffffffff, ...)`.
* Needs sm_80 or newer (cp.async, ldmatrix, m16n8k16 mma, cvt.rn.{f16,bf16}x2.f32).
"""
from __future__ import annotations

from ...device import SIMULATOR
from ..launch.constants import FP8_FORMATS
from .ptxgen import (F32, GLOBAL, I32, U32X4, asm, cast, check_array, check_integers,
                     check_numbers, named, state_address, stored_value)

from llvmlite import ir  # noqa: E402  (after kvnumba.device chose the target)
from numba.cuda import cgutils, types  # noqa: E402
from numba.cuda.core.errors import TypingError  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

FULL_MASK = 0xFFFFFFFF


# --- 16-byte global memory access --------------------------------------------------------

def _load_v4(name, ptx, doc, constraints="=r,=r,=r,=r,l"):
    def load(typingctx, array, index):
        check_array(name, array, index)

        def codegen(context, builder, sig, args):
            address = state_address(context, builder, sig, args, GLOBAL)
            words = asm(builder, f"{ptx} {{$0, $1, $2, $3}}, [$4];", constraints,
                        [I32] * 4, [address])
            return context.make_tuple(builder, sig.return_type, words)

        return U32X4(array, index), codegen

    return named(name, doc, load)


ld_nc_v4 = _load_v4("ld_nc_v4", "ld.global.nc.v4.u32", """
    `ld_nc_v4(array, index) -> (u0, u1, u2, u3)` uint32: the 16 bytes at flat
    element `index` of a global array, through the read-only (non-coherent) data path:
    `ld.global.nc.v4.u32`. Only for data no thread writes while the kernel runs.
    `u0` holds the lowest 4 bytes (elements `index, index + 1` of a float16 array).
    """)

ld_v4 = _load_v4("ld_v4", "ld.global.v4.u32", """
    `ld_v4(array, index) -> (u0, u1, u2, u3)` uint32: as `ld_nc_v4`, through the
    coherent path (`ld.global.v4.u32`), for data the kernel also writes.
    """, constraints="=r,=r,=r,=r,l,~{memory}")  # reads memory: not merged or moved past stores


@intrinsic
def ld_nc_v2(typingctx, array, index):
    """`ld_nc_v2(array, index) -> (u0, u1)` uint32: the 8 bytes at flat element `index` of
    a global array (8-byte aligned), through the read-only data path
    (`ld.global.nc.v2.u32`): eight 8-bit values, `u0` the lower four."""
    check_array("ld_nc_v2", array, index)

    def codegen(context, builder, sig, args):
        address = state_address(context, builder, sig, args, GLOBAL)
        words = asm(builder, "ld.global.nc.v2.u32 {$0, $1}, [$2];", "=r,=r,l", [I32] * 2,
                    [address])
        return context.make_tuple(builder, sig.return_type, words)

    return types.UniTuple(types.uint32, 2)(array, index), codegen


@intrinsic
def st_v4(typingctx, array, index, u0, u1, u2, u3):
    """`st_v4(array, index, u0, u1, u2, u3)`: store 16 bytes (`u0` lowest) at flat element
    `index` of a global array: `st.global.v4.u32`."""
    check_array("st_v4", array, index)
    check_integers("st_v4", u0, u1, u2, u3)

    def codegen(context, builder, sig, args):
        address = state_address(context, builder, sig, args, GLOBAL)
        words = cast(context, builder, args[2:], sig.args[2:], types.uint32)
        asm(builder, "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", [],
            [address, *words], side_effect=True)

    return types.void(array, index, u0, u1, u2, u3), codegen


def _store_f32s(name, n):
    """`name(array, index, x0 .. x{n-1})`: see the docs below."""
    def check(array, index, values):
        check_array(name, array, index)
        check_numbers(name, *values)
        kind = ELEMENTS.get(array.dtype)
        if kind not in ("float32", "float16", "bfloat16"):
            raise TypingError(f"{name}: expected a float32, float16 or uint16 (bfloat16) "
                              f"array, got {array}")

        def codegen(context, builder, sig, args):
            address = state_address(context, builder, sig, args, GLOBAL)
            floats = cast(context, builder, args[2:], sig.args[2:], types.float32)
            if kind == "float32":
                words = [builder.bitcast(f, I32) for f in floats]
            else:
                ptx_type = "f16x2" if kind == "float16" else "bf16x2"
                # `cvt.rn.<type>x2.f32 d, a, b` puts `a` in the UPPER half of d
                words = [asm(builder, f"cvt.rn.{ptx_type}.f32 $0, $2, $1;", "=r,f,f", [I32],
                             floats[i:i + 2])[0] for i in range(0, n, 2)]
            vector = {1: "", 2: ".v2", 4: ".v4"}[len(words)]
            operands = ", ".join(f"${i + 1}" for i in range(len(words)))
            operands = f"{{{operands}}}" if len(words) > 1 else operands
            asm(builder, f"st.global{vector}.b32 [$0], {operands};",
                "l" + ",r" * len(words) + ",~{memory}", [], [address, *words],
                side_effect=True)

        return types.void(array, index, *values), codegen

    if n == 2:
        def store(typingctx, array, index, x0, x1):
            return check(array, index, (x0, x1))
    else:
        def store(typingctx, array, index, x0, x1, x2, x3):
            return check(array, index, (x0, x1, x2, x3))

    return named(name, f"""
        `{name}(array, index, {', '.join(f'x{i}' for i in range(n))})`: {n} values (taken
        as float32) as elements `index .. index + {n - 1}` of a float32, float16 or bfloat16
        (uint16 bits) global array, rounded to nearest even as `from_f32` rounds, in one
        store aligned to their bytes (`st.global`, 16-bit types packed in pairs by
        `cvt.rn.f16x2.f32` / `cvt.rn.bf16x2.f32`).
        """, store)


st_f32x2 = _store_f32s("st_f32x2", 2)
st_f32x4 = _store_f32s("st_f32x4", 4)


@intrinsic
def prmt(typingctx, a, b, selector):
    """`prmt(a, b, selector) -> uint32`: byte permute (`prmt.b32`): byte i of the result
    is byte `(selector >> 4 i) & 7` of the eight bytes of `b:a` (`a`'s lowest first).
    `selector` is a compile-time integer (its sign-replicating mode, bit 3 of a nibble,
    is not used: those bits must be clear)."""
    check_integers("prmt", a, b)
    if not isinstance(selector, types.IntegerLiteral):
        raise TypingError(f"prmt: selector must be a compile-time integer, got {selector}")
    code = selector.literal_value
    if not 0 <= code <= 0xFFFF or code & 0x8888:
        raise TypingError(f"prmt: selector {code:#x} must be four nibbles of 0..7")

    def codegen(context, builder, sig, args):
        words = cast(context, builder, args[:2], sig.args[:2], types.uint32)
        (word,) = asm(builder, f"prmt.b32 $0, $1, $2, {code:#x};", "=r,r,r", [I32], words)
        return word

    return types.uint32(a, b, selector), codegen


# --- 16-bit float pairs and bit casts ----------------------------------------------------

@intrinsic
def f16x2_to_f32(typingctx, u):
    """`f16x2_to_f32(u) -> (lo, hi)` float32, exact: the low and high float16 halves of `u`.

    PTX: `mov.b32 {lo, hi}, u; cvt.f32.f16 ...` (no rounding: every f16 is an f32)."""
    check_integers("f16x2_to_f32", u)

    def codegen(context, builder, sig, args):
        (word,) = cast(context, builder, args, sig.args, types.uint32)
        halves = asm(builder, "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                               "cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
                      "=f,=f,r", [F32, F32], [word])
        return context.make_tuple(builder, sig.return_type, halves)

    return types.UniTuple(types.float32, 2)(u), codegen


@intrinsic
def bf16x2_to_f32(typingctx, u):
    """`bf16x2_to_f32(u) -> (lo, hi)` float32, exact: a bfloat16 is the top half of a
    float32, so `lo = bits(u << 16)`, `hi = bits(u & 0xffff0000)` (no PTX needed)."""
    check_integers("bf16x2_to_f32", u)

    def codegen(context, builder, sig, args):
        (word,) = cast(context, builder, args, sig.args, types.uint32)
        lo = builder.shl(word, ir.Constant(I32, 16))
        hi = builder.and_(word, ir.Constant(I32, 0xFFFF0000))
        halves = [builder.bitcast(v, F32) for v in (lo, hi)]
        return context.make_tuple(builder, sig.return_type, halves)

    return types.UniTuple(types.float32, 2)(u), codegen


def _pack_f32x2(name, ptx_type, doc):
    def pack(typingctx, lo, hi):
        check_numbers(name, lo, hi)

        def codegen(context, builder, sig, args):
            lo32, hi32 = cast(context, builder, args, sig.args, types.float32)
            # `cvt.rn.<type>x2.f32 d, a, b` puts `a` in the UPPER half of d
            (word,) = asm(builder, f"cvt.rn.{ptx_type}.f32 $0, $2, $1;", "=r,f,f", [I32],
                          [lo32, hi32])
            return word

        return types.uint32(lo, hi), codegen

    return named(name, doc, pack)


f32x2_to_f16x2 = _pack_f32x2("f32x2_to_f16x2", "f16x2", """
    `f32x2_to_f16x2(lo, hi) -> u` uint32: two float16, `lo` in the low half,
    each rounded to nearest even (`cvt.rn.f16x2.f32 u, hi, lo`): overflow gives +-inf,
    small values f16 subnormals, +-0 keeps its sign, NaN gives a NaN (payload
    unspecified). Arguments are taken as float32 first.
    """)

f32x2_to_bf16x2 = _pack_f32x2("f32x2_to_bf16x2", "bf16x2", """
    `f32x2_to_bf16x2(lo, hi) -> u` uint32: two bfloat16, `lo` in the low half,
    each rounded to nearest even (`cvt.rn.bf16x2.f32 u, hi, lo`); overflow, zeros,
    subnormals and NaN as for `f32x2_to_f16x2`.
    """)


def _bitcast(name, from_type, to_type, doc):
    llvm_type = I32 if to_type == types.uint32 else F32

    def bitcast(typingctx, value):
        check_numbers(name, value)

        def codegen(context, builder, sig, args):
            (same_width,) = cast(context, builder, args, sig.args, from_type)
            return builder.bitcast(same_width, llvm_type)

        return to_type(value), codegen

    return named(name, doc, bitcast)


u32_as_f32 = _bitcast("u32_as_f32", types.uint32, types.float32,
                      "`u32_as_f32(u) -> f` float32 with the bits of `u` (taken as uint32).")
f32_as_u32 = _bitcast("f32_as_u32", types.float32, types.uint32,
                      "`f32_as_u32(f) -> u` uint32: the bits of `f` (taken as float32).")


@intrinsic
def exp2_approx(typingctx, x):
    """`exp2_approx(x) -> float32`: 2**x in one special-function-unit instruction,
    `ex2.approx.ftz.f32` (`math.exp2` adds range handling around it). Relative error
    about 2**-22; subnormal arguments and results are flushed to zero, so
    `exp2_approx(-inf) == 0` and `exp2_approx(x) == 0` for `x < -126`. `x` is taken
    as float32."""
    check_numbers("exp2_approx", x)

    def codegen(context, builder, sig, args):
        (value,) = cast(context, builder, args, sig.args, types.float32)
        (result,) = asm(builder, "ex2.approx.ftz.f32 $0, $1;", "=f,f", [F32], [value])
        return result

    return types.float32(x), codegen


# --- one element of a K/V/q/out array <-> float32 -----------------------------------------
# Arrays of bfloat16 hold its bit patterns as uint16 and 8-bit floats theirs as uint8
# (e4m3) or int8 (e5m2): Numba has none of these types, so the element type says how to
# read and write a value: float16 / float32 numerically, the integer types as bits.

#: element type -> what it holds
FP8_ELEMENTS = tuple(getattr(types, name) for name in FP8_FORMATS)
ELEMENTS = {types.float16: "float16", types.float32: "float32", types.uint16: "bfloat16",
            **dict(zip(FP8_ELEMENTS, FP8_FORMATS.values()))}


def _element_type(name, dtype, what):
    if dtype not in ELEMENTS:
        raise TypingError(f"{name}: expected {what} of float16, float32, uint16 (bfloat16), "
                          f"uint8 (e4m3) or int8 (e5m2), got {dtype}")
    return ELEMENTS[dtype]


def _fp8_to_f32(builder, byte, fmt):
    halves = asm(builder, "{ .reg .b32 w; .reg .b16 lo, hi; "
                          f"cvt.rn.f16x2.{fmt}x2 w, $1; mov.b32 {{lo, hi}}, w; "
                          "cvt.f32.f16 $0, lo; }", "=f,h", [F32],
                 [builder.zext(byte, ir.IntType(16))])
    return halves[0]


def _f32_to_fp8(builder, f32, fmt):
    (pair,) = asm(builder, f"cvt.rn.satfinite.{fmt}x2.f32 $0, $1, $1;", "=h,f",
                  [ir.IntType(16)], [f32])
    return builder.trunc(pair, ir.IntType(8))


def _from_f32(context, builder, f32, dtype):
    kind = ELEMENTS[dtype]
    if kind == "bfloat16":
        (bits,) = asm(builder, "cvt.rn.bf16.f32 $0, $1;", "=h,f", [ir.IntType(16)], [f32])
        return bits
    if dtype in FP8_ELEMENTS:
        return _f32_to_fp8(builder, f32, kind)
    return context.cast(builder, f32, types.float32, dtype)


@intrinsic
def to_f32(typingctx, x):
    """`to_f32(x) -> float32`, exact: a float16 or float32 element, a uint16 element read
    as bfloat16 bits (the top half of a float32), a uint8 / int8 one as e4m3 / e5m2 bits
    (`cvt.rn.f16x2.<fmt>x2`: every 8-bit float is a float16)."""
    kind = _element_type("to_f32", x, "an element")

    def codegen(context, builder, sig, args):
        (value,) = args
        if kind == "bfloat16":
            word = builder.shl(builder.zext(value, I32), ir.Constant(I32, 16))
            return builder.bitcast(word, F32)
        if sig.args[0] in FP8_ELEMENTS:
            return _fp8_to_f32(builder, value, kind)
        return context.cast(builder, value, sig.args[0], types.float32)

    return types.float32(x), codegen


@intrinsic
def from_f32(typingctx, value, array):
    """`from_f32(value, array)`: `value` (taken as float32) as an element of `array`, rounded
    to nearest even: float16, float32, bfloat16 bits for a uint16 array
    (`cvt.rn.bf16.f32`), or 8-bit float bits for a uint8 (e4m3) / int8 (e5m2) array,
    saturated (`cvt.rn.satfinite`: past the largest finite, infinity included, gives it;
    NaN gives NaN)."""
    check_numbers("from_f32", value)
    dtype = getattr(array, "dtype", None)
    _element_type("from_f32", dtype, "an array")

    def codegen(context, builder, sig, args):
        (f32,) = cast(context, builder, args[:1], sig.args[:1], types.float32)
        return _from_f32(context, builder, f32, dtype)

    return dtype(value, array), codegen


@intrinsic
def to_storage(typingctx, value, inv_scale, array):
    """`to_storage(value, inv_scale, array)`: `value` as K/V storage of `array` holds it.
    8-bit floats (uint8 / int8 arrays): `value * 0 + value` (NaN for +-inf and NaN,
    `value` itself otherwise, -0 included) times `inv_scale`, then `from_f32`: a
    non-finite input stays non-finite (NaN: e4m3 has no infinity, and a saturating
    conversion would make e5m2's finite), a finite one never becomes NaN (past the
    largest finite after scaling, it saturates). Other arrays: `from_f32(value, array)`
    (`inv_scale`, 1.0 for them, is not read). Arguments taken as float32."""
    check_numbers("to_storage", value, inv_scale)
    dtype = getattr(array, "dtype", None)
    _element_type("to_storage", dtype, "an array")

    def codegen(context, builder, sig, args):
        f32, inv = cast(context, builder, args[:2], sig.args[:2], types.float32)
        if dtype in FP8_ELEMENTS:
            f32 = stored_value(builder, f32, inv)
        return _from_f32(context, builder, f32, dtype)

    return dtype(value, inv_scale, array), codegen


# --- warp shuffles -----------------------------------------------------------------------
# Numba's own `cuda.shfl_*_sync` refuse uint32; these take any 32-bit integer or float32
# value, shuffle its bits with `shfl.sync.<mode>.b32` and return the same type.

_SHUFFLE_TYPES = (types.int32, types.uint32, types.float32)


def _shuffle(name, mode, doc):
    def shuffle(typingctx, value, lane):
        if value not in _SHUFFLE_TYPES:
            raise TypingError(f"{name}: value must be one of {_SHUFFLE_TYPES}, got {value}")
        check_integers(name, lane)

        def codegen(context, builder, sig, args):
            value_type = context.get_value_type(sig.args[0])
            (b,) = cast(context, builder, args[1:], sig.args[1:], types.uint32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.LiteralStructType([I32, ir.IntType(1)]),
                                                [I32] * 5),
                "llvm.nvvm.shfl.sync.i32")
            # c = 0x1f: the whole warp is one segment, lanes 0..31
            got = builder.call(fn, [ir.Constant(I32, FULL_MASK), ir.Constant(I32, mode),
                                    builder.bitcast(args[0], I32), b, ir.Constant(I32, 0x1F)])
            return builder.bitcast(builder.extract_value(got, 0), value_type)

        return value(value, lane), codegen

    return named(name, doc, shuffle)


shfl_xor = _shuffle("shfl_xor", 3, """
    `shfl_xor(value, lane_mask)`: `value` of lane `cuda.laneid ^ lane_mask`
    (`shfl.sync.bfly.b32`, full warp); int32, uint32 or float32.
    """)
shfl_idx = _shuffle("shfl_idx", 0, """
    `shfl_idx(value, src_lane)`: `value` of lane `src_lane % 32`
    (`shfl.sync.idx.b32`, full warp); int32, uint32 or float32.
    """)


# --- byte views ------------------------------------------------------------------------------

BYTES = types.Array(types.uint8, 1, "C")


@intrinsic
def bytes_from(typingctx, array, index):
    """`bytes_from(array, index) -> uint8[::1]`: the bytes of a C-contiguous array from
    flat element `index` to its end, as a one-dimensional view (no copy). A kernel that
    walks rows of a large array from one place keeps this view's base address and adds
    byte offsets: `cp_async_16(tile, i, bytes_from(store, start), row * row_bytes)` costs
    one 32 x 32 -> 64-bit multiply-add per address. The view's base is one opaque 64-bit
    value (a `mov.b64`), so LLVM cannot split it back into the array's base plus `index`
    and re-add the two in every address computed from it."""
    check_array("bytes_from", array, index)

    def codegen(context, builder, sig, args):
        source = context.make_array(sig.args[0])(context, builder, value=args[0])
        first = context.cast(builder, args[1], sig.args[1], types.intp)
        itemsize = ir.Constant(first.type, context.get_abi_sizeof(
            context.get_data_type(sig.args[0].dtype)))
        start = builder.gep(source.data, [first])
        (whole,) = asm(builder, "mov.b64 $0, $1;", "=l,l", [ir.IntType(64)],
                       [builder.ptrtoint(start, ir.IntType(64))])
        start = builder.inttoptr(whole, start.type)
        view = context.make_array(BYTES)(context, builder)
        context.populate_array(view, data=builder.bitcast(start, view.data.type),
                               shape=[builder.mul(builder.sub(source.nitems, first), itemsize)],
                               strides=[ir.Constant(first.type, 1)], itemsize=1, meminfo=None)
        return view._getvalue()

    return BYTES(array, index), codegen


@intrinsic
def elements_from(typingctx, array, index):
    """`elements_from(array, index) -> dtype[::1]`: the elements of a C-contiguous array
    from flat element `index` to its end, as a one-dimensional view (no copy), its base
    opaque as `bytes_from`'s: a kernel reading many elements at offsets from one place
    (`view[c]`, `c` a compile-time offset) keeps one 64-bit base and folds each offset
    into its load or store."""
    check_array("elements_from", array, index)
    flat = types.Array(array.dtype, 1, "C")

    def codegen(context, builder, sig, args):
        source = context.make_array(sig.args[0])(context, builder, value=args[0])
        first = context.cast(builder, args[1], sig.args[1], types.intp)
        itemsize = context.get_abi_sizeof(context.get_data_type(sig.args[0].dtype))
        start = builder.gep(source.data, [first])
        (whole,) = asm(builder, "mov.b64 $0, $1;", "=l,l", [ir.IntType(64)],
                       [builder.ptrtoint(start, ir.IntType(64))])
        view = context.make_array(flat)(context, builder)
        context.populate_array(view, data=builder.inttoptr(whole, start.type),
                               shape=[builder.sub(source.nitems, first)],
                               strides=[ir.Constant(first.type, itemsize)],
                               itemsize=itemsize, meminfo=None)
        return view._getvalue()

    return flat(array, index), codegen


@intrinsic
def mul_wide_u32(typingctx, a, b):
    """`mul_wide_u32(a, b) -> uint64`: the full product of `a` and `b` taken as unsigned
    32-bit integers (`mul.wide.u32`). Added to a 64-bit address it becomes one
    multiply-add (`IMAD.WIDE.U32`): LLVM, given the same product of two 32-bit values
    computed from 64-bit ones, may keep a full 64-bit multiply."""
    check_integers("mul_wide_u32", a, b)

    def codegen(context, builder, sig, args):
        words = cast(context, builder, args, sig.args, types.uint32)
        (product,) = asm(builder, "mul.wide.u32 $0, $1, $2;", "=l,r,r", [ir.IntType(64)],
                         words)
        return product

    return types.uint64(a, b), codegen


if SIMULATOR:
    from .ptxsim import (bf16x2_to_f32, bytes_from, elements_from, exp2_approx,  # noqa: E402,F401,F811  (same names, simulated)
                         f16x2_to_f32, f32_as_u32, f32x2_to_bf16x2, f32x2_to_f16x2, from_f32, ld_nc_v2, ld_nc_v4, ld_v4,
                         mul_wide_u32, prmt, shfl_idx, shfl_xor, st_f32x2, st_f32x4, st_v4,
                         to_f32, to_storage, u32_as_f32)
