"""The lean launch path: what it packs for each kernel, and what a decode step launches.

On a GPU kvnumba launches its kernels through `cuLaunchKernel` with a parameter buffer
it packs itself (`kvnumba.kernels.launch.calling`); the simulator keeps Numba's dispatcher. The
lean path is checked here without a GPU, in `KVNUMBA_DEVICE=compile` mode (kernels
compiled to PTX) with `bench.host.fake_device` standing in for the device and a
recorder in place of `cuLaunchKernel`:

* packing: every parameter the lean path hands the driver is, byte for byte, what
  Numba's own launch would hand it for the same arguments (`_Kernel._prepare_args`,
  packed by cuda.core's `ParamHolder`);
* a decode step: which storage, inputs, tables, scalars and stream its launches get.

Under the simulator (the suite's default) one test runs this file again in compile
mode; the tests of pure helpers run in any mode.
"""
import ctypes
import importlib
import os
import subprocess
import sys

import numpy as np
import pytest

import kvnumba.device as kv_device
from kvnumba.kernels.launch import abi, calling as launch, lean
from kvnumba.kernels.launch.calling import DeviceView

COMPILE = kv_device.KIND == "compile"
compile_mode = pytest.mark.skipif(not COMPILE, reason="KVNUMBA_DEVICE=compile only (run by "
                                                      "test_the_compile_mode_checks_pass)")


# ---------------------------------------------------------------------------- any mode
@pytest.mark.parametrize("shape", [(3,), (4, 5), (2, 3, 4), (1, 7, 1, 2)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int32])
def test_dense_strides_and_fields_are_numpys(shape, dtype):
    array = np.empty(shape, dtype)
    assert abi.c_strides(shape, array.itemsize) == array.strides
    fields = abi.array_fields(1234, shape, array.strides, array.itemsize)
    assert fields == (0, 0, array.size, array.itemsize, 1234, *shape, *array.strides)
    assert fields[abi.POINTER] == 1234


def _numpy_views():
    base = np.arange(2 * 3 * 8, dtype=np.float16).reshape(2, 3, 8)
    return [base, base[:, :, ::2], base.transpose(1, 0, 2), base[:, 1:2], base[1:2, :, :],
            np.broadcast_to(base[:, :1], (2, 3, 8)), base[:, 1:, :], base.reshape(6, 8)[1:]]


@pytest.mark.parametrize("view", _numpy_views(), ids=lambda a: f"{a.shape}{a.strides}")
def test_a_view_is_c_contiguous_exactly_when_numpy_says_so(view):
    """NumPy's own flag is the reference: strides of a C-ordered array, any stride on an
    axis of extent 1."""
    got = DeviceView(view, view.ctypes.data, view.shape, view.strides, view.dtype)
    assert got.is_c_contiguous() == view.flags.c_contiguous
    assert got._numba_type_.layout == ("C" if view.flags.c_contiguous else "A")
    assert got._numba_type_.ndim == view.ndim and got.size == view.size
    fields = (0, 0, view.size, 2, view.ctypes.data, *view.shape, *view.strides)
    name, described, packed = getattr(got, abi.ARGUMENT)
    assert (name, described) == (got._numba_type_.name, fields)
    assert packed == np.array(fields, "<i8").tobytes()       # as the launch buffer holds them


def test_launch_extents_are_three_dimensional():
    assert lean.dim3(5) == (5, 1, 1)
    assert lean.dim3((2, 3)) == (2, 3, 1)
    assert lean.dim3((np.int64(2), 3, 4)) == (2, 3, 4)
    assert lean.stream_handle(0) == 0


@pytest.mark.skipif(COMPILE, reason="a cache needs the simulator or a GPU")
def test_the_launch_key_moves_with_the_buffers_the_launches_use():
    """Storage that grows moves: steps of the same shape get a new key once it has, so a
    CUDA graph captured before is never replayed on memory the cache let go."""
    import kvnumba as kv
    config = kv.CacheConfig(layers=[kv.flat()], n_kv_heads=1, head_dim=16, capacity=64,
                            max_seqs=2, max_write=8, max_step=8, dtype="float16",
                            page_size=8, initial_pages=2)     # the scratch page and one
    cache = kv.BatchedSequenceCache(config)
    seq = cache.seq_new()
    keys = []
    for _ in range(10):       # positions 0 .. 9: the pool of 2 pages grows to 4 at position 8
        plan = cache.declare_step([seq])
        cache.prepare_step()
        keys.append(plan.launch_key)
        cache.commit_step()
    assert len(set(keys[:8])) == 1 and keys[7] != keys[8] == keys[9]


