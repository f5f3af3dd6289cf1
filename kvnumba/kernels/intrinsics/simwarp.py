"""Warps for Numba's CUDA simulator: the lanes meet, one computes, each takes its part.

The simulator runs a block's threads as Python threads (`BlockThread`) and has no
warp-level operations at all. `exchange(op, value)` provides the one they are
built from: every lane of the caller's warp deposits a value; the last lane to
arrive runs `op(values)` once for the whole warp (values in lane order) and every
lane gets that result back with its own lane index. One lock and one wait per
lane and call: each call is a fresh round object, so a fast lane can start the
next call while slow ones still read the last result.

Warps are keyed by (block, warp index): their table hangs on the block's
`BlockManager`, which the simulator makes afresh for every block of every launch,
so nothing is shared between blocks or carried from one launch to the next. Lane
= linear thread index % 32; a block's last warp may have fewer lanes. Each thread
joins its warp when the block creates it (`_join_warps_on_creation`).

As on a GPU with the full mask, every lane of the warp must make the same call.
A lane that makes a different warp call, has exited, or waits at `syncthreads`
instead is reported (`WarpError` in the kernel) rather than left to hang.
"""
from __future__ import annotations

import threading
import time

WARP_SIZE = 32
#: a waiting lane checks this often (s) that the missing lanes can still arrive
POLL_S = 0.05
#: a missing lane must wait at syncthreads this long (s) before the warp reports it, once
#: no lane of the warp has passed the barrier it waits at (`_Warp.being_released`)
STUCK_S = 2.0

class WarpError(RuntimeError):
    """The lanes of a warp did not all make the same warp-wide call."""


class _Round:
    """One warp-wide call: the op, each lane's value, and the outcome once all arrived."""

    __slots__ = ("op", "values", "arrived", "count", "done", "result", "error", "stuck_since")

    def __init__(self, lanes: int):
        self.stuck_since = None
        self.op = None
        self.values = [None] * lanes
        self.arrived = [False] * lanes
        self.count = 0
        self.done = False
        self.result = None
        self.error = None


class _Warp:
    def __init__(self, index: int, lanes: int):
        self.index = index
        self.lanes = lanes
        self.threads = [None] * lanes     # each lane's BlockThread, as the block makes them
        self.exited = [False] * lanes     # lanes whose thread has returned from the kernel
        self.cond = threading.Condition(threading.Lock())
        self.round = _Round(lanes)

    def meet(self, lane: int, op, value):
        with self.cond:
            rnd = self.round
            rnd.values[lane] = value
            rnd.arrived[lane] = True
            rnd.count += 1
            if rnd.op is None:
                rnd.op = op
            elif op is not rnd.op and rnd.error is None:
                rnd.error = (f"warp {self.index}: lane {lane} called {_name(op)} while "
                             f"other lanes called {_name(rnd.op)}")
            if rnd.count == self.lanes:
                if rnd.error is None:
                    try:
                        rnd.result = op(rnd.values)
                    except Exception as e:  # every lane raises it, not only this one
                        rnd.error = f"warp {self.index}: {_name(op)}: {e}"
                self._close(rnd)
            while not rnd.done:
                self.cond.wait(POLL_S)
                if not rnd.done:
                    self._check_missing(rnd)
        if rnd.error is not None:
            raise WarpError(rnd.error)
        return rnd.result

    def _close(self, rnd):
        """End the round (the caller holds the lock): open the next one, wake the lanes."""
        self.round = _Round(self.lanes)
        rnd.done = True
        self.cond.notify_all()

    def being_released(self, rnd, thread) -> bool:
        """Whether `thread`, blocked at syncthreads, waits at a barrier that a lane of this
        round has passed already: the simulator releases a barrier's threads one by one
        (the last may wait seconds for the GIL on a loaded machine), so it will come."""
        return any(rnd.arrived[lane] and t._kvnumba_barriers > thread._kvnumba_barriers
                   for lane, t in enumerate(self.threads) if t is not None)

    def _check_missing(self, rnd):
        """Fail the round if the launch is aborting or a missing lane can never arrive: it
        has exited, or it has waited at a barrier no lane of the warp has passed for
        STUCK_S (the others wait here)."""
        if threading.current_thread().abort:
            rnd.error = f"warp {self.index}: launch aborted while waiting in {_name(rnd.op)}"
        at_barrier = None
        for lane, t in enumerate(self.threads):
            if rnd.arrived[lane] or t is None:
                continue
            if self.exited[lane]:
                rnd.error = (f"warp {self.index}: lane {lane} exited while the others wait "
                             f"in {_name(rnd.op)}: every lane of the warp must make the call")
            elif (t.syncthreads_blocked and at_barrier is None
                  and not self.being_released(rnd, t)):
                at_barrier = lane
        now = time.monotonic()
        if at_barrier is None:
            rnd.stuck_since = None
        elif rnd.stuck_since is None:
            rnd.stuck_since = now
        elif now - rnd.stuck_since >= STUCK_S and rnd.error is None:
            rnd.error = (f"warp {self.index}: lane {at_barrier} waits at syncthreads while "
                         f"the others wait in {_name(rnd.op)}: every lane of the warp must "
                         f"make the call")
        if rnd.error is not None:
            self._close(rnd)

    def leave(self, lane: int):
        """Lane `lane` returned from the kernel: waiting lanes re-check who can still come."""
        with self.cond:
            self.exited[lane] = True
            self.cond.notify_all()


