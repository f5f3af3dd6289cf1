"""Where the kernels run (contract §11): a CUDA GPU, or Numba's CUDA simulator.

Import this module before anything imports `numba.cuda`: Numba reads
`NUMBA_ENABLE_CUDASIM` when it is first configured. `KVNUMBA_DEVICE=gpu|simulator`
forces a choice; otherwise a GPU is used when the CUDA driver reports one, else
the simulator, with a one-line notice on stderr when the first cache is built.
`KVNUMBA_DEVICE=compile` is compile-only: numba.cuda in GPU mode without a GPU, so
kernels can be compiled to PTX / SASS (`python -m kvnumba.bench.sass`) but nothing can be
launched.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
from contextlib import contextmanager, nullcontext

import numpy as np

from .errors import CapacityError, ConfigError, KVCacheError


class DeviceError(KVCacheError):
    """The requested device cannot be used (e.g. `KVNUMBA_DEVICE=gpu` without a GPU)."""


def _driver():
    """The CUDA driver library, or None without one."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _driver_gpu_count() -> int:
    """GPUs the CUDA driver reports, without importing numba.cuda (0 if no driver)."""
    lib = _driver()
    if lib is None:
        return 0
    count = ctypes.c_int(0)
    if lib.cuInit(0) != 0 or lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


_POINTER_DEVICE_ORDINAL = 9   # CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL


def pointer_device(pointer: int) -> int | None:
    """The ordinal of the GPU whose memory `pointer` addresses (the driver's answer), or
    None where the driver cannot tell (host memory, no driver, the simulator)."""
    lib = None if SIMULATOR or not pointer else _driver()
    if lib is None:
        return None
    ordinal = ctypes.c_int(-1)
    if lib.cuPointerGetAttribute(ctypes.byref(ordinal), _POINTER_DEVICE_ORDINAL,
                                 ctypes.c_uint64(pointer)) != 0:
        return None
    return ordinal.value


