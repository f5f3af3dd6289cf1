"""How kvnumba's inline-PTX intrinsics are emitted (`ptx`, `tensorcore`): an inline-asm
call, value casts, an array element's address in a PTX state space, an intrinsic named
for its error messages, and the typing checks the intrinsics share."""
from __future__ import annotations

import inspect

from ... import device  # noqa: F401  (first: kvnumba.device chooses the target)

from llvmlite import ir  # noqa: E402  (after kvnumba.device chose the target)
from numba.cuda import types  # noqa: E402
from numba.cuda.core.errors import TypingError  # noqa: E402
from numba.cuda.extending import intrinsic  # noqa: E402

I32 = ir.IntType(32)
F32 = ir.FloatType()
U32X4 = types.UniTuple(types.uint32, 4)
F32X4 = types.UniTuple(types.float32, 4)


# --- code generation helpers -------------------------------------------------------------

def asm(builder, text, constraints, outputs, args, side_effect=False, convergent=False):
    """Emit inline PTX `text`; returns its results, one llvmlite value per type in `outputs`.

    `convergent` keeps LLVM from moving a warp-synchronous instruction into divergent code.
    """
    if not outputs:
        ret = ir.VoidType()
    elif len(outputs) == 1:
        ret = outputs[0]
    else:
        ret = ir.LiteralStructType(outputs)
    inline = ir.InlineAsm(ir.FunctionType(ret, [a.type for a in args]), text, constraints,
                          side_effect=side_effect)
    call = builder.call(inline, args, attrs=("convergent",) if convergent else ())
    if len(outputs) == 1:
        return [call]
    return [builder.extract_value(call, i) for i in range(len(outputs))]


def cast(context, builder, values, from_types, to_type):
    return [context.cast(builder, v, t, to_type) for v, t in zip(values, from_types)]


def stored_value(builder, value, inv_scale):
    """The float32 an 8-bit float store narrows: `value * 0 + value` in one fma (NaN for a
    non-finite value, the value itself otherwise, -0 too) times `inv_scale`. No
    fast-math flags, so LLVM keeps the fma."""
    return builder.fmul(builder.fma(value, ir.Constant(F32, 0.0), value), inv_scale)


def element_pointer(context, builder, array_type, array, index_type, index):
    """Generic pointer to flat element `index` of a C-contiguous array (no bounds check)."""
    data = context.make_array(array_type)(context, builder, value=array).data
    return builder.gep(data, [context.cast(builder, index, index_type, types.intp)])


GLOBAL, SHARED = 1, 3           # LLVM NVPTX address spaces
ADDRESS_BITS = {GLOBAL: 64, SHARED: 32}


def state_address(context, builder, sig, args, space, at=0):
    """Address of flat element `args[at + 1]` of array `args[at]` in a PTX state space:
    64-bit global, or 32-bit shared-space address (what `ldmatrix` / `cp.async` take).

    LLVM turns the cast into `cvta.to.global` / `cvta.to.shared`, or drops it where it
    can see where the pointer came from (a shared array).
    """
    pointer = element_pointer(context, builder, sig.args[at], args[at], sig.args[at + 1],
                               args[at + 1])
    in_space = builder.addrspacecast(pointer, ir.PointerType(pointer.type.pointee, space))
    return builder.ptrtoint(in_space, ir.IntType(ADDRESS_BITS[space]))


def named(name, doc, defn):
    """`defn` as an intrinsic called `name` (error messages name it) documented by `doc`."""
    defn.__name__ = defn.__qualname__ = name
    defn.__doc__ = inspect.cleandoc(doc)
    return intrinsic(defn)


# --- typing checks ---------------------------------------------------------------------------

def check_array(name, array, index, bits=None):
    if not (isinstance(array, types.Array) and array.layout == "C"):
        raise TypingError(f"{name}: expected a C-contiguous array, got {array}")
    if bits is not None and getattr(array.dtype, "bitwidth", None) != bits:
        raise TypingError(f"{name}: expected an array of {bits}-bit elements, got {array}")
    check_integers(name, index)


def check_integers(name, *values):
    for value in values:
        if not isinstance(value, types.Integer):
            raise TypingError(f"{name}: expected an integer, got {value}")


def check_numbers(name, *values):
    for value in values:
        if not isinstance(value, (types.Integer, types.Float)):
            raise TypingError(f"{name}: expected a number, got {value}")


def shared_address32(context, builder, array_type, array, index_type, index):
    """The 32-bit shared-space address of flat element `index` of a shared array, as
    its base plus a 32-bit offset: the base is the same value for every index, so that
    ptxas may fold constant offsets into the instruction's address."""
    data = context.make_array(array_type)(context, builder, value=array).data
    shared = builder.addrspacecast(data, ir.PointerType(data.type.pointee, SHARED))
    base = builder.ptrtoint(shared, I32)
    offset = builder.trunc(context.cast(builder, index, index_type, types.intp), I32)
    itemsize = context.get_abi_sizeof(context.get_data_type(array_type.dtype))
    return builder.add(base, builder.mul(offset, ir.Constant(I32, itemsize)))

