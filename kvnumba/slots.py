"""Per-slot lifecycle state, positions and high-waters, validated by the declared machine.

Every event on a batch of slots is one lookup in the table compiled from
`statemachines.SLOT_LIFECYCLE`; with `KVNUMBA_STRICT=1` each slot is also driven
through its own `transitions` model and the two must agree.
"""
from __future__ import annotations

import os
from enum import IntEnum

import numpy as np

from statemachines import (REFUSED, RESTORES, SLOT_LIFECYCLE, STEP_PROTOCOL, MachineModel,
                           compile_machine)

from .errors import FreeSequenceError, SlotStateError, StepProtocolError


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


_min = np.minimum.reduce
_max = np.maximum.reduce


def strict_mode() -> bool:
    """True when `KVNUMBA_STRICT=1`: the `transitions` models are driven too."""
    return os.environ.get("KVNUMBA_STRICT", "") == "1"


class SlotTable:
    """State, pos and high-water of `n` slots, changed only through declared events.

    `check(event, seqs)` refuses (typed error, nothing changed) or returns the
    next states; `apply(event, seqs, nxt)` commits them. Ids are assumed in range.
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
        """Next state of each slot in `seqs` under `event`; raises if any slot refuses."""
        return self.transition(event, seqs)[1]

    def transition(self, event: str, seqs: np.ndarray) -> tuple:
        """`(current, next)` states of the slots in `seqs` under `event` (the current ones
        for `apply`, which would read them again); raises if any slot refuses."""
        current = self.state.take(seqs)
        nxt = self._next[event].take(current)
        if _min(nxt) == REFUSED:
            bad = int(seqs[np.flatnonzero(nxt == REFUSED)[0]])
            self._refuse(event, bad)
        if self._models is not None:
            self._cross_check(event, seqs, allowed=True)
        return current, nxt

    def check_one(self, event: str, seq: int) -> int:
        nxt = int(self._next[event][self.state[seq]])
        if nxt == REFUSED:
            self._refuse(event, seq)
        if self._models is not None:
            self._cross_check(event, [seq], allowed=True)
        return nxt

    def apply(self, event: str, seqs, nxt, current=None) -> None:
        """Move `seqs` to `nxt` (from `check`); `RESTORES` entries go back to `before_declare`.
        `current`: their states now, if `transition` read them."""
        if event == "declare":
            self.before_declare[seqs] = self.state[seqs] if current is None else current
        if event == "abort":
            nxt = np.where(nxt == RESTORES, self.before_declare[seqs], nxt)
        self.state[seqs] = nxt
        if self._models is not None:
            for seq in np.atleast_1d(seqs):
                if not self._models[int(seq)].fire(event):
                    raise AssertionError(f"strict: transitions refused {event} on slot {seq} "
                                         f"which the compiled table allowed")
                assert self._models[int(seq)].state == SlotState(self.state[seq]).name.lower()

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


def state_refusal(seq: int, state: SlotState, doing: str, allowed) -> SlotStateError:
    """The error for `doing` on sequence `seq` in `state` (FREE: also an unknown sequence)."""
    if state == SlotState.FREE:
        return FreeSequenceError(f"sequence {seq} is FREE (no live sequence holds that column; "
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
        self._table = STEP_MACHINE.table
        self._event = STEP_MACHINE.event_index
        strict = strict_mode() if strict is None else strict
        self._model = MachineModel(STEP_PROTOCOL) if strict else None

    @property
    def state(self) -> StepState:
        return StepState(self.index)

    def check(self, event: str, verb: str) -> int:
        """The next state under `event`, or `StepProtocolError` naming what is needed."""
        nxt = int(self._table[self.index, self._event[event]])
        if self._model is not None and bool(self._model.may_trigger(event)) != (nxt != REFUSED):
            raise AssertionError(f"strict: step machine disagrees on {event} from {self.state}")
        if nxt == REFUSED:
            need = " or ".join(s.upper() for s in STEP_MACHINE.allowed_from(event))
            raise StepProtocolError(f"{verb}: the step is {self.state.name}; it needs {need} "
                                    f"({_STEP_HINTS[event, self.state]})")
        return nxt

    def apply(self, event: str, nxt: int) -> None:
        self.index = nxt
        if self._model is not None and not self._model.fire(event):
            raise AssertionError(f"strict: transitions refused step event {event}")

    def require_idle(self, verb: str) -> None:
        """Sequence verbs run between steps only."""
        if self.index != StepState.IDLE:
            raise StepProtocolError(f"{verb}: a step is open ({self.state.name}); sequence verbs "
                                    f"run between steps (commit_step or abort_step first)")