@pytest.mark.skipif(COMPILE, reason="a cache needs the simulator or a GPU")
def test_tables_that_outgrow_the_staging_buffer_grow_it_and_arrive_whole():
    """Alternating one-token spans of two long sequences: every span is a decode segment
    cut into several chunks, more work rows than the buffer sized for usual steps holds.
    The device buffer then holds each token's column and position, the segment table
    and each window's work and combine tables, at the offsets the launches read."""
    import kvnumba as kv
    from kvnumba.kernels import decode
    from kvnumba.data.routing import upload_entries
    config = kv.CacheConfig(layers=[kv.flat(), kv.ring(window=300)], n_kv_heads=1,
                            head_dim=16, capacity=2048, max_seqs=2, max_write=64,
                            max_step=128, dtype="float16", initial_pages=2048)
    cache = kv.BatchedSequenceCache(config)
    a, b = cache.seq_new(), cache.seq_new()
    for _ in range(31):                    # positions only: steps that write nothing
        cache.declare_step([a] * 64 + [b] * 60)
        cache.prepare_step()
        cache.commit_step()
    ids = [a, b] * 32
    plan = cache.declare_step(ids)
    cache.prepare_step(70)
    staged = cache._steps.upload.device.copy_to_host()
    assert cache._steps.upload.size > upload_entries(config)
    cursor = {a: 31 * 64, b: 31 * 60}
    positions = []
    for seq in ids:
        positions.append(cursor[seq])
        cursor[seq] += 1
    width = 70
    assert staged[:width].tolist() == ids + [config.max_seqs] * 6        # padding: scratch
    assert staged[width:2 * width].tolist() == positions + [0] * 6
    assert (plan.seq_cols == staged[:width]).all()
    assert (plan.positions == staged[width:2 * width]).all()
    info = plan.seq_info
    assert (staged[2 * width:2 * width + info.size] == info.ravel()).all()
    routes = cache._steps.step.routes
    assert routes.decode_chunks[0].n_items > 6 * len(info)     # the flat layer's long keys
    for mask_code, placed in routes.decode_chunks.items():
        want = decode.chunk_tables(info, np.arange(len(info)), mask_code=mask_code)
        assert placed.n_items == want.n_items and placed.n_combine == want.n_combine
        work = staged[placed.work_off:placed.work_off + want.work.size]
        combine = staged[placed.combine_off:placed.combine_off + want.combine.size]
        assert (work == want.work.ravel()).all() and (combine == want.combine.ravel()).all()
        run = routes.decode_runs[mask_code]
        assert run.tables is cache._steps.upload.device and run.seq_info_off == 2 * width
    cache.abort_step()


@pytest.mark.skipif(COMPILE or kv_device.KIND == "gpu",
                    reason="runs the compile-mode checks from the simulator")
def test_the_compile_mode_checks_pass():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["KVNUMBA_DEVICE"] = "compile"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
                           "no:cacheprovider", "-rs", __file__], env=env, capture_output=True,
                          text=True, timeout=1800, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "compile only" not in proc.stdout          # nothing skipped for want of the mode


# ---------------------------------------------------------------------------- compile mode
def _param_holder():
    from cuda import bindings
    major = bindings.__version__.split(".")[0]
    try:
        module = importlib.import_module(f"cuda.core.cu{major}._kernel_arg_handler")
    except ImportError:
        module = importlib.import_module("cuda.core._kernel_arg_handler")
    return module.ParamHolder


def _width(value) -> int:
    """Bytes `ParamHolder` copies for one of Numba's kernel arguments."""
    if isinstance(value, bool):
        return 1
    if isinstance(value, int):
        return 8                                   # intptr_t
    if isinstance(value, np.generic):
        return value.itemsize
    return ctypes.sizeof(value)


def _numba_array(array):
    """A Numba device array over the same memory (what Numba's launch is given)."""
    if type(array) is DeviceView:
        return kv_device.cuda.from_cuda_array_interface(array.__cuda_array_interface__,
                                                        owner=array)
    return array


def numba_parameters(kernel, args, stream) -> list:
    """The bytes Numba's own launch hands the driver for `args`, parameter by parameter."""
    specialised = kernel.dispatcher.specialize(*args)
    compiled, = specialised.overloads.values()
    values = []
    for argument_type, arg in zip(compiled.argument_types, map(_numba_array, args)):
        compiled._prepare_args(argument_type, arg, stream, [], values)
    holder = _param_holder()(values)
    pointers = (ctypes.c_void_p * len(values)).from_address(holder.ptr)
    return [ctypes.string_at(pointers[i], _width(v)) for i, v in enumerate(values)]


