"""The simulator's block loop, made to give way to the threads it waits on.

Numba's CUDA simulator runs a block's threads as Python threads and, in the launching
thread, polls them in a loop (`BlockManager.run`: who waits at `syncthreads`, who has
an exception, who is alive) until all have returned. That loop never blocks, so it
holds the interpreter lock for whole switch intervals while the block's threads,
each needing the lock to run a line, wait for it: on a 2-core host a d512 block took
from 1 to 20 seconds by how the lock happened to pass. Asking each thread whether it
is alive now first gives way (`time.sleep(0)` releases the lock), so the threads run
between polls and the same block takes about a second, every time. Nothing else
changes: the loop asks the same questions in the same order.
"""
from __future__ import annotations

import time


def _yield_while_polling() -> None:
    """Make the simulator's `BlockThread.is_alive` give way first (once per process)."""
    from numba.cuda.simulator import kernel

    cls = kernel.BlockThread
    if getattr(cls, "_kvnumba_yields", False):
        return
    is_alive = cls.is_alive

    def yielding_is_alive(self):
        time.sleep(0)
        return is_alive(self)

    cls.is_alive = yielding_is_alive
    cls._kvnumba_yields = True


_yield_while_polling()
