"""Budgets on the static figures of `python -m kvnumba.bench.sass` (`bench.sass.figures`), and
the tables it prints.

A budget file is JSON: `{"every kernel": {BUDGET: LIMIT, ...}, "<kernel label>":
{BUDGET: LIMIT, ...}, ...}`, a label being one of the report's kernels. BUDGET is
`max_<figure>` (the figure may not exceed LIMIT) or `min_<figure>` (it may not fall
below LIMIT). A kernel's own entry overrides the same budget under "every kernel".
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

EVERY = "every kernel"
#: figure -> how the report's last column shows it
MODEL_FORMATS = {
    "instructions_per_key": "{:.1f} instr/key",
    "hmma_percent": "HMMA {:.1f}% of loop",
    "instructions_per_cp_async": "{:.1f} instr/cp.async",
    "masked_hmma_percent": "masked {:.1f}%",
    "instructions_per_vector_2kb_flat": "2 KiB rows: {:.1f}",
    "instructions_per_vector_2kb_ring": "to {:.1f} instr/vector;",
    "instructions_per_vector_256b_flat": "256 B: {:.1f}",
    "instructions_per_vector_256b_ring": "to {:.1f}",
    "instructions_per_vector_2kb": "2 KiB rows: {:.1f} instr/vector;",
    "instructions_per_vector_256b": "256 B: {:.1f}",
    "round_trips": "{} round trips",
    "h200_hbm_percent": "H200 est. {:.1f}% HBM",
    "h200_tflops": "{:.0f} TFLOP/s",
    "instructions_per_head": "{} instr/head",
    "h100_hbm_percent": "H100 est. {:.1f}% HBM",
    "hmma_flop_percent": "HMMA {:.1f}% of FLOPs",
    "h100_tflops": "H100 est. {:.1f} TFLOP/s",
}
#: the report's columns: heading -> figure
COLUMNS = {"regs": "registers", "cap": "register_cap", "spill B": "spill_bytes",
           "stack B": "stack_bytes", "smem B": "shared_bytes", "LDG.128": "LDG.E.128",
           "STG.128": "STG.E.128", "LDGSTS": "LDGSTS", "LDSM": "LDSM", "HMMA": "HMMA",
           "SHFL": "SHFL", "LDL/STL": "local_accesses", "f64": "float64", "div64": "div64_calls"}


class BudgetError(ValueError):
    """A budget file that names an unknown kernel or figure, or is malformed."""


@dataclass(frozen=True)
class Verdict:
    """One budget of one kernel: the figure against its limit."""

    kernel: str
    figure_name: str
    figure: float
    limit: float
    at_most: bool           # a maximum (else a minimum)

    @property
    def holds(self) -> bool:
        return self.figure <= self.limit if self.at_most else self.figure >= self.limit

    def __str__(self) -> str:
        relation = ("<=" if self.at_most else ">=") if self.holds else \
            (">" if self.at_most else "<")
        return f"{self.kernel}: {self.figure_name} {_number(self.figure)} {relation} " \
               f"{_number(self.limit)}"


def load(path: Path) -> dict:
    """The budget file at `path`: label -> {budget: limit}."""
    try:
        budgets = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BudgetError(f"{path}: {e}") from e
    if not isinstance(budgets, dict) or not all(
            isinstance(entry, dict) and all(isinstance(v, (int, float)) for v in entry.values())
            for entry in budgets.values()):
        raise BudgetError(f"{path}: expected {{label: {{budget: number}}}}")
    return budgets


def _parse_budget(name: str) -> tuple[str, bool]:
    """(figure, at_most) of `max_<figure>` / `min_<figure>`."""
    kind, _, figure = name.partition("_")
    if kind not in ("max", "min") or not figure:
        raise BudgetError(f"budget {name!r}: expected max_<figure> or min_<figure>")
    return figure, kind == "max"


def verdicts(budgets: dict, figures: dict) -> list[Verdict]:
    """Every budget of every kernel in `figures` (label -> figure values), the
    "every kernel" ones included. A budget for a label not in `figures`, or on a
    figure its kernel does not have, is an error."""
    unknown = set(budgets) - set(figures) - {EVERY}
    if unknown:
        raise BudgetError(f"budgets for kernels the report does not build: {sorted(unknown)}")
    found = []
    for label, values in figures.items():
        limits = {**budgets.get(EVERY, {}), **budgets.get(label, {})}
        for name, limit in limits.items():
            figure, at_most = _parse_budget(name)
            if figure not in values:
                raise BudgetError(f"{label}: budget {name!r} names a figure it does not have "
                                  f"(it has: {', '.join(sorted(values))})")
            found.append(Verdict(label, figure, values[figure], limit, at_most))
    return found


def _number(x) -> str:
    """An int as it is, a float to 4 significant digits."""
    return str(x) if isinstance(x, int) else f"{x:.4g}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell: numbers to the right, text to the left."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    numeric = [all(re.fullmatch(r"-?[\d.]+", row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if right else cell.ljust(w)
                       for cell, w, right in zip(row, widths, numeric)).rstrip()
             for row in [header, *rows]]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def model_cell(values: dict) -> str:
    """The report's last column: the kind's own figures."""
    return " ".join(fmt.format(values[name]) for name, fmt in MODEL_FORMATS.items()
                    if name in values)


def figure_table(figures: dict) -> str:
    """One row per kernel (label -> figure values)."""
    rows = [[label, *(str(values[f]) for f in COLUMNS.values()), model_cell(values)]
            for label, values in figures.items()]
    return _table(["kernel", *COLUMNS, "model"], rows)


def verdict_table(found: list[Verdict]) -> str:
    """One row per budget: kernel, figure, value, limit, whether it holds."""
    rows = [[v.kernel, v.figure_name, _number(v.figure),
             ("<= " if v.at_most else ">= ") + _number(v.limit), "ok" if v.holds else "EXCEEDED"]
            for v in found]
    return _table(["kernel", "budget", "figure", "limit", "status"], rows)
