"""Kernel benchmarks: write, clone, decode and prefill attention, on a CUDA GPU.

Every figure is a ratio against a ceiling or a peer measured in the same run:

* the roofline is one large (1 GiB) device-to-device copy: its read+write traffic
  bandwidth. Write and clone report their own read+write traffic as a fraction of it;
  decode attention reports the K/V bytes it reads (FlashInfer's metric) as a fraction.
* prefill reports TFLOP/s (4 * head_dim * n_q_heads per visible (query, key) pair)
  and its fraction of a large float16 `torch.matmul` measured in the same run.
* peers, where PyTorch with CUDA is installed: `scaled_dot_product_attention`
  (batched, and one call per sequence) and FlashAttention varlen
  (`torch.ops.aten._flash_attention_forward` with `cu_seqlens`), on the same data,
  with the largest |difference| of the outputs as a check.

Cases (float16 storage, 8 kv heads, 32 q heads, head_dim 128): the write of a
4 x 1024 prefill step and of a 256 x 1 decode step; a clone's ring copies (rings of
4096 positions over 4 layers, 64 MiB: flat layers share their pages instead);
decode of B in {1, 32, 128} sequences x {512, 4096, 16384} keys; a skewed decode
batch (64 sequences, `geomspace(32, 32768)` keys) on a flat and on a ring layer
(window 4096); prefill 4 x 1024, 1 x 4096, 4 x 512 after 4096 cached
tokens; a mixed step (4 x 1024 chunks plus 64 decode tokens) against its parts.

GPU ms are CUDA events around back-to-back calls (median of repeats); host µs is
the wall time the Python call takes to return (what a serving loop pays per call);
wall µs (host included) is call + synchronise, for the single-sequence decode.
Every cache is built through the public API on one stream (PyTorch's, when
PyTorch is present, so both libraries' work is timed by the same events).

    python -m bench.kernels [--quick | --smoke]

`--smoke` runs every case at toy sizes, also on Numba's CUDA simulator (no GPU
needed, no timings), to check that the benchmark itself works.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
import traceback

import numpy as np

import kvnumba as kv
import kvnumba.device as kv_device

SKIP_MESSAGE = "no CUDA GPU: kernel benchmarks skipped (--smoke runs them at toy sizes)"


@dataclasses.dataclass(frozen=True)
class Sizes:
    """One run's shapes and case sizes."""

    n_kv_heads: int = 8
    n_q_heads: int = 32
    head_dim: int = 128
    dtype: str = "float16"                    # write, clone and the mixed step
    dtypes: tuple = ("float16", "bfloat16")   # the attention cases, each in every dtype
    copy_mib: int = 1024
    write_prefill: tuple = (4, 1024)          # sequences x tokens
    write_decode: int = 256                   # sequences x 1 token
    clone: tuple = (4096, 4)                  # positions x layers
    decode_batches: tuple = (1, 32, 128)
    decode_histories: tuple = (512, 4096, 16384)
    skewed: tuple = (64, 32, 32768)           # sequences, shortest, longest
    ring_window: int = 4096
    prefill: tuple = (("4x1024", 4, 1024, 0), ("1x4096", 1, 4096, 0),
                      ("4x512@4096", 4, 512, 4096))
    mixed: tuple = (4, 1024, 64, 4096)        # chunks x tokens, decode tokens at history
    matmul: int = 8192
    warmup: int = 5
    iters: int = 20
    repeats: int = 7


FULL = Sizes()
QUICK = dataclasses.replace(FULL, copy_mib=256, decode_batches=(1, 32),
                            decode_histories=(512, 4096), warmup=2, iters=5, repeats=3)
SMOKE = Sizes(n_kv_heads=1, n_q_heads=2, head_dim=16, copy_mib=1, write_prefill=(2, 4),
              write_decode=3, clone=(32, 2), decode_batches=(1, 2), decode_histories=(5,),
              skewed=(3, 2, 9), ring_window=4, prefill=(("2x5", 2, 5, 0), ("1x5@3", 1, 5, 3)),
              mixed=(1, 5, 2, 3), matmul=64, warmup=0, iters=1, repeats=1)

