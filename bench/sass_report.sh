#!/usr/bin/env bash
# The static sm_90 report of docs/benchmarks.md: the write, clone, decode and prefill
# kernels at the specialisations the table lists (no GPU needed; see bench/sass.py for
# the tools it uses). Run from the repository root: bash bench/sass_report.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
q3="[:, :, ::1]"; s4="[:, :, :, ::1]"
decode() {  # storage type -> the decode kernel's signature
  echo "void($1$q3, $1$s4, $1$s4, int32[::1], $1$q3, float32[::1], float32[::1], int64, int64, int64, int64, int64, int64, int64, float32, float32)"
}
prefill() {
  echo "void($1$q3, $1$s4, $1$s4, int32[::1], $1$q3, int64, int64, int64, int64, int64, int64, float32, float32)"
}
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$PYTHON" -m bench.sass \
  "kvnumba.kernels.write:_write_vectors" \
  "void(float16$s4, float16$s4, float16$q3, float16$q3, int32[::1], int64, int64)" \
  "kvnumba.kernels.copy:_copy_vectors" "void(float16[:, :, :, :, :, ::1], int64, int64, int64)" \
  "kvnumba.kernels.decode:_decode_kernel(128, 'float16', 4, False)" "$(decode float16)" \
  "kvnumba.kernels.decode:_decode_kernel(128, 'uint16', 4, False)" "$(decode uint16)" \
  "kvnumba.kernels.decode:_decode_kernel(128, 'float32', 4, False)" "$(decode float32)" \
  "kvnumba.kernels.decode:_decode_kernel(256, 'float16', 4, False)" "$(decode float16)" \
  "kvnumba.kernels.prefill:_prefill_kernel(64, 64, 64, 'float16', False)" "$(prefill float16)" \
  "kvnumba.kernels.prefill:_prefill_kernel(128, 64, 64, 'float16', False)" "$(prefill float16)" \
  "kvnumba.kernels.prefill:_prefill_kernel(128, 64, 64, 'bfloat16', False)" "$(prefill uint16)" \
  "kvnumba.kernels.prefill:_prefill_kernel(256, 48, 16, 'float16', False)" "$(prefill float16)"
