"""Kernel launches straight through the CUDA driver's `cuLaunchKernel`.

Numba's own launch converts and packs every argument again on every call (about 100
µs of host time for a 16-argument kernel on a slow host). Here, once per argument
signature, the kernel is specialised and its parameters laid out in a reused buffer
(`DriverLaunch`); a call then only reads each array's kernel argument (computed once
per array object and kept on it, already packed: `abi.describe`), packs the buffer in
one `struct.pack_into` and calls `cuLaunchKernel` with it.

`LeanKernel(kernel)(grid, block, stream, *args)` launches `kernel[grid, block,
stream](*args)`; `LeanKernel(kernel).bind(grid, block, stream, *args)`, with
`abi.PER_CALL` in place of each argument the calls pass, converts the grid, block and
stream and packs the fixed arguments once (`LeanLaunch`).

`driver` is the one object that calls into the CUDA driver; a stand-in with the same
`launch` and `send` methods can record launches instead (the host-time benchmark does,
without a GPU).
"""
from __future__ import annotations

import ctypes
import struct
import threading
from functools import lru_cache
from itertools import chain

from ...device import SIMULATOR
from .abi import (PER_CALL, SLOT, argument_of, describe, is_device_array, item_format, merge,
                  packed_of, parameter_codes, picker, type_name_of)


class DriverLaunch:
    """One specialised kernel for one argument signature: its function handle and a
    reused parameter buffer.

    The buffer holds every parameter in an 8-byte slot, the arguments' in `order` (a
    permutation of the argument indices: the caller's packing order, e.g. the arrays
    first and the scalars after them), so a call packs each array's packed fields and
    each scalar in that order in one `struct.pack_into`. A bound launch (`LeanLaunch`)
    packs the last `n_fixed` arguments of the order once (`pack_fixed`) and hands them
    over as one more bytes item; `n_fixed` None: every argument is packed per call.
    `address` is the array of pointers, in the kernel's parameter order, that
    `cuLaunchKernel` reads the parameters through. The driver copies them at the launch
    (a CUDA graph captures the copy), so the buffer is reused at once; `lock` keeps
    another thread from packing it while the driver reads it.
    """

    def __init__(self, name: str, function, argument_types, order, n_fixed=None):
        self.name = name
        self.function = function
        codes = [parameter_codes(t) for t in argument_types]
        self.codes = tuple(chain.from_iterable(codes))     # kernel order
        self.counts = tuple(map(len, codes))               # parameters per argument
        items = [item_format(argument_types[i]) for i in order]
        split = len(order) - (n_fixed or 0)
        self._fixed = struct.Struct("<" + "".join(items[split:]))
        fixed_item = [] if n_fixed is None else [f"{self._fixed.size}s"]
        self._struct = struct.Struct("<" + "".join(items[:split] + fixed_item))
        slots, first = {}, 0
        for i in order:
            slots[i] = first
            first += len(codes[i])
        self.buffer = ctypes.create_string_buffer(self._struct.size)
        base = ctypes.addressof(self.buffer)
        pointers = [base + SLOT * (slots[i] + j) for i in range(len(codes))
                    for j in range(len(codes[i]))]
        self._pointers = (ctypes.c_void_p * max(1, len(pointers)))(*pointers)
        self.address = ctypes.addressof(self._pointers)
        self.pack = self._struct.pack_into
        self.lock = threading.Lock()

    def pack_fixed(self, values) -> bytes:
        """The fixed arguments (the last `n_fixed` of the order: each array's packed
        fields, each scalar's value) as the one bytes item a bound launch's calls pass."""
        return self._fixed.pack(*values)

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
        self._bound = {}       # bound launches' DriverLaunch by signature and layout
        self._arrays = self._scalars = None
        self._order = None

    def __call__(self, grid, block, stream, *args):
        if self._arrays is None:
            self._bind(args)
        arrays = self._arrays(args)
        try:
            types, _, fields = zip(*map(argument_of, arrays))
        except AttributeError:
            types, _, fields = zip(*map(self._described, arrays))
        scalars = self._scalars(args)
        key = (types, *map(type, scalars))
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = self._specialise(args, self._order)
        with launch.lock:     # one buffer per signature: held until the driver has read it
            launch.pack(launch.buffer, 0, *fields, *scalars)
            driver.launch(launch, grid, block, stream)

    def bind(self, grid, block, stream, *args) -> "LeanLaunch":
        """This kernel's launch on `grid`, `block` and `stream` with `args`, each call
        passing the `PER_CALL` ones (module doc, `LeanLaunch`)."""
        return LeanLaunch(self, grid, block, stream, args)

    def _bind(self, args) -> None:
        positions = tuple(i for i, arg in enumerate(args) if is_device_array(arg))
        if not positions:
            raise TypeError(f"{self.name}: a kernel launched here takes device arrays")
        scalars = tuple(i for i in range(len(args)) if i not in positions)
        self._order = positions + scalars
        self._arrays = picker(positions)
        self._scalars = picker(scalars)

    def _described(self, array):
        if not is_device_array(array):
            raise TypeError(f"{self.name}: argument {type(array).__name__} where its first "
                            f"launch passed a device array")
        return describe(array)

    def bound_launch(self, args, order: tuple, n_fixed: int) -> DriverLaunch:
        """The `DriverLaunch` of `args`' signature laid out in `order`, its last `n_fixed`
        arguments packed once (a bound launch's; made once per signature and layout)."""
        key = (tuple(self._described(a)[0] if is_device_array(a) else type(a)
                     for a in args), order, n_fixed)
        launch = self._bound.get(key)
        if launch is None:
            launch = self._bound[key] = self._specialise(args, order, n_fixed)
        return launch

    def _specialise(self, args, order: tuple, n_fixed=None) -> DriverLaunch:
        specialised = self.dispatcher.specialize(*args)
        kernel, = specialised.overloads.values()
        if kernel.cooperative or kernel.debug or kernel.extensions:
            raise TypeError(f"{self.name}: cooperative kernels, debug kernels and argument "
                            f"extensions are launched by Numba, not here")
        return DriverLaunch(self.name, function_handle(kernel), kernel.argument_types, order,
                            n_fixed)


