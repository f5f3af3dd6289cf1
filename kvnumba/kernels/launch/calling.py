"""How kvnumba's kernels are called: the calling convention every host wrapper uses.

* `Specialised(kernel)(grid, block, stream, *args)` launches `kernel[grid, block,
  stream](*args)`, and `Specialised(kernel).bind(grid, block, stream, *args)`, with
  `PER_CALL` in place of each argument the calls pass, binds a launch made many times
  with most of its arguments unchanged (a step's launches, layer after layer). On a GPU
  that is `lean.LeanKernel` (straight to `cuLaunchKernel`); on Numba's CUDA simulator,
  `SimulatedKernel` (Numba's own launch, its type dispatch done once per signature).
* Arrays reach a kernel as Numba device arrays or as `DeviceView`s (any memory with a
  device pointer, described once); `device_pointer` and `aligned` read where their data
  is; `no_output()` stands for an optional output the caller did not ask for.
* The grid-stride kernels share a block size, a vector width and a cap on blocks
  (`STRIDE_THREADS`, `VECTOR_BYTES`, `MAX_BLOCKS`).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ...device import SIMULATOR
from .abi import ARGUMENT, POINTER, array_fields, c_strides, describe, kernel_argument, merge
from .abi import PER_CALL  # noqa: F401  (the calling convention: bound launches' marker)
from .lean import LeanKernel

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


@lru_cache(maxsize=None)
def no_output():
    """A float32 device array of no rows (`[0, 1]`), passed for an optional output the
    caller did not ask for (the attention kernels' `lse`): a kernel stores to such an
    output only when `shape[0] > 0`, so one launch serves both cases. Made once, on
    first use; it holds no memory, so its null address serves every device."""
    from ...device import cuda
    return cuda.device_array((0, 1), np.float32)


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

    def bind(self, grid, block, stream, *args) -> "SimulatedLaunch":
        """This kernel's launch on `grid`, `block` and `stream` with `args`, each call
        passing the `PER_CALL` ones (module doc)."""
        return SimulatedLaunch(self, grid, block, stream, args)


class SimulatedLaunch:
    """A bound launch on the simulator (`SimulatedKernel.bind`): a call fills in its
    arguments and launches the kernel."""

    def __init__(self, kernel: SimulatedKernel, grid, block, stream, args: tuple):
        self.kernel, self.grid, self.block, self.stream = kernel, grid, block, stream
        self.args = args

    def arguments(self, values: tuple) -> tuple:
        """The kernel's whole argument list for a call passing `values`."""
        return merge(self.args, values)

    def __call__(self, *values):
        self.kernel(self.grid, self.block, self.stream, *self.arguments(values))


# ------------------------------------------------------------------ device memory

class DeviceView:
    """Device memory the kernels read or write in place: what a launch needs of it and
    nothing more (a Numba device array costs far more to build, once per call).

    `owner` is the object whose memory it is (kept alive with the view); `ptr` the
    address of element 0; `strides` in bytes. A view is C-contiguous when its strides
    are those of its shape (an axis of extent 1 may have any stride), and typed for
    Numba as such (`_numba_type_`); it carries its kernel argument
    (`abi.ARGUMENT`) from the start.
    """

    __slots__ = ("owner", "ptr", "shape", "strides", "dtype", "size", "_c_contiguous",
                 "_numba_type_", ARGUMENT)

    def __init__(self, owner, ptr: int, shape: tuple, strides: tuple, dtype: np.dtype):
        self.owner, self.ptr, self.shape, self.strides, self.dtype = \
            owner, ptr, shape, strides, dtype
        self.size, self._c_contiguous, self._numba_type_, before, after = \
            _layout(shape, strides, dtype)
        setattr(self, ARGUMENT, kernel_argument(self._numba_type_.name, (*before, ptr, *after)))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def is_c_contiguous(self) -> bool:
        return self._c_contiguous

    @property
    def device_ctypes_pointer(self):
        import ctypes
        return ctypes.c_void_p(self.ptr)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": self.shape, "strides": self.strides, "typestr": self.dtype.str,
                "data": (self.ptr, False), "version": 3}


@lru_cache(maxsize=256)
def _layout(shape: tuple, strides: tuple, dtype: np.dtype) -> tuple:
    """What a view of this geometry is, its pointer aside (cached: a step's shapes repeat
    every layer): `(size, C-contiguous, Numba type, ABI fields before the pointer, ABI
    fields after it)`. Numba's layout is "C" when C-contiguous, else "A" (any)."""
    from numba.cuda import types
    from numba.cuda.np.numpy_support import from_dtype

    dense = c_strides(shape, dtype.itemsize)
    contiguous = strides == dense or all(s == c or n == 1 for s, c, n in
                                         zip(strides, dense, shape))
    numba_type = types.Array(from_dtype(dtype), len(shape), "C" if contiguous else "A")
    fields = array_fields(0, shape, strides, dtype.itemsize)
    return fields[2], contiguous, numba_type, fields[:POINTER], fields[POINTER + 1:]


def device_pointer(array) -> int:
    """The address of a device array's data, as a launch passes it (described once per
    Numba device array); on the simulator, the address of the memory it simulates."""
    if SIMULATOR:
        return array._ary.ctypes.data
    described = getattr(array, ARGUMENT, None)     # `describe`'s own first look, inlined
    return (described or describe(array))[1][POINTER]


def aligned(array, alignment: int) -> bool:
    """Whether a device array's data starts at a multiple of `alignment` bytes."""
    return device_pointer(array) % alignment == 0


Specialised = SimulatedKernel if SIMULATOR else LeanKernel


def run_block(items: int) -> tuple[int, int]:
    """`(lanes, rows)`: a block of `STRIDE_THREADS` threads for runs of `items` items,
    `lanes` (a power of two, at least `items` up to `STRIDE_THREADS`) along a run and
    `rows` runs side by side."""
    lanes = min(STRIDE_THREADS, 1 << max(0, items - 1).bit_length())
    return lanes, STRIDE_THREADS // lanes
