"""The step tables on their way to the device: one int32 buffer, one upload per step.

`prepare_step` writes the step's tables as int32 sections straight into a pinned host
buffer (`begin`, then `put` or the planners' own compiled passes, which write at an
offset): the per-token columns and positions first, then the segment table and the
attention plans, back to back. The used prefix goes to the device in one
host-to-device copy (`send`). Kernels get the device buffer and the element offset of
each section they read. The buffers are sized for the cache's usual steps and keep
their address (a captured CUDA graph keeps reading the current step's tables); a step
whose tables do not fit (many long sequences split into many decode chunks) grows them
first (`reserve`), after waiting for the stream, keeping what the step wrote.

Two pinned host buffers alternate; before one is refilled, the event recorded
after its last upload is waited on, which only blocks when the device is more than
a step behind.
"""
from __future__ import annotations

import numpy as np

from .device import SIMULATOR, allocating, cuda, host_buffer, upload_prefix


class Staging:
    """`device`: the int32 device buffer of `size` elements the kernels read; `host`: the
    host buffer the next upload is written into (`begin`)."""

    def __init__(self, size: int, stream):
        self.stream = stream
        self._allocate(size)
        self._events = [None, None]
        self._turn = 0
        self.host = self._hosts[0]

    def _allocate(self, size: int) -> None:
        with allocating(f"step tables of {size} int32 entries"):
            device = cuda.device_array(size, dtype=np.int32, stream=self.stream)
            hosts = [host_buffer(size, np.int32) for _ in range(2)]
        self.size, self.device, self._hosts = size, device, hosts

    def begin(self, size: int) -> np.ndarray:
        """The host buffer of the next upload (`host`), once the device has read what
        its last upload sent, holding at least `size` entries (`reserve`)."""
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        self.host = self._hosts[self._turn]
        return self.reserve(size, 0)

    def reserve(self, end: int, written: int) -> np.ndarray:
        """`host`, holding at least `end` entries: when it is smaller, every buffer grows
        first (once the stream has finished with them), the step's first `written`
        entries kept."""
        if end > self.size:   # rare: the last uploads must land before the buffers go
            self.stream.synchronize()
            kept = self.host[:written].copy()
            self._allocate(max(end, 2 * self.size))
            self.host = self._hosts[self._turn]
            self.host[:written] = kept
        return self.host

    def put(self, section: np.ndarray, at: int) -> int:
        """Write `section` (int32-convertible) into `host` from entry `at`; returns where
        it ends."""
        end = at + section.size
        self.reserve(end, at)[at:end] = section.ravel()
        return end

    def send(self, end: int) -> None:
        """Copy `host[:end]` to the device in one transfer, without a host synchronisation;
        the next upload is written into the other host buffer."""
        turn = self._turn
        upload_prefix(self.device, self.host, end, self.stream)
        if not SIMULATOR:
            if self._events[turn] is None:
                self._events[turn] = cuda.event(timing=False)
            self._events[turn].record(self.stream)
        self._turn = turn ^ 1
