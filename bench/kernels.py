"""Kernel benchmarks (CUDA GPU only; on the simulator they are skipped, exit 0).

Cases (float16 storage, 8 kv heads, head_dim 128):

* write:   a prefill step (4 x 1024 tokens) and a decode step (256 x 1 token):
           GB/s of K+V bytes written, and the ratio against a device-to-device
           copy of the same byte count measured in the same run.
* clone:   `seq_clone` of a 4096-token prefix over 4 flat layers: GB/s of K+V
           bytes copied, ratio against the d2d copy.
* decode attention: B in {1, 32, 128} sequences x history in {512, 4096, 16384},
           32 q heads: achieved GB/s of K/V read (FlashInfer's metric) and its
           fraction of the d2d copy's memory traffic (read + write) bandwidth.
* prefill attention: 4 x 1024, 1 x 4096 and 4 x 512 after 4096 cached tokens:
           TFLOP/s (4 * visible (q, k) pairs * head_dim * n_q_heads) and the
           fraction of the FP32 CUDA-core peak.
* peer: where PyTorch is installed, `scaled_dot_product_attention` on the same
  data (one call per sequence, and one batched call since every case's segments
  have equal lengths), with the max |difference| of the outputs as a check.

Every cache is built through the public API on one stream (PyTorch's, when
PyTorch is present, so both libraries' work is timed by the same CUDA events).
Times are the median over repeats of (events around `iters` back-to-back calls)
/ iters, after warm-up; small cases therefore include host launch overhead
when it exceeds the GPU time.

    python -m bench.kernels [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import traceback
import warnings

import numpy as np

import kvnumba as kv
import kvnumba.device as kv_device

SKIP_MESSAGE = "no CUDA GPU: kernel benchmarks skipped"

N_KV_HEADS = 8
N_Q_HEADS = 32
HEAD_DIM = 128
DTYPE = "float16"
ITEM = 2  # bytes per float16

DECODE_BATCHES = (1, 32, 128)
DECODE_HISTORIES = (512, 4096, 16384)
PREFILL_CASES = (  # (name, sequences, chunk tokens, cached history before the chunk)
    ("4x1024", 4, 1024, 0),
    ("1x4096", 1, 4096, 0),
    ("4x512@4096", 4, 512, 4096),
)
CLONE_TOKENS = 4096
CLONE_LAYERS = 4
WRITE_PREFILL = (4, 1024)   # sequences x tokens of the prefill-sized write
WRITE_DECODE = 256          # sequences x 1 token of the decode write
COPY_MIB = (1024, 256)      # the reference d2d copy (full run, quick run)

#: FP32 lanes per SM by compute capability major (8.0 has 64, 8.6/8.9 have 128)
_FP32_PER_SM = {6: 64, 7: 64, 8: 128, 9: 128, 10: 128, 11: 128, 12: 128}


# ---------------------------------------------------------------------------- setup
def gpu_available() -> bool:
    return not kv_device.SIMULATOR


def device_name() -> str:
    if not gpu_available():
        return "simulator"
    name = kv_device.cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def fp32_peak_tflops():
    """SMs x FP32 lanes x 2 (FMA) x boost clock, or None if the driver won't say."""
    try:
        dev = kv_device.cuda.get_current_device()
        major, minor = dev.compute_capability
        lanes = 64 if (major, minor) == (8, 0) else _FP32_PER_SM.get(major, 128)
        return dev.MULTIPROCESSOR_COUNT * lanes * 2 * dev.CLOCK_RATE * 1e3 / 1e12
    except Exception:  # noqa: BLE001 (an attribute the driver no longer reports)
        return None


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


