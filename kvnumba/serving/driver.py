"""The step driver: one step of any BatchControl, from its inputs to its commit, and
aborted on any error in between.

A serving loop's step is always the same five phases (contract §7): pack the inputs
(a `SessionTable`), declare, prepare, run the model over the step (its layers write
and attend), commit. `run_step` drives the last four for sequence ids, `run_inputs`
all five for session inputs. Whatever goes wrong once a step is declared (a refused
`prepare_step`, an exception or an interrupt in the model, a refused `commit_step`),
the step is aborted before the error propagates, so the control is idle again and
usable; a refusal before anything was declared changes nothing, as every refusal.

    packed_out = run_inputs(table, [(a, 0, [5, 6, 7]), (b, 4, [9])], forward)

where `forward(packed, plan)` runs the model: for each layer, `control.write` /
`attend` / `update_and_attend` with arrays of `plan.width` rows.
"""
from __future__ import annotations

from typing import Callable

from ..protocol import BatchControl
from ..host.slots import StepState


def run_step(control: BatchControl, seq_ids, forward: Callable, *, blocks=(),
             width: int | None = None):
    """Declare a step of `seq_ids` (one sequence id per token, ints or an int array
    `[n_tokens]`; `blocks`: draft-block owners), prepare it at `width` tokens (default
    no padding), call `forward(plan)` (the prepared `StepPlan`) and commit; returns what
    `forward` returned. Any error after the declaration aborts the step, then
    propagates."""
    control.declare_step(seq_ids, blocks=blocks)
    try:
        plan = control.prepare_step(width)
        result = forward(plan)
        control.commit_step()
    except BaseException:
        if control.step_state != StepState.IDLE:
            control.abort_step()
        raise
    return result


def run_inputs(table, inputs, forward: Callable, *, blocks=(), width: int | None = None):
    """Pack session `inputs` (`(sid, start, tokens[, produce_output])`, see
    `SessionTable.pack`) and run their step on `table.control` (`run_step`);
    `forward(packed, plan)` gets the `PackedStep` (tokens, positions, logit indices) and
    the prepared plan. `blocks` names sessions whose inputs are draft blocks. Returns
    what `forward` returned."""
    packed = table.pack(inputs)
    owners = [table.seq(sid) for sid in blocks]
    return run_step(table.control, packed.seq_ids, lambda plan: forward(packed, plan),
                    blocks=owners, width=width)
