"""Host-time benchmark of the data path: µs per `write`, `attend` and `update_and_attend`.

A decode step of B sequences (B in {1, 32, 128}; 8 kv / 32 q heads, head_dim 128,
float16, one flat and one ring layer, `HISTORY` positions each) runs through the real
host path of every call: argument checks, array interop, the kernels' host wrappers,
parameter packing. What the machine lacks is replaced and nothing else:

* on a GPU nothing is replaced: the kernels launch (host time is the time a call
  takes to return);
* without one, in `KVNUMBA_DEVICE=compile` mode (numba.cuda in GPU mode, kernels
  compiled to PTX), `fake_device` stands in for the device: allocations get addresses
  but no memory, copies and events do nothing, compiled modules are "loaded" without a
  driver, and a `Recorder` takes the place of `cuLaunchKernel`, recording each launch.

Inputs are given as Numba device arrays ("device") and as foreign objects that only
expose `__cuda_array_interface__`, the way CuPy arrays or PyTorch CUDA tensors reach
kvnumba ("interface"), with `out=` given (the serving pattern). Each row reports the
µs per call over repeated timed blocks (wall-clock median and best, and the median of
this thread's CPU time, steadier on a shared host), the same call's CPU time through
Numba's own launch (`numba_cpu_us`, device arrays: its per-call argument conversion,
with only its final driver call replaced, so the two differ by the launch path alone),
and the launches one call makes (kernel, grid, block).

    python -m kvnumba.bench.host [--quick] [--json PATH]

Without a GPU it runs itself in `KVNUMBA_DEVICE=compile` mode (a subprocess).
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

import numpy as np

import kvnumba as kv
import kvnumba.device as kv_device
from kvnumba.kernels.launch import calling as launch, lean

from .command import section_main

BATCHES = (1, 32, 128)
KINDS = ("device", "interface")
OPS = ("write", "attend", "update_and_attend")
N_KV_HEADS, N_Q_HEADS, HEAD_DIM = 8, 32, 128
HISTORY = 511                    # positions before the step: 512 keys, 2 decode chunks
TARGET_US = 25.0                 # update_and_attend of device arrays, launches recorded


# ---------------------------------------------------------------------------- the fakes
class Launched(NamedTuple):
    """One recorded launch: the kernel's name, grid and block (x, y, z), the stream handle;
    with `Recorder.keep_parameters`, the parameters as the driver would read them, raw
    (bytes per kernel parameter) and decoded (one tuple of values per argument)."""

    name: str
    grid: tuple
    block: tuple
    stream: int
    raw: list | None
    arguments: list | None


_record = tuple.__new__


class Recorder:
    """Stands in for `kvnumba.kernels.launch.lean.driver`: records every launch (`launches`)
    instead of calling `cuLaunchKernel`, after the same grid and stream conversions, and
    counts the uploads it would copy.

    While `counting` (timed loops), a launch is made into its record as ever but only the
    last one is kept (`last`, and `count` of them): a list growing by hundreds of thousands
    of records would put its own allocation and page faults into the timings."""

    def __init__(self, keep_parameters: bool = False):
        self.launches = []
        self.keep_parameters = keep_parameters
        self.counting = False
        self.last, self.count = None, 0
        self.copies = 0

    def record(self, launched) -> None:
        if self.counting:
            self.last = launched
            self.count += 1
        else:
            self.launches.append(launched)

    def launch(self, kernel, grid, block, stream) -> None:
        self.send(kernel, lean.dim3(grid), lean.dim3(block), lean.stream_handle(stream))

    def copy_to_device(self, destination: int, source: int, nbytes: int, stream: int) -> None:
        """An upload: counted (`copies`), not made."""
        self.copies += 1

    def send(self, kernel, grid: tuple, block: tuple, stream: int) -> None:
        if self.keep_parameters:
            raw, arguments = kernel.parameter_bytes(), kernel.parameters()
        else:
            raw = arguments = None
        # a stand-in for the driver call: the record made without NamedTuple's Python-level
        # constructor, so the call's own host time is what the timings show
        self.record(_record(Launched, (kernel.name, grid, block, stream, raw, arguments)))


class _FakeGpu:
    """What Numba asks of the current device when it compiles: an sm_90 part."""

    id = 0
    compute_capability = (9, 0)


class _FakeEvent:
    def record(self, stream=0):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=0):
        pass


class _FakeContext:
    """A CUDA context without a device: allocations are addresses, nothing more."""

    device = _FakeGpu()

    def __init__(self):
        self._next = 1 << 40

    def memalloc(self, size):
        from cuda.bindings import driver as binding
        from numba.cuda.cudadrv.driver import MemoryPointer
        pointer = self._next
        self._next += -(-max(size, 1) // 256) * 256
        return MemoryPointer(self, binding.CUdeviceptr(pointer), size)

    def memhostalloc(self, size, mapped=False, portable=False, wc=False):
        return np.zeros(size, np.uint8)

    def get_default_stream(self):
        return self.create_external_stream(0)

    def create_external_stream(self, ptr):
        from cuda.bindings import driver as binding
        from numba.cuda.cudadrv.driver import Stream
        return Stream(binding.CUstream(ptr), external=bool(ptr))

    def create_event(self, timing=True):
        return _FakeEvent()


class _FakeRuntime:
    def __init__(self):
        self.context = _FakeContext()

    @contextlib.contextmanager
    def ensure_context(self):
        yield

    def get_or_create_context(self, devnum=None):
        return self.context


class _NoDriver:
    """Numba's driver object without a driver: every `cu*` call (copies, event records)
    does nothing."""

    def __getattr__(self, name):
        if not name.startswith("cu"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class _LoadedModule:
    initialized = True


class _LoadedFunction:
    """A compiled kernel as if its module were loaded: a name and a (made-up) handle."""

    module = _LoadedModule()
    kernel = None

    def __init__(self, name: str, handle: int):
        self.name, self.handle = name, handle


def _loaded_function(library):
    found = library.__dict__.get("_bench_function")
    if found is None:
        found = library._bench_function = _LoadedFunction(library.name, id(library))
    return found


@contextlib.contextmanager
def fake_device(recorder: Recorder):
    """Run kvnumba in `KVNUMBA_DEVICE=compile` mode as if a GPU were there, recording
    launches into `recorder` (see the module doc); everything is restored on exit."""
    from numba.cuda import codegen
    from numba.cuda.cudadrv import devices, driver

    if kv_device.KIND != "compile":
        raise RuntimeError(f"fake_device needs KVNUMBA_DEVICE=compile (running on the "
                           f"{kv_device.KIND})")
    saved = (devices._runtime, driver.driver, codegen.CUDACodeLibrary.get_cufunc,
             lean.driver)
    devices._runtime, driver.driver = _FakeRuntime(), _NoDriver()
    codegen.CUDACodeLibrary.get_cufunc = _loaded_function
    lean.driver = recorder
    try:
        yield recorder
    finally:
        (devices._runtime, driver.driver, codegen.CUDACodeLibrary.get_cufunc,
         lean.driver) = saved


@contextlib.contextmanager
def numba_launch(recorder: Recorder):
    """Launch through Numba's dispatcher (`kernel[grid, block, stream](*args)`) instead of
    kvnumba's lean path (plain and bound launches), with only its final driver call
    (`cuda.core.launch`) recorded."""
    from numba.cuda import dispatcher

    def call(self, grid, block, stream, *args):
        kernels = self.__dict__.setdefault("_bench_numba", {})
        key = tuple(map(launch._type_key, args))
        kernel = kernels.get(key)
        if kernel is None:
            kernel = kernels[key] = self.dispatcher.specialize(*args)
        kernel[grid, block, stream](*args)

    def bound(self, *values):
        call(self.kernel, self.grid, self.block, self.stream, *self.arguments(values))

    def recorded(stream, config, kernel, *kernel_args):
        recorder.record(Launched("", config.grid, config.block, 0, None, None))

    saved = lean.LeanKernel.__call__, lean.LeanLaunch.__call__, dispatcher.launch
    lean.LeanKernel.__call__, lean.LeanLaunch.__call__, dispatcher.launch = \
        call, bound, recorded
    try:
        yield
    finally:
        lean.LeanKernel.__call__, lean.LeanLaunch.__call__, dispatcher.launch = saved


class InterfaceArray:
    """A foreign device array: only `__cuda_array_interface__` (version 3, no stream, as
    PyTorch exports it), over the memory of a Numba device array."""

    def __init__(self, array):
        self._array = array
        self.shape, self.dtype = array.shape, array.dtype

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "strides": None, "typestr": self.dtype.str,
                "data": (self._array.device_ctypes_pointer.value, False), "version": 3}


# ---------------------------------------------------------------------------- the step
def make_cache(batch: int):
    """A cache with `batch` sequences at `HISTORY` positions, a decode step prepared."""
    config = kv.CacheConfig(layers=[kv.flat(), kv.ring(window=4096)], n_kv_heads=N_KV_HEADS,
                            head_dim=HEAD_DIM, capacity=4096, max_seqs=max(BATCHES),
                            max_write=HISTORY, max_step=HISTORY, dtype="float16",
                            initial_pages=1024)
    cache = kv.BatchedSequenceCache(config)
    for seq in range(batch):
        cache.seq_new()
        cache.declare_step([seq] * HISTORY)      # positions only: a step without writes
        cache.prepare_step()
        cache.commit_step()
    cache.declare_step(np.arange(batch))
    cache.prepare_step()
    return cache


def make_inputs(batch: int, kind: str) -> dict:
    cuda = kv_device.cuda
    arrays = dict(q=cuda.device_array((batch, N_Q_HEADS, HEAD_DIM), np.float16),
                  k=cuda.device_array((batch, N_KV_HEADS, HEAD_DIM), np.float16),
                  v=cuda.device_array((batch, N_KV_HEADS, HEAD_DIM), np.float16),
                  out=cuda.device_array((batch, N_Q_HEADS, HEAD_DIM), np.float16))
    if kind == "interface":
        arrays = {name: InterfaceArray(a) for name, a in arrays.items()}
    return arrays


def calls(cache, inputs) -> dict:
    """One call of each op, per layer: `op(layer)`."""
    q, k, v, out = inputs["q"], inputs["k"], inputs["v"], inputs["out"]
    return {"write": lambda layer: cache.write(layer, k, v),
            "attend": lambda layer: cache.attend(layer, q, out=out),
            "update_and_attend": lambda layer: cache.update_and_attend(layer, q, k, v,
                                                                       out=out)}


class Timed(NamedTuple):
    """One op's µs per call: wall-clock median and best block, thread CPU time median and
    best block."""
    us: float
    best_us: float
    cpu_us: float
    best_cpu_us: float


def _time(ops: dict, layers, recorder, *, repeats: int, budget_s: float) -> dict:
    """`Timed` per entry of `ops` (name -> `(op, context)`: `op(layer)` is called in
    `context()`) over `repeats` timed blocks of back-to-back calls each: wall-clock time,
    and this thread's CPU time (which time spent waiting for a core does not inflate);
    `recorder` counts the launches meanwhile.

    The ops take their blocks in turn, many short ones: on a shared virtual machine whole
    stretches of a second or more run at half speed (every figure, Numba's alike, doubles
    at once). Interleaved, every op sees the same host, its best block is the call's own
    cost and its median shows what the host added."""
    calls = {}
    for name, (op, context) in ops.items():
        with context():
            calls[name] = _calls_per_block(op, layers, budget_s / repeats / len(ops))
    wall = {name: [] for name in ops}
    cpu = {name: [] for name in ops}
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()
    recorder.counting = True
    try:
        for _ in range(repeats):
            for name, (op, context) in ops.items():
                with context():
                    block_wall, block_cpu = _block(op, layers, calls[name])
                wall[name].append(block_wall)
                cpu[name].append(block_cpu)
    finally:
        recorder.counting = False
        if gc_was:
            gc.enable()
    return {name: Timed(statistics.median(wall[name]), min(wall[name]),
                        statistics.median(cpu[name]), min(cpu[name])) for name in ops}


def _calls_per_block(op, layers, block_s: float) -> int:
    """Rounds over `layers` that take about `block_s`, once `op` is warm."""
    for layer in layers:
        op(layer)                               # warm: compiled, described, grown
    start = time.perf_counter()
    for layer in layers:
        op(layer)
    one = max((time.perf_counter() - start) / len(layers), 1e-7)
    return max(1, int(block_s / one / len(layers)))


def _block(op, layers, rounds: int) -> tuple:
    """(wall, CPU) µs per call of `rounds` rounds of `op` over `layers`."""
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(rounds):
        for layer in layers:
            op(layer)
    calls = rounds * len(layers)
    return ((time.perf_counter() - start) / calls * 1e6,
            (time.thread_time() - start_cpu) / calls * 1e6)


def _launches_of(op, layer, recorder) -> list:
    before = len(recorder.launches)
    op(layer)
    return [(r.name, r.grid, r.block) for r in recorder.launches[before:]]


def run(quick: bool = False, batches=BATCHES, kinds=KINDS, numba: bool = True) -> dict:
    """Time every (B, input kind, op); returns the figures as a dict."""
    repeats, budget = (3, 0.05) if quick else (40, 4.0)
    recorder = Recorder()
    fake = kv_device.KIND == "compile"
    rows = []
    with fake_device(recorder) if fake else contextlib.nullcontext():
        for batch in batches:
            cache = make_cache(batch)
            layers = range(cache.config.n_layers)
            for kind in kinds:
                ops = calls(cache, make_inputs(batch, kind))
                timed = {name: (op, contextlib.nullcontext) for name, op in ops.items()}
                compare = fake and numba and kind == "device"
                if compare:
                    timed.update({("numba", name): (op, lambda: numba_launch(recorder))
                                  for name, op in ops.items()})
                figures = _time(timed, layers, recorder, repeats=repeats, budget_s=budget)
                for name in OPS:
                    row = dict(batch=batch, kind=kind, op=name, **figures[name]._asdict())
                    if fake:
                        row["launches"] = _launches_of(ops[name], 0, recorder)
                        recorder.launches.clear()
                    if compare:
                        row["numba_cpu_us"] = figures["numba", name].best_cpu_us
                    rows.append(row)
    result = dict(device=kv_device.KIND, launches_replaced=fake, quick=quick, rows=rows,
                  target_us=TARGET_US)
    worst = [r["best_cpu_us"] for r in rows
             if r["op"] == "update_and_attend" and r["kind"] == "device"]
    if worst:
        result["update_and_attend_us"] = max(worst)
        result["meets_target"] = max(worst) <= TARGET_US
    return result


# ---------------------------------------------------------------------------- report
HEADER = (f"{'B':>4} {'inputs':<10} {'call':<18} {'µs/call':>8} {'best':>7} {'CPU µs':>7} "
          f"{'best CPU':>8} {'Numba CPU':>9}  launches (kernel grid x block)")


def _format_row(row) -> str:
    numba = f"{row['numba_cpu_us']:>9.1f}" if "numba_cpu_us" in row else f"{'':>9}"
    launches = ", ".join(f"{name} {grid[0]}x{block[0]}"
                         for name, grid, block in row.get("launches", ()))
    return (f"{row['batch']:>4} {row['kind']:<10} {row['op']:<18} {row['us']:>8.1f} "
            f"{row['best_us']:>7.1f} {row['cpu_us']:>7.1f} {row['best_cpu_us']:>8.1f} {numba}  "
            f"{launches}")


def header_lines(result) -> list:
    how = ("launches recorded instead of cuLaunchKernel (KVNUMBA_DEVICE=compile, no GPU)"
           if result["launches_replaced"] else "kernels launched on the GPU")
    return ["data path host time: µs per call of one layer (wall-clock median of timed "
            "blocks, best block; thread CPU time, median and best block)",
            f"  decode step, {N_KV_HEADS} kv / {N_Q_HEADS} q heads, head_dim {HEAD_DIM}, "
            f"float16, {HISTORY + 1} keys; {how}; Numba CPU: the same call through "
            f"Numba's launch (best CPU block)",
            f"  target: update_and_attend <= {TARGET_US:.0f} CPU µs, best block (device "
            f"arrays)"]


def report(result: dict) -> str:
    lines = header_lines(result) + [HEADER] + [_format_row(r) for r in result["rows"]]
    if "update_and_attend_us" in result:
        met = "met" if result["meets_target"] else "MISSED"
        lines.append(f"  update_and_attend, worst B: {result['update_and_attend_us']:.1f} CPU "
                     f"µs, best block (target <= {TARGET_US:.0f}: {met})")
    return "\n".join(lines)


def run_anywhere(quick: bool = False) -> dict:
    """`run`, here on a GPU or in compile mode; from the simulator, in a subprocess in
    `KVNUMBA_DEVICE=compile` mode (the device is chosen when kvnumba is imported).
    Compile mode compiles the kernels without a GPU: where NVRTC or libNVVM cannot be
    found, this raises the `MissingTool` naming the `sass` extra instead."""
    from .prerequisites import missing_compiler

    if kv_device.KIND != "gpu":
        missing = missing_compiler("data path host time")
        if missing is not None:
            raise missing
    if not kv_device.SIMULATOR:
        return run(quick=quick)
    return in_compile_mode("kvnumba.bench.host", quick)


def in_compile_mode(module: str, quick: bool) -> dict:
    """The figures of `python -m <module> --json` run in a subprocess in
    `KVNUMBA_DEVICE=compile` mode (the device is chosen when kvnumba is imported)."""
    env = dict(os.environ, KVNUMBA_DEVICE="compile")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "figures.json")
        subprocess.run([sys.executable, "-m", module, "--json", path,
                        *(["--quick"] if quick else [])], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        with open(path) as figures:
            return json.load(figures)


def main(argv=None) -> int:
    return section_main(argv, "python -m kvnumba.bench.host", __doc__, run_anywhere, report,
                        "short run (a few ms per case)")


if __name__ == "__main__":
    raise SystemExit(main())
