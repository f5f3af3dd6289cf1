"""What an engine's parts share between steps: the sequences it holds (`Roster`) and what
it has counted (`Counts`)."""
from __future__ import annotations

from collections import deque
from dataclasses import astuple, dataclass, field, fields


@dataclass
class Roster:
    """An engine's sequences: `waiting` for admission (in order), `running`, and
    `stepping`, those the current step admits or runs (which its failure ends)."""

    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    stepping: list = field(default_factory=list)


@dataclass
class Counts:
    """Draft tokens `proposed` and `accepted` so far; `prompt_tokens` of the requests
    admitted so far and `cached_tokens` of them served from the model's prefix index."""

    proposed: int = 0
    accepted: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0

    def values(self) -> tuple:
        """The counts, in field order (as rank 0 sends them to the other ranks)."""
        return astuple(self)

    def set(self, values: tuple) -> None:
        """Take `values` (`values()` of another rank's counts)."""
        for name, value in zip((f.name for f in fields(self)), values, strict=True):
            setattr(self, name, value)
