"""`Bench`: what every kernel case shares: sizes, the stream, timers, PyTorch (or None),
the roofline, random device data and caches filled through the public API."""
from __future__ import annotations

import contextlib
import statistics
import time

import numpy as np

import kvnumba as kv
import kvnumba.device as kv_device

from .sizes import Sizes, gpu_available, ratio


def _torch():
    """PyTorch where it is installed with CUDA, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


class Bench:
    """Shared state: sizes, the stream, timers, torch (or None) and the roofline."""

    def __init__(self, sizes: Sizes):
        self.sizes = sizes
        self.cuda = kv_device.cuda
        self.timed = gpu_available()
        self.torch = _torch() if self.timed else None
        if self.torch is not None:
            self.torch_stream = self.torch.cuda.Stream()
            self.stream = self.cuda.external_stream(self.torch_stream.cuda_stream)
        else:
            self.stream = self.cuda.stream()
        self.rng = np.random.default_rng(0)
        self.copy_traffic_gbps = None

    def context(self):
        """Make PyTorch's current stream the cache's stream (a no-op without PyTorch)."""
        if self.torch is None:
            return contextlib.nullcontext()
        return self.torch.cuda.stream(self.torch_stream)

    # -------------------------------------------------------------- timers
    def gpu_ms(self, fn, iters=None):
        """Median GPU ms per call of `fn` (CUDA events around back-to-back calls); None on the
        simulator, which runs the calls once and times nothing."""
        s = self.sizes
        iters = iters or s.iters
        if not self.timed:
            fn()
            return None
        for _ in range(s.warmup):
            fn()
        self.stream.synchronize()
        samples = []
        for _ in range(s.repeats):
            start, end = self.cuda.event(timing=True), self.cuda.event(timing=True)
            start.record(self.stream)
            for _ in range(iters):
                fn()
            end.record(self.stream)
            end.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        return statistics.median(samples)

    def host_us(self, fn, *, wait: bool = False):
        """Median µs for `fn` to return (`wait`: and for the stream to drain: wall time,
        host included). The stream is drained before each sample."""
        if not self.timed:
            return None
        samples = []
        for _ in range(max(5, self.sizes.iters)):
            self.stream.synchronize()
            start = time.perf_counter()
            fn()
            if wait:
                self.stream.synchronize()
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)

    def copy_roofline(self) -> dict:
        """One large device-to-device copy: the read+write traffic bandwidth every
        bandwidth figure is compared with."""
        nbytes = self.sizes.copy_mib << 20
        ms = self._copy_ms(nbytes)
        self.release()                      # the copy's buffers went with `_copy_ms`
        self.copy_traffic_gbps = None if ms is None else 2 * nbytes / ms / 1e6
        return dict(bytes=nbytes, ms=ms, traffic_gbps=self.copy_traffic_gbps)

    def _copy_ms(self, nbytes: int):
        src = self.cuda.device_array(nbytes, dtype=np.uint8, stream=self.stream)
        dst = self.cuda.device_array(nbytes, dtype=np.uint8, stream=self.stream)
        return self.gpu_ms(lambda: dst.copy_to_device(src, stream=self.stream))

    def matmul_tflops(self):
        """A large float16 `torch.matmul`: the dense tensor-core rate prefill is compared with."""
        if self.torch is None:
            return None
        n = self.sizes.matmul
        a = self.torch.randn(n, n, device="cuda", dtype=self.torch.float16)
        b = self.torch.randn(n, n, device="cuda", dtype=self.torch.float16)
        ms = self.gpu_ms(lambda: self.torch.matmul(a, b), iters=max(2, self.sizes.iters // 4))
        return 2 * n ** 3 / ms / 1e9

    def of_copy(self, traffic_bytes, ms):
        """Fraction of the roofline that `traffic_bytes` moved in `ms` reach."""
        return ratio(None if ms is None else traffic_bytes / ms / 1e6, self.copy_traffic_gbps)

    # -------------------------------------------------------------- data
    def random(self, shape, dtype=None):
        """Standard normal values on the device in `dtype`: a Numba device array, or for
        bfloat16 a PyTorch tensor (Numba has no bfloat16; without PyTorch, float32 values
        that the kernels round into bfloat16 storage)."""
        host = self.rng.standard_normal(shape, dtype=np.float32)
        return self._on_device(host, dtype or self.sizes.dtype)

    def empty(self, shape, dtype=None):
        """An output on the device, as `random` makes inputs (zeros: uninitialised host
        memory could hold float32 values float16 cannot, and warn when cast)."""
        return self._on_device(np.zeros(shape, np.float32), dtype or self.sizes.dtype)

    def _on_device(self, host, dtype):
        if dtype == "bfloat16" and self.torch is not None:
            return self.torch.from_numpy(host).to("cuda", self.torch.bfloat16)
        name = "float32" if dtype == "bfloat16" else dtype
        return self.cuda.to_device(host.astype(name), stream=self.stream)

    def release(self):
        """Free what dropped references left behind (between cases)."""
        self.stream.synchronize()
        with contextlib.suppress(Exception):
            self.cuda.current_context().deallocations.clear()
        if self.torch is not None:
            self.torch.cuda.empty_cache()

    def each_released(self, rows_of, items) -> list:
        """The rows of `rows_of(item)` for every item, in order, with each call's device
        memory freed before the next: its caches and sources go with its frame."""
        rows = []
        for item in items:
            rows += rows_of(item)
            self.release()
        return rows

    def cache(self, *, layers, capacity, max_seqs, max_write, max_step, dtype=None):
        """A cache of `layers` on the bench's stream, every page allocated up front."""
        s = self.sizes
        config = kv.CacheConfig(layers=layers, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim,
                                capacity=capacity, max_seqs=max_seqs, max_write=max_write,
                                max_step=max_step, dtype=dtype or s.dtype,
                                initial_pages=capacity)
        return kv.BatchedSequenceCache(config, stream=self.stream)

    def kv_source(self, tokens, dtype=None):
        """Random K and V of `tokens` plus spare rows; fills take shifted slices of them."""
        s = self.sizes
        shape = (tokens + max(64, tokens // 4), s.n_kv_heads, s.head_dim)
        return self.random(shape, dtype), self.random(shape, dtype)

    def fill(self, cache, seqs, targets, k_src, v_src):
        """Advance each sequence of `seqs` to its target (an int, or one per sequence),
        writing K/V on every layer, within max_write per sequence and max_step per step."""
        config = cache.config
        targets = np.broadcast_to(np.asarray(targets), (len(seqs),))
        spare = k_src.shape[0] - config.max_step
        while True:
            parts, used = [], 0
            for seq, target in zip(seqs, targets):
                n = min(int(target) - cache.pos(seq), config.max_write, config.max_step - used)
                if n > 0:
                    parts.append(np.full(n, seq, dtype=np.int64))
                    used += n
                if used == config.max_step:
                    break
            if not parts:
                return
            cache.declare_step(np.concatenate(parts))
            cache.prepare_step()
            off = int(self.rng.integers(0, spare + 1))
            for layer in range(config.n_layers):
                cache.write(layer, k_src[off:off + used], v_src[off:off + used])
            cache.commit_step()

    def q_out(self, tokens, dtype=None, n_q_heads=None):
        """Random queries of `tokens` tokens (of `n_q_heads` heads: by default the
        sizes') and an output for them."""
        s = self.sizes
        shape = (tokens, n_q_heads or s.n_q_heads, s.head_dim)
        return self.random(shape, dtype), self.empty(shape, dtype)