def _join_warps_on_creation() -> None:
    """Make every simulator thread a lane of its block's warp, from creation to exit.

    The block's `BlockManager` creates its `BlockThread`s one by one, in the
    launching thread; each now also enters itself, by lane, in its warp (made on
    first need, kept in the manager's `_kvnumba_warps`) and keeps that warp at hand,
    and tells it when it returns from the kernel; it counts the barriers it has passed
    (`_kvnumba_barriers`), so a lane still flagged at a barrier its warp has passed is
    known to be on its way. So a lane finds its warp without
    a lookup or a lock, and waiting lanes can tell a lane that has not arrived *yet*
    (perhaps not even started) from one that never will: the simulator keeps its
    list of a block's threads to itself, and a thread's own state does not tell
    "starting" from "finished".
    """
    from numba.cuda.simulator import kernel

    cls = kernel.BlockThread
    if getattr(cls, "_kvnumba_joins_warps", False):
        return
    init, run, sync = cls.__init__, cls.run, cls.syncthreads

    def __init__(self, f, manager, *args, **kwargs):
        init(self, f, manager, *args, **kwargs)
        warps = manager.__dict__.setdefault("_kvnumba_warps", {})
        index = self.thread_id // WARP_SIZE
        warp = warps.get(index)
        if warp is None:
            x, y, z = manager._block_dim
            lanes = min(WARP_SIZE, x * y * z - index * WARP_SIZE)
            warp = warps[index] = _Warp(index, lanes)
        warp.threads[self.thread_id % WARP_SIZE] = self
        self._kvnumba_warp = warp
        self._kvnumba_barriers = 0

    def syncthreads_counted(self):
        sync(self)
        self._kvnumba_barriers += 1

    def run_then_leave(self):
        try:
            run(self)
        finally:
            self._kvnumba_warp.leave(self.thread_id % WARP_SIZE)

    cls.__init__ = __init__
    cls.run = run_then_leave
    cls.syncthreads = syncthreads_counted
    cls._kvnumba_joins_warps = True


_join_warps_on_creation()


def _name(op) -> str:
    return getattr(op, "__name__", repr(op))


def exchange(op, value):
    """`(op(values), lane)`: deposit `value`, meet the warp's other lanes, share one result.

    Every lane of the warp must call `exchange` with the same `op` (a module-level
    function: ops are compared by identity); it runs once, in the last lane to
    arrive, on all lanes' values in lane order.
    """
    thread = threading.current_thread()
    lane = thread.thread_id % WARP_SIZE
    return thread._kvnumba_warp.meet(lane, op, value), lane