class Bench:
    """Shared state: the stream, the timer, torch (or None), reference copy timings."""

    def __init__(self, quick: bool):
        self.quick = quick
        self.cuda = kv_device.cuda
        self.torch = _torch()
        if self.torch is not None:
            self.torch_stream = self.torch.cuda.Stream()
            self.stream = self.cuda.external_stream(self.torch_stream.cuda_stream)
        else:
            self.torch_stream = None
            self.stream = self.cuda.stream()
        self.warmup = 2 if quick else 5
        self.iters = 5 if quick else 20
        self.repeats = 3 if quick else 7
        self.rng = np.random.default_rng(0)
        self._copy_ms = {}
        self.gqa_native = self._probe_gqa() if self.torch is not None else None

    def _probe_gqa(self) -> bool:
        """Does this PyTorch's SDPA take `enable_gqa` (2.5+)?"""
        torch = self.torch
        q = torch.zeros(1, N_Q_HEADS, 1, HEAD_DIM, dtype=torch.float16, device="cuda")
        k = torch.zeros(1, N_KV_HEADS, 1, HEAD_DIM, dtype=torch.float16, device="cuda")
        try:
            torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        except TypeError:
            return False
        return True

    def context(self):
        """Make PyTorch's current stream the cache's stream (a no-op without PyTorch)."""
        if self.torch is None:
            return contextlib.nullcontext()
        return self.torch.cuda.stream(self.torch_stream)

    def time_ms(self, fn, iters=None) -> float:
        """Median ms per call of `fn` (which enqueues work on the stream)."""
        cuda, stream = self.cuda, self.stream
        iters = iters or self.iters
        for _ in range(self.warmup):
            fn()
        stream.synchronize()
        samples = []
        for _ in range(self.repeats):
            start, end = cuda.event(timing=True), cuda.event(timing=True)
            start.record(stream)
            for _ in range(iters):
                fn()
            end.record(stream)
            end.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        return statistics.median(samples)

    def copy_ms(self, nbytes: int) -> float:
        """ms of one device-to-device copy of `nbytes` contiguous bytes (cached per size)."""
        if nbytes not in self._copy_ms:
            src = self.cuda.device_array(nbytes, dtype=np.uint8, stream=self.stream)
            dst = self.cuda.device_array(nbytes, dtype=np.uint8, stream=self.stream)
            self._copy_ms[nbytes] = self.time_ms(
                lambda: dst.copy_to_device(src, stream=self.stream))
            del src, dst
        return self._copy_ms[nbytes]

    def random(self, shape, scale=1.0):
        host = (self.rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)
        return self.cuda.to_device(host, stream=self.stream)

    def release(self):
        """Free what dropped references left behind (between cases)."""
        self.stream.synchronize()
        with contextlib.suppress(Exception):
            self.cuda.current_context().deallocations.clear()
        if self.torch is not None:
            self.torch.cuda.empty_cache()

    # -------------------------------------------------------------- torch peer
    def sdpa(self, q, k, v, **kw):
        """`scaled_dot_product_attention` with GQA (native when available, else expanded)."""
        F = self.torch.nn.functional
        if self.gqa_native:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
        return F.scaled_dot_product_attention(q, k, v, **kw)

    def torch_kv(self, k_store, v_store, cols, kv_len):
        """`[n, n_kv, kv_len, d]` contiguous torch copies of columns `cols`, rows `[0, kv_len)`
        (heads expanded to the q heads when PyTorch has no native GQA)."""
        torch = self.torch
        out = []
        for store in (k_store, v_store):
            t = torch.as_tensor(store, device="cuda")[:kv_len, list(cols)]  # [L, n, h, d]
            t = t.permute(1, 2, 0, 3).contiguous()
            if not self.gqa_native:
                t = t.repeat_interleave(N_Q_HEADS // N_KV_HEADS, dim=1)
            out.append(t)
        return out


def _cache(bench, *, layers, capacity, max_seqs, max_write, max_step):
    config = kv.CacheConfig(layers=[kv.flat() for _ in range(layers)], n_kv_heads=N_KV_HEADS,
                            head_dim=HEAD_DIM, capacity=capacity, max_seqs=max_seqs,
                            max_write=max_write, max_step=max_step, dtype=DTYPE,
                            initial_rows=capacity)
    return kv.BatchedSequenceCache(config, stream=bench.stream)


def _fill(bench, cache, seqs, target, k_src, v_src):
    """Advance every sequence of `seqs` to `target` positions, writing K/V on every layer,
    in steps of at most max_write tokens per sequence and max_step per step."""
    config = cache.config
    spare = k_src.shape[0] - config.max_step
    while True:
        parts, used = [], 0
        for seq in seqs:
            n = min(target - cache.pos(seq), config.max_write, config.max_step - used)
            if n > 0:
                parts.append(np.full(n, seq, dtype=np.int64))
                used += n
            if used == config.max_step:
                break
        if not parts:
            return
        cache.declare_step(np.concatenate(parts))
        cache.prepare_step()
        off = int(bench.rng.integers(0, spare + 1))
        for layer in range(config.n_layers):
            cache.write(layer, k_src[off:off + used], v_src[off:off + used])
        cache.commit_step()


def _kv_source(bench, tokens):
    """Random K and V of `tokens + spare` tokens; fills take shifted slices of them."""
    shape = (tokens + max(64, tokens // 4), N_KV_HEADS, HEAD_DIM)
    return bench.random(shape), bench.random(shape)


# ---------------------------------------------------------------------------- cases
def bench_write(bench) -> list:
    rows = []
    n_pre, len_pre = WRITE_PREFILL
    n_seqs = max(n_pre, WRITE_DECODE)
    cache = _cache(bench, layers=1, capacity=len_pre, max_seqs=n_seqs, max_write=len_pre,
                   max_step=max(n_pre * len_pre, WRITE_DECODE))
    for _ in range(n_seqs):
        cache.seq_new()
    k_src, v_src = _kv_source(bench, cache.config.max_step)
    for name, ids in ((f"prefill {n_pre}x{len_pre}", np.repeat(np.arange(n_pre), len_pre)),
                      (f"decode {WRITE_DECODE}x1", np.arange(WRITE_DECODE))):
        n = ids.size
        cache.declare_step(ids)
        cache.prepare_step()
        k, v = k_src[:n], v_src[:n]
        ms = bench.time_ms(lambda: cache.write(0, k, v))
        cache.abort_step()
        nbytes = 2 * n * N_KV_HEADS * HEAD_DIM * ITEM
        copy = bench.copy_ms(nbytes)
        rows.append(dict(case=name, tokens=n, bytes=nbytes, ms=ms, gbps=nbytes / ms / 1e6,
                         copy_ms=copy, copy_gbps=nbytes / copy / 1e6, vs_copy=copy / ms))
    del cache, k_src, v_src
    bench.release()
    return rows


def bench_clone(bench) -> list:
    cache = _cache(bench, layers=CLONE_LAYERS, capacity=CLONE_TOKENS, max_seqs=2,
                   max_write=CLONE_TOKENS, max_step=CLONE_TOKENS)
    k_src, v_src = _kv_source(bench, CLONE_TOKENS)
    src = cache.seq_new()
    _fill(bench, cache, [src], CLONE_TOKENS, k_src, v_src)

    def clone():
        cache.seq_rm(cache.seq_clone(src))

    ms = bench.time_ms(clone)
    nbytes = CLONE_LAYERS * 2 * CLONE_TOKENS * N_KV_HEADS * HEAD_DIM * ITEM
    copy = bench.copy_ms(nbytes)
    del cache, k_src, v_src
    bench.release()
    return [dict(case=f"clone {CLONE_TOKENS} tok x {CLONE_LAYERS} layers", bytes=nbytes, ms=ms,
                 gbps=nbytes / ms / 1e6, copy_ms=copy, copy_gbps=nbytes / copy / 1e6,
                 vs_copy=copy / ms)]


def _peer_decode(bench, cache, q, out, batch, kv_len) -> dict:
    """SDPA on the same batch: batched (equal lengths) and one call per sequence."""
    torch = bench.torch
    k_store, v_store = cache.layer_data(0)
    bench.stream.synchronize()
    kt, vt = bench.torch_kv(k_store, v_store, range(batch), kv_len)
    qt = torch.as_tensor(q, device="cuda").unsqueeze(2)            # [B, 32, 1, d]
    # the query is the last position: it sees every key, so no mask (is_causal would
    # align the mask top-left and hide all but the first key)
    batched_ms = bench.time_ms(lambda: bench.sdpa(qt, kt, vt))
    q_each = [qt[i:i + 1] for i in range(batch)]
    k_each = [kt[i:i + 1] for i in range(batch)]
    v_each = [vt[i:i + 1] for i in range(batch)]

    def looped():
        for i in range(batch):
            bench.sdpa(q_each[i], k_each[i], v_each[i])

    loop_ms = bench.time_ms(looped, iters=max(2, bench.iters // 4))
    ref = bench.sdpa(qt, kt, vt).squeeze(2)
    diff = (torch.as_tensor(out, device="cuda").float() - ref.float()).abs().max().item()
    return dict(sdpa_ms=batched_ms, sdpa_loop_ms=loop_ms, max_abs_diff=diff)


def bench_decode(bench, copy_traffic_gbps) -> list:
    batches = DECODE_BATCHES[:2] if bench.quick else DECODE_BATCHES
    histories = DECODE_HISTORIES[:2] if bench.quick else DECODE_HISTORIES
    n_seqs = max(batches)
    capacity = max(histories) + 64
    max_write = 4096
    max_step = max_write * 4
    cache = _cache(bench, layers=1, capacity=capacity, max_seqs=n_seqs, max_write=max_write,
                   max_step=max_step)
    seqs = [cache.seq_new() for _ in range(n_seqs)]
    k_src, v_src = _kv_source(bench, max_step)
    q_all = bench.random((n_seqs, N_Q_HEADS, HEAD_DIM))
    out_all = bench.cuda.device_array((n_seqs, N_Q_HEADS, HEAD_DIM), dtype=np.float16,
                                      stream=bench.stream)
    rows = []
    for history in sorted(histories):
        _fill(bench, cache, seqs, history, k_src, v_src)
        for batch in batches:
            row = dict(batch=batch, history=history)
            try:
                cache.declare_step(np.arange(batch))
                cache.prepare_step()
                cache.write(0, k_src[:batch], v_src[:batch])  # the decode token itself
                q, out = q_all[:batch], out_all[:batch]
                ms = bench.time_ms(lambda: cache.attend(0, q, out=out))
                kv_len = history + 1
                nbytes = batch * kv_len * 2 * N_KV_HEADS * HEAD_DIM * ITEM
                gbps = nbytes / ms / 1e6
                row.update(ms=ms, bytes=nbytes, gbps=gbps, frac_copy=gbps / copy_traffic_gbps)
                if bench.torch is not None:
                    peer = _peer_decode(bench, cache, q, out, batch, kv_len)
                    row.update(peer, vs_sdpa=peer["sdpa_ms"] / ms,
                               vs_sdpa_loop=peer["sdpa_loop_ms"] / ms)
            except Exception as exc:  # noqa: BLE001 (report the case, keep benchmarking)
                row["error"] = _error(exc)
            finally:
                if cache.step_state != kv.StepState.IDLE:
                    cache.abort_step()  # positions stay at `history`
                bench.release()
            rows.append(row)
    del cache, k_src, v_src, q_all, out_all
    bench.release()
    return rows


def _prefill_flops(n_seqs, q_len, history) -> int:
    """4 * d * n_q_heads per visible (query, key) pair; query i sees history + i + 1 keys."""
    pairs = q_len * history + q_len * (q_len + 1) // 2
    return 4 * HEAD_DIM * N_Q_HEADS * n_seqs * pairs


def _peer_prefill(bench, cache, q, out, seqs, q_len, history) -> dict:
    torch = bench.torch
    k_store, v_store = cache.layer_data(0)
    bench.stream.synchronize()
    kv_len = history + q_len
    kt, vt = bench.torch_kv(k_store, v_store, seqs, kv_len)                 # [n, h, L, d]
    n = len(seqs)
    qt = torch.as_tensor(q, device="cuda").view(n, q_len, N_Q_HEADS, HEAD_DIM)
    qt = qt.permute(0, 2, 1, 3).contiguous()                                 # [n, 32, q, d]
    if history == 0:
        kw = dict(is_causal=True)
    else:  # bottom-right causal: query i (position history + i) sees keys j <= history + i
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device="cuda").tril(diagonal=history)
        kw = dict(attn_mask=mask)
    batched_ms = bench.time_ms(lambda: bench.sdpa(qt, kt, vt, **kw), iters=max(2, bench.iters // 2))
    each = [(qt[i:i + 1], kt[i:i + 1], vt[i:i + 1]) for i in range(n)]

    def looped():
        for qi, ki, vi in each:
            bench.sdpa(qi, ki, vi, **kw)

    loop_ms = bench.time_ms(looped, iters=max(2, bench.iters // 2))
    ref = bench.sdpa(qt, kt, vt, **kw).permute(0, 2, 1, 3).reshape(n * q_len, N_Q_HEADS, HEAD_DIM)
    got = torch.as_tensor(out, device="cuda")[:n * q_len]
    diff = (got.float() - ref.float()).abs().max().item()
    return dict(sdpa_ms=batched_ms, sdpa_loop_ms=loop_ms, max_abs_diff=diff)


def bench_prefill(bench, peak_tflops) -> list:
    max_tokens = max(n * q for _, n, q, _ in PREFILL_CASES)
    max_q = max(q for _, _, q, _ in PREFILL_CASES)
    capacity = max(h + q for _, _, q, h in PREFILL_CASES)
    n_seqs = sum(n for _, n, _, _ in PREFILL_CASES)
    cache = _cache(bench, layers=1, capacity=capacity, max_seqs=n_seqs, max_write=max_q,
                   max_step=max_tokens)
    k_src, v_src = _kv_source(bench, max_tokens)
    q_all = bench.random((max_tokens, N_Q_HEADS, HEAD_DIM))
    out_all = bench.cuda.device_array((max_tokens, N_Q_HEADS, HEAD_DIM), dtype=np.float16,
                                      stream=bench.stream)
    rows = []
    for name, n, q_len, history in PREFILL_CASES:
        seqs = [cache.seq_new() for _ in range(n)]
        row = dict(case=name, sequences=n, q_len=q_len, history=history)
        try:
            _fill(bench, cache, seqs, history, k_src, v_src)
            tokens = n * q_len
            cache.declare_step(np.repeat(np.array(seqs), q_len))
            cache.prepare_step()
            cache.write(0, k_src[:tokens], v_src[:tokens])
            q, out = q_all[:tokens], out_all[:tokens]
            ms = bench.time_ms(lambda: cache.attend(0, q, out=out), iters=max(2, bench.iters // 2))
            flops = _prefill_flops(n, q_len, history)
            tflops = flops / ms / 1e9
            row.update(ms=ms, flops=flops, tflops=tflops,
                       frac_fp32_peak=None if not peak_tflops else tflops / peak_tflops)
            if bench.torch is not None:
                peer = _peer_prefill(bench, cache, q, out, seqs, q_len, history)
                row.update(peer, vs_sdpa=peer["sdpa_ms"] / ms,
                           vs_sdpa_loop=peer["sdpa_loop_ms"] / ms)
        except Exception as exc:  # noqa: BLE001
            row["error"] = _error(exc)
        finally:
            if cache.step_state != kv.StepState.IDLE:
                cache.abort_step()
            bench.release()
        rows.append(row)
    del cache, k_src, v_src, q_all, out_all
    bench.release()
    return rows


def _error(exc) -> str:
    traceback.print_exception(exc, file=sys.stderr)
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------- run / report
def run(quick: bool = False, verbose: bool = False) -> dict:
    """All kernel cases on the GPU; `{"skipped": True, ...}` without one."""
    if not gpu_available():
        return dict(skipped=True, reason=SKIP_MESSAGE)
    warnings.filterwarnings("ignore", module="numba")  # low-occupancy notes on small launches
    bench = Bench(quick)
    result = dict(skipped=False, device=device_name(), quick=quick,
                  torch=None if bench.torch is None else bench.torch.__version__)
    with bench.context():
        big = COPY_MIB[1 if quick else 0] << 20
        copy = bench.copy_ms(big)
        result["copy"] = dict(bytes=big, ms=copy, gbps=big / copy / 1e6,
                              traffic_gbps=2 * big / copy / 1e6)
        result["fp32_peak_tflops"] = fp32_peak_tflops()
        sections = (("write", lambda: bench_write(bench)),
                    ("clone", lambda: bench_clone(bench)),
                    ("decode", lambda: bench_decode(bench, result["copy"]["traffic_gbps"])),
                    ("prefill", lambda: bench_prefill(bench, result["fp32_peak_tflops"])))
        for key, fn in sections:
            try:
                result[key] = fn()
            except Exception as exc:  # noqa: BLE001 (one broken section must not hide the rest)
                result[key] = [dict(error=_error(exc))]
                bench.release()
            if verbose:
                print(report_section(result, key), flush=True)
    result["gqa_native_sdpa"] = bench.gqa_native
    return result


def _f(value, fmt):
    return "-" if value is None else format(value, fmt)


def report_header(result) -> str:
    c = result["copy"]
    peak = result.get("fp32_peak_tflops")
    return (f"kernels on {result['device']} (float16, {N_KV_HEADS} kv heads, head_dim {HEAD_DIM}"
            f"; PyTorch {result['torch'] or 'not installed'})\n"
            f"  d2d copy of {c['bytes'] >> 20} MiB: {c['gbps']:.0f} GB/s copied = "
            f"{c['traffic_gbps']:.0f} GB/s read+write; FP32 CUDA-core peak "
            f"{_f(peak, '.1f')} TFLOP/s\n"
            f"  times: CUDA events around back-to-back calls, median (host launch overhead "
            f"included when it exceeds the GPU time)")


def report_section(result, key) -> str:
    rows = result.get(key, [])
    lines = []
    if key in ("write", "clone"):
        lines.append(f"{key}: GB/s of K+V bytes moved vs a d2d copy of the same bytes")
        lines.append(f"  {'case':<30} {'MiB':>8} {'µs':>9} {'GB/s':>8} {'copy GB/s':>10} "
                     f"{'vs copy':>8}")
        for r in rows:
            if "error" in r:
                lines.append(f"  {r.get('case', key):<30} ERROR {r['error']}")
                continue
            lines.append(f"  {r['case']:<30} {r['bytes'] / 2**20:>8.1f} {r['ms'] * 1e3:>9.1f} "
                         f"{r['gbps']:>8.0f} {r['copy_gbps']:>10.0f} {r['vs_copy']:>7.2f}x")
    elif key == "decode":
        lines.append(f"decode attention ({N_Q_HEADS} q heads): K/V bytes read / time; "
                     f"fraction of d2d copy traffic; x sdpa = sdpa time / kvnumba time")
        lines.append(f"  {'B':>4} {'history':>8} {'µs':>9} {'GB/s':>8} {'of copy':>8} "
                     f"{'sdpa µs':>9} {'x sdpa':>7} {'loop µs':>9} {'x loop':>7} {'max|d|':>8}")
        for r in rows:
            if "error" in r:
                lines.append(f"  {r.get('batch', '-'):>4} {r.get('history', '-'):>8} "
                             f"ERROR {r['error']}")
                continue
            lines.append(f"  {r['batch']:>4} {r['history']:>8} {r['ms'] * 1e3:>9.1f} "
                         f"{r['gbps']:>8.0f} {r['frac_copy']:>7.0%} "
                         f"{_f(_us(r, 'sdpa_ms'), '9.1f'):>9} {_f(r.get('vs_sdpa'), '6.2f'):>6}x "
                         f"{_f(_us(r, 'sdpa_loop_ms'), '9.1f'):>9} "
                         f"{_f(r.get('vs_sdpa_loop'), '6.2f'):>6}x "
                         f"{_f(r.get('max_abs_diff'), '8.1e'):>8}")
    elif key == "prefill":
        lines.append(f"prefill attention ({N_Q_HEADS} q heads, causal): TFLOP/s "
                     f"(4 * visible pairs * d * heads) and fraction of the FP32 peak")
        lines.append(f"  {'case':<12} {'µs':>10} {'TFLOP/s':>8} {'of FP32':>8} {'sdpa µs':>10} "
                     f"{'x sdpa':>7} {'loop µs':>10} {'x loop':>7} {'max|d|':>8}")
        for r in rows:
            if "error" in r:
                lines.append(f"  {r.get('case', '-'):<12} ERROR {r['error']}")
                continue
            frac = r.get("frac_fp32_peak")
            lines.append(f"  {r['case']:<12} {r['ms'] * 1e3:>10.1f} {r['tflops']:>8.2f} "
                         f"{'-' if frac is None else format(frac, '.0%'):>8} "
                         f"{_f(_us(r, 'sdpa_ms'), '10.1f'):>10} {_f(r.get('vs_sdpa'), '6.2f'):>6}x "
                         f"{_f(_us(r, 'sdpa_loop_ms'), '10.1f'):>10} "
                         f"{_f(r.get('vs_sdpa_loop'), '6.2f'):>6}x "
                         f"{_f(r.get('max_abs_diff'), '8.1e'):>8}")
    return "\n".join(lines)


def _us(row, key):
    return None if row.get(key) is None else row[key] * 1e3


def report(result) -> str:
    if result.get("skipped"):
        return result["reason"]
    return "\n".join([report_header(result)] +
                     [report_section(result, k) for k in ("write", "clone", "decode", "prefill")])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    args = parser.parse_args(argv)
    if not gpu_available():
        print(SKIP_MESSAGE)
        return 0
    result = run(quick=args.quick)
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
