"""Device selection (contract §11) and array interop."""
import subprocess
import sys

import numpy as np
import pytest

import kvnumba as kv
from kvnumba import device
from kvnumba.device import cuda


def python(code, **env):
    import os
    full = {k: v for k, v in os.environ.items() if k not in ("KVNUMBA_DEVICE",
                                                           "NUMBA_ENABLE_CUDASIM")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full,
                          timeout=120)


def test_forced_simulator_is_silent_and_enables_numba_cudasim():
    r = python("import kvnumba, numba.core.config as c; print(kvnumba.device.KIND, "
               "c.ENABLE_CUDASIM)", KVNUMBA_DEVICE="simulator")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["simulator", "1"] and "no CUDA GPU" not in r.stderr


def test_compile_only_kind_puts_numba_in_gpu_mode_without_the_simulator():
    """`KVNUMBA_DEVICE=compile` (no GPU needed): numba.cuda in GPU mode, and `ptx` binds
    the PTX intrinsics rather than the simulator's functions."""
    r = python("import kvnumba, numba.core.config as c; from kvnumba.kernels.intrinsics import tensorcore; "
               "print(kvnumba.device.KIND, kvnumba.device.SIMULATOR, c.ENABLE_CUDASIM, "
               "type(tensorcore.mma_f16_f32).__name__)", KVNUMBA_DEVICE="compile")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["compile", "False", "0", "_Intrinsic"]
    assert "no CUDA GPU" not in r.stderr


def test_unknown_device_name_is_refused():
    r = python("import kvnumba", KVNUMBA_DEVICE="tpu")
    assert r.returncode != 0 and "DeviceError" in r.stderr and "'tpu'" in r.stderr


def test_a_numba_cuda_that_cannot_load_is_a_device_error_naming_versions_and_fix():
    """NumPy 2.5 removed `np.row_stack`, which numba-cuda 0.30 registers for the GPU target:
    import must fail at once with the versions and the fix, not in the first compile."""
    r = python("import numpy; del numpy.row_stack; import kvnumba", KVNUMBA_DEVICE="compile")
    assert r.returncode != 0 and "DeviceError" in r.stderr
    for text in ("numpy " + np.__version__, "numba-cuda", "row_stack", "numpy>=1.24,<2.5"):
        assert text in r.stderr, (text, r.stderr[-600:])
    ok = python("import kvnumba; print(kvnumba.device.KIND)", KVNUMBA_DEVICE="compile")
    assert ok.returncode == 0 and ok.stdout.strip() == "compile", ok.stderr


@pytest.mark.skipif(not device.SIMULATOR, reason="only meaningful on a machine without a GPU")
def test_gpu_requested_without_one_is_a_clear_error():
    r = python("import kvnumba", KVNUMBA_DEVICE="gpu")
    assert r.returncode != 0 and "KVNUMBA_DEVICE=gpu" in r.stderr and "no GPU" in r.stderr


@pytest.mark.skipif(not device.SIMULATOR, reason="only meaningful on a machine without a GPU")
def test_auto_choice_prints_one_notice_line_when_the_first_cache_is_built():
    r = python("import kvnumba; print(kvnumba.device.KIND)")
    assert r.returncode == 0 and r.stdout.strip() == "simulator"
    assert "kvnumba:" not in r.stderr          # an import (or a --help) says nothing
    r = python("import kvnumba as kv; c = kv.CacheConfig(); kv.BatchedSequenceCache(c); "
               "kv.BatchedSequenceCache(c)")
    assert r.returncode == 0, r.stderr
    assert len([line for line in r.stderr.splitlines() if "kvnumba:" in line]) == 1


@pytest.mark.skipif(not device.SIMULATOR, reason="only meaningful on a machine without a GPU")
def test_numba_imported_first_is_reconfigured_before_numba_cuda():
    r = python("import numba; import kvnumba; from numba import cuda; "
               "print(kvnumba.device.KIND, cuda.simulator is not None)",
               KVNUMBA_DEVICE="simulator")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[0] == "simulator"


def make():
    cfg = kv.CacheConfig(layers=[kv.flat()], n_kv_heads=1, head_dim=4, capacity=8, max_seqs=2,
                         max_write=4, max_step=4, dtype="float32", initial_pages=4)
    return kv.BatchedSequenceCache(cfg)