class LeanLaunch:
    """A `LeanKernel` bound to a grid, block, stream and every argument but the
    `PER_CALL` ones (`LeanKernel.bind`); `launch(*values)` passes those, in order.

    The grid, block and stream are converted and the fixed arguments described once.
    They sit after the call's arguments in the buffer (a `DriverLaunch` whose order is
    the call's arrays, the call's scalars, then the fixed arguments), packed once into
    one bytes item, so a call describes its own arrays, looks its signature up (the Numba
    type of each of its arrays, the Python type of each of its scalars) and packs
    `(*its arrays, *its scalars, fixed)`. Which of a call's arguments are arrays is fixed
    by the first call.
    """

    __slots__ = ("kernel", "grid", "block", "stream", "args", "_handle", "_fixed_values",
                 "_fixed_order", "_fixed", "_places", "_order", "_arrays", "_scalars",
                 "_count", "_launches")

    def __init__(self, kernel: LeanKernel, grid, block, stream, args: tuple):
        self.kernel = kernel
        self.grid, self.block, self.stream = dim3(grid), dim3(block), stream
        self._handle = stream_handle(stream)
        self.args = args
        self._places = tuple(i for i, arg in enumerate(args) if arg is PER_CALL)
        fixed = [i for i, arg in enumerate(args) if arg is not PER_CALL]
        arrays = [i for i in fixed if is_device_array(args[i])]
        scalars = [i for i in fixed if i not in arrays]
        self._fixed_values = (*(kernel._described(args[i])[2] for i in arrays),
                              *(args[i] for i in scalars))
        self._fixed_order = (*arrays, *scalars)
        self._fixed = None         # the fixed arguments packed, once the layout is known
        self._order = self._arrays = self._scalars = self._count = None
        self._launches = {}

    def arguments(self, values: tuple) -> tuple:
        """The kernel's whole argument list for a call passing `values`."""
        return merge(self.args, values)

    def __call__(self, *values):
        if len(values) != self._count:
            self._split(values)      # the first call (or one refused there)
        try:
            described = tuple(map(argument_of, self._arrays(values)))
        except AttributeError:
            described = tuple(map(self.kernel._described, self._arrays(values)))
        scalars = self._scalars(values)
        key = (tuple(map(type_name_of, described)), *map(type, scalars))
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches[key] = self._resolve(values)
        lock = launch.lock    # the kernel's buffer for this signature and layout
        lock.acquire()
        try:
            launch.pack(launch.buffer, 0, *map(packed_of, described), *scalars, self._fixed)
            driver.send(launch, self.grid, self.block, self._handle)
        finally:
            lock.release()

    def _split(self, values) -> None:
        """Which of a call's arguments are arrays (from the first call), and the buffer
        order that follows."""
        if len(values) != len(self._places) or self._count is not None:
            raise TypeError(f"{self.kernel.name}: a bound launch takes "
                            f"{len(self._places)} per-call arguments, got {len(values)}")
        arrays = tuple(i for i, value in enumerate(values) if is_device_array(value))
        if not arrays:
            raise TypeError(f"{self.kernel.name}: a bound launch's per-call arguments "
                            f"include a device array")
        scalars = tuple(i for i in range(len(values)) if i not in arrays)
        self._order = (*(self._places[i] for i in arrays),
                       *(self._places[i] for i in scalars), *self._fixed_order)
        self._arrays = picker(arrays)
        self._scalars = picker(scalars)
        self._count = len(values)

    def _resolve(self, values) -> DriverLaunch:
        launch = self.kernel.bound_launch(self.arguments(values), self._order,
                                          len(self._fixed_order))
        if self._fixed is None:    # the fixed arguments' types, so their packing, never change
            self._fixed = launch.pack_fixed(self._fixed_values)
        return launch


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
    """`cuLaunchKernel` of a `DriverLaunch` (the CUDA driver, through `cuda.bindings`):
    `launch` takes any grid, block and stream, `send` them converted (`dim3`,
    `stream_handle`), as a bound launch keeps them; and `copy_to_device`, a step's
    upload as one `cuMemcpyHtoDAsync`."""

    def __init__(self):
        from cuda.bindings import driver as binding
        self._launch = binding.cuLaunchKernel
        self._copy = binding.cuMemcpyHtoDAsync
        self._success = binding.CUresult.CUDA_SUCCESS

    def copy_to_device(self, destination: int, source: int, nbytes: int, stream: int) -> None:
        """Copy `nbytes` from host address `source` (page-locked, to be asynchronous) to
        device address `destination` on stream handle `stream`, without waiting."""
        error = self._copy(destination, source, nbytes, stream)[0]
        if error != self._success:
            from numba.cuda.cudadrv.driver import CudaAPIError
            raise CudaAPIError(error, f"cuMemcpyHtoDAsync of {nbytes} bytes failed: "
                                      f"{error.name}")

    def launch(self, launch: DriverLaunch, grid, block, stream) -> None:
        self.send(launch, dim3(grid), dim3(block), stream_handle(stream))

    def send(self, launch: DriverLaunch, grid: tuple, block: tuple, stream: int) -> None:
        gx, gy, gz = grid
        bx, by, bz = block
        error = self._launch(launch.function, gx, gy, gz, bx, by, bz, 0, stream,
                             launch.address, 0)[0]
        if error != self._success:
            from numba.cuda.cudadrv.driver import CudaAPIError
            raise CudaAPIError(error, f"cuLaunchKernel of {launch.name} (grid {grid}, block "
                                      f"{block}) failed: {error.name}")


driver = None if SIMULATOR else Driver()
