"""The kernel ABI a launch packs: how Numba's kernels take their arguments, and the
arguments a bound launch fixes once.

Numba's kernel ABI (`_Kernel._prepare_args` in numba-cuda) flattens each array into
meminfo, parent, item count, item size, data pointer, shape and strides (bytes), and
passes each scalar as the type the kernel was specialised for. `describe` reads an
array's fields once per array object and keeps them on it, packed; `parameter_codes`
and `item_format` lay a signature's parameters out in 8-byte slots, as
`lean.DriverLaunch` packs them. `PER_CALL` marks, in a bound launch's arguments, the
ones each call passes.
"""
from __future__ import annotations

import math
import struct
from functools import lru_cache
from operator import attrgetter, itemgetter

import numpy as np


# ------------------------------------------------------------------ bound arguments

class _PerCall:
    __slots__ = ()

    def __repr__(self):
        return "PER_CALL"


#: in a `bind`'s arguments: one that each call of the bound launch passes (in order)
PER_CALL = _PerCall()


def merge(args: tuple, values: tuple) -> tuple:
    """`args` with its `PER_CALL` places filled by `values`, in order."""
    places = sum(arg is PER_CALL for arg in args)     # not `count`: it compares by ==
    if len(values) != places:
        raise TypeError(f"a bound launch takes {places} per-call arguments, got "
                        f"{len(values)}")
    given = iter(values)
    return tuple(next(given) if arg is PER_CALL else arg for arg in args)


# ------------------------------------------------------------------ kernel arguments

#: the attribute under which a device array keeps its kernel argument once described
ARGUMENT = "_kvnumba_argument"
#: of a described device array: its description, and of a description the Numba type's
#: name and the packed fields
argument_of = attrgetter(ARGUMENT)
type_name_of, packed_of = itemgetter(0), itemgetter(2)


#: where the data pointer sits among an array's ABI fields
POINTER = 4


def array_fields(pointer: int, shape: tuple, strides: tuple, itemsize: int) -> tuple:
    """The parameters Numba's kernel ABI passes for one array: meminfo and parent (none:
    0), item count, item size, data pointer, then the shape and the strides in bytes."""
    return (0, 0, math.prod(shape), itemsize, pointer, *shape, *strides)


@lru_cache(maxsize=1024)
def c_strides(shape: tuple, itemsize: int) -> tuple:
    """Byte strides of a C-contiguous array of `shape` (cached: a step's shapes repeat
    every layer)."""
    strides = []
    step = itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def kernel_argument(type_name: str, fields: tuple) -> tuple:
    """An array's kernel argument as `describe` gives it: `(name of its Numba type, ABI
    fields, the fields packed as a launch's buffer holds them)` (8-byte integers)."""
    return type_name, fields, _fields_struct(len(fields)).pack(*fields)


@lru_cache(maxsize=None)
def _fields_struct(n: int) -> struct.Struct:
    """The packing of `n` ABI fields (8-byte integers)."""
    return struct.Struct(f"<{n}q")


def describe(array) -> tuple:
    """`(name of its Numba type, ABI fields, packed fields)` of a device array as a kernel
    argument (`kernel_argument`; the type's name is what tells specialisations apart, and
    it hashes fast).

    A Numba device array never changes its pointer or shape, so its description is kept
    on it (later launches read it back in one attribute lookup); an array that carries
    one from the start (`launch.calling.DeviceView`) is taken at its word; any other is read from
    its `__cuda_array_interface__` and typed as Numba types it, at every launch.
    """
    found = getattr(array, ARGUMENT, None)
    if found is not None:
        return found
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.cuda.typing.typeof import Purpose, typeof

    if isinstance(array, DeviceNDArray):
        described = kernel_argument(
            array._numba_type_.name, array_fields(array.device_ctypes_pointer.value or 0,
                                                  array.shape, array.strides,
                                                  array.dtype.itemsize))
        setattr(array, ARGUMENT, described)
        return described
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is None:
        raise TypeError(f"a kernel takes device arrays (with __cuda_array_interface__), got "
                        f"{type(array).__name__}")
    shape = tuple(interface["shape"])
    itemsize = np.dtype(interface["typestr"]).itemsize
    strides = tuple(interface.get("strides") or c_strides(shape, itemsize))
    return kernel_argument(typeof(array, Purpose.argument).name,
                           array_fields(interface["data"][0] or 0, shape, strides, itemsize))


def is_device_array(arg) -> bool:
    """What `describe` takes: an object with `__cuda_array_interface__` (a NumPy array
    counts too, to be refused there by name rather than packed as a scalar)."""
    interface = "__cuda_array_interface__"    # asked of the type first: a property costs
    return hasattr(type(arg), interface) or isinstance(arg, np.ndarray) or hasattr(arg, interface)


def picker(positions: tuple):
    """`args -> tuple(args[i] for i in positions)`, in C for two or more positions."""
    if len(positions) >= 2:
        return itemgetter(*positions)
    if positions:
        index, = positions
        return lambda args: (args[index],)
    return lambda args: ()


# ------------------------------------------------------------------ parameter layout

#: struct codes of the scalar parameters the launch packs itself (8-byte slots)
_SCALAR_CODES = {"int8": "b", "int16": "h", "int32": "i", "int64": "q", "uint8": "B",
                 "uint16": "H", "uint32": "I", "uint64": "Q", "float32": "f",
                 "float64": "d", "bool": "?"}
SLOT = 8


def parameter_codes(argument_type) -> tuple:
    """The struct codes of the kernel parameters one argument of `argument_type` (a Numba
    type) becomes: an array's 5 + 2 * ndim 8-byte integers, or one scalar."""
    from numba.cuda import types

    if isinstance(argument_type, types.Array):
        return ("q",) * (5 + 2 * argument_type.ndim)
    code = _SCALAR_CODES.get(str(argument_type))
    if code is None:
        raise TypeError(f"launch: a kernel parameter of Numba type {argument_type} is not "
                        f"packed here (arrays, integers, float32/64 and bool are)")
    return (code,)


def item_format(argument_type) -> str:
    """How one argument is handed to a buffer's `pack_into` (a struct format): an array
    as its packed fields (`describe`: one bytes item), a scalar as its value in an 8-byte
    slot."""
    from numba.cuda import types

    codes = parameter_codes(argument_type)
    if isinstance(argument_type, types.Array):
        return f"{SLOT * len(codes)}s"
    code, = codes
    pad = SLOT - struct.calcsize(code)
    return f"{code}{pad}x" if pad else code
