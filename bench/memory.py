"""Memory of paged storage, measurable anywhere (the simulator included).

* The skewed batch: 64 sequences at `geomspace(32, 32768)` positions on one flat and one
  ring layer; the bytes of the pages they hold against the bytes of the positions held
  (flat: each sequence's positions; ring: its ring of R positions, which comes with the
  sequence) plus one page per sequence per layer kind (a last page is partly empty),
  and against what storage of one column per sequence would allocate (`max_seqs + 1`
  columns of the longest sequence, rings for every slot).
* Forks: 8 clones of one long sequence; the flat pages they add (the page straddling the
  fork point, at most one each).
* A fork's cost: wall time of `seq_clone` + `seq_rm` at a short and a long prefix, with
  its device work (on the simulator: simulated launches, threads in Python), and its
  host work alone (on the simulator the upload, patch and copy launches made no-ops,
  as the control-plane bench does): neither grows with the prefix.

Steps are declared, prepared and committed without writing K/V (the control plane
alone moves pages), so no kernel runs but the page-table patches and the page copies.
"""
from __future__ import annotations

import time

import numpy as np

import kvnumba as kv

from .control import device_work

HEADER = "Memory (paged storage)"


def _cache(layers, *, capacity, max_seqs, max_write, page_size, initial_pages=None,
           dtype="float16"):
    config = kv.CacheConfig(layers=layers, n_kv_heads=1, head_dim=16, capacity=capacity,
                            max_seqs=max_seqs, max_write=max_write, max_step=4096,
                            dtype=dtype, page_size=page_size, initial_pages=initial_pages)
    return kv.BatchedSequenceCache(config)


def _fill(cache, lengths, chunk: int) -> list:
    """New sequences advanced to `lengths` positions, `chunk` tokens a step over all."""
    seqs = [cache.seq_new() for _ in lengths]
    left = dict(zip(seqs, lengths))
    while left:
        ids, budget = [], chunk
        for seq in list(left):
            n = min(left[seq], cache.config.max_write, budget)
            if n == 0:
                break
            ids += [seq] * n
            budget -= n
            left[seq] -= n
            if not left[seq]:
                del left[seq]
        cache.declare_step(ids)
        cache.prepare_step()
        cache.commit_step()
    return seqs


def skewed(quick: bool) -> dict:
    n, longest, page = (8, 2048, 16) if quick else (64, 32768, 16)
    lengths = np.geomspace(32, longest, n).astype(int).tolist()
    window = 4096 if not quick else 256
    caches = [_cache([kv.flat(), kv.ring(window=window)], capacity=longest, max_seqs=n,
                     max_write=512, page_size=page, dtype=dtype)
              for dtype in ("float16", "float8_e4m3")]
    for each in caches:
        _fill(each, lengths, 4096)
    cache, fp8 = caches
    per_position = cache.config.page_bytes // page             # one layer, K and V
    ring_rows = int(cache.config.ring_rows()[1])
    # the flat layer holds each sequence's positions; the ring layer R positions per live
    # sequence (its ring comes with the sequence)
    held_positions = sum(lengths) + n * ring_rows
    bound = held_positions * per_position + 2 * n * cache.config.page_bytes
    columns = (n + 1) * (longest + ring_rows) * per_position
    return dict(case=f"{n} sequences, geomspace(32, {longest}) positions, flat + ring "
                     f"(W {window}), page {page}",
                held=cache.nbytes_held, positions=held_positions * per_position, bound=bound,
                ratio=cache.nbytes_held / bound, columns=columns,
                saving=columns / cache.nbytes_held, fp8_held=fp8.nbytes_held,
                fp8_ratio=fp8.nbytes_held / cache.nbytes_held)


def forks(quick: bool) -> dict:
    prefix = 2048 + 5 if quick else 32768 - 11
    cache = _cache([kv.flat()], capacity=prefix + 16, max_seqs=9, max_write=512,
                   page_size=16, initial_pages=prefix // 16 + 10)
    src, = _fill(cache, [prefix], 4096)
    before = cache.pool_pages()[0].in_use
    for _ in range(8):
        cache.seq_clone(src)
    return dict(case=f"8 forks of {prefix} positions (page 16)",
                added=cache.pool_pages()[0].in_use - before)


def fork_time(prefix: int, repeats: int) -> tuple:
    """Median seconds of one `seq_clone` (+ its `seq_rm`) of a `prefix`-position sequence
    on a flat + ring cache: with its device work, and host work alone (on a GPU the
    launches are asynchronous: both are host time)."""
    cache = _cache([kv.flat(), kv.ring(window=64)], capacity=prefix + 16, max_seqs=2,
                   max_write=512, page_size=16, initial_pages=prefix // 8 + 16)
    src, = _fill(cache, [prefix - 5], 4096)                   # a straddling page to copy
    def median(runs):
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            cache.seq_rm(cache.seq_clone(src))
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    with_device = median(repeats)
    with device_work():
        host = median(20 * repeats)
    return with_device, host


def run(quick: bool = False) -> dict:
    short, long = (1024, 4096) if quick else (1024, 32768)
    repeats = 3 if quick else 7
    return dict(skewed=skewed(quick), forks=forks(quick),
                fork_ms={short: [1e3 * t for t in fork_time(short, repeats)],
                         long: [1e3 * t for t in fork_time(long, repeats)]})


def report(result: dict) -> str:
    s, f = result["skewed"], result["forks"]
    (short, (t_short, h_short)), (long, (t_long, h_long)) = sorted(result["fork_ms"].items())
    mib = 2**20
    return "\n".join([
        HEADER,
        f"  {s['case']}: pages held {s['held'] / mib:.2f} MiB = {s['ratio']:.3f} x (positions "
        f"held {s['positions'] / mib:.2f} MiB + one page per sequence per layer kind; "
        f"target <= 1.05); one column per sequence would allocate {s['columns'] / mib:.1f} "
        f"MiB ({s['saving']:.0f}x); in float8_e4m3 {s['fp8_held'] / mib:.2f} MiB = "
        f"{s['fp8_ratio']:.3f} x float16's (target <= 0.51)",
        f"  {f['case']}: {f['added']} pages added (target <= 8)",
        f"  fork (seq_clone + seq_rm, flat + ring): {t_short:.2f} ms at {short} positions, "
        f"{t_long:.2f} ms at {long} ({t_long / t_short:.2f}x); host work alone "
        f"{1e3 * h_short:.0f} µs and {1e3 * h_long:.0f} µs ({h_long / h_short:.2f}x)",
    ])
