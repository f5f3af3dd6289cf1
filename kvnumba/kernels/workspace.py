"""Scratch device buffers for split-K partials, shared by the attention paths of a cache
(the decode kernel and the generic kernel lay them out as their runs document)."""
from __future__ import annotations

import numpy as np

from ..device import cuda
from .launch.calling import device_pointer


class AttentionWorkspace:
    """Scratch device buffers for split-K partials, grown on demand and reused across calls
    (by this kernel and by `decode`; each lays them out as its `run` documents).

    `part_acc`: flat float32 unnormalised outputs; `part_ml`: flat float32 (running
    max, sum) pairs. Sizes only grow (to the next power of two), so a warm workspace
    allocates nothing.
    """

    def __init__(self):
        self.part_acc = None
        self.part_ml = None
        self.dummy = cuda.device_array(1, np.float32)   # for launches without partials

    @staticmethod
    def _grown(buf, size, stream):
        if buf is not None and buf.size >= size:
            return buf
        return cuda.device_array(1 << max(0, int(size - 1).bit_length()), np.float32,
                                 stream=stream)

    def partials(self, acc_size: int, ml_size: int, stream=0):
        """`(part_acc, part_ml)` of at least these sizes (elements)."""
        self.part_acc = self._grown(self.part_acc, acc_size, stream)
        self.part_ml = self._grown(self.part_ml, ml_size, stream)
        return self.part_acc, self.part_ml

    @property
    def nbytes(self) -> int:
        return sum(b.size * 4 for b in (self.part_acc, self.part_ml, self.dummy)
                   if b is not None)

    def addresses(self) -> tuple:
        """Where the partials are now (0 while there are none): they move when they grow."""
        return tuple(0 if b is None else device_pointer(b) for b in (self.part_acc,
                                                                      self.part_ml))
