"""A state layer's prefix snapshots (contract §17): the recurrent state of a column at a
past position `E`, rebuilt from its base and input log (`recurrence`'s storage, either
op's) into a snapshot slot, with the same arithmetic as the step kernel, so a sequence
restored from the snapshot continues exactly as the one that wrote those positions.

`caps [n, 3]` int32: per capture `(col, E, slot)`; block `(capture, head)`, its lanes
the step kernel's (`lanes`: a column of the state over `parts` lanes): the base (the
zero state at base position 0) replayed over log rows `[bp, E)` and stored to
`snaps[slot]` (`[slots, H, Dk, Dv]`, or `[slots, H, Dv, Dk]` for a `transposed` state).

The caller guarantees `bp <= E` and that the log still holds `[bp, E)` (`E` at or past
the column's floor, at or below its position).
"""
from __future__ import annotations

from functools import lru_cache

from ...device import SIMULATOR, cuda
from ..launch.calling import Specialised
from ..masks import storage_row
from .lanes import lane_functions
from .recurrence import block_threads, lanes_per_column, logged

from numba import float32, int32, uint32  # noqa: E402  (after kvnumba.device chose the target)

#: a capture's fields: its column, its position, its snapshot slot
CAP_COL, CAP_END, CAP_SLOT = 0, 1, 2


@lru_cache(maxsize=None)
def _kernel(dk: int, dv: int, per_channel: bool, transposed: bool):
    """The capture kernel of heads of `dk` rows and `dv` columns, a decay per row
    (`per_channel`) or per head, the state `[H, Dk, Dv]` or `transposed`: the step
    kernel's lanes (`lanes`)."""
    parts = lanes_per_column(dk, dv)
    threads = block_threads(dv, parts)
    lane = lane_functions(dk, dv, per_channel, parts, transposed)
    rows, load, store, clear, step = lane.rows, lane.load, lane.store, lane.clear, lane.step

    @cuda.jit(**({} if SIMULATOR else {"launch_bounds": (threads,)}))
    def capture(base, log_k, log_v, log_g, log_b, marks, snaps, caps, has_beta):
        i, h, tid = cuda.blockIdx.x, cuda.blockIdx.y, int32(cuda.threadIdx.x)
        n_threads = int32(cuda.blockDim.x)
        j, p = int32(uint32(tid) // parts), int32(uint32(tid) % parts)
        log_rows = log_k.shape[1]
        mine = j < dv
        q_s = cuda.shared.array(dk, float32)
        k_s = cuda.shared.array(dk, float32)
        d_s = cuda.shared.array(dk, float32)
        s = cuda.local.array(rows, float32)
        col, end, slot = caps[i, CAP_COL], caps[i, CAP_END], caps[i, CAP_SLOT]
        bp = marks[col, 1]
        if bp == 0:
            clear(s)
        else:
            load(s, base, col, h, j, p)
        pos = bp
        while pos < end:
            vj, b = logged(log_k, log_v, log_g, log_b, col, storage_row(pos, log_rows), h,
                           k_s, d_s, dk, per_channel, tid, n_threads, j, mine)
            cuda.syncthreads()
            step(s, q_s, k_s, d_s, p, has_beta, vj, b, False)
            cuda.syncthreads()
            pos += 1
        store(s, snaps, slot, h, j, p)

    return Specialised(capture), threads


def capture(base, log_k, log_v, log_g, log_b, marks, snaps, caps, n: int, per_channel: bool,
            has_beta: bool, transposed: bool = False, stream=0) -> None:
    """Rebuild `n` snapshots (module doc): `caps` an int32 device array `[n, 3]`;
    `per_channel` / `has_beta` / `transposed`: the layer's gate, rule and state layout
    (as its steps ran), the logs in the lanes' roles (`recurrence`). One launch."""
    if n:
        dk, dv = base.shape[2], base.shape[3]
        if transposed:
            dk, dv = dv, dk
        kernel, threads = _kernel(dk, dv, bool(per_channel), bool(transposed))
        kernel((n, base.shape[1]), threads, stream, base, log_k, log_v, log_g, log_b, marks,
               snaps, caps, bool(has_beta))