@pytest.fixture
def device():
    from kvnumba.bench import host
    recorder = host.Recorder(keep_parameters=True)
    with host.fake_device(recorder):
        yield host, recorder


@pytest.fixture
def calls(monkeypatch):
    """Every launch, of a `LeanKernel` or of a bound `LeanLaunch`: (kernel, grid, block,
    stream, the kernel's whole argument list)."""
    seen = []
    plain, bound = lean.LeanKernel.__call__, lean.LeanLaunch.__call__

    def spy(self, grid, block, stream, *args):
        seen.append((self, grid, block, stream, args))
        plain(self, grid, block, stream, *args)

    def spy_bound(self, *values):
        seen.append((self.kernel, self.grid, self.block, self.stream, self.arguments(values)))
        bound(self, *values)

    monkeypatch.setattr(lean.LeanKernel, "__call__", spy)
    monkeypatch.setattr(lean.LeanLaunch, "__call__", spy_bound)
    return seen


@compile_mode
@pytest.mark.parametrize("kind", ["device", "interface"])
@pytest.mark.parametrize("padding", [0, 3])
def test_each_launch_packs_what_numbas_launch_would(device, calls, kind, padding):
    """A decode step's write, padding, attention and combine launches, then a clone's copy:
    the lean path's parameters equal Numba's, field for field, byte for byte."""
    host, recorder = device
    cache = host.make_cache(4)
    cache.abort_step()
    cache.declare_step(np.arange(4))
    cache.prepare_step(4 + padding)
    inputs = host.make_inputs(4 + padding, kind)
    for layer in range(cache.config.n_layers):
        cache.update_and_attend(layer, inputs["q"], inputs["k"], inputs["v"],
                                out=inputs["out"], scale=0.3, softcap=None if layer else 5.0)
    cache.commit_step()
    cache.seq_clone(1)
    names = {kernel.name for kernel, *_ in calls}
    # write, decode, combine (two chunks of keys), the clone's copy; zeroing the padding
    assert len(names) >= 4 + bool(padding) and len(calls) == len(recorder.launches)
    for (kernel, _, _, stream, args), record in zip(calls, recorder.launches):
        assert record.raw == numba_parameters(kernel, args, stream), kernel.name


@compile_mode
def test_steps_of_one_shape_bind_their_launches_once(device, calls, monkeypatch):
    """A decode loop whose steps keep their shape (batch, chunk counts, width) binds its
    write, decode and combine launches in the first step only; every launch of every step
    still packs what Numba's launch would."""
    host, recorder = device
    binds = []
    bind = lean.LeanKernel.bind
    monkeypatch.setattr(lean.LeanKernel, "bind",
                        lambda self, *args: binds.append(self.name) or bind(self, *args))
    cache = host.make_cache(4)
    cache.abort_step()
    inputs = host.make_inputs(4, "device")
    first = len(calls)
    bound = []
    for _ in range(3):               # 512, 513, 514 keys: two chunks each time
        cache.declare_step(np.arange(4))
        cache.prepare_step()
        before = len(binds)
        for layer in range(cache.config.n_layers):
            cache.update_and_attend(layer, inputs["q"], inputs["k"], inputs["v"],
                                    out=inputs["out"])
        bound.append(len(binds) - before)
        cache.commit_step()
    assert bound[0] >= 3 and bound[1:] == [0, 0], bound
    # write, decode and combine per layer and step; the step to position 512 takes a page
    # for each sequence: one page-table patch launch in its prepare_step
    stepped = [kernel.name for kernel, *_ in calls[first:]]
    assert len(stepped) == 3 * 3 * cache.config.n_layers + 1
    assert stepped.count("_patch_pages") == 1
    assert len(calls) == len(recorder.launches)
    for (kernel, _, _, stream, args), record in zip(calls, recorder.launches):
        assert record.raw == numba_parameters(kernel, args, stream), kernel.name


def _probe_kernel():
    """A kernel of every parameter kind the lean path packs: arrays of 1 to 3 dimensions
    (one strided), signed and unsigned integers, float32, float64 and bool."""
    cuda = kv_device.cuda

    @cuda.jit
    def probe(a, b, i32, f32, f64, flag, u64, c):
        if cuda.grid(1) == 0 and flag:
            a[0] = f32 + f64 + i32 + u64 + b[0, 0, 0] + c[0, 0]

    return launch.Specialised(probe)


