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
  with the largest |difference| of the outputs as a check (`kvnumba[torch]`).

Cases (float16 storage, 8 kv heads, 32 q heads, head_dim 128): the write of a
4 x 1024 prefill step and of a 256 x 1 decode step; a clone's ring copies (rings of
4096 positions over 4 layers, 64 MiB: flat layers share their pages instead);
decode of B in {1, 32, 128} sequences x {512, 4096, 16384} keys; decode of grouped
queries (8 and 16 query heads per kv head, 128 sequences x 4096 keys, float16 and
float8_e4m3 storage: the tensor-core decode); a skewed decode
batch (64 sequences, `geomspace(32, 32768)` keys) on a flat and on a ring layer
(window 4096); prefill 4 x 1024, 1 x 4096, 4 x 512 after 4096 cached
tokens; a mixed step (4 x 1024 chunks plus 64 decode tokens) against its parts.
The attention cases run in bfloat16 too where ml_dtypes (`kvnumba[bf16]`) is installed.

GPU ms are CUDA events around back-to-back calls (median of repeats); host µs is
the wall time the Python call takes to return (what a serving loop pays per call);
wall µs (host included) is call + synchronise, for the single-sequence decode.
Every cache is built through the public API on one stream (PyTorch's, when
PyTorch is present, so both libraries' work is timed by the same events).

    python -m kvnumba.bench.kernels [--quick | --smoke]

`--smoke` runs every case at toy sizes, also on Numba's CUDA simulator (no GPU
needed, no timings), to check that the benchmark itself works.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback

from .attention import bench_decode, bench_grouped, bench_mixed, bench_prefill, bench_skewed
from .harness import Bench
from .moves import bench_clone, bench_write
from .peers import Peers
from .report import SECTIONS, report, report_section
from .sizes import (FULL, SKIP_MESSAGE, SMOKE, TARGETS, Sizes, add_size_arguments,
                    device_name, gpu_available, sizes_for)
from ..prerequisites import missing_packages


def without_missing_packages(sizes: Sizes) -> tuple[Sizes, dict]:
    """`sizes` less the cases whose packages are not installed, and what each part left
    out lacks (by part: `MissingTool.record()`), its line printed: the bfloat16 cases
    without ml_dtypes, the peers without PyTorch (on a GPU: the simulator runs none)."""
    tools = {}
    if gpu_available():
        tools["peers"] = missing_packages("kernel peers (SDPA, FlashAttention varlen)",
                                          ("torch",), "torch", "PyTorch")
    if "bfloat16" in sizes.dtypes:
        tools["bfloat16"] = missing_packages("kernel cases in bfloat16", ("ml_dtypes",),
                                             "bf16", "ml_dtypes")
    missing = {part: tool for part, tool in tools.items() if tool is not None}
    if "bfloat16" in missing:
        sizes = dataclasses.replace(sizes,
                                    dtypes=tuple(d for d in sizes.dtypes if d != "bfloat16"))
    for tool in missing.values():
        print(tool, flush=True)
    return sizes, {part: tool.record() for part, tool in missing.items()}


def run(sizes: Sizes = FULL, verbose: bool = False) -> dict:
    """Every case; on the simulator only at toy sizes (`SMOKE`), without timings; the
    cases whose packages are not installed are left out (`missing` says why)."""
    if not gpu_available() and sizes is not SMOKE:
        return dict(skipped=True, reason=SKIP_MESSAGE)
    sizes, missing = without_missing_packages(sizes)
    bench = Bench(sizes)
    peers = Peers(bench) if bench.torch is not None else None
    result = dict(skipped=False, device=device_name(), sizes=dataclasses.asdict(sizes),
                  torch=None if bench.torch is None else bench.torch.__version__,
                  targets=TARGETS, missing=missing)
    with bench.context():
        result["copy"] = bench.copy_roofline()
        result["matmul_tflops"] = bench.matmul_tflops()
        cases = dict(write=lambda: bench_write(bench), clone=lambda: bench_clone(bench),
                     decode=lambda: bench_decode(bench, peers),
                     skewed=lambda: bench_skewed(bench, peers),
                     grouped=lambda: bench_grouped(bench),
                     prefill=lambda: bench_prefill(bench, peers, result["matmul_tflops"]),
                     mixed=lambda: bench_mixed(bench))
        for key in SECTIONS:
            try:
                result[key] = cases[key]()
            except Exception as exc:  # noqa: BLE001 (one broken section must not hide the rest)
                traceback.print_exception(exc, file=sys.stderr)
                result[key] = [dict(error=f"{type(exc).__name__}: {exc}")]
            bench.release()         # the section's caches went with its frame
            if verbose:
                print(report_section(result, key), flush=True)
    return result


def main(argv=None) -> int:
    """`python -m kvnumba.bench.kernels [--quick | --smoke]`: run the cases, print the report."""
    parser = argparse.ArgumentParser(prog="python -m kvnumba.bench.kernels",
                                     description=__doc__.splitlines()[0])
    add_size_arguments(parser)
    args = parser.parse_args(argv)
    print(report(run(sizes_for(args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