def _choose() -> str:
    forced = os.environ.get("KVNUMBA_DEVICE", "").strip().lower()
    if forced not in ("", "gpu", "simulator", "compile"):
        raise DeviceError(f"KVNUMBA_DEVICE={forced!r}: must be 'gpu', 'simulator' or "
                          f"'compile'")
    if forced == "compile":
        return "compile"
    if forced == "simulator" or (not forced and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"):
        return "simulator"
    if _driver_gpu_count() > 0:
        return "gpu"
    if forced == "gpu":
        raise DeviceError("KVNUMBA_DEVICE=gpu, but the CUDA driver reports no GPU")
    global _NOTICE
    _NOTICE = ("kvnumba: no CUDA GPU found; running kernels on Numba's CUDA simulator "
               "(correctness only, small sizes)")
    return "simulator"


_NOTICE = None   # said once, when the first cache is built (not for `--help` and the like)
KIND = _choose()
SIMULATOR = KIND == "simulator"
#: the simulator was chosen because no GPU was found, not asked for
FELL_BACK = _NOTICE is not None
#: CUDA devices a cache can be placed on (ids `0 .. GPU_COUNT - 1`); the simulator and
#: compile-only mode have device 0 only
GPU_COUNT = _driver_gpu_count() if KIND == "gpu" else 1


#: the interpreter's thread switch interval while simulated kernels run: the simulator
#: runs each CUDA thread as a Python thread and waits at barriers by polling them.
#: Before its polling loop gave way (`kernels.intrinsics.simpace`) the default 5 ms
#: slice made each barrier cost ~16 ms a block (a model's decode steps 24 s at 5e-3,
#: 35 s at 1e-4, 16 s at 1e-3 on a 2-core host); now 1e-3 and 5e-3 run alike and
#: 2e-4 spends a quarter more time switching
SIMULATOR_SWITCH_INTERVAL = 1e-3


@contextmanager
def simulator_pace():
    """Run the body with the switch interval simulated kernels want (on a GPU: as is)."""
    switch = sys.getswitchinterval()
    if SIMULATOR:
        sys.setswitchinterval(SIMULATOR_SWITCH_INTERVAL)
    try:
        yield
    finally:
        sys.setswitchinterval(switch)


def announce() -> None:
    """Print the one-line notice of an automatic fallback to the simulator, once."""
    global _NOTICE
    if _NOTICE is not None:
        print(_NOTICE, file=sys.stderr)
        _NOTICE = None

if "numba.cuda" in sys.modules:  # too late to choose: it must already be in the right mode
    import numba.core.config
    if bool(numba.core.config.ENABLE_CUDASIM) != SIMULATOR:
        raise DeviceError(f"numba.cuda was imported in the other mode before kvnumba chose "
                          f"{KIND!r}; import kvnumba first, or set NUMBA_ENABLE_CUDASIM="
                          f"{'1' if SIMULATOR else '0'}")
else:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if SIMULATOR else "0"
    if "numba" in sys.modules:  # numba read its config already: make it read again
        import numba.core.config
        numba.core.config.reload_config()

from numba import cuda  # noqa: E402  (must follow the choice above)


def _package_versions() -> str:
    from importlib import metadata
    found = []
    for name in ("numpy", "numba", "numba-cuda"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return ", ".join(found)


def _load_cuda_target() -> None:
    """Load numba-cuda's GPU target now, so an install that cannot work fails at import
    with the versions and the fix, not deep inside the first kernel compile.

    Seen: numba-cuda 0.30.4 registers `np.row_stack`, which NumPy 2.5 removed.
    """
    from numba.cuda.descriptor import cuda_target
    try:
        cuda_target.target_context.refresh()
    except (AttributeError, ImportError) as exc:
        raise DeviceError(f"numba-cuda cannot load its GPU target with this install "
                          f"({_package_versions()}): {type(exc).__name__}: {exc}. kvnumba "
                          f"needs NumPy < 2.5 with numba-cuda 0.30: pip install "
                          f"'numpy>=1.24,<2.5'") from exc


def _compile_only() -> None:
    """Compile-only mode has no device, but Numba asks the current device for its compute
    capability when it compiles a device function called from a kernel: answer sm_90,
    the architecture `python -m kvnumba.bench.sass` reports on."""
    from numba.cuda import dispatcher

    class Sm90:
        compute_capability = (9, 0)

    dispatcher.get_current_device = Sm90


if KIND == "compile":
    _compile_only()
if not SIMULATOR:
    _load_cuda_target()
    if "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS" not in os.environ:
        # a decode step of a few sequences is a small grid by design; Numba would warn on
        # every such launch, and a warning costs host time on the hot path
        from numba.cuda.core import config as _cuda_config
        _cuda_config.CUDA_LOW_OCCUPANCY_WARNINGS = 0


def _aligned_empty(shape, dtype: np.dtype, alignment: int | None) -> np.ndarray:
    """`np.empty(shape, dtype)` starting at a multiple of `alignment` bytes (None: NumPy's
    own alignment)."""
    if alignment is None:
        return np.empty(shape, dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    skip = -raw.ctypes.data % alignment
    return raw[skip:skip + nbytes].view(dtype).reshape(shape)


def _serialise_simulator_shared_arrays() -> None:
    """Make the simulator's `cuda.shared.array` allocation atomic.

    The simulator finds a block's shared array by call site: the first thread to
    get there allocates it, the others look it up. That check-then-insert is not
    locked (numba-cuda 0.30.4), so two threads switching at the wrong moment get
    two different "shared" arrays, and about 1% of launches of a kernel with
    several shared arrays computed garbage at `sys.setswitchinterval(1e-4)`.
    Real GPUs are not affected. It also honours `alignment=` (the simulator refuses it):
    the array then starts at a multiple of `alignment` bytes, as `cp.async` and
    `ldmatrix` destinations must.
    """
    import threading

    from numba.core import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    shared = kernelapi.FakeCUDAShared
    if getattr(shared, "_kvnumba_locked", False):
        return
    allocate = shared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0:  # dynamic: one buffer, not keyed by call site
            return allocate(self, shape, dtype)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)  # the kernel line that asked, as the simulator keys it
        site = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            found = self._allocations.get(site)
            if found is None:
                found = self._allocations[site] = _aligned_empty(shape, np.dtype(dtype),
                                                                 alignment)
        return found

    shared.array = array
    shared._kvnumba_locked = True


if SIMULATOR:
    _serialise_simulator_shared_arrays()


@contextmanager
def allocating(what: str):
    """Turn a failed host or device allocation inside the block into `CapacityError`."""
    try:
        yield
    except KVCacheError:
        raise
    except Exception as exc:  # MemoryError, NumPy's size limits, the driver's out-of-memory
        raise CapacityError(f"{what}: allocation failed ({type(exc).__name__}: {exc})") from exc


def device_id(device) -> int:
    """The id of the CUDA device a cache is placed on: `device` an int id or a Numba
    device (its `id`), None for the current device. `ConfigError` for anything else or
    an id outside `[0, GPU_COUNT)` (the simulator has device 0 only)."""
    if device is None:
        return cuda.get_current_device().id if KIND == "gpu" else 0
    if KIND != "gpu" and not hasattr(device, "id") and hasattr(device, "compute_capability"):
        return 0       # the simulator's (or compile mode's) one device, as Numba gives it
    number = getattr(device, "id", device)
    if isinstance(number, (bool, np.bool_)) or not isinstance(number, (int, np.integer)):
        raise ConfigError(f"device: expected an int CUDA device id or a Numba device, got "
                          f"{device!r} ({type(device).__name__})")
    if not 0 <= number < GPU_COUNT:
        where = "on this machine" if KIND == "gpu" else f"(the {KIND} has device 0 only)"
        raise ConfigError(f"device={int(number)}: outside the CUDA device ids [0, "
                          f"{GPU_COUNT}) {where}; pass one of them, or None for the "
                          f"current device")
    return int(number)


#: the compute capability the 8-bit float conversions need (`cvt` to and from e4m3 /
#: e5m2: PTX 7.8, sm_89)
FP8_CAPABILITY = (8, 9)


def check_storage_capability(dtype: str, device: int) -> None:
    """Refuse 8-bit float storage (`ConfigError` naming the capability) on a GPU older than
    `FP8_CAPABILITY`; the simulator and compile mode (sm_90) take every dtype."""
    if KIND != "gpu" or not dtype.startswith("float8"):
        return
    capability = tuple(cuda.gpus[device].compute_capability)
    if capability < FP8_CAPABILITY:
        raise ConfigError(f"dtype={dtype!r}: 8-bit float storage needs compute capability "
                          f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or later (its conversions "
                          f"are sm_89 instructions); device {device} has "
                          f"{capability[0]}.{capability[1]}: store float16 or bfloat16 on it")


def placed_on(device: int):
    """Make CUDA device `device` current inside the block (a GPU's; nothing to do on the
    simulator or in compile-only mode, which have device 0 only)."""
    return cuda.gpus[device] if KIND == "gpu" else nullcontext()


def on_its_device(method):
    """Decorate a cache method that launches or copies so that it runs with the cache's
    device (`self.device`) current. On a machine with one device there is nothing to
    switch, and the method is returned as it is (no cost per call)."""
    if GPU_COUNT <= 1:
        return method

    @functools.wraps(method)
    def placed(self, *args, **kwargs):
        with cuda.gpus[self.device]:
            return method(self, *args, **kwargs)
    return placed


def torch_stream():
    """A Numba stream for PyTorch's current CUDA stream, for `BatchedSequenceCache(config,
    stream=kvnumba.torch_stream())`: kvnumba's launches then queue behind PyTorch's kernels
    and before the next ones, with no synchronisation. `DeviceError` without a GPU or
    without PyTorch built with CUDA."""
    try:
        import torch
    except ImportError:
        raise DeviceError("torch_stream: PyTorch is not installed (pip install "
                          "-e '.[torch]' in a kvnumba checkout)") from None
    if SIMULATOR or not torch.cuda.is_available():
        raise DeviceError(f"torch_stream: needs a CUDA GPU and PyTorch built with CUDA "
                          f"(kvnumba runs on the {KIND}, torch.cuda.is_available() is "
                          f"{torch.cuda.is_available()})")
    return cuda.external_stream(torch.cuda.current_stream().cuda_stream)


def host_buffer(n: int, dtype) -> np.ndarray:
    """A host buffer for uploads: page-locked on a GPU (async copies), plain in the simulator."""
    return np.zeros(n, dtype=dtype) if SIMULATOR else cuda.pinned_array(n, dtype=dtype)


def upload_prefix(device_array, host: np.ndarray, n: int, stream) -> None:
    """Copy `host[:n]` into the start of `device_array`: one host-to-device copy, no sync."""
    if SIMULATOR:
        device_array.copy_to_device(host, stream=stream)
        return
    from numba.cuda.cudadrv import driver
    driver.host_to_device(device_array, host, n * host.itemsize, stream=stream)
