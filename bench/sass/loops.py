"""What the figures of `bench.sass.figures` and its kinds share: `Figures`, the classes of
SASS instructions the report counts, and a kernel's main loop with the notes that
tell how it was found."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from . import model
from .flow import Flow, Loop
from .model import Instruction

#: report column -> predicate on a SASS instruction
COUNTED: dict[str, Callable[[Instruction], bool]] = {
    "LDG.E.128": lambda ins: ins.base == "LDG" and ".128" in ins.opcode,
    "STG.E.128": lambda ins: ins.base == "STG" and ".128" in ins.opcode,
    "LDGSTS": lambda ins: ins.base == "LDGSTS",
    "LDSM": lambda ins: ins.base == "LDSM",
    "HMMA": lambda ins: ins.base == "HMMA",
    "SHFL": lambda ins: ins.base == "SHFL",
    "local_accesses": lambda ins: ins.base in ("LDL", "STL"),
    "float64": model.is_float64,
    "div64_calls": model.is_div64_call,
}

is_wide_load = COUNTED["LDG.E.128"]


@dataclass
class Figures:
    """What a kernel is measured as: `values` (figure name -> number, the names
    budgets use) and `notes` (how a model figure was made)."""

    values: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def main_loop(flow: Flow, marks, what: str) -> Loop:
    """`flow.main_loop(marks)`; an error naming `what` if no loop holds one."""
    loop = flow.main_loop(marks)
    if loop is None:
        raise ValueError(f"no loop holds {what}: the kernel's main loop is not in its SASS")
    return loop


def other_loops(flow: Flow, counted: list, marks, what: str, how: str = "") -> list[str]:
    """A note listing the loops besides those in `counted`: header address,
    instructions, and how many of them `marks` (`what`)."""
    others = [loop for loop in flow.loops if loop not in counted]
    if not others:
        return []
    listed = ", ".join(f"{loop.header:#x} ({len(loop.instructions)}, {loop.count(marks)})"
                       for loop in others)
    return [f"other loops (header, instructions, {what}){how}: {listed}"]


def fallback_note(flow: Flow) -> list[str]:
    """A note on the divergent-warp fallbacks left out of the figures."""
    if not flow.fallback:
        return []
    return [f"{len(flow.fallback)} instructions of divergent-warp fallbacks (BRA.DIV), "
            f"which a converged warp never runs, are left out"]