@compile_mode
def test_every_parameter_kind_packs_what_numbas_launch_would(device, calls):
    host, recorder = device
    cuda = kv_device.cuda
    base = cuda.device_array((4, 6, 8), np.float16)
    strided = DeviceView(base, base.device_ctypes_pointer.value, (4, 3, 8), (96, 32, 2),
                         np.dtype(np.float16))
    args = (cuda.device_array(5, np.float32), strided, np.int32(-7), np.float32(0.1), 2.5,
            True, np.uint64(2 ** 63 + 5), cuda.device_array((3, 2), np.int32))
    probe = _probe_kernel()
    probe((2, 3), 64, 0, *args)
    (kernel, _, _, stream, passed), = calls
    record, = recorder.launches
    assert record.raw == numba_parameters(kernel, passed, stream)
    assert record.grid == (2, 3, 1) and record.block == (64, 1, 1)
    assert record.arguments[2:7] == [(-7,), (np.float32(0.1),), (2.5,), (True,), (2 ** 63 + 5,)]
    assert record.arguments[1][abi.POINTER:] == (strided.ptr, 4, 3, 8, 96, 32, 2)


@compile_mode
def test_a_bound_launch_packs_what_numbas_launch_would_for_each_call(device, calls):
    """Fixed arrays and scalars between the per-call ones; per-call arrays of two
    signatures (C-contiguous, then strided) and two scalar values."""
    host, recorder = device
    cuda = kv_device.cuda
    base = cuda.device_array((4, 6, 8), np.float16)
    strided = DeviceView(base, base.device_ctypes_pointer.value, (4, 3, 8), (96, 32, 2),
                         np.dtype(np.float16))
    probe = _probe_kernel()
    fixed = cuda.device_array((3, 2), np.int32)
    bound = probe.bind((2, 3), 64, cuda.external_stream(0x99), launch.PER_CALL,
                       launch.PER_CALL, np.int32(-7), launch.PER_CALL, 2.5, True,
                       np.uint64(2 ** 63 + 5), fixed)
    first = cuda.device_array(5, np.float32)
    for b, f32 in ((cuda.device_array((4, 3, 8), np.float16), 0.1), (strided, 0.2),
                   (cuda.device_array((4, 3, 8), np.float16), 0.3)):
        bound(first, b, np.float32(f32))
    assert len(calls) == len(recorder.launches) == 3
    for (kernel, _, _, stream, args), record in zip(calls, recorder.launches):
        assert record.raw == numba_parameters(kernel, args, stream)
        assert record.grid == (2, 3, 1) and record.block == (64, 1, 1)
        assert record.stream == 0x99
    assert [r.arguments[3] for r in recorder.launches] == [(np.float32(f),)
                                                            for f in (0.1, 0.2, 0.3)]
    assert recorder.launches[1].arguments[1][abi.POINTER:] == (strided.ptr, 4, 3, 8, 96,
                                                                  32, 2)
    with pytest.raises(TypeError, match="3 per-call"):
        bound(first, strided)


@compile_mode
def test_the_driver_gets_each_launch_as_culaunchkernel_takes_it(device, monkeypatch):
    """Function, grid, block, no dynamic shared memory, the stream's handle, and the
    kernel parameters through the launch's pointer array; a failure names the kernel."""
    from cuda.bindings import driver as binding
    from numba.cuda.cudadrv.driver import CudaAPIError
    seen, result = [], [binding.CUresult.CUDA_SUCCESS]
    real = lean.Driver()
    monkeypatch.setattr(real, "_launch", lambda *a: seen.append(a) or (result[0],))
    monkeypatch.setattr(lean, "driver", real)
    cuda = kv_device.cuda
    args = (cuda.device_array(5, np.float32), cuda.device_array((4, 3, 8), np.float16),
            np.int32(1), np.float32(1), 1.0, False, np.uint64(1),
            cuda.device_array((3, 2), np.int32))
    probe = _probe_kernel()
    probe(7, (32, 4), cuda.external_stream(0x77), *args)
    (function, *grid_block, shared, stream, params, extra), = seen
    specialised, = probe._launches.values()
    assert function == specialised.function and grid_block == [7, 1, 1, 32, 4, 1]
    assert shared == 0 and stream == 0x77 and extra == 0 and params == specialised.address
    pointers = (ctypes.c_void_p * len(specialised.codes)).from_address(params)
    assert ctypes.c_int64.from_address(pointers[4]).value == args[0].device_ctypes_pointer.value
    result[0] = binding.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaAPIError, match="probe"):
        probe(7, 32, 0, *args)


