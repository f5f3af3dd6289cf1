"""The benchmarks run and report sane figures (never timed assertions)."""
import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import json

import pytest

import kvnumba.device as kv_device
from kvnumba.bench import __main__ as bench_main
from kvnumba.bench import control, host, prefix
from kvnumba.bench.kernels import run as kernels


def test_control_quick_reports_every_batch_and_kind():
    """Run here (the simulator's device work excluded; compile mode is the subprocess
    `run_anywhere` makes, which the bench's smoke run takes for this section and the
    host section alike)."""
    result = control.run(quick=True)
    seen = {(r["batch"], r["kind"]) for r in result["rows"]}
    assert seen == {(b, k) for b in control.BATCHES for k in control.KINDS}
    for row in result["rows"]:
        for key in ("kvnumba_us", "naive_us", "ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (row, key)
        assert row["tokens"] >= row["batch"]
    assert result["device_work"] == control.DEVICE_WORK[kv_device.KIND]
    assert result["staggered"] == control.PAGE_SIZE
    assert "decode_us_at_256" in result and "ratio_at_256" in result
    assert "targets" in control.report(result).splitlines()[2]


def test_staggered_lengths_take_pages_in_every_decode_step():
    """The control bench's sequences start staggered over a page, so every decode step
    of B sequences takes B / PAGE_SIZE new pages (patched on the device)."""
    import numpy as np
    with control.device_work():
        driver = control.KvDriver(64)
        ids = np.arange(64)
        for _ in range(2 * control.PAGE_SIZE):
            assert driver.cache.page_demand(ids).needed == 64 // control.PAGE_SIZE
            driver.step(ids)


def host_reports_every_call_and_what_it_launches(result: dict) -> None:
    """The data path's host time as `--quick` (and `--smoke`) runs it, in compile mode (a
    subprocess from the simulator): every (B, inputs, call) is timed and, without a GPU,
    its launches are recorded: an update_and_attend launches what a write and an attend
    launch, in that order."""
    rows = {(r["batch"], r["kind"], r["op"]): r for r in result["rows"]}
    assert set(rows) == {(b, k, o) for b in host.BATCHES for k in host.KINDS for o in host.OPS}
    for row in rows.values():
        assert math.isfinite(row["us"]) and 0 < row["best_us"] <= row["us"], row
        assert math.isfinite(row["cpu_us"]) and 0 < row["best_cpu_us"] <= row["cpu_us"], row
    if not result["launches_replaced"]:
        return
    for (batch, kind, op), row in rows.items():
        if op == "update_and_attend":
            both = rows[batch, kind, "write"]["launches"] + rows[batch, kind, "attend"]["launches"]
            assert row["launches"] == both and len(both) >= 2, row
        if kind == "device":
            assert math.isfinite(row["numba_cpu_us"]) and row["numba_cpu_us"] > 0, row
    assert "target" in host.report(result).splitlines()[2]


def test_mixed_step_fits_the_config():
    for batch in control.BATCHES:
        ids = control.step_ids(batch, "mixed")
        assert ids.size <= control.MAX_STEP
        assert (ids[1:] >= ids[:-1]).all()  # one run per sequence
        assert set(ids.tolist()) == set(range(batch))


def bench_command(args, cwd, merged=False):
    """`python -m kvnumba.bench...` in `cwd` (any directory: the benchmarks are installed);
    `merged`: stderr interleaved into stdout, in the order it was written."""
    env = {k: v for k, v in os.environ.items() if k != "KVNUMBA_DEVICE"}
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, text=True,
                          timeout=300, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merged else subprocess.PIPE)


