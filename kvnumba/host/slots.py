"""Per-slot lifecycle state, positions and high-waters, validated by the declared machine.

Every event on a batch of slots is one lookup in the table compiled from
`statemachines.SLOT_LIFECYCLE`; with `KVNUMBA_STRICT=1` each slot is also driven
through its own `transitions` model and the two must agree.
"""
from __future__ import annotations

import os
from enum import IntEnum

import numpy as np
from numba import njit

from ..errors import FreeSequenceError, SlotStateError, StepProtocolError
from ..statemachines import (REFUSED, RESTORES, SLOT_LIFECYCLE, STEP_PROTOCOL, MachineModel,
                             compile_machine)


class _Named(IntEnum):
    """An IntEnum that prints as its name (`PREPARED`, not `2`)."""

    def __str__(self):
        return self.name

    def __format__(self, spec):
        return format(self.name, spec)


class SlotState(_Named):
    """A sequence slot's lifecycle state (the order of `SLOT_LIFECYCLE.states`)."""

    FREE = 0
    CLAIMED = 1
    PREFILLING = 2
    COMMITTED = 3
    REWOUND = 4


class StepState(_Named):
    """Where the step protocol stands (the order of `STEP_PROTOCOL.states`)."""

    IDLE = 0
    DECLARED = 1
    PREPARED = 2


assert [s.name.lower() for s in SlotState] == list(SLOT_LIFECYCLE.states)
assert [s.name.lower() for s in StepState] == list(STEP_PROTOCOL.states)

SLOT_MACHINE = compile_machine(SLOT_LIFECYCLE)
STEP_MACHINE = compile_machine(STEP_PROTOCOL)


def strict_mode() -> bool:
    """True when `KVNUMBA_STRICT=1`: the `transitions` models are driven too."""
    return os.environ.get("KVNUMBA_STRICT", "") == "1"


class SlotTable:
    """State, pos and high-water of `n` slots, changed only through declared events.

    `check(event, seqs)` refuses (typed error, nothing changed) or returns the
    next states; `apply(event, seqs, next_states)` commits them. Ids are assumed in range.
    """

    def __init__(self, n: int, strict: bool | None = None):
        self.n = n
        # states are indices (intp): looking the next states up by them needs no cast
        self.state = np.zeros(n, dtype=np.intp)
        self.pos = np.zeros(n, dtype=np.int64)
        self.high_water = np.zeros(n, dtype=np.int64)
        self.before_declare = np.zeros(n, dtype=np.intp)  # where `abort` returns to
        # one read-only column of the compiled table per event: next state by current state
        self._next = {event: SLOT_MACHINE.table[:, i].astype(np.intp)
                      for event, i in SLOT_MACHINE.event_index.items()}
        self.strict = strict_mode() if strict is None else strict
        self._models = [MachineModel(SLOT_LIFECYCLE) for _ in range(n)] if self.strict else None

    def check(self, event: str, seqs: np.ndarray) -> np.ndarray:
        """Next state of each slot in `seqs` (an int64 array) under `event`; raises if any
        slot refuses."""
        next_states, bad = _lookup(self.state, self._next[event], seqs)
        self._refuse_at(event, seqs, bad)
        return next_states

    def require(self, event: str, seqs: np.ndarray) -> None:
        """Raise if any slot in `seqs` (an int64 array) refuses `event`; changes nothing."""
        self._refuse_at(event, seqs, _refused(self.state, self._next[event], seqs))

    def _refuse_at(self, event: str, seqs, bad: int) -> None:
        """Raise for the slot `seqs[bad]` (`bad` >= 0: the first that refuses `event`)."""
        if bad >= 0:
            self._refuse(event, int(seqs[bad]))
        if self._models is not None:
            self._cross_check(event, seqs, allowed=True)

    def check_one(self, event: str, seq: int) -> int:
        next_state = int(self._next[event][self.state[seq]])
        if next_state == REFUSED:
            self._refuse(event, seq)
        if self._models is not None:
            self._cross_check(event, [seq], allowed=True)
        return next_state

    def apply(self, event: str, seqs, next_states) -> None:
        """Move `seqs` to `next_states` (from `check`); `RESTORES` entries go back to
        `before_declare`."""
        if event == "declare":
            self.before_declare[seqs] = self.state[seqs]
        if event == "abort":
            next_states = np.where(next_states == RESTORES, self.before_declare[seqs],
                                   next_states)
        self.state[seqs] = next_states
        if self._models is not None:
            for seq in np.atleast_1d(seqs):
                if not self._models[int(seq)].fire(event):
                    raise AssertionError(f"strict: transitions refused {event} on slot {seq} "
                                         f"which the compiled table allowed")
                assert self._models[int(seq)].state == SlotState(self.state[seq]).name.lower()

    def declare(self, seqs: np.ndarray) -> None:
        """The declare event applied to the slots `seqs` (an int64 array, each slot once,
        `require`d first): each remembers its state (for `abort`) and takes the next."""
        if self._models is not None:
            self.apply("declare", seqs, self.check("declare", seqs))
            return
        _declare(self.state, self.before_declare, self._next["declare"], seqs)

    def advance(self, event: str, seqs: np.ndarray, totals: np.ndarray) -> None:
        """Apply `event` to the slots `seqs` (an int64 array, each slot once) and move each
        `totals[i]` positions on, its high-water to at least there; raises, with nothing
        changed, if any slot refuses the event."""
        if self._models is not None:
            self.apply(event, seqs, self.check(event, seqs))
            self.pos[seqs] += totals
            self.high_water[seqs] = np.maximum(self.high_water[seqs], self.pos[seqs])
            return
        bad = _advance(self.state, self.pos, self.high_water, self._next[event], seqs, totals)
        self._refuse_at(event, seqs, bad)

    def _cross_check(self, event, seqs, allowed):
        for seq in seqs:
            if bool(self._models[int(seq)].may_trigger(event)) != allowed:
                raise AssertionError(f"strict: transitions and the compiled table disagree on "
                                     f"{event} from {SlotState(self.state[seq]).name}")

    def _refuse(self, event: str, seq: int):
        state = SlotState(int(self.state[seq]))
        allowed = [SlotState[s.upper()].name for s in SLOT_MACHINE.allowed_from(event)]
        if self._models is not None:
            self._cross_check(event, [seq], allowed=False)
        raise state_refusal(seq, state, f"event {event!r}", allowed)