#: targets on an H200-class GPU, as ratios measured in one run
TARGETS = dict(decode_of_copy=0.8, decode_vs_sdpa=0.9, skewed_vs_flash=2.0, write_of_copy=0.8,
               clone_of_copy=0.8, single_decode_wall_us=40.0, prefill_tflops=150.0,
               prefill_vs_flash=0.33)


def gpu_available() -> bool:
    return not kv_device.SIMULATOR


def device_name() -> str:
    if not gpu_available():
        return "simulator"
    name = kv_device.cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _ratio(a, b):
    return None if not a or not b else a / b


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
        src = self.cuda.device_array(nbytes, dtype=np.uint8, stream=self.stream)
        dst = self.cuda.device_array(nbytes, dtype=np.uint8, stream=self.stream)
        ms = self.gpu_ms(lambda: dst.copy_to_device(src, stream=self.stream))
        del src, dst
        self.release()
        self.copy_traffic_gbps = None if ms is None else 2 * nbytes / ms / 1e6
        return dict(bytes=nbytes, ms=ms, traffic_gbps=self.copy_traffic_gbps)

    def matmul_tflops(self):
        """A large float16 `torch.matmul`: the dense tensor-core rate prefill is compared with."""
        if self.torch is None:
            return None
        n = self.sizes.matmul
        a = self.torch.randn(n, n, device="cuda", dtype=self.torch.float16)
        b = self.torch.randn(n, n, device="cuda", dtype=self.torch.float16)
        ms = self.gpu_ms(lambda: self.torch.matmul(a, b), iters=max(2, self.sizes.iters // 4))
        del a, b
        return 2 * n ** 3 / ms / 1e9

    def of_copy(self, traffic_bytes, ms):
        """Fraction of the roofline that `traffic_bytes` moved in `ms` reach."""
        return _ratio(None if ms is None else traffic_bytes / ms / 1e6, self.copy_traffic_gbps)

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

    def cache(self, *, layers, capacity, max_seqs, max_write, max_step, dtype=None):
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

    def q_out(self, tokens, dtype=None):
        s = self.sizes
        shape = (tokens, s.n_q_heads, s.head_dim)
        return self.random(shape, dtype), self.empty(shape, dtype)


# ---------------------------------------------------------------------------- peers
class Peers:
    """PyTorch's attention on the cache's own data: SDPA and FlashAttention varlen."""

    def __init__(self, bench: Bench):
        self.bench = bench
        self.torch = bench.torch
        self.sizes = bench.sizes

    def tensor(self, array, dtype):
        """A torch view of a device array of elements `dtype` (the cache's bfloat16
        storage: uint16 bits), or the tensor itself."""
        torch = self.torch
        if isinstance(array, torch.Tensor):
            return array
        if dtype == "bfloat16":
            return torch.as_tensor(array.view(np.int16), device="cuda").view(torch.bfloat16)
        return torch.as_tensor(array, device="cuda")

    def packed_kv(self, cache, layer, seqs, lengths):
        """`[sum(lengths), n_kv_heads, d]` K and V of each sequence's positions in order
        (ring layers: the last `lengths` positions, unwrapped), and `cu_seqlens_k`."""
        torch = self.torch
        config = cache.config
        ring = int(config.ring_rows()[layer])
        page = config.page_size
        k_store, v_store = (self.tensor(a, config.dtype).reshape(-1, config.n_kv_heads,
                                                                 config.head_dim)
                            for a in cache.layer_data(layer))     # slots [pages x page]
        parts_k, parts_v = [], []
        for seq, length in zip(seqs, lengths):
            end = cache.pos(seq)
            positions = torch.arange(end - length, end, device="cuda")
            rows = positions % ring if ring else positions
            table = torch.as_tensor(cache.page_table(seq, layer).astype(np.int64),
                                    device="cuda")
            slots = table[rows // page] * page + rows % page
            parts_k.append(k_store[slots])
            parts_v.append(v_store[slots])
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32, device="cuda")
        cu[1:] = torch.cumsum(torch.as_tensor(lengths, device="cuda"), 0)
        return torch.cat(parts_k), torch.cat(parts_v), cu

    def flash_varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, window=None):
        """`(ms, out)` of FlashAttention varlen through `torch.ops.aten`, or (None, None)."""
        torch = self.torch
        kw = dict(scale=None)
        if window:
            kw.update(window_size_left=window - 1, window_size_right=0)
        op = torch.ops.aten._flash_attention_forward

        def call():
            return op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, **kw)[0]

        try:
            out = call()
        except (RuntimeError, TypeError) as exc:  # an old PyTorch, or no flash kernels
            print(f"  (FlashAttention varlen unavailable: {exc})", file=sys.stderr)
            return None, None
        return self.bench.gpu_ms(call), out

    def sdpa(self, q, k, v, **kw):
        """SDPA with native GQA (PyTorch 2.5+)."""
        return self.torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                                                    **kw)

    def max_diff(self, ours, dtype, theirs):
        return (self.tensor(ours, dtype).float() - theirs.float()).abs().max().item()


