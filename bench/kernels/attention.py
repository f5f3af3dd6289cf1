"""The attention kernel cases: decode (uniform and skewed batches, flat and ring
layers), causal prefill, and a mixed step against its parts; each against PyTorch's
SDPA and FlashAttention varlen where `peers` is given."""
from __future__ import annotations

import sys
import traceback

import numpy as np

import kvnumba as kv

from .harness import Bench
from .peers import Peers
from .sizes import ratio


def _guarded(bench: Bench, cache, row, fn) -> dict:
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


# ---------------------------------------------------------------------------- decode
def _decode_row(bench: Bench, peers: Peers | None, cache, seqs, lengths, layer=0,
                n_q_heads=None) -> dict:
    """Time one decode step's attention (the step's own token already written; q, k, v
    and out in the storage's type, float16 over 8-bit float storage)."""
    s = bench.sizes
    dtype = "float16" if cache.config.is_fp8 else cache.config.dtype
    batch = len(seqs)
    cache.declare_step(np.asarray(seqs))
    cache.prepare_step()
    k_src = bench.random((batch, s.n_kv_heads, s.head_dim), dtype)
    cache.write(layer, k_src, k_src)
    q, out = bench.q_out(batch, dtype, n_q_heads)
    ms = bench.gpu_ms(lambda: cache.attend(layer, q, out=out))
    host = bench.host_us(lambda: cache.attend(layer, q, out=out))
    keys = int(np.sum(lengths)) + batch                     # history plus the new token
    nbytes = keys * 2 * s.n_kv_heads * s.head_dim * cache.config.storage_dtype.itemsize
    row = dict(batch=batch, keys=keys, ms=ms, host_us=host, bytes=nbytes,
               of_copy=bench.of_copy(nbytes, ms))
    if peers is None:
        cache.abort_step()
        return row
    window = cache.config.layers[layer].window
    torch = peers.torch
    cache.commit_step()          # the peers read the committed columns
    seen = [min(n + 1, window) if window else n + 1 for n in lengths]
    k, v, cu_k = peers.packed_kv(cache, layer, seqs, seen)
    qt = peers.tensor(q, dtype)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    row.update(peers.flash_figures(ms, out, dtype, qt, k, v, cu_q, cu_k, 1, max(seen), window))
    if not window and len(set(lengths)) == 1:   # equal lengths: SDPA batched and looped
        length = seen[0]
        kt = k.view(batch, length, s.n_kv_heads, s.head_dim).transpose(1, 2)
        vt = v.view(batch, length, s.n_kv_heads, s.head_dim).transpose(1, 2)
        qb = qt.unsqueeze(2)
        row["sdpa_ms"] = bench.gpu_ms(lambda: peers.sdpa(qb, kt, vt))
        each = [(qb[i:i + 1], kt[i:i + 1], vt[i:i + 1]) for i in range(batch)]
        row["sdpa_loop_ms"] = bench.gpu_ms(
            lambda: [peers.sdpa(*args) for args in each], iters=max(2, s.iters // 4))
        row.update(vs_sdpa=ratio(row["sdpa_ms"], ms),
                   vs_sdpa_loop=ratio(row["sdpa_loop_ms"], ms))
    return row


def bench_decode(bench: Bench, peers: Peers | None) -> list:
    """B sequences x H keys for each B and H of the sizes, in every attention dtype."""
    return bench.each_released(lambda dtype: _decode_rows(bench, peers, dtype),
                               bench.sizes.dtypes)


def _decode_rows(bench: Bench, peers: Peers | None, dtype) -> list:
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
    return rows


def bench_grouped(bench: Bench) -> list:
    """Decode of grouped queries (on tensor cores: each kv head serves `group` query
    heads), B sequences x H keys, for each group and dtype of the sizes."""
    return bench.each_released(lambda dtype: _grouped_rows(bench, dtype),
                               bench.sizes.grouped_dtypes)


def _grouped_rows(bench: Bench, dtype) -> list:
    s = bench.sizes
    groups, n_seqs, history = s.grouped
    capacity = history + 64
    cache = bench.cache(layers=[kv.flat()], capacity=capacity, max_seqs=n_seqs,
                        max_write=min(4096, capacity), max_step=4 * min(4096, capacity),
                        dtype=dtype)
    seqs = [cache.seq_new() for _ in range(n_seqs)]
    k_src, v_src = bench.kv_source(cache.config.max_step,
                                   "float16" if cache.config.is_fp8 else dtype)
    bench.fill(cache, seqs, history, k_src, v_src)
    return [_guarded(bench, cache, dict(case=f"group {group}: {n_seqs} x {history}",
                                        dtype=dtype),
                     lambda: _decode_row(bench, None, cache, seqs, [history] * n_seqs,
                                         n_q_heads=group * s.n_kv_heads))
            for group in groups]


def bench_skewed(bench: Bench, peers: Peers | None) -> list:
    """The skewed batch (`geomspace` lengths) on a flat and on a ring layer, in every
    attention dtype."""
    s = bench.sizes
    layers = (("flat", kv.flat()), (f"ring {s.ring_window}", kv.ring(s.ring_window)))
    return bench.each_released(lambda case: [_skewed_row(bench, peers, *case)],
                               [(dtype, name, layer) for dtype in s.dtypes
                                for name, layer in layers])


def _skewed_row(bench: Bench, peers: Peers | None, dtype, name, layer) -> dict:
    n, shortest, longest = bench.sizes.skewed
    lengths = np.geomspace(shortest, longest, n).astype(np.int64)
    max_write = min(64 if layer.is_ring else 4096, longest)
    cache = bench.cache(layers=[layer], capacity=longest + 64, max_seqs=n,
                        max_write=max_write, max_step=max(4 * max_write, n), dtype=dtype)
    seqs = [cache.seq_new() for _ in range(n)]
    k_src, v_src = bench.kv_source(cache.config.max_step, dtype)
    bench.fill(cache, seqs, lengths, k_src, v_src)
    window = layer.window
    seen = np.minimum(lengths, window - 1) if window else lengths  # history read
    return _guarded(bench, cache, dict(case=f"skewed {n} seqs, {name}", dtype=dtype),
                    lambda: _decode_row(bench, peers, cache, seqs, seen))


# ---------------------------------------------------------------------------- prefill
def _prefill_flops(sizes, n_seqs, q_len, history) -> int:
    """4 * d * n_q_heads per visible (query, key) pair; query i sees history + i + 1 keys."""
    pairs = q_len * history + q_len * (q_len + 1) // 2
    return 4 * sizes.head_dim * sizes.n_q_heads * n_seqs * pairs


def _prefill_row(bench: Bench, peers: Peers | None, cache, seqs, q_len, history,
                 matmul) -> dict:
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
    row = dict(ms=ms, host_us=host, tflops=tflops, of_matmul=ratio(tflops, matmul))
    if peers is None:
        cache.abort_step()
        return row
    torch = peers.torch
    cache.commit_step()
    k, v, cu_k = peers.packed_kv(cache, 0, seqs, [history + q_len] * n)
    qt = peers.tensor(q, dtype)
    cu_q = torch.arange(0, tokens + 1, q_len, dtype=torch.int32, device="cuda")
    row.update(peers.flash_figures(ms, out, dtype, qt, k, v, cu_q, cu_k, q_len,
                                   history + q_len))
    return row


def bench_prefill(bench: Bench, peers: Peers | None, matmul) -> list:
    """Each prefill case of the sizes, in every attention dtype; `matmul`: the dense
    TFLOP/s rate the figures are compared with (None: not measured)."""
    return bench.each_released(lambda dtype: _prefill_rows(bench, peers, matmul, dtype),
                               bench.sizes.dtypes)


def _prefill_rows(bench: Bench, peers: Peers | None, matmul, dtype) -> list:
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
    return rows


# ---------------------------------------------------------------------------- mixed
def bench_mixed(bench: Bench) -> list:
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
    row["vs_parts"] = ratio(parts_ms, row["mixed"])
    return [row]
