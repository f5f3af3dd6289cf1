"""`run`: the checked cached run, the cache-free replay, and the result they add up to."""
from __future__ import annotations

import sys
import time

import kvnumba as kv

from .checker import CheckedEngine, Stop
from .engines import CacheEngine, ReferenceEngine
from .options import Options, build_model, cache_config, prompts_for
from .report import STEP_HEADER, DemoResult, SessionReport, header, report_text
from .scenario import Scenario, planned_steps


def run(*, out=sys.stdout, tamper=None, tamper_step=None, fail_fast=False,
        **options) -> DemoResult:
    """Run the demo; `options` are `Options` fields (`ValueError` when one is out of
    range). Prints progress to `out` (None: silent).

    `tamper(cache, table)` runs once, right after step `tamper_step` commits;
    `fail_fast` stops the run at the first mismatching step.
    """
    opts = Options(**options)
    opts.validate()
    started = time.perf_counter()
    with kv.device.simulator_pace():
        return _run(opts, out, tamper, tamper_step, fail_fast, started)


def _run(opts: Options, out, tamper, tamper_step, fail_fast, started) -> DemoResult:
    model = build_model(opts)
    config = cache_config(opts)
    prompts = prompts_for(opts)
    cached = CacheEngine(model, config)
    checked = CheckedEngine(cached, ReferenceEngine(model), opts.dtype, out=out, tamper=tamper,
                            tamper_step=tamper_step, fail_fast=fail_fast,
                            total_steps=planned_steps(opts))
    _print(out, header(opts, config, prompts, cached.cache))
    _print(out, STEP_HEADER)
    pages_before = _flat_pages(cached.cache)
    scenario = Scenario(checked, model, opts, prompts)
    completed = True
    try:
        scenario.run()
    except Stop as stop:
        completed = False
        _print(out, f"  {stop}")
    mismatches = [p for r in checked.reports for p in r.problems]
    sessions = _replay(scenario, checked, model, opts, prompts, completed, mismatches)

    features = dict(scenario.features)
    rows = config.ring_rows()
    ring = next((i for i, spec in enumerate(config.layers) if spec.is_ring), None)
    if ring is not None:
        features["ring wrap"] = (f"ring layer {ring} (W={config.layers[ring].window}) holds "
                                 f"{rows[ring]} rows; sessions wrote up to position "
                                 f"{scenario.max_pos - 1}")
    if pages_before is not None:
        features["flat growth"] = (f"the flat layers' pool grew from {pages_before} to "
                                   f"{_flat_pages(cached.cache)} pages of {config.page_size} "
                                   f"positions; forks shared their prefixes' pages")
    if completed:
        freed = all(cached.cache.state(s) == kv.SlotState.FREE
                    for s in range(config.max_seqs))
        features["close"] = "every session closed, every sequence slot free" if freed else \
            "sequence slots still in use after closing every session"
        if not freed:
            mismatches.append("sequence slots still in use after closing every session")
    result = DemoResult(completed and not mismatches, sessions, checked.reports, mismatches,
                        features, time.perf_counter() - started, completed)
    _print(out, report_text(result))
    return result


def _replay(scenario: Scenario, checked: CheckedEngine, model, opts: Options, prompts: list,
            completed: bool, mismatches: list) -> list:
    """The independent replay: the same script on the reference alone. Returns a
    `SessionReport` per session of the cached run; appends to `mismatches` each session
    whose tokens differ (once the cached run completed) and a replay that failed."""
    replay = Scenario(ReferenceEngine(model), model, opts, prompts)
    replayed = True
    try:
        replay.run()
    except Exception as exc:  # noqa: BLE001  (a replay that cannot follow is a mismatch too)
        replayed = False
        mismatches.append(f"the cache-free replay failed: {exc!r}")
    whole_steps_ok = "*" not in checked.bad_sessions
    sessions = []
    for sid, generated in scenario.generated.items():
        reference = replay.generated.get(sid, [])
        sessions.append(SessionReport(sid, scenario.origin[sid], scenario.prompt_len[sid],
                                      generated, reference,
                                      whole_steps_ok and sid not in checked.bad_sessions))
        if completed and replayed and generated != reference:
            mismatches.append(f"session {sid}: generated {generated} but the cache-free "
                              f"replay generated {reference}")
    return sessions


def _flat_pages(cache: kv.BatchedSequenceCache) -> int | None:
    """Pages allocated to the flat layers' pool, None without flat layers."""
    return next((p.allocated for p in cache.pool_pages() if p.rows == 0), None)


def _print(out, text: str) -> None:
    if out is not None:
        print(text, file=out, flush=True)
