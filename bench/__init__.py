"""kvnumba microbenchmarks (installed with kvnumba: they run from any directory).

- `python -m bench.control`: host time of declare + prepare + commit, against a
  naive baseline that drives one `transitions` model per slot (CPU, runs anywhere).
- `python -m bench.kernels`: write, clone and attention kernels on a CUDA GPU
  (fractions of a 1 GiB copy's bandwidth, TFLOP/s against a large fp16 matmul,
  PyTorch SDPA and FlashAttention varlen as peers).
- `python -m bench [--quick | --smoke] [--results DIR]` (also `kvnumba-bench`): both,
  plus a JSON record in DIR (default `./bench-results`).
- `python -m bench.sass`: static sm_90 report (registers, spills, shared memory,
  key SASS instructions) of compiled kernels; needs no GPU, only the CUDA tools.

Benchmarks never assert timings; the tests only check that they run.
"""