# ---------------------------------------------------------------------------- cases
def bench_write(bench) -> list:
    s = bench.sizes
    n_pre, len_pre = s.write_prefill
    n_seqs = max(n_pre, s.write_decode)
    max_step = max(n_pre * len_pre, s.write_decode)
    cache = bench.cache(layers=[kv.flat()], capacity=len_pre, max_seqs=n_seqs,
                        max_write=len_pre, max_step=max_step)
    for _ in range(n_seqs):
        cache.seq_new()
    k_src, v_src = bench.kv_source(max_step)
    rows = []
    for name, ids in ((f"prefill {n_pre}x{len_pre}", np.repeat(np.arange(n_pre), len_pre)),
                      (f"decode {s.write_decode}x1", np.arange(s.write_decode))):
        n = ids.size
        cache.declare_step(ids)
        cache.prepare_step()
        k, v = k_src[:n], v_src[:n]
        ms = bench.gpu_ms(lambda: cache.write(0, k, v))
        host = bench.host_us(lambda: cache.write(0, k, v))
        cache.abort_step()
        nbytes = 2 * n * s.n_kv_heads * s.head_dim * np.dtype(s.dtype).itemsize
        rows.append(dict(case=name, bytes=nbytes, ms=ms, host_us=host,
                         of_copy=bench.of_copy(2 * nbytes, ms)))   # read inputs + write rows
    del cache, k_src, v_src
    bench.release()
    return rows


