"""The kernel cases that move K/V: `write` (a prefill step and a decode step) and a
clone's ring copies, as read+write traffic against the roofline."""
from __future__ import annotations

import numpy as np

import kvnumba as kv

from .harness import Bench


def bench_write(bench: Bench) -> list:
    """`write` of a prefill step and of a decode step on one flat layer."""
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
    return rows


def bench_clone(bench: Bench) -> list:
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
    return [dict(case=f"clone: rings of {tokens} positions x {layers} layers", bytes=nbytes,
                 ms=ms, host_us=host, of_copy=bench.of_copy(2 * nbytes, ms))]
