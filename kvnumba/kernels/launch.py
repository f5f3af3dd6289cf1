"""Launch a compiled kernel with as little host work per call as the device allows.

`Specialised(kernel)(grid, block, stream, *args)` launches `kernel[grid, block,
stream](*args)`. Every kernel of kvnumba is launched this way, so what it saves, every
call site saves.

On Numba's CUDA simulator it asks Numba once per argument signature for the kernel
specialised to it (`Dispatcher.specialize`) and launches that.

On a GPU, Numba's own launch would convert and pack every argument again on every call
(about 100 µs of host time for a 16-argument kernel on a slow host). Here, once per
argument signature, the kernel is specialised and its parameters laid out in a reused
buffer (`DriverLaunch`); a call then only reads each array's kernel argument (computed
once per array object and kept on it, see `describe`), packs the buffer in one
`struct.pack_into` and calls `cuLaunchKernel` with it. The parameters are the ones
Numba's kernel ABI takes (`_Kernel._prepare_args` in numba-cuda): each array is flattened
into meminfo, parent, item count, item size, data pointer, shape and strides (bytes);
each scalar is passed as the type it was specialised for.

`driver` is the one object that calls into the CUDA driver; a stand-in with the same
`launch` method can record launches instead (the host-time benchmark does, without a
GPU).
"""
from __future__ import annotations

import ctypes
import math
import struct
import threading
from functools import lru_cache
from itertools import chain
from operator import attrgetter, itemgetter

import numpy as np

from ..device import SIMULATOR

#: the grid-stride kernels (write, clone copy): threads per block, 16-byte vectors, and
#: a cap on blocks that still fills a large GPU several times over
STRIDE_THREADS = 256
VECTOR_BYTES = 16
MAX_BLOCKS = 4096


