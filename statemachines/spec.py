"""How a machine is declared: states, an initial state, and transitions as plain data."""
from __future__ import annotations

from dataclasses import dataclass

#: `Transition.dest` value meaning "back to the state held before the `restores` event"
RESTORE = "<restore>"


@dataclass(frozen=True)
class Transition:
    """`event` moves a machine from any of `sources` to `dest`.

    With `dest == RESTORE`, the machine returns to the state it held just before
    the last `restores` event fired (e.g. an aborted step returns each slot to the
    state it had before `declare`).
    """

    event: str
    sources: tuple
    dest: str
    restores: str | None = None


@dataclass(frozen=True)
class MachineSpec:
    """A declared machine. The single source of truth for tables, models and diagrams."""

    name: str
    states: tuple
    initial: str
    transitions: tuple

    @property
    def events(self) -> tuple:
        """Events in declaration order, each once."""
        return tuple(dict.fromkeys(t.event for t in self.transitions))

    def __post_init__(self):
        if self.initial not in self.states:
            raise ValueError(f"{self.name}: initial state {self.initial!r} is not declared")
        seen = set()
        for t in self.transitions:
            for source in t.sources:
                if source not in self.states:
                    raise ValueError(f"{self.name}: {t.event} from undeclared state {source!r}")
                if (source, t.event) in seen:
                    raise ValueError(f"{self.name}: {t.event} from {source!r} declared twice")
                seen.add((source, t.event))
            if t.dest == RESTORE:
                if t.restores not in {u.event for u in self.transitions}:
                    raise ValueError(f"{self.name}: {t.event} restores unknown event {t.restores!r}")
            elif t.dest not in self.states:
                raise ValueError(f"{self.name}: {t.event} to undeclared state {t.dest!r}")
