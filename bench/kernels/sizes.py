"""The kernel benchmarks' sizes (full, `--quick`, `--smoke`), targets and device facts."""
from __future__ import annotations

import dataclasses

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
    grouped: tuple = ((8, 16), 128, 4096)      # query heads per kv head, sequences x keys
    grouped_dtypes: tuple = ("float16", "float8_e4m3")
    prefill: tuple = (("4x1024", 4, 1024, 0), ("1x4096", 1, 4096, 0),
                      ("4x512@4096", 4, 512, 4096))
    mixed: tuple = (4, 1024, 64, 4096)        # chunks x tokens, decode tokens at history
    matmul: int = 8192
    warmup: int = 5
    iters: int = 20
    repeats: int = 7


FULL = Sizes()
QUICK = dataclasses.replace(FULL, copy_mib=256, decode_batches=(1, 32), grouped=((8,), 64, 4096),
                            decode_histories=(512, 4096), warmup=2, iters=5, repeats=3)
SMOKE = Sizes(n_kv_heads=1, n_q_heads=2, head_dim=16, copy_mib=1, write_prefill=(2, 4),
              write_decode=3, clone=(32, 2), decode_batches=(1, 2), decode_histories=(5,),
              skewed=(3, 2, 9), ring_window=4, grouped=((8,), 2, 5), prefill=(("2x5", 2, 5, 0), ("1x5@3", 1, 5, 3)),
              mixed=(1, 5, 2, 3), matmul=64, warmup=0, iters=1, repeats=1)

#: targets on an H200-class GPU, as ratios measured in one run
TARGETS = dict(decode_of_copy=0.8, decode_vs_sdpa=0.9, skewed_vs_flash=2.0, write_of_copy=0.8,
               clone_of_copy=0.8, single_decode_wall_us=40.0, prefill_tflops=150.0,
               prefill_vs_flash=0.33)


def gpu_available() -> bool:
    """Whether the kernels run on a CUDA GPU (not on Numba's simulator)."""
    return not kv_device.SIMULATOR


def device_name() -> str:
    """The GPU's name, or "simulator"."""
    if not gpu_available():
        return "simulator"
    name = kv_device.cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def ratio(a, b):
    """a / b, or None where either is missing (not measured) or zero."""
    return None if not a or not b else a / b


def add_size_arguments(parser) -> None:
    """`--quick` / `--smoke`, for `python -m kvnumba.bench.kernels` and `python -m kvnumba.bench`."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    size.add_argument("--smoke", action="store_true",
                      help="toy sizes, no timings: checks the benchmarks run (simulator too)")


def sizes_for(args) -> Sizes:
    """The `Sizes` the parsed `--quick` / `--smoke` arguments ask for."""
    return SMOKE if args.smoke else QUICK if args.quick else FULL
