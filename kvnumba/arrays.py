"""Arrays in and out of the data path: NumPy, device arrays and PyTorch tensors (contract §8).

Kernels see one convention: a Numba device array of float16, float32, or (bfloat16)
its bit patterns as uint16, since Numba has no bfloat16 type. This module checks what
callers pass (`check`, `check_out`: `ShapeError` before any launch), turns it into
that convention without a copy where the data already lives on the device
(`device_view`), and hands results back in the caller's kind (`Result`): NumPy for
NumPy (bfloat16 as `ml_dtypes.bfloat16`), a tensor on q's device for a PyTorch q, a
device array for a device array.

PyTorch is optional: a tensor is recognised by its type's module, and `torch` is only
imported for a tensor that was passed in.
"""
from __future__ import annotations

import numpy as np

from .device import SIMULATOR, cuda
from .errors import ShapeError

BFLOAT16 = "bfloat16"


def is_torch(array) -> bool:
    """A `torch.Tensor` (told without importing torch)."""
    return type(array).__module__.split(".")[0] == "torch" and hasattr(array, "requires_grad")


def on_device(array) -> bool:
    """Already on the device: Numba's arrays (the simulator's too), CuPy arrays, PyTorch CUDA
    tensors, anything with `__cuda_array_interface__`."""
    if is_torch(array):
        return array.is_cuda
    return hasattr(array, "__cuda_array_interface__") or hasattr(array, "copy_to_host")


def is_array(array) -> bool:
    """What the data path accepts: NumPy arrays, device arrays, PyTorch tensors."""
    return isinstance(array, np.ndarray) or is_torch(array) or on_device(array)


def dtype_name(array) -> str | None:
    """"float16", "float32", "bfloat16", ... of any array (torch's too), or None."""
    dtype = getattr(array, "dtype", None)
    if dtype is None:
        return None
    if is_torch(array):
        return str(dtype).rsplit(".", 1)[-1]
    try:
        return np.dtype(dtype).name
    except TypeError:
        return None


def kernel_dtype(name: str) -> np.dtype:
    """The dtype a device array of elements `name` has for the kernels (bfloat16: uint16)."""
    return np.dtype(np.uint16) if name == BFLOAT16 else np.dtype(name)


def host_dtype(name: str) -> np.dtype:
    """The NumPy dtype of elements `name` on the host (bfloat16: `ml_dtypes.bfloat16`)."""
    if name != BFLOAT16:
        return np.dtype(name)
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)


def check(name: str, array, shape: tuple | None, dtypes) -> None:
    """Refuse (`ShapeError`) a non-array, a tensor that requires grad, or an array of the
    wrong rank, shape or dtype. `shape=None` checks only the kind and the dtype."""
    if not is_array(array):
        raise ShapeError(f"{name}: expected a NumPy, PyTorch or device array"
                         f"{'' if shape is None else f' of shape {tuple(shape)}'} "
                         f"and dtype in {list(dtypes)}, got {type(array).__name__}")
    if is_torch(array) and array.requires_grad:
        raise ShapeError(f"{name}: the tensor requires grad; the cache is not "
                         f"differentiable: pass {name}.detach()")
    got_shape = tuple(array.shape)
    if shape is not None and len(got_shape) != len(shape):
        raise ShapeError(f"{name}: expected rank {len(shape)} {tuple(shape)}, got rank "
                         f"{len(got_shape)} {got_shape}")
    if shape is not None and got_shape != tuple(shape):
        raise ShapeError(f"{name}: expected shape {tuple(shape)}, got {got_shape}")
    if dtype_name(array) not in dtypes:
        raise ShapeError(f"{name}: dtype {dtype_name(array)} not in {list(dtypes)}")


def check_out(name: str, out, shape: tuple, dtypes) -> None:
    """`check`, and a host `out` must be writeable."""
    check(name, out, shape, dtypes)
    if isinstance(out, np.ndarray) and not out.flags.writeable:
        raise ShapeError(f"{name}: the NumPy array is read-only; pass a writeable array "
                         f"(or none, to get a new one)")


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
    if hasattr(array, "copy_to_host"):           # a Numba device array (or the simulator's)
        return array
    if is_torch(array) and array.is_cuda:
        if dtype_name(array) == BFLOAT16:
            import torch
            return cuda.as_cuda_array(array.detach().view(torch.int16)).view(np.uint16)
        return cuda.as_cuda_array(array.detach())
    if on_device(array):                         # CuPy, ...: the CUDA array interface
        return cuda.as_cuda_array(array)
    return cuda.to_device(np.ascontiguousarray(host_view(array)), stream=stream)


def aligned(array, alignment: int) -> bool:
    """Whether a device array's data starts at a multiple of `alignment` bytes."""
    if SIMULATOR:
        return array._ary.ctypes.data % alignment == 0
    pointer = array.device_ctypes_pointer.value
    return pointer is None or pointer % alignment == 0


class Result:
    """Where an attention output goes, and what the call returns.

    `Result(q, out, shape, stream)`: `device` is the device array the kernels write;
    `value()` returns `out` itself when one was given (a host `out` filled from the
    device), else a new array of q's kind and dtype: a tensor on q's device for PyTorch,
    NumPy for NumPy, the device array for device arrays.
    """

    def __init__(self, q, out, shape, stream):
        self.q, self.out, self.stream = q, out, stream
        self.handle = None
        if out is not None and on_device(out):
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
        if out is not None and on_device(out):
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