def bench_clone(bench) -> list:
    """A fork of a sequence holding `tokens` positions on `layers` ring layers of a ring
    of `tokens` positions: flat layers share their pages (nothing to time but the table
    work), ring layers copy theirs, so this is the clone's copy bandwidth."""
    s = bench.sizes
    tokens, layers = s.clone
    chunk = 16
    cache = bench.cache(layers=[kv.ring(window=tokens - chunk + 1)] * layers,
                        capacity=2 * tokens, max_seqs=2, max_write=chunk, max_step=chunk)
    k_src, v_src = bench.kv_source(tokens)
    src = cache.seq_new()
    bench.fill(cache, [src], tokens, k_src, v_src)

    def clone():
        cache.seq_rm(cache.seq_clone(src))

    ms = bench.gpu_ms(clone)
    host = bench.host_us(clone)
    page = cache.config.page_size
    ring_slots = -(-int(cache.config.ring_rows()[0]) // page) * page
    nbytes = layers * 2 * ring_slots * s.n_kv_heads * s.head_dim * np.dtype(s.dtype).itemsize
    del cache, k_src, v_src
    bench.release()
    return [dict(case=f"clone: rings of {tokens} positions x {layers} layers", bytes=nbytes,
                 ms=ms, host_us=host, of_copy=bench.of_copy(2 * nbytes, ms))]


def _decode_row(bench, peers, cache, seqs, lengths, layer=0) -> dict:
    """Time one decode step's attention (the step's own token already written)."""
    s = bench.sizes
    dtype = cache.config.dtype
    batch = len(seqs)
    cache.declare_step(np.asarray(seqs))
    cache.prepare_step()
    k_src = bench.random((batch, s.n_kv_heads, s.head_dim), dtype)
    cache.write(layer, k_src, k_src)
    q, out = bench.q_out(batch, dtype)
    ms = bench.gpu_ms(lambda: cache.attend(layer, q, out=out))
    host = bench.host_us(lambda: cache.attend(layer, q, out=out))
    keys = int(np.sum(lengths)) + batch                     # history plus the new token
    nbytes = keys * 2 * s.n_kv_heads * s.head_dim * cache.config.storage_dtype.itemsize
    row = dict(batch=batch, keys=keys, ms=ms, host_us=host, bytes=nbytes,
               of_copy=bench.of_copy(nbytes, ms))
    if peers is not None:
        window = cache.config.layers[layer].window
        torch = peers.torch
        cache.commit_step()          # the peers read the committed columns
        seen = [min(n + 1, window) if window else n + 1 for n in lengths]
        k, v, cu_k = peers.packed_kv(cache, layer, seqs, seen)
        qt = peers.tensor(q, dtype)
        cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        flash_ms, flash_out = peers.flash_varlen(qt, k, v, cu_q, cu_k, 1, max(seen), window)
        row.update(flash_ms=flash_ms, vs_flash=_ratio(flash_ms, ms))
        if flash_out is not None:
            row["max_abs_diff"] = peers.max_diff(out, dtype, flash_out)
        if not window and len(set(lengths)) == 1:   # equal lengths: SDPA batched and looped
            length = seen[0]
            kt = k.view(batch, length, s.n_kv_heads, s.head_dim).transpose(1, 2)
            vt = v.view(batch, length, s.n_kv_heads, s.head_dim).transpose(1, 2)
            qb = qt.unsqueeze(2)
            row["sdpa_ms"] = bench.gpu_ms(lambda: peers.sdpa(qb, kt, vt))
            each = [(qb[i:i + 1], kt[i:i + 1], vt[i:i + 1]) for i in range(batch)]
            row["sdpa_loop_ms"] = bench.gpu_ms(
                lambda: [peers.sdpa(*args) for args in each], iters=max(2, s.iters // 4))
            row.update(vs_sdpa=_ratio(row["sdpa_ms"], ms),
                       vs_sdpa_loop=_ratio(row["sdpa_loop_ms"], ms))
        return row
    cache.abort_step()
    return row


def bench_decode(bench, peers) -> list:
    return [row for dtype in bench.sizes.dtypes for row in _decode_rows(bench, peers, dtype)]


def _decode_rows(bench, peers, dtype) -> list:
    s = bench.sizes
    n_seqs = max(s.decode_batches)
    capacity = max(s.decode_histories) + 64
    cache = bench.cache(layers=[kv.flat()], capacity=capacity, max_seqs=n_seqs,
                        max_write=min(4096, capacity), max_step=4 * min(4096, capacity),
                        dtype=dtype)
    seqs = [cache.seq_new() for _ in range(n_seqs)]
    k_src, v_src = bench.kv_source(cache.config.max_step, dtype)
    rows = []
    for history in sorted(s.decode_histories):
        for seq in seqs:
            if cache.pos(seq) > history:
                cache.rewind(seq, history)
        bench.fill(cache, seqs, history, k_src, v_src)
        for batch in s.decode_batches:
            rows.append(_guarded(bench, cache, dict(case=f"{batch} x {history}", dtype=dtype),
                                 lambda: _decode_row(bench, peers, cache, seqs[:batch],
                                                     [history] * batch)))
            for seq in seqs[:batch]:     # a committed peer step: back to the history
                if cache.pos(seq) > history:
                    cache.rewind(seq, history)
    single = rows[0] if rows and rows[0].get("batch") == 1 else None
    if single is not None and bench.timed:  # one attend, host included
        cache.declare_step([seqs[0]])
        cache.prepare_step()
        cache.write(0, k_src[:1], v_src[:1])
        q, out = bench.q_out(1, dtype)
        single["wall_us"] = bench.host_us(lambda: cache.attend(0, q, out=out), wait=True)
        cache.abort_step()
    del cache, k_src, v_src
    bench.release()
    return rows


def bench_skewed(bench, peers) -> list:
    s = bench.sizes
    n, shortest, longest = s.skewed
    lengths = np.geomspace(shortest, longest, n).astype(np.int64)
    rows = []
    layers = (("flat", kv.flat()), (f"ring {s.ring_window}", kv.ring(s.ring_window)))
    for dtype in s.dtypes:
        for name, layer in layers:
            max_write = min(64 if layer.is_ring else 4096, longest)
            cache = bench.cache(layers=[layer], capacity=longest + 64, max_seqs=n,
                                max_write=max_write, max_step=max(4 * max_write, n),
                                dtype=dtype)
            seqs = [cache.seq_new() for _ in range(n)]
            k_src, v_src = bench.kv_source(cache.config.max_step, dtype)
            bench.fill(cache, seqs, lengths, k_src, v_src)
            window = layer.window
            seen = np.minimum(lengths, window - 1) if window else lengths  # history read
            rows.append(_guarded(bench, cache, dict(case=f"skewed {n} seqs, {name}",
                                                    dtype=dtype),
                                 lambda: _decode_row(bench, peers, cache, seqs, seen)))
        del cache, k_src, v_src
        bench.release()
    return rows


def _prefill_flops(sizes, n_seqs, q_len, history) -> int:
    """4 * d * n_q_heads per visible (query, key) pair; query i sees history + i + 1 keys."""
    pairs = q_len * history + q_len * (q_len + 1) // 2
    return 4 * sizes.head_dim * sizes.n_q_heads * n_seqs * pairs


def _prefill_row(bench, peers, cache, seqs, q_len, history, matmul) -> dict:
    s = bench.sizes
    dtype = cache.config.dtype
    n = len(seqs)
    tokens = n * q_len
    cache.declare_step(np.repeat(np.asarray(seqs), q_len))
    cache.prepare_step()
    k_new = bench.random((tokens, s.n_kv_heads, s.head_dim), dtype)
    cache.write(0, k_new, k_new)
    q, out = bench.q_out(tokens, dtype)
    ms = bench.gpu_ms(lambda: cache.attend(0, q, out=out), iters=max(2, s.iters // 2))
    host = bench.host_us(lambda: cache.attend(0, q, out=out))
    tflops = None if ms is None else _prefill_flops(s, n, q_len, history) / ms / 1e9
    row = dict(ms=ms, host_us=host, tflops=tflops, of_matmul=_ratio(tflops, matmul))
    if peers is not None:
        torch = peers.torch
        cache.commit_step()
        k, v, cu_k = peers.packed_kv(cache, 0, seqs, [history + q_len] * n)
        qt = peers.tensor(q, dtype)
        cu_q = torch.arange(0, tokens + 1, q_len, dtype=torch.int32, device="cuda")
        flash_ms, flash_out = peers.flash_varlen(qt, k, v, cu_q, cu_k, q_len, history + q_len)
        row.update(flash_ms=flash_ms, vs_flash=_ratio(flash_ms, ms))
        if flash_out is not None:
            row["max_abs_diff"] = peers.max_diff(out, dtype, flash_out)
        return row
    cache.abort_step()
    return row


def bench_prefill(bench, peers, matmul) -> list:
    return [row for dtype in bench.sizes.dtypes
            for row in _prefill_rows(bench, peers, matmul, dtype)]


def _prefill_rows(bench, peers, matmul, dtype) -> list:
    s = bench.sizes
    max_tokens = max(n * q for _, n, q, _ in s.prefill)
    max_q = max(q for _, _, q, _ in s.prefill)
    capacity = max(h + q for _, _, q, h in s.prefill)
    n_seqs = sum(n for _, n, _, _ in s.prefill)
    cache = bench.cache(layers=[kv.flat()], capacity=capacity, max_seqs=n_seqs,
                        max_write=max_q, max_step=max_tokens, dtype=dtype)
    k_src, v_src = bench.kv_source(max_tokens, dtype)
    rows = []
    for name, n, q_len, history in s.prefill:
        seqs = [cache.seq_new() for _ in range(n)]
        bench.fill(cache, seqs, history, k_src, v_src)
        rows.append(_guarded(bench, cache, dict(case=name, dtype=dtype),
                             lambda: _prefill_row(bench, peers, cache, seqs, q_len, history,
                                                  matmul)))
    del cache, k_src, v_src
    bench.release()
    return rows


def bench_mixed(bench) -> list:
    """A step of prefill chunks plus decode tokens, against each part alone."""
    s = bench.sizes
    chunks, chunk, n_decode, history = s.mixed
    cache = bench.cache(layers=[kv.flat()], capacity=history + chunk + 8,
                        max_seqs=chunks + n_decode, max_write=chunk,
                        max_step=chunks * chunk + n_decode)
    prefill = [cache.seq_new() for _ in range(chunks)]
    decode = [cache.seq_new() for _ in range(n_decode)]
    k_src, v_src = bench.kv_source(cache.config.max_step)
    bench.fill(cache, decode, history, k_src, v_src)
    parts = {"prefill alone": np.repeat(prefill, chunk), "decode alone": np.asarray(decode),
             "mixed": np.concatenate([np.repeat(prefill, chunk), decode])}
    row = dict(case=f"{chunks} x {chunk} chunks + {n_decode} decode tokens at {history}")
    for name, ids in parts.items():
        cache.declare_step(ids)
        cache.prepare_step()
        cache.write(0, k_src[:ids.size], v_src[:ids.size])
        q, out = bench.q_out(ids.size)
        row[name] = bench.gpu_ms(lambda: cache.attend(0, q, out=out),
                                 iters=max(2, s.iters // 2))
        cache.abort_step()
    parts_ms = (row["prefill alone"] or 0) + (row["decode alone"] or 0)
    row["vs_parts"] = _ratio(parts_ms, row["mixed"])
    del cache, k_src, v_src
    bench.release()
    return [row]


def _guarded(bench, cache, row, fn) -> dict:
    """`row` updated with `fn()`'s figures, or with the error; the step is closed after."""
    try:
        row.update(fn())
    except Exception as exc:  # noqa: BLE001 (report the case, keep benchmarking)
        traceback.print_exception(exc, file=sys.stderr)
        row["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if cache.step_state != kv.StepState.IDLE:
            cache.abort_step()
        bench.release()
    return row


# ---------------------------------------------------------------------------- run / report
SECTIONS = ("write", "clone", "decode", "skewed", "prefill", "mixed")


def run(sizes: Sizes = FULL, verbose: bool = False) -> dict:
    """Every case; on the simulator only at toy sizes (`SMOKE`), without timings."""
    if not gpu_available() and sizes is not SMOKE:
        return dict(skipped=True, reason=SKIP_MESSAGE)
    bench = Bench(sizes)
    peers = Peers(bench) if bench.torch is not None else None
    result = dict(skipped=False, device=device_name(), sizes=dataclasses.asdict(sizes),
                  torch=None if bench.torch is None else bench.torch.__version__,
                  targets=TARGETS)
    with bench.context():
        result["copy"] = bench.copy_roofline()
        result["matmul_tflops"] = bench.matmul_tflops()
        cases = dict(write=lambda: bench_write(bench), clone=lambda: bench_clone(bench),
                     decode=lambda: bench_decode(bench, peers),
                     skewed=lambda: bench_skewed(bench, peers),
                     prefill=lambda: bench_prefill(bench, peers, result["matmul_tflops"]),
                     mixed=lambda: bench_mixed(bench))
        for key in SECTIONS:
            try:
                result[key] = cases[key]()
            except Exception as exc:  # noqa: BLE001 (one broken section must not hide the rest)
                traceback.print_exception(exc, file=sys.stderr)
                result[key] = [dict(error=f"{type(exc).__name__}: {exc}")]
                bench.release()
            if verbose:
                print(report_section(result, key), flush=True)
    return result


def _f(value, fmt):
    return "-" if value is None else format(value, fmt)


def _count(n: int, noun: str) -> str:
    """`n noun`, the noun plural unless n is 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def report_header(result) -> str:
    s = result["sizes"]
    c = result["copy"]
    others = ", ".join(d for d in s["dtypes"] if d != s["dtype"])
    device = result["device"]
    where = f"the {device}" if device == "simulator" else device
    return (f"kernels on {where} ({s['dtype']} storage; attention also in "
            f"{others}; {_count(s['n_kv_heads'], 'kv head')}, "
            f"{_count(s['n_q_heads'], 'q head')}, head_dim "
            f"{s['head_dim']}; PyTorch with CUDA: {result['torch'] or 'none, no peers'})\n"
            f"  roofline: d2d copy of {c['bytes'] >> 20} MiB = "
            f"{_f(c['traffic_gbps'], '.0f')} GB/s read+write; fp16 torch.matmul "
            f"{_f(result['matmul_tflops'], '.0f')} TFLOP/s\n"
            f"  GPU µs: CUDA events around back-to-back calls (median); host µs: time for "
            f"the call to return")


#: per section: (title, field, width, format, scale); format None: the text as it is
_COLUMNS = {
    "write": [("case", "case", 30, None, 1), ("MiB", "bytes", 7, ".1f", 2 ** -20),
              ("GPU µs", "ms", 9, ".1f", 1e3), ("host µs", "host_us", 8, ".1f", 1),
              ("of copy", "of_copy", 8, ".0%", 1)],
    "decode": [("case", "case", 24, None, 1), ("dtype", "dtype", 9, None, 1),
               ("GPU µs", "ms", 9, ".1f", 1e3),
               ("host µs", "host_us", 8, ".1f", 1), ("wall µs", "wall_us", 8, ".1f", 1),
               ("of copy", "of_copy", 8, ".0%", 1), ("x sdpa", "vs_sdpa", 7, ".2f", 1),
               ("x loop", "vs_sdpa_loop", 7, ".2f", 1), ("x flash", "vs_flash", 8, ".2f", 1),
               ("max|d|", "max_abs_diff", 8, ".1e", 1)],
    "prefill": [("case", "case", 12, None, 1), ("dtype", "dtype", 9, None, 1),
                ("GPU µs", "ms", 9, ".1f", 1e3),
                ("host µs", "host_us", 8, ".1f", 1), ("TFLOP/s", "tflops", 8, ".1f", 1),
                ("of mm", "of_matmul", 7, ".0%", 1), ("x flash", "vs_flash", 8, ".2f", 1),
                ("max|d|", "max_abs_diff", 8, ".1e", 1)],
    "mixed": [("case", "case", 40, None, 1), ("mixed µs", "mixed", 9, ".1f", 1e3),
              ("prefill µs", "prefill alone", 10, ".1f", 1e3),
              ("decode µs", "decode alone", 10, ".1f", 1e3), ("x parts", "vs_parts", 8, ".2f", 1)],
}
_COLUMNS["clone"] = _COLUMNS["write"]
_COLUMNS["skewed"] = _COLUMNS["decode"]
_TITLES = {
    "write": "write: read+write traffic as a fraction of the roofline",
    "clone": "clone: read+write traffic as a fraction of the roofline",
    "decode": "decode attention: K/V bytes read as a fraction of the roofline; x peer = "
              "peer time / kvnumba time",
    "skewed": "decode attention, skewed batch (geomspace lengths)",
    "prefill": "prefill attention (causal): TFLOP/s, fraction of the fp16 matmul rate",
    "mixed": "mixed step vs its prefill part alone + its decode part alone",
}


def _cell(value, width, fmt, scale) -> str:
    if fmt is None:
        return format(str(value), f"<{width}")
    return format("-" if value is None else format(value * scale, fmt), f">{width}")


def report_section(result, key) -> str:
    columns = _COLUMNS[key]
    header = " ".join(format(title, f"<{w}" if fmt is None else f">{w}")
                      for title, _, w, fmt, _ in columns)
    lines = [_TITLES[key], "  " + header]
    for row in result.get(key, []):
        if "error" in row:
            lines.append(f"  {row.get('case', key)} ERROR {row['error']}")
            continue
        lines.append("  " + " ".join(_cell(row.get(field), w, fmt, scale)
                                     for _, field, w, fmt, scale in columns))
    return "\n".join(lines)


def report_targets(result) -> str:
    """Each target (set for float16): the figure it is judged on, and met / missed."""
    t = result["targets"]
    rows = {r.get("case"): r for key in ("decode", "skewed", "prefill")
            for r in result.get(key, []) if r.get("dtype") == "float16"}
    checks = []

    def check(name, value, target, higher=True):
        if value is None:
            checks.append(f"  {name}: not measured")
            return
        ok = value >= target if higher else value <= target
        checks.append(f"  {name}: {value:.3g} (target {'>=' if higher else '<='} {target:g}: "
                      f"{'met' if ok else 'MISSED'})")

    big = rows.get("128 x 4096", {})
    check("decode 128 x 4096, fraction of roofline", big.get("of_copy"), t["decode_of_copy"])
    check("decode 128 x 4096, x sdpa", big.get("vs_sdpa"), t["decode_vs_sdpa"])
    skewed = next((r for k, r in rows.items() if k and k.startswith("skewed") and "flat" in k), {})
    check("skewed flat, fraction of roofline", skewed.get("of_copy"), t["decode_of_copy"])
    check("skewed flat, x flash varlen", skewed.get("vs_flash"), t["skewed_vs_flash"])
    write = result.get("write", [{}])[0]
    check("write prefill, fraction of roofline", write.get("of_copy"), t["write_of_copy"])
    clone = result.get("clone", [{}])[0]
    check("clone, fraction of roofline", clone.get("of_copy"), t["clone_of_copy"])
    single = rows.get("1 x 512", {})
    check("decode 1 x 512, wall µs", single.get("wall_us"), t["single_decode_wall_us"],
          higher=False)
    for name in ("4x1024", "4x512@4096"):
        check(f"prefill {name}, TFLOP/s", rows.get(name, {}).get("tflops"), t["prefill_tflops"])
        check(f"prefill {name}, x flash varlen", rows.get(name, {}).get("vs_flash"),
              t["prefill_vs_flash"])
    mixed = result.get("mixed", [{}])[0]
    check("mixed step, (prefill + decode) / mixed", mixed.get("vs_parts"), 1.0)
    return "targets (H200-class GPU, float16):\n" + "\n".join(checks)


def report(result) -> str:
    if result.get("skipped"):
        return result["reason"]
    return "\n".join([report_header(result)] + [report_section(result, k) for k in SECTIONS]
                     + [report_targets(result)])


def add_size_arguments(parser) -> None:
    """`--quick` / `--smoke`, for this module's command line and `python -m bench`."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    size.add_argument("--smoke", action="store_true",
                      help="toy sizes, no timings: checks the benchmarks run (simulator too)")


def sizes_for(args) -> Sizes:
    """The `Sizes` the parsed `--quick` / `--smoke` arguments ask for."""
    return SMOKE if args.smoke else QUICK if args.quick else FULL


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels",
                                     description=__doc__.splitlines()[0])
    add_size_arguments(parser)
    args = parser.parse_args(argv)
    print(report(run(sizes_for(args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
