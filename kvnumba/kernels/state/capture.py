"""A state layer's prefix snapshots (contract §17): the recurrent state of a column at a
past position `E`, rebuilt from its base and input log (`delta_rule`'s storage) into a
snapshot slot, with the same arithmetic as the step kernel, so a sequence restored from
the snapshot continues exactly as the one that wrote those positions.

`caps [n, 3]` int32: per capture `(col, E, slot)`; block `(capture, head)`, one thread
per value channel (as `delta_rule`): the base (the zero state at base position 0)
replayed over log rows `[bp, E)` and stored to `snaps[slot]` (`[slots, H, Dk, Dv]`).

The caller guarantees `bp <= E` and that the log still holds `[bp, E)` (`E` at or past
the column's floor, at or below its position).
"""
from __future__ import annotations

from functools import lru_cache

from ...device import cuda
from ..launch.calling import Specialised
from ..masks import storage_row
from .delta_rule import _clear, _load, _logged, _step, block_threads, dk_cap

from numba import float32  # noqa: E402  (after kvnumba.device chose the target)

#: a capture's fields: its column, its position, its snapshot slot
CAP_COL, CAP_END, CAP_SLOT = 0, 1, 2


@lru_cache(maxsize=None)
def _kernel(cap: int):
    """The capture kernel for `Dk <= cap`."""

    @cuda.jit
    def capture(base, log_k, log_v, log_g, log_b, marks, snaps, caps, per_channel,
                has_beta):
        i, h, j = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        dk, dv, log_rows = base.shape[2], base.shape[3], log_k.shape[1]
        mine = j < dv
        q_s = cuda.shared.array(cap, float32)
        k_s = cuda.shared.array(cap, float32)
        d_s = cuda.shared.array(cap, float32)
        s = cuda.local.array(cap, float32)
        col, end, slot = caps[i, CAP_COL], caps[i, CAP_END], caps[i, CAP_SLOT]
        bp = marks[col, 1]
        if mine:
            if bp == 0:
                _clear(s, dk)
            else:
                _load(s, base, col, h, j, dk)
        for pos in range(bp, end):
            vj, b = _logged(log_k, log_v, log_g, log_b, col, storage_row(pos, log_rows), h,
                            k_s, d_s, dk, per_channel, mine)
            cuda.syncthreads()
            if mine:
                _step(s, q_s, k_s, d_s, dk, per_channel, has_beta, vj, b, False)
            cuda.syncthreads()
        if mine:
            for r in range(dk):
                snaps[slot, h, r, j] = s[r]

    return Specialised(capture)


def capture(base, log_k, log_v, log_g, log_b, marks, snaps, caps, n: int, per_channel: bool,
            has_beta: bool, stream=0) -> None:
    """Rebuild `n` snapshots (module doc): `caps` an int32 device array `[n, 3]`;
    `per_channel` / `has_beta`: the layer's gate and rule (as its steps ran). One launch."""
    if n:
        dv = base.shape[3]
        _kernel(dk_cap(base.shape[2]))((n, base.shape[1]), block_threads(dv), stream, base,
                                       log_k, log_v, log_g, log_b, marks, snaps, caps,
                                       bool(per_channel), bool(has_beta))
