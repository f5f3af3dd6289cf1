"""The step tables on their way to the device: one packed int32 buffer, one upload per step.

Device layout (int32), fixed at construction so kernel views are made once:

    [ seq_info: max_segments x SEQ_INFO_FIELDS | tokens: max_step x 2 (column, position) ]

Only the used prefix is uploaded. Two pinned host buffers alternate; before one
is refilled, the event recorded after its last upload is waited on, which only
blocks when the device is more than a step behind.
"""
from __future__ import annotations

import numpy as np

from .device import SIMULATOR, cuda, host_buffer, upload_prefix
from .plan import SEQ_INFO_FIELDS


class Staging:
    """Device views `seq_info [max_segments, F]`, `seq_cols [max_step]`, `positions [max_step]`."""

    def __init__(self, max_step: int, max_segments: int, stream):
        self.stream = stream
        self.info_size = max_segments * SEQ_INFO_FIELDS
        size = self.info_size + 2 * max_step
        self.device = cuda.device_array(size, dtype=np.int32, stream=stream)
        self.seq_info = self.device[:self.info_size].reshape(max_segments, SEQ_INFO_FIELDS)
        tokens = self.device[self.info_size:].reshape(max_step, 2)
        self.seq_cols = tokens[:, 0]
        self.positions = tokens[:, 1]
        self._hosts = [host_buffer(size, np.int32) for _ in range(2)]
        self._events = [None, None]
        self._turn = 0

    def upload(self, seq_info: np.ndarray, seq_cols: np.ndarray, positions: np.ndarray) -> None:
        """Pack the tables into the next host buffer and copy its used prefix to the device."""
        turn = self._turn
        self._turn ^= 1
        if self._events[turn] is not None:
            self._events[turn].synchronize()
        host = self._hosts[turn]
        n_info = seq_info.size
        host[:n_info] = seq_info.ravel()
        width = len(seq_cols)
        tokens = host[self.info_size:self.info_size + 2 * width].reshape(width, 2)
        tokens[:, 0] = seq_cols
        tokens[:, 1] = positions
        upload_prefix(self.device, host, self.info_size + 2 * width, self.stream)
        if not SIMULATOR:
            if self._events[turn] is None:
                self._events[turn] = cuda.event(timing=False)
            self._events[turn].record(self.stream)
