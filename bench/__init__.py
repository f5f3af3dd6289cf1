"""kvnumba microbenchmarks (installed with kvnumba: they run from any directory).

- `python -m kvnumba.bench.control`: host time of declare + prepare + commit, against a
  naive baseline that drives one `transitions` model per slot (CPU, runs anywhere).
- `python -m kvnumba.bench.host`: host time of `write`, `attend` and `update_and_attend` for
  a decode step's layer, with the driver launch replaced by a recorder (CPU: runs in
  compile mode over fake device memory, which needs the `sass` extra's NVRTC and
  libNVVM, or on a GPU), and the launches each makes.
- `python -m kvnumba.bench.kernels`: write, clone and attention kernels on a CUDA GPU
  (fractions of a 1 GiB copy's bandwidth, TFLOP/s against a large fp16 matmul,
  PyTorch SDPA and FlashAttention varlen as peers with the `torch` extra; the bfloat16
  cases need the `bf16` extra). The kernel bench is the `kernels/` folder: its
  runner `run.py`, sizes `sizes.py`, harness `harness.py`, peers `peers.py`, cases
  `moves.py` and `attention.py`, and report `report.py`.
- `python -m kvnumba.bench.prefix`: prefix reuse through the prefix index, on and off: prompt
  tokens computed, pages held and the share of each prompt served from the index in a
  control-plane serving loop (deterministic counts), and host µs per page looked up and
  registered (CPU, runs anywhere).
- `python -m kvnumba.bench.engine`: the Hugging Face engine against `model.generate()` (a GPU
  and the `hf` extra).
- `python -m kvnumba.bench [--quick | --smoke] [--results DIR]` (also `kvnumba-bench`): all of
  these, the memory bench and the prefix-reuse bench, plus a JSON record in DIR (default
  `./bench-results`); a section whose libraries are not installed is skipped with a line
  naming the extra that installs them (`prerequisites.py`).
- `python -m kvnumba.bench.sass [--report | --check]`: static sm_90a report (registers,
  spills, shared memory, key SASS instructions, per-key / per-tile / per-vector
  figures) of compiled kernels, and `--check` against `bench/sass/budgets.json`; needs
  no GPU, only the CUDA tools of the `sass` extra.

Benchmarks never assert timings; the tests only check that they run.
"""