@compile_mode
def test_a_decode_step_launches_each_layer_on_its_own_storage_and_the_caches_stream(device):
    host, recorder = device
    kv = host.kv
    stream = kv_device.cuda.external_stream(0x5150)
    config = kv.CacheConfig(layers=[kv.flat(), kv.ring(window=64)], n_kv_heads=2, head_dim=128,
                            capacity=512, max_seqs=4, max_write=300, max_step=300,
                            dtype="float16", initial_pages=512)
    cache = kv.BatchedSequenceCache(config, stream=stream)
    for seq in range(3):
        cache.seq_new()
        cache.declare_step([seq] * (100 * seq + 1))
        cache.prepare_step()
        cache.commit_step()
    plan = cache.declare_step([2, 0, 1])
    cache.prepare_step()
    cuda = kv_device.cuda
    q, out = (cuda.device_array((3, 8, 128), np.float16) for _ in range(2))
    k, v = (cuda.device_array((3, 2, 128), np.float16) for _ in range(2))

    def pointer(array):
        return array.device_ctypes_pointer.value

    stores = [{pointer(cache.layer_data(layer)[0]), pointer(cache.layer_data(layer)[1])}
              for layer in range(2)]
    for layer, (rows, window) in enumerate([(0, 0), (64 + 300 - 1, 64)]):
        recorder.launches.clear()
        cache.update_and_attend(layer, q, k, v, out=out, scale=0.25)
        write, *attention = recorder.launches
        assert all(r.stream == 0x5150 for r in recorder.launches)
        arrays = [{a[abi.POINTER] for a in r.arguments if len(a) > 1} for r in
                  recorder.launches]
        scalars = [[a[0] for a in r.arguments if len(a) == 1] for r in recorder.launches]
        assert {pointer(k), pointer(v)} | stores[layer] <= arrays[0]
        assert not arrays[0] & stores[1 - layer]
        assert rows in scalars[0] and plan.n_tokens in scalars[0]
        first = attention[0]
        assert {pointer(q), pointer(out)} | stores[layer] <= arrays[1]
        assert not arrays[1] & stores[1 - layer]
        assert rows in scalars[1] and window in scalars[1] and 0.25 in scalars[1]
        assert first.grid[0] >= plan.n_tokens          # at least a block per segment


@compile_mode
def test_a_kernel_refuses_a_host_array_where_it_took_a_device_array(device):
    host, _ = device
    from kvnumba.kernels import padding
    out = kv_device.cuda.device_array((4, 2, 16), np.float16)
    padding.zero_rows(out, 2, 0)
    with pytest.raises(TypeError, match="ndarray"):
        padding.zero_rows(np.zeros((4, 2, 16), np.float16), 2, 0)


@compile_mode
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_a_torch_tensor_reaches_the_kernels_as_a_view_of_its_memory(dtype):
    torch = pytest.importorskip("torch")
    from kvnumba.data.arrays import _torch_view
    tensor = torch.zeros(4, 3, 16, dtype=getattr(torch, dtype))
    for t in (tensor, tensor.transpose(0, 1), tensor[:, 1:2]):
        view = _torch_view(t)
        host = t.view(torch.int16).numpy() if dtype == "bfloat16" else t.numpy()
        assert type(view) is DeviceView and view.owner is t
        assert view.ptr == t.data_ptr() == host.ctypes.data
        assert view.shape == host.shape and view.strides == host.strides
        assert view.dtype == (np.dtype(np.uint16) if dtype == "bfloat16" else host.dtype)
        assert view.is_c_contiguous() == host.flags.c_contiguous == t.is_contiguous()


@compile_mode
def test_an_interface_array_that_names_a_stream_goes_through_numba(device):
    """CUDA array interface v3: a consumer waits on the exporter's stream; Numba does."""
    host, _ = device
    from kvnumba.data.arrays import device_view
    base = kv_device.cuda.device_array((4, 8), np.float32)

    class WithStream(host.InterfaceArray):
        @property
        def __cuda_array_interface__(self):
            return dict(super().__cuda_array_interface__, stream=7)

    assert type(device_view(host.InterfaceArray(base))) is DeviceView
    view = device_view(WithStream(base))
    assert type(view) is not DeviceView
    assert view.device_ctypes_pointer.value == base.device_ctypes_pointer.value
