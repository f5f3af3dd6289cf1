"""The simulator's block loop gives way as it polls (kvnumba.kernels.intrinsics.simpace):
its threads still report alive while they run and not alive once they return, and a
block with barriers still computes what it computes without the change."""
import threading

import numpy as np
import pytest

from kvnumba import device
from kvnumba.device import cuda

pytestmark = pytest.mark.skipif(not device.SIMULATOR, reason="the simulator's own threads")


def test_a_polled_thread_is_alive_until_it_returns_and_gives_way_first(monkeypatch):
    from kvnumba.kernels.intrinsics import simpace
    from numba.cuda.simulator import kernel
    assert kernel.BlockThread._kvnumba_yields
    slept = []
    monkeypatch.setattr(simpace.time, "sleep", slept.append)
    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    assert kernel.BlockThread.is_alive(thread) and slept == [0]
    release.set()
    thread.join()
    assert not kernel.BlockThread.is_alive(thread) and slept == [0, 0]


def test_a_block_meets_at_its_barriers_as_before():
    """Each of 64 threads adds a neighbour's value 1, 2 and 4 places on over three
    barrier rounds: the result is the sum of the 8 values from its own on (wrapping)."""
    @cuda.jit
    def spread(values, out):
        shared = cuda.shared.array(64, np.int64)
        tid = cuda.threadIdx.x
        shared[tid] = values[tid]
        for step in (1, 2, 4):
            cuda.syncthreads()
            total = shared[tid] + shared[(tid + step) % 64]
            cuda.syncthreads()
            shared[tid] = total
        out[tid] = shared[tid]

    values = np.arange(64, dtype=np.int64) ** 2
    out = cuda.device_array(64, np.int64)
    spread[1, 64](cuda.to_device(values), out)
    want = np.array([values[(np.arange(t, t + 8)) % 64].sum() for t in range(64)])
    assert (out.copy_to_host() == want).all()
