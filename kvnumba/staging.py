"""The step tables on their way to the device: one int32 buffer, one upload per step.

`prepare_step` hands `upload` the step's tables as int32 sections (the per-token
columns and positions first, then the segment table and the attention plans);
they are packed back to back into a pinned host buffer and the used prefix goes to
the device in one host-to-device copy. Kernels get the device buffer and the element
offset of each section they read. The buffers are sized for the cache's usual steps
and keep their address (a captured CUDA graph keeps reading the current step's
tables); a step whose tables do not fit (many long sequences split into many decode
chunks) grows them first, after waiting for the stream.

Two pinned host buffers alternate; before one is refilled, the event recorded
after its last upload is waited on, which only blocks when the device is more than
a step behind.
"""
from __future__ import annotations

import numpy as np

from .device import SIMULATOR, allocating, cuda, host_buffer, upload_prefix


class Staging:
    """`device`: the int32 device buffer of `size` elements the kernels read."""

    def __init__(self, size: int, stream):
        self.stream = stream
        self._allocate(size)
        self._events = [None, None]
        self._turn = 0

    def _allocate(self, size: int) -> None:
        with allocating(f"step tables of {size} int32 entries"):
            device = cuda.device_array(size, dtype=np.int32, stream=self.stream)
            hosts = [host_buffer(size, np.int32) for _ in range(2)]
        self.size, self.device, self._hosts = size, device, hosts

    def upload(self, *sections: np.ndarray) -> list:
        """Pack `sections` (int32-convertible arrays) back to back, copy them to the device
        in one transfer, and return each section's element offset."""
        offsets = []
        end = 0
        for section in sections:
            offsets.append(end)
            end += section.size
        if end > self.size:  # rare: the last uploads must land before the buffers go
            self.stream.synchronize()
            self._allocate(max(end, 2 * self.size))
        turn = self._turn
        self._turn ^= 1
        if self._events[turn] is not None:
            self._events[turn].synchronize()
        host = self._hosts[turn]
        np.concatenate([section.ravel() for section in sections], out=host[:end])
        upload_prefix(self.device, host, end, self.stream)
        if not SIMULATOR:
            if self._events[turn] is None:
                self._events[turn] = cuda.event(timing=False)
            self._events[turn].record(self.stream)
        return offsets
