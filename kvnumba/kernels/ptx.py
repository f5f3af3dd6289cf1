"""Inline PTX for the fast attention kernels: 16-byte memory access, f16 / bf16
packing, a fast exp2, warp shuffles, tensor-core `mma`, `ldmatrix` and `cp.async`.

Every public name is a device function for `@cuda.jit` kernels. On Numba's CUDA
simulator (`kvnumba.device.SIMULATOR`) the same names are bound to `ptxsim`'s
Python functions of identical semantics, so a kernel is written once for both.

Conventions:

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

import inspect

from ..device import SIMULATOR

from llvmlite import ir  # noqa: E402  (after kvnumba.device chose the target)
from numba.cuda import cgutils, types  # noqa: E402
from numba.cuda.core.errors import TypingError  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

I32 = ir.IntType(32)
F32 = ir.FloatType()
FULL_MASK = 0xFFFFFFFF
U32X4 = types.UniTuple(types.uint32, 4)
F32X4 = types.UniTuple(types.float32, 4)


# --- code generation helpers -------------------------------------------------------------

def _asm(builder, text, constraints, outputs, args, side_effect=False, convergent=False):
    """Emit inline PTX `text`; returns its results, one llvmlite value per type in `outputs`.

    `convergent` keeps LLVM from moving a warp-synchronous instruction into divergent code.
    """
    if not outputs:
        ret = ir.VoidType()
    elif len(outputs) == 1:
        ret = outputs[0]
    else:
        ret = ir.LiteralStructType(outputs)
    asm = ir.InlineAsm(ir.FunctionType(ret, [a.type for a in args]), text, constraints,
                       side_effect=side_effect)
    call = builder.call(asm, args, attrs=("convergent",) if convergent else ())
    if len(outputs) == 1:
        return [call]
    return [builder.extract_value(call, i) for i in range(len(outputs))]


def _cast(context, builder, values, from_types, to_type):
    return [context.cast(builder, v, t, to_type) for v, t in zip(values, from_types)]


def _element_pointer(context, builder, array_type, array, index_type, index):
    """Generic pointer to flat element `index` of a C-contiguous array (no bounds check)."""
    data = context.make_array(array_type)(context, builder, value=array).data
    return builder.gep(data, [context.cast(builder, index, index_type, types.intp)])


GLOBAL, SHARED = 1, 3           # LLVM NVPTX address spaces
_ADDRESS_BITS = {GLOBAL: 64, SHARED: 32}


def _address(context, builder, sig, args, space, at=0):
    """Address of flat element `args[at + 1]` of array `args[at]` in a PTX state space:
    64-bit global, or 32-bit shared window (what `ldmatrix` / `cp.async` take).

    LLVM turns the cast into `cvta.to.global` / `cvta.to.shared`, or drops it where it
    can see where the pointer came from (a shared array).
    """
    pointer = _element_pointer(context, builder, sig.args[at], args[at], sig.args[at + 1],
                               args[at + 1])
    in_space = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, space))
    return builder.ptrtoint(in_space, ir.IntType(_ADDRESS_BITS[space]))


def _named(name, doc, defn):
    """`defn` as an intrinsic called `name` (error messages name it) documented by `doc`."""
    defn.__name__ = defn.__qualname__ = name
    defn.__doc__ = inspect.cleandoc(doc)
    return intrinsic(defn)


# --- typing checks ---------------------------------------------------------------------------

def _check_array(name, array, index, bits=None):
    if not (isinstance(array, types.Array) and array.layout == "C"):
        raise TypingError(f"{name}: expected a C-contiguous array, got {array}")
    if bits is not None and getattr(array.dtype, "bitwidth", None) != bits:
        raise TypingError(f"{name}: expected an array of {bits}-bit elements, got {array}")
    _check_integers(name, index)


def _check_integers(name, *values):
    for value in values:
        if not isinstance(value, types.Integer):
            raise TypingError(f"{name}: expected an integer, got {value}")


def _check_numbers(name, *values):
    for value in values:
        if not isinstance(value, (types.Integer, types.Float)):
            raise TypingError(f"{name}: expected a number, got {value}")


# --- 16-byte global memory access --------------------------------------------------------

def _load_v4(name, ptx, doc, constraints="=r,=r,=r,=r,l"):
    def load(typingctx, array, index):
        _check_array(name, array, index)

        def codegen(context, builder, sig, args):
            address = _address(context, builder, sig, args, GLOBAL)
            words = _asm(builder, f"{ptx} {{$0, $1, $2, $3}}, [$4];", constraints,
                         [I32] * 4, [address])
            return context.make_tuple(builder, sig.return_type, words)

        return U32X4(array, index), codegen

    return _named(name, doc, load)


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
def st_v4(typingctx, array, index, u0, u1, u2, u3):
    """`st_v4(array, index, u0, u1, u2, u3)`: store 16 bytes (`u0` lowest) at flat element
    `index` of a global array: `st.global.v4.u32`."""
    _check_array("st_v4", array, index)
    _check_integers("st_v4", u0, u1, u2, u3)

    def codegen(context, builder, sig, args):
        address = _address(context, builder, sig, args, GLOBAL)
        words = _cast(context, builder, args[2:], sig.args[2:], types.uint32)
        _asm(builder, "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r,~{memory}", [],
             [address, *words], side_effect=True)

    return types.void(array, index, u0, u1, u2, u3), codegen


# --- 16-bit float pairs and bit casts ----------------------------------------------------

@intrinsic
def f16x2_to_f32(typingctx, u):
    """`f16x2_to_f32(u) -> (lo, hi)` float32, exact: the low and high float16 halves of `u`.

    PTX: `mov.b32 {lo, hi}, u; cvt.f32.f16 ...` (no rounding: every f16 is an f32)."""
    _check_integers("f16x2_to_f32", u)

    def codegen(context, builder, sig, args):
        (word,) = _cast(context, builder, args, sig.args, types.uint32)
        halves = _asm(builder, "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                               "cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
                      "=f,=f,r", [F32, F32], [word])
        return context.make_tuple(builder, sig.return_type, halves)

    return types.UniTuple(types.float32, 2)(u), codegen


@intrinsic
def bf16x2_to_f32(typingctx, u):
    """`bf16x2_to_f32(u) -> (lo, hi)` float32, exact: a bfloat16 is the top half of a
    float32, so `lo = bits(u << 16)`, `hi = bits(u & 0xffff0000)` (no PTX needed)."""
    _check_integers("bf16x2_to_f32", u)

    def codegen(context, builder, sig, args):
        (word,) = _cast(context, builder, args, sig.args, types.uint32)
        lo = builder.shl(word, ir.Constant(I32, 16))
        hi = builder.and_(word, ir.Constant(I32, 0xFFFF0000))
        halves = [builder.bitcast(v, F32) for v in (lo, hi)]
        return context.make_tuple(builder, sig.return_type, halves)

    return types.UniTuple(types.float32, 2)(u), codegen


def _pack_f32x2(name, ptx_type, doc):
    def pack(typingctx, lo, hi):
        _check_numbers(name, lo, hi)

        def codegen(context, builder, sig, args):
            lo32, hi32 = _cast(context, builder, args, sig.args, types.float32)
            # `cvt.rn.<type>x2.f32 d, a, b` puts `a` in the UPPER half of d
            (word,) = _asm(builder, f"cvt.rn.{ptx_type}.f32 $0, $2, $1;", "=r,f,f", [I32],
                           [lo32, hi32])
            return word

        return types.uint32(lo, hi), codegen

    return _named(name, doc, pack)


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

    def cast(typingctx, value):
        _check_numbers(name, value)

        def codegen(context, builder, sig, args):
            (same_width,) = _cast(context, builder, args, sig.args, from_type)
            return builder.bitcast(same_width, llvm_type)

        return to_type(value), codegen

    return _named(name, doc, cast)


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
    _check_numbers("exp2_approx", x)

    def codegen(context, builder, sig, args):
        (value,) = _cast(context, builder, args, sig.args, types.float32)
        (result,) = _asm(builder, "ex2.approx.ftz.f32 $0, $1;", "=f,f", [F32], [value])
        return result

    return types.float32(x), codegen


# --- one element of a K/V/q/out array <-> float32 -----------------------------------------
# Arrays of bfloat16 hold its bit patterns as uint16 (Numba has no bfloat16 type), so the
# element type says how to read and write a value: float16 / float32 numerically, uint16
# as bfloat16 bits.

@intrinsic
def to_f32(typingctx, x):
    """`to_f32(x) -> float32`, exact: a float16 or float32 element, or a uint16 element read
    as bfloat16 bits (the top half of a float32)."""
    if x not in (types.float16, types.float32, types.uint16):
        raise TypingError(f"to_f32: expected a float16, float32 or uint16 (bfloat16) "
                          f"element, got {x}")

    def codegen(context, builder, sig, args):
        (value,) = args
        if sig.args[0] == types.uint16:
            word = builder.shl(builder.zext(value, I32), ir.Constant(I32, 16))
            return builder.bitcast(word, F32)
        return context.cast(builder, value, sig.args[0], types.float32)

    return types.float32(x), codegen


@intrinsic
def from_f32(typingctx, value, array):
    """`from_f32(value, array)`: `value` (taken as float32) as an element of `array`, rounded
    to nearest even: float16, float32, or bfloat16 bits for a uint16 array
    (`cvt.rn.bf16.f32`)."""
    _check_numbers("from_f32", value)
    dtype = getattr(array, "dtype", None)
    if dtype not in (types.float16, types.float32, types.uint16):
        raise TypingError(f"from_f32: expected a float16, float32 or uint16 (bfloat16) "
                          f"array, got {array}")

    def codegen(context, builder, sig, args):
        (f32,) = _cast(context, builder, args[:1], sig.args[:1], types.float32)
        if dtype == types.uint16:
            (bits,) = _asm(builder, "cvt.rn.bf16.f32 $0, $1;", "=h,f", [ir.IntType(16)],
                           [f32])
            return bits
        return context.cast(builder, f32, types.float32, dtype)

    return dtype(value, array), codegen


# --- warp shuffles -----------------------------------------------------------------------
# Numba's own `cuda.shfl_*_sync` refuse uint32; these take any 32-bit integer or float32
# value, shuffle its bits with `shfl.sync.<mode>.b32` and return the same type.

_SHUFFLE_TYPES = (types.int32, types.uint32, types.float32)


def _shuffle(name, mode, doc):
    def shuffle(typingctx, value, lane):
        if value not in _SHUFFLE_TYPES:
            raise TypingError(f"{name}: value must be one of {_SHUFFLE_TYPES}, got {value}")
        _check_integers(name, lane)

        def codegen(context, builder, sig, args):
            value_type = context.get_value_type(sig.args[0])
            (b,) = _cast(context, builder, args[1:], sig.args[1:], types.uint32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.LiteralStructType([I32, ir.IntType(1)]),
                                                [I32] * 5),
                "llvm.nvvm.shfl.sync.i32")
            # c = 0x1f: the whole warp is one segment, lanes 0..31
            got = builder.call(fn, [ir.Constant(I32, FULL_MASK), ir.Constant(I32, mode),
                                    builder.bitcast(args[0], I32), b, ir.Constant(I32, 0x1F)])
            return builder.bitcast(builder.extract_value(got, 0), value_type)

        return value(value, lane), codegen

    return _named(name, doc, shuffle)


shfl_xor = _shuffle("shfl_xor", 3, """
    `shfl_xor(value, lane_mask)`: `value` of lane `cuda.laneid ^ lane_mask`
    (`shfl.sync.bfly.b32`, full warp); int32, uint32 or float32.
    """)
shfl_idx = _shuffle("shfl_idx", 0, """
    `shfl_idx(value, src_lane)`: `value` of lane `src_lane % 32`
    (`shfl.sync.idx.b32`, full warp); int32, uint32 or float32.
    """)


# --- tensor cores: mma.m16n8k16 ----------------------------------------------------------
# D (16x8, f32) = A (16x16) @ B (16x8) + C (16x8, f32), one warp. With
# g = lane // 4 ("groupID") and t = lane % 4 ("threadID_in_group"), per lane:
#
#   A, row-major, 4 x .b32 of two 16-bit values (lower column in the low half):
#     a0 = A[g,     2t : 2t+2]     a1 = A[g + 8, 2t : 2t+2]
#     a2 = A[g, 2t + 8 : 2t+10]    a3 = A[g + 8, 2t + 8 : 2t+10]
#   B, "col" (a column of B is K-contiguous), 2 x .b32 (lower row in the low half):
#     b0 = B[2t : 2t+2, g]         b1 = B[2t + 8 : 2t+10, g]
#   C and D, 4 x .f32:
#     c0 = C[g, 2t]  c1 = C[g, 2t + 1]  c2 = C[g + 8, 2t]  c3 = C[g + 8, 2t + 1]

def _mma(name, ptx_type, doc):
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        _check_integers(name, a0, a1, a2, a3, b0, b1)
        _check_numbers(name, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            ab = _cast(context, builder, args[:6], sig.args[:6], types.uint32)
            c = _cast(context, builder, args[6:], sig.args[6:], types.float32)
            d = _asm(builder,
                     f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32 "
                     "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                     "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [F32] * 4, [*ab, *c],
                     convergent=True)
            return context.make_tuple(builder, sig.return_type, d)

        return F32X4(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    return _named(name, doc, mma)


mma_f16_f32 = _mma("mma_f16_f32", "f16", """
    `mma_f16_f32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3) -> (d0, d1, d2, d3)`:
    D = A @ B + C for one warp, A 16x16 and B 16x8 float16 (uint32 registers of two),
    C and D 16x8 float32, in the fragment layout above:
    `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`. Products are exact, sums at
    least float32-accurate (the hardware's order and rounding of the sum are its own).
    """)

mma_bf16_f32 = _mma("mma_bf16_f32", "bf16", """
    `mma_bf16_f32(...)`: as `mma_f16_f32` with bfloat16 A and B:
    `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`.
    """)


# --- ldmatrix: four 8x8 matrices of 16-bit values from shared memory ---------------------
# Lane l supplies the address of row l % 8 of matrix M_{l // 8}: 8 contiguous 16-bit
# values, 16-byte aligned. M_i lands in register r_i; with g = lane // 4, t = lane % 4:
#   ldmatrix_x4:        r_i = M_i[g, 2t : 2t+2]          (lower column in the low half)
#   ldmatrix_x4_trans:  r_i = M_i[2t : 2t+2, g]          (lower row in the low half)
# Feeding the mma above from row-major shared tiles (lane l passes the index
# row * pitch + col of the tile's element (row, col)):
#   A, a 16x16 tile:                  row = l % 16,               col = 8 * (l // 16)
#     M_0..M_3 = A[0:8, 0:8], A[8:16, 0:8], A[0:8, 8:16], A[8:16, 8:16] = a0..a3
#   B = K^T, K a 16x16 (key, dim) tile, non-trans:
#                                     row = l % 8 + 8 * (l // 16), col = 8 * (l // 8 % 2)
#     (r0, r1) = (b0, b1) for keys 0..7, (r2, r3) = (b0, b1) for keys 8..15
#   B = V, V a 16x16 (key, dim) tile, .trans:
#                                     row = l % 16,               col = 8 * (l // 16)
#     (r0, r1) = (b0, b1) for dims 0..7, (r2, r3) = (b0, b1) for dims 8..15

def _ldmatrix(name, ptx, doc):
    def ldmatrix(typingctx, shared_array, index):
        _check_array(name, shared_array, index, bits=16)

        def codegen(context, builder, sig, args):
            address = _address(context, builder, sig, args, SHARED)
            # the memory clobber: shared tiles change (cp.async, stores) between loads
            # of one address; without it LLVM merges them or hoists them out of loops
            regs = _asm(builder, f"{ptx} {{$0, $1, $2, $3}}, [$4];",
                        "=r,=r,=r,=r,r,~{memory}", [I32] * 4, [address], convergent=True)
            return context.make_tuple(builder, sig.return_type, regs)

        return U32X4(shared_array, index), codegen

    return _named(name, doc, ldmatrix)


ldmatrix_x4 = _ldmatrix("ldmatrix_x4", "ldmatrix.sync.aligned.m8n8.x4.shared.b16", """
    `ldmatrix_x4(shared_array, index) -> (r0, r1, r2, r3)` uint32:
    `ldmatrix.sync.aligned.m8n8.x4.shared.b16`. Each lane passes the flat element index
    of the row it supplies, in a shared array of 16-bit elements (float16, uint16, ...);
    layouts above.
    """)

ldmatrix_x4_trans = _ldmatrix("ldmatrix_x4_trans",
                              "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", """
    `ldmatrix_x4_trans(shared_array, index)`: as `ldmatrix_x4`, each
    matrix transposed: `ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`.
    """)


# --- cp.async: global -> shared without registers ----------------------------------------

@intrinsic
def cp_async_16(typingctx, shared_array, shared_index, global_array, global_index):
    """`cp_async_16(shared_array, shared_index, global_array, global_index)`: start copying
    16 bytes from a global array to a shared one (flat element indices, both 16-byte
    aligned), bypassing L1: `cp.async.cg.shared.global [dst], [src], 16`. The data is
    there once `cp_async_wait` covers the group it was committed in (then syncthreads
    before other threads read it)."""
    _check_array("cp_async_16", shared_array, shared_index)
    _check_array("cp_async_16", global_array, global_index)

    def codegen(context, builder, sig, args):
        dst = _address(context, builder, sig, args, SHARED)
        src = _address(context, builder, sig, args, GLOBAL, at=2)
        _asm(builder, "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}", [],
             [dst, src], side_effect=True)

    return types.void(shared_array, shared_index, global_array, global_index), codegen


@intrinsic
def cp_async_commit(typingctx):
    """`cp_async_commit()`: close this thread's group of pending copies:
    `cp.async.commit_group`."""

    def codegen(context, builder, sig, args):
        _asm(builder, "cp.async.commit_group;", "~{memory}", [], [], side_effect=True)

    return types.void(), codegen


@intrinsic
def cp_async_wait(typingctx, n):
    """`cp_async_wait(n)`: wait until at most `n` of this thread's committed groups are
    pending: `cp.async.wait_group n`; `cp_async_wait(0)` waits for all. `n` is an
    immediate: a literal, or a global or closure integer (compute `STAGES - 2` and
    the like outside the kernel)."""
    if not isinstance(n, types.IntegerLiteral):
        raise TypingError(f"cp_async_wait: n must be a compile-time integer, got {n}")
    pending = n.literal_value

    def codegen(context, builder, sig, args):
        _asm(builder, f"cp.async.wait_group {pending};", "~{memory}", [], [],
             side_effect=True)

    return types.void(n), codegen


if SIMULATOR:
    from .ptxsim import (  # noqa: E402,F401,F811  (same names, simulated)
        bf16x2_to_f32, cp_async_16, cp_async_commit, cp_async_wait, exp2_approx, f16x2_to_f32,
        f32_as_u32, f32x2_to_bf16x2, f32x2_to_f16x2, from_f32, ld_nc_v4, ld_v4, ldmatrix_x4,
        ldmatrix_x4_trans, mma_bf16_f32, mma_f16_f32, shfl_idx, shfl_xor, st_v4,
        to_f32, u32_as_f32)


# --- cp.async that may write zeros instead -----------------------------------------------

def _shared_address32(context, builder, array_type, array, index_type, index):
    """The 32-bit shared-window address of flat element `index` of a shared array, as
    its base plus a 32-bit offset: the base is the same value for every index, so that
    ptxas may fold constant offsets into the instruction's address."""
    data = context.make_array(array_type)(context, builder, value=array).data
    shared = builder.addrspacecast(data, ir.PointerType(data.type.pointee, SHARED))
    base = builder.ptrtoint(shared, I32)
    offset = builder.trunc(context.cast(builder, index, index_type, types.intp), I32)
    itemsize = context.get_abi_sizeof(context.get_data_type(array_type.dtype))
    return builder.add(base, builder.mul(offset, ir.Constant(I32, itemsize)))


@intrinsic
def cp_async_16_zfill(typingctx, shared_array, shared_index, global_array, global_index,
                      zero):
    """`cp_async_16_zfill(shared_array, shared_index, global_array, global_index, zero)`:
    as `cp_async_16`, except that where `zero` is true (a bool or a nonzero integer) the
    16 shared bytes become zeros and global memory is not read at all
    (`cp.async.cg.shared.global [dst], [src], 16, ignore_src`): one instruction stages a
    tile row or zero-fills it. The shared address is computed in 32 bits from the
    array's base, so ptxas folds constant index offsets into the instruction."""
    _check_array("cp_async_16_zfill", shared_array, shared_index)
    _check_array("cp_async_16_zfill", global_array, global_index)
    if not isinstance(zero, (types.Boolean, types.Integer)):
        raise TypingError(f"cp_async_16_zfill: zero must be a bool or an integer, got {zero}")

    def codegen(context, builder, sig, args):
        dst = _shared_address32(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        src = _address(context, builder, sig, args, GLOBAL, at=2)
        flag = context.cast(builder, args[4], sig.args[4], types.boolean)
        ignore = builder.zext(flag, I32)
        _asm(builder, "{ .reg .pred ignore; setp.ne.b32 ignore, $2, 0; "
                      "cp.async.cg.shared.global [$0], [$1], 16, ignore; }",
             "r,l,r,~{memory}", [], [dst, src, ignore], side_effect=True)

    return types.void(shared_array, shared_index, global_array, global_index, zero), codegen


# --- byte views ------------------------------------------------------------------------------

BYTES = types.Array(types.uint8, 1, "C")


@intrinsic
def bytes_from(typingctx, array, index):
    """`bytes_from(array, index) -> uint8[::1]`: the bytes of a C-contiguous array from
    flat element `index` to its end, as a one-dimensional view (no copy). A kernel that
    walks rows of a large array from one place keeps this view's base address and adds
    byte offsets: `cp_async_16(tile, i, bytes_from(store, start), row * row_bytes)` costs
    one 32 x 32 -> 64-bit multiply-add per address."""
    _check_array("bytes_from", array, index)

    def codegen(context, builder, sig, args):
        source = context.make_array(sig.args[0])(context, builder, value=args[0])
        first = context.cast(builder, args[1], sig.args[1], types.intp)
        itemsize = ir.Constant(first.type, context.get_abi_sizeof(
            context.get_data_type(sig.args[0].dtype)))
        start = builder.gep(source.data, [first])
        view = context.make_array(BYTES)(context, builder)
        context.populate_array(view, data=builder.bitcast(start, view.data.type),
                               shape=[builder.mul(builder.sub(source.nitems, first), itemsize)],
                               strides=[ir.Constant(first.type, 1)], itemsize=1, meminfo=None)
        return view._getvalue()

    return BYTES(array, index), codegen


@intrinsic
def mul_wide_u32(typingctx, a, b):
    """`mul_wide_u32(a, b) -> uint64`: the full product of `a` and `b` taken as unsigned
    32-bit integers (`mul.wide.u32`). Added to a 64-bit address it becomes one
    multiply-add (`IMAD.WIDE.U32`): LLVM, given the same product of two 32-bit values
    computed from 64-bit ones, may keep a full 64-bit multiply."""
    _check_integers("mul_wide_u32", a, b)

    def codegen(context, builder, sig, args):
        words = _cast(context, builder, args, sig.args, types.uint32)
        (product,) = _asm(builder, "mul.wide.u32 $0, $1, $2;", "=l,r,r", [ir.IntType(64)],
                          words)
        return product

    return types.uint64(a, b), codegen


if SIMULATOR:
    from .ptxsim import bytes_from, cp_async_16_zfill, mul_wide_u32  # noqa: E402,F401,F811