def ceil_div(a: int, b: int) -> int:
    """`ceil(a / b)` for ints: grid sizes and tile counts."""
    return -(-a // b)


def stride_blocks(work: int) -> int:
    """Blocks of `STRIDE_THREADS` for a grid-stride loop over `work` items."""
    return min(MAX_BLOCKS, ceil_div(work, STRIDE_THREADS))


# ------------------------------------------------------------------ the simulator

def _type_key(arg):
    dtype = getattr(arg, "dtype", None)
    if dtype is None or not hasattr(arg, "shape"):
        return type(arg)
    contiguous = arg.is_c_contiguous() if hasattr(arg, "is_c_contiguous") else \
        arg.flags.c_contiguous
    return dtype, len(arg.shape), contiguous


class SimulatedKernel:
    """`SimulatedKernel(kernel)(grid, block, stream, *args)`: `kernel[grid, block,
    stream](*args)` on the simulator, with the type dispatch done once per argument
    signature (the signature key keeps a strided array from ever reaching a kernel
    specialised for a contiguous one)."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self._kernels = {}

    def __call__(self, grid, block, stream, *args):
        key = tuple(map(_type_key, args))
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = self.dispatcher.specialize(*args)
        kernel[grid, block, stream](*args)


# ------------------------------------------------------------------ kernel arguments

#: the attribute under which a device array keeps its kernel argument once described
ARGUMENT = "_kvnumba_argument"
_argument = attrgetter(ARGUMENT)


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


def describe(array) -> tuple:
    """`(name of its Numba type, ABI fields)` of a device array as a kernel argument (the
    type's name is what tells specialisations apart, and it hashes fast).

    A Numba device array never changes its pointer or shape, so its description is kept
    on it (later launches read it back in one attribute lookup); an array that carries
    one from the start (`arrays.DeviceView`) is taken at its word; any other is read from
    its `__cuda_array_interface__` and typed as Numba types it, at every launch.
    """
    found = getattr(array, ARGUMENT, None)
    if found is not None:
        return found
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    from numba.cuda.typing.typeof import Purpose, typeof

    if isinstance(array, DeviceNDArray):
        described = (array._numba_type_.name,
                     array_fields(array.device_ctypes_pointer.value or 0, array.shape,
                                  array.strides, array.dtype.itemsize))
        setattr(array, ARGUMENT, described)
        return described
    interface = getattr(array, "__cuda_array_interface__", None)
    if interface is None:
        raise TypeError(f"a kernel takes device arrays (with __cuda_array_interface__), got "
                        f"{type(array).__name__}")
    shape = tuple(interface["shape"])
    itemsize = np.dtype(interface["typestr"]).itemsize
    strides = tuple(interface.get("strides") or c_strides(shape, itemsize))
    return (typeof(array, Purpose.argument).name,
            array_fields(interface["data"][0] or 0, shape, strides, itemsize))


def is_device_array(arg) -> bool:
    """What `describe` takes: an object with `__cuda_array_interface__` (a NumPy array
    counts too, to be refused there by name rather than packed as a scalar)."""
    interface = "__cuda_array_interface__"    # asked of the type first: a property costs
    return hasattr(type(arg), interface) or isinstance(arg, np.ndarray) or hasattr(arg, interface)


def _picker(positions: tuple):
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


class DriverLaunch:
    """One specialised kernel for one argument signature: its function handle and a
    reused parameter buffer.

    The buffer holds every parameter in an 8-byte slot, the arrays' fields first and the
    scalars after them, so a call packs `(*fields of each array, *scalars)` in one
    `struct.pack_into`; `address` is the array of pointers, in the kernel's parameter
    order, that `cuLaunchKernel` reads the parameters through. The driver copies them at
    the launch (a CUDA graph captures the copy), so the buffer is reused at once; `lock`
    keeps another thread from packing it while the driver reads it.
    """

    def __init__(self, name: str, function, argument_types, array_positions):
        self.name = name
        self.function = function
        codes = [parameter_codes(t) for t in argument_types]
        self.codes = tuple(chain.from_iterable(codes))     # kernel order
        self.counts = tuple(map(len, codes))               # parameters per argument
        arrays = set(array_positions)
        order = [i for i in range(len(codes)) if i in arrays] + \
                [i for i in range(len(codes)) if i not in arrays]
        slots, first = {}, 0
        for i in order:
            slots[i] = first
            first += len(codes[i])
        packed = [code for i in order for code in codes[i]]
        self._struct = struct.Struct("<" + "".join(f"{c}{SLOT - struct.calcsize(c)}x"
                                                   if struct.calcsize(c) < SLOT else c
                                                   for c in packed))
        self.buffer = ctypes.create_string_buffer(self._struct.size)
        base = ctypes.addressof(self.buffer)
        pointers = [base + SLOT * (slots[i] + j) for i in range(len(codes))
                    for j in range(len(codes[i]))]
        self._pointers = (ctypes.c_void_p * max(1, len(pointers)))(*pointers)
        self.address = ctypes.addressof(self._pointers)
        self.pack = self._struct.pack_into
        self.lock = threading.Lock()

    def parameter_bytes(self) -> list:
        """What the driver reads for each kernel parameter, in the kernel's order: the
        bytes at each pointer of `address`, as wide as the parameter's type."""
        return [ctypes.string_at(self._pointers[i], struct.calcsize(code))
                for i, code in enumerate(self.codes)]

    def parameters(self) -> list:
        """`parameter_bytes`, decoded: one tuple of values per kernel argument."""
        values = iter(struct.unpack("<" + code, raw)[0]
                      for code, raw in zip(self.codes, self.parameter_bytes()))
        return [tuple(next(values) for _ in range(n)) for n in self.counts]


def function_handle(kernel) -> int:
    """The `CUfunction` (a `CUkernel` cast to one) of a compiled Numba kernel, as an int."""
    return int(kernel._codelibrary.get_cufunc().handle)


class LeanKernel:
    """`LeanKernel(kernel)(grid, block, stream, *args)`: `kernel[grid, block,
    stream](*args)` through a `DriverLaunch` per argument signature.

    The signature is the Numba type of each array and the Python type of each scalar.
    Which arguments are arrays is fixed by the kernel's first call (a kernel's
    parameters do not change kind); a later call that passes something else where an
    array went is refused.
    """

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self.name = dispatcher.py_func.__name__
        self._launches = {}
        self._arrays = self._scalars = None
        self._array_positions = None

    def __call__(self, grid, block, stream, *args):
        if self._arrays is None:
            self._bind(args)
        arrays = self._arrays(args)
        try:
            types, fields = zip(*map(_argument, arrays))
        except AttributeError:
            types, fields = zip(*map(self._described, arrays))
        scalars = self._scalars(args)
        key = (types, *map(type, scalars))
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = self._specialise(args)
        with launch.lock:     # one buffer per signature: held until the driver has read it
            launch.pack(launch.buffer, 0, *chain.from_iterable(fields), *scalars)
            driver.launch(launch, grid, block, stream)

    def _bind(self, args) -> None:
        positions = tuple(i for i, arg in enumerate(args) if is_device_array(arg))
        if not positions:
            raise TypeError(f"{self.name}: a kernel launched here takes device arrays")
        self._array_positions = positions
        self._arrays = _picker(positions)
        self._scalars = _picker(tuple(i for i in range(len(args)) if i not in positions))

    def _described(self, array):
        if not is_device_array(array):
            raise TypeError(f"{self.name}: argument {type(array).__name__} where its first "
                            f"launch passed a device array")
        return describe(array)

    def _specialise(self, args) -> DriverLaunch:
        specialised = self.dispatcher.specialize(*args)
        kernel, = specialised.overloads.values()
        if kernel.cooperative or kernel.debug or kernel.extensions:
            raise TypeError(f"{self.name}: cooperative kernels, debug kernels and argument "
                            f"extensions are launched by Numba, not here")
        return DriverLaunch(self.name, function_handle(kernel), kernel.argument_types,
                            self._array_positions)


# ------------------------------------------------------------------ the driver call

@lru_cache(maxsize=1024)
def dim3(extent) -> tuple:
    """A grid or block extent (an int or a tuple of up to 3) as (x, y, z) (cached: a
    step's launch shapes repeat every layer)."""
    if isinstance(extent, tuple):
        return (*map(int, extent), 1, 1)[:3]
    return int(extent), 1, 1


def stream_handle(stream) -> int:
    """The `CUstream` of a Numba or `cuda.core` stream (or 0, the default stream), as an
    int."""
    handle = getattr(stream, "handle", stream)
    return int(handle) if handle else 0


class Driver:
    """`cuLaunchKernel` of a `DriverLaunch` (the CUDA driver, through `cuda.bindings`)."""

    def __init__(self):
        from cuda.bindings import driver as binding
        self._launch = binding.cuLaunchKernel
        self._success = binding.CUresult.CUDA_SUCCESS

    def launch(self, launch: DriverLaunch, grid, block, stream) -> None:
        gx, gy, gz = dim3(grid)
        bx, by, bz = dim3(block)
        error = self._launch(launch.function, gx, gy, gz, bx, by, bz, 0,
                             stream_handle(stream), launch.address, 0)[0]
        if error != self._success:
            from numba.cuda.cudadrv.driver import CudaAPIError
            raise CudaAPIError(error, f"cuLaunchKernel of {launch.name} (grid {grid}, block "
                                      f"{block}) failed: {error.name}")


driver = None if SIMULATOR else Driver()
Specialised = SimulatedKernel if SIMULATOR else LeanKernel
