"""The benchmarks run and report sane figures (never timed assertions)."""
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is not an installed package: import it from the checkout
    sys.path.insert(0, str(ROOT))

import kvnumba.device as kv_device  # noqa: E402
from bench import control, kernels  # noqa: E402


def test_control_quick_reports_every_batch_and_kind():
    result = control.run(quick=True)
    seen = {(r["batch"], r["kind"]) for r in result["rows"]}
    assert seen == {(b, k) for b in control.BATCHES for k in control.KINDS}
    for row in result["rows"]:
        for key in ("kvnumba_us", "naive_us", "ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (row, key)
        assert row["tokens"] >= row["batch"]
    assert result["upload_included"] == (not kv_device.SIMULATOR)
    assert "decode_us_at_256" in result and "ratio_at_256" in result
    assert "targets" in control.report(result).splitlines()[2]


def test_mixed_step_fits_the_config():
    for batch in control.BATCHES:
        ids = control.step_ids(batch, "mixed")
        assert ids.size <= control.MAX_STEP
        assert (ids[1:] >= ids[:-1]).all()  # one run per sequence
        assert set(ids.tolist()) == set(range(batch))


def test_kernel_bench_smoke_runs_every_case():
    """At toy sizes every case runs through the public API (on the simulator: no timings)."""
    result = kernels.run(kernels.SMOKE)
    for key in kernels.SECTIONS:
        rows = result[key]
        assert rows and all("error" not in r for r in rows), (key, rows)
    text = kernels.report(result)
    assert "skewed 3 seqs, ring 4" in text and "targets" in text


def test_kernel_bench_skips_without_a_gpu():
    env = dict(os.environ, KVNUMBA_DEVICE="simulator")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "bench.kernels"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert kernels.SKIP_MESSAGE in proc.stdout