@njit(cache=True)
def _lookup(state, next_of, seqs):
    """`(next, bad)`: each slot's next state under the event whose column of the compiled
    table is `next_of`, in one compiled pass; `bad` the index of the first slot refused
    (-1: none)."""
    next_states = np.empty(seqs.size, np.intp)
    bad = -1
    for i in range(seqs.size):
        next_states[i] = next_of[state[seqs[i]]]
        if next_states[i] == REFUSED and bad < 0:
            bad = i
    return next_states, bad


@njit(cache=True)
def _refused(state, next_of, seqs):
    """The index of the first slot refused by the event of `next_of` (-1: none)."""
    for i in range(seqs.size):
        if next_of[state[seqs[i]]] == REFUSED:
            return i
    return -1


@njit(cache=True)
def _declare(state, before_declare, next_of, seqs):
    """The declare event (`next_of`) applied: each slot remembers its state, then takes
    the next."""
    for seq in seqs:
        before_declare[seq] = state[seq]
        state[seq] = next_of[state[seq]]


@njit(cache=True)
def _advance(state, pos, high_water, next_of, seqs, totals):
    """`SlotTable.advance` in one compiled pass over the slots to check them (returns the
    index of the first refused, changing nothing) and one to move them (returns -1)."""
    bad = _refused(state, next_of, seqs)
    if bad >= 0:
        return bad
    for i in range(seqs.size):
        seq = seqs[i]
        state[seq] = next_of[state[seq]]
        pos[seq] += totals[i]
        high_water[seq] = max(high_water[seq], pos[seq])
    return -1


def state_refusal(seq: int, state: SlotState, doing: str, allowed) -> SlotStateError:
    """The error for `doing` on sequence `seq` in `state` (FREE: also an unknown sequence)."""
    if state == SlotState.FREE:
        return FreeSequenceError(f"sequence {seq} is FREE (no live sequence holds that slot; "
                                 f"claim one with seq_new()): {doing} is allowed only from "
                                 f"{', '.join(allowed)}")
    return SlotStateError(f"sequence {seq} is {state.name}: {doing} is allowed only from "
                          f"{', '.join(allowed)}")


#: what to call instead, by (refused step event, the state it found)
_STEP_HINTS = {
    ("declare", StepState.DECLARED): "finish the open step with prepare_step() and "
                                     "commit_step(), or drop it with abort_step(), first",
    ("declare", StepState.PREPARED): "finish the open step with commit_step() or "
                                     "abort_step() first",
    ("prepare", StepState.IDLE): "call declare_step() first",
    ("prepare", StepState.PREPARED): "the step is already prepared",
    ("commit", StepState.IDLE): "no step is open: declare_step() and prepare_step() first",
    ("commit", StepState.DECLARED): "call prepare_step() first",
    ("abort", StepState.IDLE): "no step is open",
}


class StepMachine:
    """The step protocol of one cache: idle -> declared -> prepared -> idle (or abort).

    The state is kept as a plain int (hot path); `state` reads it as a `StepState`.
    """

    def __init__(self, strict: bool | None = None):
        self.index = int(StepState.IDLE)
        # the compiled table as Python ints: next state by event, then by current state
        self._next = {event: [int(state) for state in STEP_MACHINE.table[:, i]]
                      for event, i in STEP_MACHINE.event_index.items()}
        strict = strict_mode() if strict is None else strict
        self._model = MachineModel(STEP_PROTOCOL) if strict else None

    @property
    def state(self) -> StepState:
        return StepState(self.index)

    def check(self, event: str, verb: str) -> int:
        """The next state under `event`, or `StepProtocolError` naming what is needed."""
        next_state = self._next[event][self.index]
        if self._model is not None and \
                bool(self._model.may_trigger(event)) != (next_state != REFUSED):
            raise AssertionError(f"strict: step machine disagrees on {event} from {self.state}")
        if next_state == REFUSED:
            need = " or ".join(s.upper() for s in STEP_MACHINE.allowed_from(event))
            raise StepProtocolError(f"{verb}: the step is {self.state.name}; it needs {need} "
                                    f"({_STEP_HINTS[event, self.state]})")
        return next_state

    def apply(self, event: str, next_state: int) -> None:
        self.index = next_state
        if self._model is not None and not self._model.fire(event):
            raise AssertionError(f"strict: transitions refused step event {event}")

    def require_idle(self, verb: str) -> None:
        """Sequence verbs run between steps only."""
        if self.index != StepState.IDLE:
            raise StepProtocolError(f"{verb}: a step is open ({self.state.name}); sequence verbs "
                                    f"run between steps (commit_step or abort_step first)")
