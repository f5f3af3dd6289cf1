#!/usr/bin/env bash
# One run of everything that needs a CUDA GPU: the test suite on the GPU, then every
# benchmark. Logs and the JSON record of the figures go to the folder given as the
# first argument (default ./gpu-check).
#
#   bash bench/gpu_check.sh [OUTPUT_DIR]
#
# Run it from the repository root with kvnumba's dependencies importable (an
# installed checkout, or PYTHONPATH pointing at wheels unpacked with
# `pip install --target DIR ...` and at the checkout). It needs the test extra
# (pytest, hypothesis); PyTorch with CUDA adds the SDPA / FlashAttention peers.
set -uo pipefail
out=${1:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 KVNUMBA_DEVICE=gpu
{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import numba, numpy; from importlib.metadata import version as v; \
print('python', __import__('sys').version.split()[0], 'numpy', numpy.__version__, \
'numba', numba.__version__, 'numba-cuda', v('numba-cuda'), 'transitions', v('transitions'))"
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
        2>/dev/null || echo "torch: not installed (no peers)"
} > "$out/device.txt" 2>&1
cat "$out/device.txt"
timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests > "$out/tests.txt" 2>&1
echo "tests: exit $? ($(tail -n 1 "$out/tests.txt"))"
timeout 240 python3 -m kvnumba.bench --results "$out" > "$out/bench.txt" 2>&1
echo "bench: exit $?"
cat "$out/bench.txt"