@pytest.mark.skipif(not kv_device.SIMULATOR, reason="on a GPU the kernel bench runs")
def test_kernel_bench_skips_without_a_gpu(tmp_path):
    proc = bench_command(["kvnumba.bench.kernels"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert kernels.SKIP_MESSAGE in proc.stdout


def test_bench_runs_from_any_directory_and_writes_where_it_is_told(tmp_path):
    proc = bench_command(["kvnumba.bench", "--help"], tmp_path)
    assert proc.returncode == 0 and "--results" in proc.stdout
    assert proc.stdout.startswith("usage: python -m kvnumba.bench ")
    assert "kvnumba:" not in proc.stderr            # no simulator notice for --help
    proc = bench_command(["kvnumba.bench", "--smoke", "--results", "out"], tmp_path, merged=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "Warning" not in proc.stdout, proc.stdout    # e.g. an overflow casting to float16
    notice = proc.stdout.find("kvnumba: no CUDA GPU")   # before every table, when shown
    assert notice < proc.stdout.index("kvnumba benchmarks on ")
    if kv_device.SIMULATOR:
        assert "benchmarks on the simulator," in proc.stdout
    assert "1 kv heads" not in proc.stdout and "1 kv head," in proc.stdout
    (record,) = (tmp_path / "out").glob("*.json")
    figures = json.loads(record.read_text())
    assert figures["smoke"] and figures["kernels"]["sizes"]["head_dim"] == 16
    for key in kernels.SECTIONS:            # every kernel case ran through the public API
        rows = figures["kernels"][key]
        assert rows and all("error" not in r for r in rows), (key, rows)
    assert "data path host time" in proc.stdout
    host_reports_every_call_and_what_it_launches(figures["host"])
    assert "skewed 3 seqs, ring 4" in proc.stdout and "targets" in proc.stdout
    served = figures["serve"]              # the server did the direct calls' work, greedy
    assert served["requests"] >= 2 and served["served_tokens"] == served["direct_tokens"] > 0
    assert not (Path(control.__file__).parent / "results").exists()


def hide_compiler_libraries(monkeypatch, error):
    """numba-cuda's library lookup fails with `error` for every library (as without the
    `sass` extra, for a DynamicLibNotFoundError)."""
    from cuda import pathfinder
    from numba.cuda.cuda_paths import get_cuda_paths

    def load(libname):
        raise error

    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", load)
    monkeypatch.delattr(get_cuda_paths, "_cached_result", raising=False)  # its lookup again


@pytest.mark.skipif(not kv_device.SIMULATOR, reason="on a GPU the host bench compiles nothing")
def test_sections_without_their_libraries_are_skipped_naming_the_extra(monkeypatch, capsys,
                                                                       tmp_path):
    """No NVRTC / libNVVM and no PyTorch: the host and engine sections each print why
    and which extra installs what they lack, the record says so, and the run succeeds."""
    from cuda import pathfinder

    hide_compiler_libraries(monkeypatch, pathfinder.DynamicLibNotFoundError(
        'Failure finding "libnvrtc.so.13 or libnvrtc.so.12": No such file'))
    monkeypatch.setitem(sys.modules, "torch", None)       # as if not installed
    monkeypatch.setattr(bench_main, "SECTIONS",
                        [s for s in bench_main.SECTIONS if s.key in ("host", "engine")])
    assert bench_main.main(["--smoke", "--results", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    host_line = ("data path host time: skipped, the CUDA compiler libraries are not found "
                 "(libnvrtc.so.13 or libnvrtc.so.12); pip install -e '.[sass]' installs "
                 "NVRTC and libNVVM")
    engine_line = ("engine vs model.generate(): skipped, torch is not installed; pip install "
                   "-e '.[hf]' installs PyTorch and transformers")
    assert host_line in lines and engine_line in lines
    (record,) = tmp_path.glob("*.json")
    figures = json.loads(record.read_text())
    assert figures["host"] is None and figures["engine"] is None
    assert figures["skipped"] == {
        "host": dict(missing="the CUDA compiler libraries are not found (libnvrtc.so.13 or "
                             "libnvrtc.so.12)", extra="sass", message=host_line),
        "engine": dict(missing="torch is not installed", extra="hf", message=engine_line)}


@pytest.mark.skipif(not kv_device.SIMULATOR, reason="on a GPU the host bench compiles nothing")
def test_a_failing_library_lookup_is_not_taken_for_a_missing_library(monkeypatch):
    hide_compiler_libraries(monkeypatch, OSError("libnvrtc.so.13: invalid ELF header"))
    with pytest.raises(OSError, match="invalid ELF header"):
        host.run_anywhere(quick=True)


def test_kernel_cases_in_bfloat16_are_left_out_without_ml_dtypes(monkeypatch, capsys):
    """Without ml_dtypes (the `bf16` extra) the bfloat16 cases are left out, with a line
    naming the extra, and the float16 ones still run."""
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    sizes, missing = kernels.without_missing_packages(kernels.SMOKE)
    assert sizes.dtypes == ("float16",) and missing["bfloat16"]["extra"] == "bf16"
    assert ("kernel cases in bfloat16: skipped, ml_dtypes is not installed; pip install "
            "-e '.[bf16]' installs ml_dtypes") in capsys.readouterr().out.splitlines()


#: the prefix-reuse bench at a scale its counts can be worked out by hand: pages of 16,
#: chunks of 16, a 40-token system prompt (2 whole pages, then 8 tokens)
TINY = prefix.Sizes(requests=3, system=40, question=20, new_tokens=3, max_running=3,
                    conversations=2, turns=3, user=10, answer=6, jitter=0, max_write=16,
                    window=20, page_size=16, lookup=64)


def whole(n: int, page: int = 16) -> int:
    """Positions in the whole pages of `n` positions."""
    return n // page * page


@pytest.mark.parametrize("question", [0, TINY.question])
def test_prefix_reuse_counts_are_the_hand_computed_ones(question):
    """Reuse off computes every prompt token; on, the first request computes its prompt
    and each later one only what follows the whole pages it shares (all of the prompt
    but its last token at most): `p - floor((p - 1) / P) P` for identical prompts. Pages
    held at the peak: off, every request its own; on, the shared pages once. A windowed
    config hits alike and holds one ring per running request more."""
    sizes = dataclasses.replace(TINY, question=question)
    n, p, size = sizes.requests, sizes.system + question, sizes.page_size
    shared = whole(min(sizes.system, p - 1))
    own = -(-(p + sizes.new_tokens - 1) // size)         # pages a request ends holding
    rows = prefix.cache_config(sizes.layer_configs()["windowed"], sizes, n).ring_rows()
    ring = -(-int(rows.max()) // size)                   # pages of a sequence's ring
    for name, layers in sizes.layer_configs().items():
        rings = n * ring if name == "windowed" else 0
        off = prefix.shared_prompt(layers, sizes, reuse=False)
        assert (off["computed"], off["hit"], off["prompt_tokens"]) == (n * p, 0, n * p)
        assert off["peak_held"] == n * own + rings
        on = prefix.shared_prompt(layers, sizes, reuse=True)
        assert on["computed"] == p + (n - 1) * (p - shared), name
        assert on["hit"] == (n - 1) * shared and on["pages_evicted"] == 0
        assert on["peak_held"] == shared // size + n * (own - shared // size) + rings, name
    if question == 0:
        assert shared == whole(p - 1) and p - shared == 8


def test_prefix_reuse_serves_each_turn_from_what_the_last_one_registered():
    """A turn's prompt is the last one's, its answer and a user message; the last turn
    committed its prompt and all of its answer but the last token, so the next one is
    served the whole pages of that (and never its own last token)."""
    s = TINY
    # turn 1: the first conversation computes the system prompt, the others wait for
    # its whole pages and are served them
    prompts, hits = [s.system + s.user], [(s.conversations - 1) * whole(s.system)]
    for _ in range(1, s.turns):
        committed = prompts[-1] + s.answer - 1
        prompts.append(prompts[-1] + s.answer + s.user)
        hits.append(s.conversations * whole(min(committed, prompts[-1] - 1)))
    for layers in s.layer_configs().values():
        on = prefix.conversations(layers, s, reuse=True)
        off = prefix.conversations(layers, s, reuse=False)
        assert [t["prompt_tokens"] for t in on["turns"]] == [s.conversations * p for p in prompts]
        assert [t["hit"] for t in on["turns"]] == hits
        assert [t["hit"] for t in off["turns"]] == [0] * s.turns
        assert off["computed"] == off["prompt_tokens"] == on["prompt_tokens"]
        assert on["computed"] == on["prompt_tokens"] - sum(hits)


def test_prefix_bench_runs_and_reports_at_a_tiny_scale():
    result = prefix.run(quick=True, sizes=TINY)
    shared = result["shared_prompt"]
    assert shared["flat"]["on"]["computed"] == shared["windowed"]["on"]["computed"] == 60 + 2 * 28
    assert shared["flat"]["computed_ratio"] == pytest.approx(116 / 180)
    assert [t["turn"] for t in result["conversations"]["flat"]["on"]["turns"]] == [1, 2, 3]
    host_rows = result["host"]["rows"]
    assert result["host"]["pages"] == 4 and len(host_rows) == 6
    assert all(math.isfinite(r["us_per_page"]) and r["us_per_page"] > 0 for r in host_rows)
    text = prefix.report(result)
    assert text.startswith(prefix.HEADER) and "host µs per page" in text
    json.dumps(result)                                   # goes into the JSON record


@pytest.mark.skipif(not kv_device.SIMULATOR, reason="on a GPU the host bench compiles nothing")
def test_the_host_section_alone_without_its_libraries_says_what_to_install(monkeypatch,
                                                                           capsys):
    """`python -m kvnumba.bench.host` without NVRTC / libNVVM: one line naming the `sass`
    extra and exit status 2, no traceback."""
    from cuda import pathfinder

    hide_compiler_libraries(monkeypatch, pathfinder.DynamicLibNotFoundError(
        'Failure finding "libnvrtc.so.13 or libnvrtc.so.12": No such file'))
    assert host.main(["--quick"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "-e '.[sass]'" in err[0] and \
        err[0].startswith("python -m kvnumba.bench.host: data path host time: skipped")
