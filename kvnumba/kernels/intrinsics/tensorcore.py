"""Inline PTX of the tensor-core path: `mma.m16n8k16` on float16 / bfloat16 fragments,
`ldmatrix` (shared tiles to fragments) and `cp.async` (global to shared without
registers, optionally zero-filling).

Conventions as in `ptx`; every function here is warp-synchronous or asynchronous and
needs sm_80 or newer. On Numba's CUDA simulator the same names are bound to `ptxsim`'s
twins.
"""
from __future__ import annotations

from ...device import SIMULATOR
from .ptxgen import (F32, F32X4, GLOBAL, I32, SHARED, U32X4, asm, cast, check_array,
                     check_integers, check_numbers, named, shared_address32, state_address)

from numba.cuda import types  # noqa: E402  (after kvnumba.device chose the target)
from numba.cuda.core.errors import TypingError  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402


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
        check_integers(name, a0, a1, a2, a3, b0, b1)
        check_numbers(name, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            ab = cast(context, builder, args[:6], sig.args[:6], types.uint32)
            c = cast(context, builder, args[6:], sig.args[6:], types.float32)
            d = asm(builder,
                    f"mma.sync.aligned.m16n8k16.row.col.f32.{ptx_type}.{ptx_type}.f32 "
                     "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                     "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [F32] * 4, [*ab, *c],
                     convergent=True)
            return context.make_tuple(builder, sig.return_type, d)

        return F32X4(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    return named(name, doc, mma)


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
        check_array(name, shared_array, index, bits=16)

        def codegen(context, builder, sig, args):
            address = state_address(context, builder, sig, args, SHARED)
            # the memory clobber: shared tiles change (cp.async, stores) between loads
            # of one address; without it LLVM merges them or hoists them out of loops
            regs = asm(builder, f"{ptx} {{$0, $1, $2, $3}}, [$4];",
                       "=r,=r,=r,=r,r,~{memory}", [I32] * 4, [address], convergent=True)
            return context.make_tuple(builder, sig.return_type, regs)

        return U32X4(shared_array, index), codegen

    return named(name, doc, ldmatrix)


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


@intrinsic
def ld_shared_v2(typingctx, shared_array, index):
    """`ld_shared_v2(shared_array, index) -> (u0, u1)` uint32: the 8 bytes at flat element
    `index` of a shared array, 8-byte aligned (`ld.shared.v2.u32`; `u0` the lower four):
    one lane's own fragment words where `ldmatrix`'s layout is not the one wanted."""
    check_array("ld_shared_v2", shared_array, index)

    def codegen(context, builder, sig, args):
        address = shared_address32(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        # the memory clobber, as ldmatrix's: shared tiles change between loads
        words = asm(builder, "ld.shared.v2.u32 {$0, $1}, [$2];", "=r,=r,r,~{memory}",
                    [I32] * 2, [address])
        return context.make_tuple(builder, sig.return_type, words)

    return types.UniTuple(types.uint32, 2)(shared_array, index), codegen


# --- cp.async: global -> shared without registers ----------------------------------------

@intrinsic
def cp_async_16(typingctx, shared_array, shared_index, global_array, global_index):
    """`cp_async_16(shared_array, shared_index, global_array, global_index)`: start copying
    16 bytes from a global array to a shared one (flat element indices, both 16-byte
    aligned), bypassing L1: `cp.async.cg.shared.global [dst], [src], 16`. The data is
    there once `cp_async_wait` covers the group it was committed in (then syncthreads
    before other threads read it)."""
    check_array("cp_async_16", shared_array, shared_index)
    check_array("cp_async_16", global_array, global_index)

    def codegen(context, builder, sig, args):
        dst = state_address(context, builder, sig, args, SHARED)
        src = state_address(context, builder, sig, args, GLOBAL, at=2)
        asm(builder, "cp.async.cg.shared.global [$0], [$1], 16;", "r,l,~{memory}", [],
            [dst, src], side_effect=True)

    return types.void(shared_array, shared_index, global_array, global_index), codegen


@intrinsic
def cp_async_commit(typingctx):
    """`cp_async_commit()`: close this thread's group of pending copies:
    `cp.async.commit_group`."""

    def codegen(context, builder, sig, args):
        asm(builder, "cp.async.commit_group;", "~{memory}", [], [], side_effect=True)

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
        asm(builder, f"cp.async.wait_group {pending};", "~{memory}", [], [],
            side_effect=True)

    return types.void(n), codegen



# --- cp.async that may write zeros instead -----------------------------------------------


@intrinsic
def cp_async_16_zfill(typingctx, shared_array, shared_index, global_array, global_index,
                      zero):
    """`cp_async_16_zfill(shared_array, shared_index, global_array, global_index, zero)`:
    as `cp_async_16`, except that where `zero` is true (a bool or a nonzero integer) the
    16 shared bytes become zeros and global memory is not read at all
    (`cp.async.cg.shared.global [dst], [src], 16, ignore_src`): one instruction stages a
    tile row or zero-fills it. The shared address is computed in 32 bits from the
    array's base, so ptxas folds constant index offsets into the instruction."""
    check_array("cp_async_16_zfill", shared_array, shared_index)
    check_array("cp_async_16_zfill", global_array, global_index)
    if not isinstance(zero, (types.Boolean, types.Integer)):
        raise TypingError(f"cp_async_16_zfill: zero must be a bool or an integer, got {zero}")

    def codegen(context, builder, sig, args):
        dst = shared_address32(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        src = state_address(context, builder, sig, args, GLOBAL, at=2)
        flag = context.cast(builder, args[4], sig.args[4], types.boolean)
        ignore = builder.zext(flag, I32)
        asm(builder, "{ .reg .pred ignore; setp.ne.b32 ignore, $2, 0; "
                      "cp.async.cg.shared.global [$0], [$1], 16, ignore; }",
             "r,l,r,~{memory}", [], [dst, src, ignore], side_effect=True)

    return types.void(shared_array, shared_index, global_array, global_index, zero), codegen


@intrinsic
def st_shared_v4(typingctx, shared_array, index, u0, u1, u2, u3):
    """`st_shared_v4(shared_array, index, u0, u1, u2, u3)`: store 16 bytes (`u0` lowest) at
    flat element `index` of a shared array, 16-byte aligned (`st.shared.v4.u32`; the
    address in 32 bits from the array's base, as `cp_async_16_zfill`'s)."""
    check_array("st_shared_v4", shared_array, index)
    check_integers("st_shared_v4", u0, u1, u2, u3)

    def codegen(context, builder, sig, args):
        dst = shared_address32(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        words = cast(context, builder, args[2:], sig.args[2:], types.uint32)
        asm(builder, "st.shared.v4.u32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}", [],
            [dst, *words], side_effect=True)

    return types.void(shared_array, index, u0, u1, u2, u3), codegen


if SIMULATOR:
    from .ptxsim import (cp_async_16, cp_async_16_zfill, cp_async_commit, cp_async_wait,  # noqa: E402,F401,F811  (same names, simulated)
                         ld_shared_v2, ldmatrix_x4, ldmatrix_x4_trans, mma_bf16_f32, mma_f16_f32,
                         st_shared_v4)
