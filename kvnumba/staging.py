"""The step tables on their way to the device: one int32 buffer, one upload per step.

`prepare_step` hands `upload` the step's tables as int32 sections (the per-token
columns and positions first, then the segment table and the attention plans);
they are packed back to back into a pinned host buffer and the used prefix goes to
the device in one host-to-device copy. Kernels get the device buffer and the element
offset of each section they read. The device buffer is allocated once, at its
largest, so its address never changes (a captured CUDA graph keeps reading the
current step's tables).

Two pinned host buffers alternate; before one is refilled, the event recorded
after its last upload is waited on, which only blocks when the device is more than
a step behind.
"""
from __future__ import annotations

import numpy as np

from .device import SIMULATOR, cuda, host_buffer, upload_prefix
from .errors import CapacityError


class Staging:
    """`device`: the int32 device buffer of `size` elements the kernels read."""

    def __init__(self, size: int, stream):
        self.stream = stream
        self.size = size
        self.device = cuda.device_array(size, dtype=np.int32, stream=stream)
        self._hosts = [host_buffer(size, np.int32) for _ in range(2)]
        self._events = [None, None]
        self._turn = 0

    def upload(self, *sections: np.ndarray) -> list:
        """Pack `sections` (int32-convertible arrays) back to back, copy them to the device
        in one transfer, and return each section's element offset."""
        turn = self._turn
        self._turn ^= 1
        if self._events[turn] is not None:
            self._events[turn].synchronize()
        host = self._hosts[turn]
        offsets = []
        end = 0
        for section in sections:
            offsets.append(end)
            n = section.size
            if end + n > self.size:  # sized from the config's bounds: never expected
                raise CapacityError(f"step tables need more than {self.size} int32 entries")
            host[end:end + n] = section.ravel()
            end += n
        upload_prefix(self.device, host, end, self.stream)
        if not SIMULATOR:
            if self._events[turn] is None:
                self._events[turn] = cuda.event(timing=False)
            self._events[turn].record(self.stream)
        return offsets
