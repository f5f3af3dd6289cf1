#!/usr/bin/env bash
# The static sm_90 report of docs/benchmarks.md: the write, clone, decode, combine and
# prefill kernels at the specialisations the table lists (bench.sass.SPECIALISATIONS;
# no GPU needed; see bench/sass.py for the tools it uses). Arguments go to bench.sass,
# e.g. --keep DIR or --check. Run from anywhere: bash bench/sass_report.sh [ARGS]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} exec "${PYTHON:-python}" -m bench.sass --report "$@"
