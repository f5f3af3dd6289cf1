#!/usr/bin/env bash
# One prepared run on a lent GPU machine: the test suite on the GPU, then every
# benchmark; logs and the JSON record go under $OUT (what the device tool returns).
#
# The GPU image lacks `transitions`: carry it as a wheel. Here, once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp -d .whl transitions==0.9.3
# then run on the device:  bash bench/gpu_check.sh   (carry: [".whl"], timeout_s ~540)
set -uo pipefail
OUT=${OUT:-/tmp/kvnumba-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVNUMBA_DEVICE=gpu PYTHONPATH="$PWD"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
fi
{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import numba, numpy, transitions; from importlib.metadata import version; \
print('python', __import__('sys').version.split()[0], 'numpy', numpy.__version__, \
'numba', numba.__version__, 'numba-cuda', version('numba-cuda'), \
'transitions', version('transitions'))"
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests > "$OUT/tests.txt" 2>&1
echo "tests: exit $? ($(tail -n 1 "$OUT/tests.txt"))"
timeout 180 python3 -m bench --results "$OUT" > "$OUT/bench.txt" 2>&1
echo "bench: exit $?"
cat "$OUT/bench.txt"
