"""The lockstep check: every step of the cached engine against the reference engine's,
each leaving a `StepReport` (`report`)."""
from __future__ import annotations

import math
import time

import numpy as np

from .engines import CacheEngine, ReferenceEngine, StepOutput
from .options import TOLERANCE
from .report import StepReport, step_line

#: near-ties (top-2 reference logits within TIE) are not counted as token mismatches by
#: the per-step check (the replay still compares tokens)
TIE = 1e-3
#: problems of one step printed under its line (the report lists the first 20 of all)
PRINTED_PROBLEMS = 8


class Stop(Exception):
    """--fail-fast: the step `index` mismatched, the run stops there."""

    def __init__(self, index: int):
        super().__init__(f"stopped after step {index} (--fail-fast)")
        self.index = index


class CheckedEngine:
    """Drives the cache engine and the reference engine in lockstep, comparing every step.

    It has the engines' face, so the scenario drives it as either. `kind` labels the
    next step's report. `out`: where each step's line is printed (None: nowhere);
    `tamper(cache, table)` runs once, right after step `tamper_step` commits;
    `fail_fast` raises `Stop` after the first mismatching step.
    """

    def __init__(self, cached: CacheEngine, reference: ReferenceEngine, dtype: str,
                 out=None, tamper=None, tamper_step=None, fail_fast=False, total_steps=None):
        self.cached, self.reference = cached, reference
        self.atol, self.rtol = TOLERANCE[dtype]
        self.out = out
        self.tamper, self.tamper_step = tamper, tamper_step
        self.fail_fast = fail_fast
        self.total_steps = total_steps
        self.reports: list[StepReport] = []
        self.bad_sessions: set = set()      # session ids, "*" when a step as a whole was wrong
        self.kind = ""

    def open(self) -> int:
        """A new session in both engines (the same id in each)."""
        sid = self.cached.open()
        assert self.reference.open() == sid
        return sid

    def clone(self, sid: int, upto: int) -> int:
        """`sid`'s first `upto` positions as a new session in both engines."""
        new = self.cached.clone(sid, upto)
        assert self.reference.clone(sid, upto) == new
        return new

    def close(self, sid: int) -> None:
        """Close the session in both engines."""
        self.cached.close(sid)
        self.reference.close(sid)

    def step(self, inputs, blocks=(), width=None) -> StepOutput:
        """The cached step, checked against the reference's; returns the cached output."""
        index = len(self.reports) + 1
        got = self.cached.step(inputs, blocks, width)
        t = time.perf_counter()
        want = self.reference.step(inputs, blocks)
        problems, max_err = self._compare(index, inputs, got, want)
        report = StepReport(index, self.kind, len(got.logits), got.width, got.n_segments,
                            got.control_ms, got.kernels_s, 1e3 * (time.perf_counter() - t),
                            max_err, problems)
        self.reports.append(report)
        self._print(step_line(report, self.total_steps))
        for line in problems[:PRINTED_PROBLEMS]:
            self._print(f"      MISMATCH {line}")
        if self.tamper is not None and index == self.tamper_step:
            self.tamper(self.cached.cache, self.cached.table)
            self._print(f"      (tamper hook ran after step {index})")
        if problems and self.fail_fast:
            raise Stop(index)
        return got

    def _print(self, line: str) -> None:
        if self.out is not None:
            print(line, file=self.out, flush=True)

    def _compare(self, index, inputs, got: StepOutput, want: StepOutput) -> tuple:
        """`(problems, max_err)`: one line per difference of the step, and the largest
        attention difference."""
        problems, max_err = [], 0.0

        def bad(sid, text):
            problems.append(f"step {index}: session {sid}: {text}")
            self.bad_sessions.add(sid)

        if not np.array_equal(got.logit_indices, want.logit_indices):
            bad("*", f"logit_indices {got.logit_indices.tolist()} != expected "
                     f"{want.logit_indices.tolist()}")
        if not np.array_equal(got.positions, want.positions):
            bad("*", f"the plan's positions {got.positions.tolist()} != the inputs' "
                     f"{want.positions.tolist()}")
        if not got.pad_zero:
            bad("*", "padding rows of the attention output are not zero")
        a = 0
        for sid, start, tokens in inputs:
            b = a + len(tokens)
            where = f"positions {start}..{start + b - a - 1}"
            for layer, (x, y) in enumerate(zip(got.attn, want.attn)):
                err = float(np.max(np.abs(x[a:b] - y[a:b]))) if b > a else 0.0
                if not np.isfinite(err):
                    err = math.inf
                max_err = max(max_err, err)
                if not np.allclose(x[a:b], y[a:b], atol=self.atol, rtol=self.rtol):
                    bad(sid, f"layer {layer} attention at {where} differs from the reference "
                             f"by {err:.3g}")
            if not np.allclose(got.logits[a:b], want.logits[a:b], atol=10 * self.atol,
                               rtol=10 * self.rtol):
                err = float(np.max(np.abs(got.logits[a:b] - want.logits[a:b])))
                bad(sid, f"logits at {where} differ from the reference by {err:.3g}")
            ref_top2 = np.sort(want.logits[a:b], axis=1)[:, -2:]
            clear = ref_top2[:, 1] - ref_top2[:, 0] > TIE
            mine, theirs = got.logits[a:b].argmax(axis=1), want.logits[a:b].argmax(axis=1)
            for i in np.flatnonzero(clear & (mine != theirs)):
                bad(sid, f"greedy token after position {start + i}: cache {int(mine[i])}, "
                         f"reference {int(theirs[i])}")
            a = b
        return problems, max_err