def test_device_arrays_are_used_in_place():
    rng = np.random.default_rng(0)
    c = make()
    s = c.seq_new()
    c.declare_step([s, s])
    c.prepare_step(3)
    k = rng.standard_normal((3, 1, 4)).astype(np.float32)
    q = rng.standard_normal((3, 2, 4)).astype(np.float32)
    d_k, d_q = cuda.to_device(k), cuda.to_device(q)
    d_out = cuda.device_array((3, 2, 4), np.float16)
    got = c.update_and_attend(0, d_q, d_k, d_k, out=d_out)
    assert got is d_out                      # written in place, the caller's dtype kept
    out = d_out.copy_to_host().astype(np.float64)
    # token 0 sees only itself: softmax over one key returns its value exactly
    np.testing.assert_allclose(out[0], np.repeat(k[0], 2, axis=0), rtol=1e-3)
    np.testing.assert_array_equal(out[2], 0)  # the padding row
    host = c.attend(0, q)                    # NumPy in, NumPy out, q's dtype
    assert isinstance(host, np.ndarray) and host.dtype == np.float32
    np.testing.assert_allclose(host, out, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(device.SIMULATOR, reason="__cuda_array_interface__ needs a real device")
def test_foreign_cuda_arrays_are_used_without_a_copy():
    class Foreign:  # any producer of the CUDA array interface (CuPy, PyTorch, ...)
        def __init__(self, arr):
            self._arr = arr
            self.shape, self.dtype = arr.shape, arr.dtype
            self.__cuda_array_interface__ = arr.__cuda_array_interface__

    c = make()
    s = c.seq_new()
    c.declare_step([s])
    c.prepare_step()
    k = cuda.to_device(np.ones((1, 1, 4), np.float32))
    out = cuda.device_array((1, 1, 4), np.float32)
    c.write(0, Foreign(k), Foreign(k))
    c.attend(0, Foreign(k), out=Foreign(out))
    np.testing.assert_allclose(out.copy_to_host(), 1.0)


@pytest.mark.skipif(not device.SIMULATOR, reason="a workaround for the simulator only")
def test_simulator_shared_arrays_are_shared_by_every_thread_of_a_block():
    """numba-cuda's simulator allocates `cuda.shared.array` check-then-insert without a
    lock; kvnumba serialises it. 64 threads released together must get one array."""
    import threading

    from numba.cuda.simulator import kernelapi

    for _ in range(20):
        shared = kernelapi.FakeCUDAShared(0)
        start = threading.Barrier(64)
        got = []

        def worker():
            start.wait()
            got.append(id(shared.array((4,), np.float32)))  # one call site for all

        threads = [threading.Thread(target=worker) for _ in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(got)) == 1


def test_attention_launch_is_repeatable_on_the_device():
    """The same launch, many times: identical bits (a shared-memory race would differ)."""
    from kvnumba.kernels import generic as attention
    from kvnumba.kernels.workspace import AttentionWorkspace

    rng = np.random.default_rng(3)
    k = cuda.to_device(rng.standard_normal((8, 1, 4)).astype(np.float32))  # one page of 8
    pages = cuda.to_device(np.zeros((2, 1), np.int32))
    q = cuda.to_device(rng.standard_normal((2, 2, 4)).astype(np.float32))
    tables = cuda.to_device(np.array([0, 2, 0, 0, 0, 0], np.int32))  # one segment, served
    ws = AttentionWorkspace()
    runs = []
    for _ in range(30):
        out = cuda.device_array((2, 2, 4), np.float32)
        attention.attend(q, k, k, tables, out, pages=pages, page_bits=3, seq_info_off=0,
                         segments_off=5, n_segments=1,
                         max_q_len=2, max_kv_len=2, ring_rows=0, mask_code=0, scale=0.5,
                         softcap=0.0, workspace=ws)
        runs.append(out.copy_to_host())
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])


def small_config(max_seqs=2):
    return kv.CacheConfig(layers=[kv.flat()], n_kv_heads=1, head_dim=16, capacity=8,
                          max_seqs=max_seqs, max_write=2, max_step=2, dtype="float32",
                          initial_pages=4)


def test_the_cache_is_placed_on_the_device_asked_for():
    current = 0 if device.SIMULATOR else cuda.get_current_device().id
    assert kv.BatchedSequenceCache(small_config()).device == current
    assert kv.BatchedSequenceCache(small_config(), device=0).device == 0
    assert kv.BatchedSequenceCache(small_config(), device=cuda.gpus[0]).device == 0
    assert kv.SequenceCache(small_config(1), device=0)._inner.device == 0
    for bad, match in ((device.GPU_COUNT, r"CUDA device ids \[0, "), (-1, r"CUDA device ids \[0, "),
                       (True, "int CUDA device id"), ("cuda:0", "int CUDA device id")):
        with pytest.raises(kv.ConfigError, match=match):
            kv.BatchedSequenceCache(small_config(), device=bad)
        with pytest.raises(kv.ConfigError, match=match):
            kv.SequenceCache(small_config(1), device=bad)


class OtherDeviceArray:
    """Device memory that says, as CuPy's arrays do, which device it is on."""

    def __init__(self, host, device_id):
        self.device = device_id
        self.shape, self.dtype = host.shape, host.dtype
        self.__cuda_array_interface__ = {"shape": host.shape, "typestr": host.dtype.str,
                                         "data": (host.ctypes.data, False), "version": 3,
                                         "strides": None}


@pytest.mark.parametrize("where", ["q", "k", "v", "out"])
def test_an_array_on_another_device_is_refused_naming_both_devices(where):
    from snapshot import assert_unchanged, snapshot
    cache = kv.BatchedSequenceCache(small_config())
    seq = cache.seq_new()
    cache.declare_step([seq])
    cache.prepare_step()
    args = {name: np.ones((1, 1, 16), np.float32) for name in ("q", "k", "v", "out")}
    args[where] = OtherDeviceArray(args[where], cache.device + 1)
    before = snapshot(cache)
    with pytest.raises(kv.ShapeError, match=rf"{where}: the array is on cuda:"
                                            rf"{cache.device + 1}, the cache on "
                                            rf"cuda:{cache.device}"):
        cache.update_and_attend(0, args["q"], args["k"], args["v"], out=args["out"])
    assert_unchanged(before, snapshot(cache))
