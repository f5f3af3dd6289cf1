"""One host-to-device transfer in named sections: a step's tables (or a clone's) on
their way to the kernels.

`prepare_step` writes every table a step's launches read into one int32 host buffer,
section after section, and sends the used prefix to the device in one copy, without a
host synchronisation. Each section has a name and an entry offset (`Section`), and each
consumer is handed its section of the device buffer by name (`section`), so no offset
travels by hand. Every name is made by `Sections`, the one place they are written. A
step's sections, in order:

* `tokens` `[2 * width]`: each token's sequence (its page-table row) then its position,
  from entry 0 (the write kernel's calling convention);
* `segments` `[n_segments * SEQ_INFO_FIELDS]`: the segment table;
* `decode <W>` for each layer window W of a decode group on the fast path: its work
  table then its combine table (`kernels.decode.chunks_into` writes them in place);
* `decode list`, `prefill list`: the segments of a group on a path that takes a list;
* `state runs` `[n_runs, 4]`, `state order` `[n_segments]`: with state layers, the
  recurrence plan (`arith.state_runs`);
* `patches` `[n, 2]`: device page-table patches (flat index, slot base);
* `copies <G>` `[m, 3]`: page group G's row copies (copy-on-write in a step, on the flat
  group), as row runs (source slot, destination slot, rows; `kernels.moves.page_copy`).

A clone's, a prefix match's and a registration's uploads hold patches and copies only.

The buffers are sized for the cache's usual steps and keep their address (a captured
CUDA graph keeps reading the current step's tables); a step whose tables do not fit
(many long sequences split into many decode chunks) grows them first (`reserve`), after
waiting for the stream, keeping what the step wrote. Two pinned host buffers alternate;
before one is refilled, the event recorded after its last upload is waited on, which
only blocks when the device is more than a step behind.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..device import SIMULATOR, allocating, cuda, host_buffer, upload_prefix
from ..kernels.launch import lean
from ..kernels.launch.calling import device_pointer

class Sections:
    """The names of an upload's sections (module doc), each written here once."""

    TOKENS = "tokens"
    SEGMENTS = "segments"
    DECODE_LIST = "decode list"
    PREFILL_LIST = "prefill list"
    PATCHES = "patches"
    STATE_RUNS = "state runs"
    STATE_ORDER = "state order"

    @staticmethod
    def decode(window: int) -> str:
        """The fast decode path's work and combine tables of layer window `window`."""
        return f"decode {window}"

    @staticmethod
    def copies(group: int) -> str:
        """Page group `group`'s row copies."""
        return f"copies {group}"


class Section(NamedTuple):
    """Where one named section of an upload sits: its first entry and its entries."""

    offset: int
    size: int


#: `Section(offset, size)` without NamedTuple's Python-level constructor (a step makes
#: several: the control plane's host time)
_section = tuple.__new__


class Upload:
    """`device`: the int32 device buffer of `size` entries the kernels read; `host`: the
    host buffer the next transfer is written into; `sections`: the named sections of the
    transfer being written (or last sent), name -> `Section`; `end`: where they end."""

    def __init__(self, size: int, stream):
        self.stream = stream
        self._allocate(size)
        self._events = [None, None]
        self._turn = 0
        self.host = self._hosts[0]
        self.sections: dict = {}
        self.end = 0

    def _allocate(self, size: int) -> None:
        with allocating(f"step tables of {size} int32 entries"):
            device = cuda.device_array(size, dtype=np.int32, stream=self.stream)
            hosts = [host_buffer(size, np.int32) for _ in range(2)]
        self.size, self.device, self._hosts = size, device, hosts
        if not SIMULATOR:    # what each transfer hands the driver, worked out once
            self._addresses = (device_pointer(device), [host.ctypes.data for host in hosts],
                               lean.stream_handle(self.stream))

    def begin(self, size: int = 0) -> np.ndarray:
        """Start a transfer: the host buffer it is written into (`host`, holding at least
        `size` entries), once the device has read what that buffer's last transfer sent;
        no sections yet."""
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
        self.host = self._hosts[self._turn]
        self.sections = {}
        self.end = 0
        return self.reserve(size, 0)

    def reserve(self, end: int, written: int) -> np.ndarray:
        """`host`, holding at least `end` entries: when it is smaller, every buffer grows
        first (once the stream has finished with them), the first `written` entries of
        the transfer kept."""
        if end > self.size:   # rare: the last transfers must land before the buffers go
            self.stream.synchronize()
            kept = self.host[:written].copy()
            self._allocate(max(end, 2 * self.size))
            self.host = self._hosts[self._turn]
            self.host[:written] = kept
        return self.host

    def put(self, name: str, section: np.ndarray) -> Section:
        """Write `section` (int32-convertible, any shape, flattened) as the next section,
        `name`."""
        at = self.end
        end = at + section.size
        self.reserve(end, at)[at:end] = section.ravel()
        return self.mark(name, end)

    def mark(self, name: str, end: int) -> Section:
        """Name the entries from the last section's end up to `end` (written in place, e.g.
        by a planner given `host` and `end`) as section `name`."""
        found = self.sections[name] = _section(Section, (self.end, end - self.end))
        self.end = end
        return found

    def addresses(self) -> tuple:
        """Where the device buffer is now (it moves when a transfer outgrows it)."""
        return (device_pointer(self.device),)

    def section(self, name: str) -> Section:
        """Section `name` of this transfer (`KeyError` if it has none of that name)."""
        return self.sections[name]

    def send(self) -> None:
        """Copy `host[:end]` to the device in one transfer, without a host synchronisation;
        the next transfer is written into the other host buffer."""
        turn = self._turn
        if SIMULATOR:
            upload_prefix(self.device, self.host, self.end, self.stream)
        else:
            destination, sources, stream = self._addresses
            lean.driver.copy_to_device(destination, sources[turn], 4 * self.end, stream)
            if self._events[turn] is None:
                self._events[turn] = cuda.event(timing=False)
            self._events[turn].record(self.stream)
        self._turn = turn ^ 1
