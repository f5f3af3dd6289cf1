"""Arrays in and out of the data path: NumPy, device arrays and PyTorch tensors (contract §8).

Kernels see one convention: a Numba device array of float16, float32, or (bfloat16)
its bit patterns as uint16, since Numba has no bfloat16 type. This module checks what
callers pass (`check`, `check_out`: `ShapeError` before any launch), turns it into
that convention without a copy where the data already lives on the device
(`device_view`), and hands results back in the caller's family (`Result`): NumPy for
NumPy (bfloat16 as `ml_dtypes.bfloat16`), a tensor on q's device for a PyTorch q, a
device array for a device array.

PyTorch is optional: a tensor is recognised by its type's module, and `torch` is only
imported for a tensor that was passed in.

Every call of the data path passes through here, so what can be known from an array's
type (which family it is) or from its dtype object (its name) is worked out once per type
or dtype and looked up afterwards; on a GPU, a PyTorch CUDA tensor or a foreign
`__cuda_array_interface__` array reaches the kernels as a `DeviceView` rather than a new
Numba device array per call.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..device import GPU_COUNT, SIMULATOR, cuda, pointer_device
from ..errors import ShapeError
from ..kernels.launch.abi import c_strides
from ..kernels.launch.calling import DeviceView, device_pointer

BFLOAT16 = "bfloat16"

#: what an array is, by its type: told once per type (`_family`)
HOST, TORCH, DEVICE, INTERFACE = "host", "torch", "device", "interface"
_FAMILIES: dict = {}
_DTYPE_NAMES: dict = {}


def _family_of_type(family: type) -> str | None:
    if hasattr(family, "copy_to_host"):               # Numba's device arrays (simulator too,
        return DEVICE                               # and its mapped host arrays)
    if issubclass(family, np.ndarray):
        return HOST
    if family.__module__.split(".")[0] == "torch" and hasattr(family, "requires_grad"):
        return TORCH
    if hasattr(family, "__cuda_array_interface__"):   # CuPy, ...
        return INTERFACE
    return None


def _family(array) -> str | None:
    """HOST, TORCH, DEVICE, INTERFACE or None, from the array's type (cached), or from the
    instance for a type that sets `__cuda_array_interface__` per object."""
    family_type = type(array)
    family = _FAMILIES.get(family_type, False)
    if family is False:
        family = _FAMILIES[family_type] = _family_of_type(family_type)
    if family is None and hasattr(array, "__cuda_array_interface__"):
        return INTERFACE
    return family


def is_torch(array) -> bool:
    """A `torch.Tensor` (told without importing torch)."""
    return _family(array) == TORCH


def on_device(array) -> bool:
    """Already on the device: Numba's arrays (the simulator's too), CuPy arrays, PyTorch CUDA
    tensors, anything with `__cuda_array_interface__`."""
    family = _family(array)
    return family == DEVICE or family == INTERFACE or (family == TORCH and array.is_cuda)


def _name_of_dtype(dtype) -> str | None:
    if type(dtype).__module__.split(".")[0] == "torch":
        return str(dtype).rsplit(".", 1)[-1]
    try:
        return np.dtype(dtype).name
    except TypeError:
        return None


def dtype_name(array) -> str | None:
    """"float16", "float32", "bfloat16", ... of any array (torch's too), or None."""
    dtype = getattr(array, "dtype", None)
    if dtype is None:
        return None
    try:
        name = _DTYPE_NAMES.get(dtype, False)
    except TypeError:             # an unhashable "dtype": no dtype the data path takes
        return _name_of_dtype(dtype)
    if name is False:
        name = _DTYPE_NAMES[dtype] = _name_of_dtype(dtype)
    return name


def kernel_dtype(name: str) -> np.dtype:
    """The dtype a device array of elements `name` has for the kernels (bfloat16: uint16)."""
    return np.dtype(np.uint16) if name == BFLOAT16 else np.dtype(name)


def host_dtype(name: str) -> np.dtype:
    """The NumPy dtype of elements `name` on the host (bfloat16: `ml_dtypes.bfloat16`)."""
    if name != BFLOAT16:
        return np.dtype(name)
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def check(name: str, array, shape: tuple | None, dtypes, device: int = 0) -> None:
    """Refuse (`ShapeError`) a non-array, a tensor that requires grad, an array on a
    device other than the host and CUDA device `device` (`array_device`), or an array of
    the wrong rank, shape or dtype. `shape=None` checks only the family, device and dtype."""
    family = _family(array)
    if family is None:
        raise ShapeError(f"{name}: expected a NumPy, PyTorch or device array"
                         f"{'' if shape is None else f' of shape {tuple(shape)}'} "
                         f"and dtype in {list(dtypes)}, got {type(array).__name__}")
    if family == TORCH and array.requires_grad:
        raise ShapeError(f"{name}: the tensor requires grad; the cache is not "
                         f"differentiable: pass {name}.detach()")
    if family != HOST:
        where = array_device(array, family)
        if where is not None and where != device:
            raise ShapeError(f"{name}: the array is on {_device_name(where)}, the cache on "
                             f"cuda:{device}; pass a host array or one on cuda:{device} "
                             f"(e.g. {name}.to('cuda:{device}') for a tensor)")
    if shape is not None and array.shape != shape and tuple(array.shape) != tuple(shape):
        got_shape = tuple(array.shape)
        if len(got_shape) != len(shape):
            raise ShapeError(f"{name}: expected rank {len(shape)} {tuple(shape)}, got rank "
                             f"{len(got_shape)} {got_shape}")
        raise ShapeError(f"{name}: expected shape {tuple(shape)}, got {got_shape}")
    if dtype_name(array) not in dtypes:
        raise ShapeError(f"{name}: dtype {dtype_name(array)} not in {list(dtypes)}")


def check_out(name: str, out, shape: tuple, dtypes, device: int = 0) -> None:
    """`check`, and a host `out` must be writeable."""
    check(name, out, shape, dtypes, device)
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ShapeError(f"{name}: the NumPy array is read-only; pass a writeable array "
                         f"(or none, to get a new one)")


def memory_span(array) -> tuple:
    """`(memory, first byte, end byte)` of the bytes an array's elements occupy (strides
    taken into account), `memory` naming where ("host", or "cuda" with its device), for
    telling whether two arrays overlap; `(memory, 0, 0)` for an array of no elements."""
    family = _family(array)
    if family == HOST:
        pointer, strides, itemsize = array.ctypes.data, array.strides, array.itemsize
        memory = "host"
    elif family == TORCH:
        itemsize = array.element_size()
        pointer, strides = array.data_ptr(), [s * itemsize for s in array.stride()]
        memory = "host" if array.device.type == "cpu" else str(array.device)
    elif family == DEVICE:       # Numba's (the simulator's too): the pointer kept on the array
        pointer, strides, itemsize = device_pointer(array), array.strides, array.dtype.itemsize
        memory = "cuda"
    else:
        interface = array.__cuda_array_interface__
        itemsize = _typestr_dtype(interface["typestr"]).itemsize
        pointer = interface["data"][0] or 0
        strides = interface.get("strides") or c_strides(tuple(interface["shape"]), itemsize)
        memory = "cuda"
    shape = tuple(array.shape)
    if 0 in shape:
        return memory, 0, 0
    low = sum(min(0, s * (n - 1)) for s, n in zip(strides, shape))
    high = sum(max(0, s * (n - 1)) for s, n in zip(strides, shape))
    return memory, pointer + low, pointer + high + itemsize


def overlap(a, b) -> bool:
    """Whether arrays `a` and `b` may share bytes (their spans intersect in one memory)."""
    memory_a, first_a, end_a = memory_span(a)
    memory_b, first_b, end_b = memory_span(b)
    return memory_a == memory_b and first_a < end_b and first_b < end_a


def array_device(array, family: str):
    """Where a non-NumPy array lives, as far as can be told: a CUDA device id (int), a
    non-CUDA device's name (str: a PyTorch "meta", "mps", ... tensor), or None for the
    host or an unknown (assumed current) device.

    A PyTorch tensor says so with its `.device`. Any other array may name its device with
    a `device` attribute, as CuPy's do: an int, or an object with an int `id` (CuPy's
    `Device`) or `index` (a `torch.device`). On a machine with several GPUs, an array
    that names none is asked of the driver (the device its pointer belongs to).
    """
    if family == TORCH:
        where = array.device
        if where.type == "cpu":
            return None
        if where.type != "cuda":
            return where.type
        return where.index if where.index is not None else _torch_current_device()
    named = getattr(array, "device", None)
    if named is not None:
        for field in ("id", "index"):
            value = getattr(named, field, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        if isinstance(named, int) and not isinstance(named, bool):
            return named
    if GPU_COUNT > 1:
        return _pointer_device(array)
    return None


def _device_name(where) -> str:
    return f"cuda:{where}" if isinstance(where, int) else f"the {where} device"


def _torch_current_device() -> int:
    import torch
    return torch.cuda.current_device()


def _pointer_device(array) -> int | None:
    """The ordinal of the device a device array's memory belongs to (the driver's answer),
    or None where it does not say."""
    if _family(array) == DEVICE:
        return pointer_device(device_pointer(array))
    return pointer_device(array.__cuda_array_interface__["data"][0])


def host_view(array) -> np.ndarray:
    """A NumPy view (no copy) of a host array, in the kernels' convention (bfloat16 as
    uint16)."""
    if is_torch(array):
        if dtype_name(array) == BFLOAT16:
            import torch
            return array.detach().view(torch.int16).numpy().view(np.uint16)
        return array.detach().numpy()
    return array.view(np.uint16) if dtype_name(array) == BFLOAT16 else array


def device_view(array, stream=0):
    """A device array of `array` in the kernels' convention: zero-copy for data on the
    device, one upload for host data."""
    family = _family(array)
    if family == DEVICE:                           # a Numba device array (or the simulator's)
        return array
    if family == TORCH and array.is_cuda:
        return _torch_view(array)
    if family == INTERFACE:                        # CuPy, ...: the CUDA array interface
        return _interface_view(array)
    return cuda.to_device(np.ascontiguousarray(host_view(array)), stream=stream)


def _torch_view(tensor):
    """A PyTorch CUDA tensor for the kernels (bfloat16 as its uint16 bits): read from the
    tensor itself, which exports no stream to wait for (its `__cuda_array_interface__`
    has none)."""
    dtype = _TORCH_KERNEL_DTYPES.get(dtype_name(tensor))
    if dtype is None or SIMULATOR:
        import torch
        if dtype_name(tensor) == BFLOAT16:
            return cuda.as_cuda_array(tensor.detach().view(torch.int16)).view(np.uint16)
        return cuda.as_cuda_array(tensor.detach())
    return DeviceView(tensor, tensor.data_ptr(), tuple(tensor.shape),
                      tuple(map(dtype.itemsize.__mul__, tensor.stride())), dtype)


def _interface_view(array):
    """An array known by its `__cuda_array_interface__` only. One that names a stream to
    wait for (or a mask) goes through Numba, which honours both."""
    interface = array.__cuda_array_interface__
    if SIMULATOR or interface.get("stream") is not None or interface.get("mask") is not None:
        return cuda.as_cuda_array(array)
    dtype = _typestr_dtype(interface["typestr"])
    shape = tuple(interface["shape"])
    strides = interface.get("strides")
    strides = c_strides(shape, dtype.itemsize) if strides is None else tuple(strides)
    return DeviceView(array, interface["data"][0] or 0, shape, strides, dtype)


@lru_cache(maxsize=64)
def _typestr_dtype(typestr: str) -> np.dtype:
    """The dtype of an array interface's type string (cached: a few repeat every call)."""
    return np.dtype(typestr)


#: the dtypes the kernels see for a PyTorch tensor of each name
_TORCH_KERNEL_DTYPES = {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
                        BFLOAT16: np.dtype(np.uint16)}


class Result:
    """Where an attention output goes, and what the call returns.

    `Result(q, out, shape, stream)`: `device` is the device array the kernels write;
    `value()` returns `out` itself when one was given (a host `out` filled from the
    device), else a new array of q's family and dtype: a tensor on q's device for PyTorch,
    NumPy for NumPy, the device array for device arrays.
    """

    __slots__ = ("q", "out", "stream", "handle", "in_place", "device")

    def __init__(self, q, out, shape, stream):
        self.q, self.out, self.stream = q, out, stream
        self.handle = None
        self.in_place = out is not None and on_device(out)   # the kernels write `out`
        if self.in_place:
            self.device = device_view(out, stream)
            return
        name = dtype_name(q if out is None else out)
        if out is None and is_torch(q) and q.is_cuda:
            import torch
            self.handle = torch.empty(shape, dtype=q.dtype, device=q.device)
            self.device = device_view(self.handle, stream)
            return
        self.device = cuda.device_array(shape, dtype=kernel_dtype(name), stream=stream)

    def value(self):
        q, out = self.q, self.out
        if self.in_place:
            return out
        if self.handle is not None:
            return self.handle
        if out is None and on_device(q):
            return self.device
        host = self.device.copy_to_host(stream=self.stream)
        if out is not None:
            host_view(out)[...] = host
            return out
        name = dtype_name(q)
        if is_torch(q):
            import torch
            if name == BFLOAT16:
                return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(host)
        return host.view(host_dtype(name)) if name == BFLOAT16 else host
