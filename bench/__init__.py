"""kvnumba microbenchmarks (DESIGN §12).

- `python -m bench.control`: host time of declare + prepare + commit, against a
  naive baseline that drives one `transitions` model per slot (CPU, runs anywhere).
- `python -m bench.kernels`: write, clone and attention kernels on a CUDA GPU
  (GB/s against a device-to-device copy, TFLOP/s, PyTorch SDPA as the peer).
- `python -m bench [--quick]`: both, plus a JSON record in `bench/results/`.
- `python -m bench.sass`: static sm_90 report (registers, spills, shared memory,
  key SASS instructions) of compiled kernels; needs no GPU, only the CUDA tools.

Benchmarks never assert timings; the tests only check that they run.
"""
