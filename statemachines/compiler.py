"""Compile a `MachineSpec` into a dense table, or into a `transitions` model.

The table answers "state x event -> next state" with one NumPy lookup, so a
whole batch of slots is validated at once. The `transitions` model is the
reference the table is tested against, and what strict mode drives.
"""
from __future__ import annotations

import numpy as np
from transitions import Machine, MachineError

from .spec import RESTORE, MachineSpec

REFUSED = -1   # table entry: the event is not allowed from this state
RESTORES = -2  # table entry: back to the state saved when the restored event fired


class CompiledMachine:
    """`table[state, event]` is the next state's index, `REFUSED` or `RESTORES`."""

    def __init__(self, spec: MachineSpec):
        self.spec = spec
        self.states = spec.states
        self.events = spec.events
        self.state_index = {s: i for i, s in enumerate(self.states)}
        self.event_index = {e: i for i, e in enumerate(self.events)}
        table = np.full((len(self.states), len(self.events)), REFUSED, dtype=np.int8)
        for t in spec.transitions:
            dest = RESTORES if t.dest == RESTORE else self.state_index[t.dest]
            for source in t.sources:
                table[self.state_index[source], self.event_index[t.event]] = dest
        table.setflags(write=False)
        self.table = table

    def allowed_from(self, event: str) -> tuple:
        """The states `event` may fire from, by name."""
        column = self.table[:, self.event_index[event]]
        return tuple(s for s, nxt in zip(self.states, column) if nxt != REFUSED)


class MachineModel:
    """One object driven by a `transitions.Machine` built from a spec.

    `fire(event)` returns True and moves, or returns False and stays put.
    """

    def __init__(self, spec: MachineSpec, initial: str | None = None):
        self.before = {}  # event name -> state held just before it last fired
        self._machine = Machine(model=self, states=list(spec.states),
                                initial=initial or spec.initial,
                                transitions=self._transition_dicts(spec),
                                auto_transitions=False, ignore_invalid_triggers=False,
                                model_attribute="state")

    def fire(self, event: str) -> bool:
        before = self.state
        try:
            moved = self.trigger(event)
        except MachineError:
            return False
        if moved:
            self.before[event] = before
        return bool(moved)

    def _transition_dicts(self, spec: MachineSpec) -> list:
        """`transitions` dicts; a RESTORE becomes one conditional transition per earlier state."""
        out = []
        for t in spec.transitions:
            if t.dest != RESTORE:
                out.append({"trigger": t.event, "source": list(t.sources), "dest": t.dest})
                continue
            restored_from = next(u for u in spec.transitions if u.event == t.restores).sources
            for earlier in restored_from:
                out.append({"trigger": t.event, "source": list(t.sources), "dest": earlier,
                            "conditions": self._was(t.restores, earlier)})
        return out

    def _was(self, event: str, state: str):
        return lambda *args, **kwargs: self.before.get(event) == state


def compile_machine(spec: MachineSpec) -> CompiledMachine:
    """The dense table of `spec`."""
    return CompiledMachine(spec)
