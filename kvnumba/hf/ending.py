"""Requests ended before they finish: a cancelled request, or those a failed step ends
(every sequence of each, waiting or running, its sessions closed), the step's exception
told which."""
from __future__ import annotations

from collections import deque


def end(roster, seating, rids: set) -> list:
    """End the requests `rids` (every sequence of each, in `roster`, waiting or running),
    their sessions closed by `seating`; returns the ids that were waiting or running, in
    order."""
    ended = sorted({s.rid for s in [*roster.waiting, *roster.running] if s.rid in rids})
    roster.waiting = deque(s for s in roster.waiting if s.rid not in rids)
    for seq in [s for s in roster.running if s.rid in rids]:
        roster.running.remove(seq)
        seating.close(seq)
    return ended


def fail_step(exc: BaseException, roster, seating) -> None:
    """End the requests of the step that raised `exc` (`roster.stepping`'s) and tell `exc`
    which (`failed_requests`, and a note)."""
    failed = end(roster, seating, {s.rid for s in roster.stepping})
    try:
        exc.failed_requests = tuple(failed)
    except AttributeError:                  # an exception type that takes no attributes
        pass
    if failed and hasattr(exc, "add_note"):
        exc.add_note(f"kvnumba.hf.Engine: the step failed; requests {failed} ended, their "
                     f"sequences freed")
