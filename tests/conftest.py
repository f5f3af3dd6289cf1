"""Test setup: the simulator by default, fast thread switching, hypothesis profiles.

`HYPOTHESIS_PROFILE=thorough` runs the long stateful searches (10,000+ steps).
`KVNUMBA_TEST_PAGE_SIZE=8` (or 256, any size the config takes) makes that the page size
of every `CacheConfig` that does not name one, so the whole suite runs at it: the tests
that name a page size (the kernels', the page tests') keep theirs.
"""
import os
import sys

import pytest

os.environ.setdefault("KVNUMBA_DEVICE", "simulator")
#: PyTorch on one thread a process (set before anything imports torch; subprocesses inherit
#: it): the tests' tensors are far too small to split, and with a pool of a thread a core
#: in every xdist worker the pools' waiting threads spin on the cores the simulated kernels
#: need (measured on 2 cores: a speculative-sampling verdict over 4 tokens, 3.9 ms of CPU
#: on 2 threads, 0.06 ms on 1)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

from kvnumba import device  # noqa: E402

if device.SIMULATOR:    # why this interval: at its definition
    sys.setswitchinterval(device.SIMULATOR_SWITCH_INTERVAL)

def _default_page_size(size: int) -> None:
    """Every `CacheConfig` built without `page_size` takes `size` (its dataclass default)."""
    import dataclasses

    import kvnumba as kv
    names = [f.name for f in dataclasses.fields(kv.CacheConfig)]
    defaults = list(kv.CacheConfig.__init__.__defaults__)
    defaults[names.index("page_size") - (len(names) - len(defaults))] = size
    kv.CacheConfig.__init__.__defaults__ = tuple(defaults)


if os.environ.get("KVNUMBA_TEST_PAGE_SIZE"):
    _default_page_size(int(os.environ["KVNUMBA_TEST_PAGE_SIZE"]))

@pytest.fixture
def nan_storage(monkeypatch):
    """Every array a cache's pools allocate starts as NaN: a row nobody wrote poisons
    whatever reads it."""
    import numpy as np

    from kvnumba.data import storage as storage_module
    real = storage_module.PageStorage._allocate

    def poisoned(self, kind, n_pages):
        groups = real(self, kind, n_pages)
        for group in groups:
            if group.dtype.itemsize == 1:  # 8-bit float bits: 0x7F is NaN in e4m3 and e5m2
                group.copy_to_device(np.full(group.shape, 0x7F, group.dtype))
            else:
                group.copy_to_device(np.full(group.shape, np.nan, group.dtype))
        return groups

    monkeypatch.setattr(storage_module.PageStorage, "_allocate", poisoned)


settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=1000, deadline=None,
                          stateful_step_count=100,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter):
    """What the stateful search exercised (its `COUNTS`), so a long run shows how many
    steps, spans and refusals it really covered rather than only that it passed."""
    module = next((m for name, m in list(sys.modules.items())
                   if name.rpartition(".")[2] == "test_cache_stateful"), None)
    counts = getattr(module, "COUNTS", None)
    if counts:
        terminalreporter.write_sep("-", "stateful search coverage")
        for what, n in sorted(counts.items()):
            terminalreporter.write_line(f"{n:>9,}  {what}")


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the cores (two from 4 cores on). A simulated
    kernel's threads pass the interpreter lock around and leave a core idle about a
    third of the time, which another worker fills (measured on 2 cores: 31 model and
    cache tests in 146 s on 2 workers, 105 s on 3, 114 s on 4)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    return cores + (2 if cores >= 4 else 1)


#: the slowest tests (45 s or more each on 2 cores, slowest first), dealt out over the
#: workers and started first: run last, one of them would leave its worker finishing
#: alone while the others have nothing left
SLOW_FIRST = ("test_bench.py::test_bench_runs_from_any_directory",
              "test_hf_tp.py::test_two_ranks_serve_what_one_process_generates",
              "test_hf_cli.py::test_generate_self_check_reports_each_run",
              "test_hf_gemma4.py::test_gemma4_text_is_served_token_for_token",
              "test_sass_budgets.py::test_the_regressed_kernels_fail",
              "test_hf_hybrid.py::test_hybrid_served_packed_forked_and_drafted_as_generated",
              "test_launch.py::test_the_compile_mode_checks_pass",
              "test_hf_verify.py::test_models_with_learned_sinks_are_served_token_for_token",
              "test_cache_stateful.py::TestCacheMachineE4M3",
              "test_state_stateful.py::TestStateLayers",
              "test_hf_llama4.py::test_llama4_text_is_served_token_for_token",
              "test_layer_shapes.py::test_layers_of_several_shapes_and_shared_layers_attend",
              "test_state_kernels.py::test_the_kernels_compile_and_launch_in_compile_mode",
              "test_spans.py::test_interleaved_spans_equal_each_sequence_alone",
              "test_single.py::test_single_control_matches_one_sequence_of_a_batched_cache")


def pytest_collection_modifyitems(items):
    """The `SLOW_FIRST` tests ahead of the rest, dealt out over the xdist workers.

    `--dist worksteal` first hands each worker a run of consecutive tests, a share as
    even as it can be, and lets an idle worker take the later half of another's queue:
    so each worker's share begins with its own slow tests, taken in `SLOW_FIRST`'s order
    (the first, fourth, ... to the first worker of three: each worker one of the
    slowest), rather than every slow test queued on the first worker, one after another.
    The rest keep their order."""
    def rank(item):
        return next((i for i, name in enumerate(SLOW_FIRST) if name in item.nodeid), None)

    slow = sorted((item for item in items if rank(item) is not None), key=rank)
    rest = [item for item in items if rank(item) is None]
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    ordered, left = [], len(items)
    for worker in range(workers):
        share = left // (workers - worker)   # what worksteal hands this worker first
        own = slow[worker::workers]
        taken = max(0, share - len(own))
        ordered += own + rest[:taken]
        rest = rest[taken:]
        left -= share
    items[:] = ordered + rest


def pytest_collection_finish(session):
    """What collection imported (PyTorch, transformers, numba, the test modules: hundreds
    of thousands of objects) moved out of the garbage collector's sight, and collections
    made 20 times rarer: the simulator's threads make objects fast enough to set off a
    full collection every second or so, each walking the whole heap while holding the
    interpreter lock (a Llama model test: 1.97 s of collections, 1.18 s with these).
    Objects the tests make are collected as before, only in larger batches."""
    import gc
    gc.collect()
    gc.freeze()
    gc.set_threshold(20 * gc.get_threshold()[0], *gc.get_threshold()[1:])
