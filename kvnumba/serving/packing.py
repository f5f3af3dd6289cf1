"""The packing of session inputs into one step: `(sid, start, tokens[, produce_output])`
inputs checked against each session's cursor and laid end to end on the token axis
(`PackedStep`), with the rewinds they imply queued and applied only once every input has
passed (`StepPacker`, behind `SessionTable.pack`). BatchControl verbs alone."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from ..args import describe, is_int
from ..errors import CapacityError, KVCacheError, SessionError, ShapeError, StepProtocolError
from ..host.slots import SLOT_MACHINE, SlotState, StepState, state_refusal
from ..protocol import BatchControl
from ..refusals import floor_refusal, split_hint
from .refused import as_int, naming

# the states the declared lifecycle lets `rewind` and `declare` fire from
_REWINDABLE = tuple(SlotState[s.upper()] for s in SLOT_MACHINE.allowed_from("rewind"))
_DECLARABLE = tuple(SlotState[s.upper()] for s in SLOT_MACHINE.allowed_from("declare"))


@dataclass(frozen=True)
class PackedStep:
    """One step's inputs laid end to end on the token axis.

    tokens:         the inputs' tokens concatenated along axis 0 (token ids `[n]`, or
                    payload rows `[n, ...]`).
    positions:      `[n]` int64, the absolute position of each token in its session.
    seq_ids:        `[n]` int64, the sequence of each token: pass it to
                    `control.declare_step(packed.seq_ids)`.
    logit_indices:  `[n_inputs]` int64, one per input: the index of its last token if it
                    produces output, else -1. An input produces output when its fourth
                    element `produce_output` says so, or, without one, when it is its
                    session's last input in the batch (an earlier chunk of a prompt
                    samples nothing).
    """

    tokens: np.ndarray
    positions: np.ndarray
    seq_ids: np.ndarray
    logit_indices: np.ndarray

    @property
    def n_tokens(self) -> int:
        return int(self.seq_ids.size)


class _Input(NamedTuple):
    """One pack input, checked on its own: the `index`-th of the batch."""

    index: int
    sid: int
    start: int
    tokens: np.ndarray
    produce: bool | None       # its `produce_output`, None without one


@dataclass
class _Spans:
    """The inputs laid out so far: one span of its session's sequence per input."""

    cursors: dict = field(default_factory=dict)      # sid -> where its next input starts
    written: dict = field(default_factory=dict)      # sid -> tokens in this step
    last_input: dict = field(default_factory=dict)   # sid -> its last input's index
    rewinds: dict = field(default_factory=dict)      # sid -> (seq, target)
    chunks: list = field(default_factory=list)
    seqs: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    lens: list = field(default_factory=list)
    outputs: list = field(default_factory=list)

    def add(self, item: _Input, seq: int) -> None:
        """`item` as the next span, of sequence `seq`."""
        sid, n = item.sid, int(item.tokens.shape[0])
        self.cursors[sid] = item.start + n
        self.written[sid] = self.written.get(sid, 0) + n
        self.last_input[sid] = item.index
        self.chunks.append(item.tokens)
        self.seqs.append(seq)
        self.starts.append(item.start)
        self.lens.append(n)
        self.outputs.append(item.produce)

    def packed(self) -> PackedStep:
        """The spans end to end (`ShapeError` when their tokens do not concatenate)."""
        chunks = self.chunks
        try:
            tokens = chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=0)
        except ValueError as exc:
            shapes = [c.shape for c in chunks]
            raise ShapeError(f"pack: inputs do not concatenate along axis 0 (shapes {shapes}): "
                             f"{exc}") from None
        lens_a = np.asarray(self.lens, dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(lens_a)[:-1]))
        seq_ids = np.repeat(np.asarray(self.seqs, dtype=np.int64), lens_a)
        positions = np.arange(int(lens_a.sum()), dtype=np.int64) + \
            np.repeat(np.asarray(self.starts, dtype=np.int64) - offsets, lens_a)
        last = set(self.last_input.values())
        sampled = np.array([i in last if produce is None else bool(produce)
                            for i, produce in enumerate(self.outputs)], dtype=bool)
        logit_indices = np.where(sampled, offsets + lens_a - 1, -1).astype(np.int64)
        for a in (positions, seq_ids, logit_indices):
            a.setflags(write=False)
        return PackedStep(tokens, positions, seq_ids, logit_indices)


class StepPacker:
    """Packs session inputs into one step of `control` (`SessionTable.pack` says how).

    control:             the BatchControl the sessions' sequences live in.
    max_session_tokens:  most positions one session may reach.
    seq_of:              `seq_of(sid, verb)`, the sequence of open session `sid`, else
                         `SessionError` naming `verb`.
    """

    def __init__(self, control: BatchControl, *, max_session_tokens: int,
                 seq_of: Callable[[int, str], int]):
        self.control = control
        self.max_session_tokens = int(max_session_tokens)
        self._seq_of = seq_of

    def pack(self, inputs) -> PackedStep:
        """Lay `inputs` end to end for one step, every refusal before anything changes;
        the queued rewinds run last."""
        if isinstance(inputs, (str, bytes, dict, set, frozenset)) or \
                not isinstance(inputs, Iterable):
            raise SessionError(f"pack: inputs must be a list of (sid, start, tokens), got "
                               f"{describe(inputs)}")
        inputs = list(inputs)
        if not inputs:
            raise SessionError("pack: no inputs")
        control = self.control
        if control.step_state != StepState.IDLE:
            raise StepProtocolError(f"pack: a step is open ({control.step_state.name}); pack "
                                    f"the next step after commit_step() or abort_step()")
        spans = _Spans()
        for i, item in enumerate(inputs):
            self._lay(spans, _input(i, item))
        self._check_step_limits(spans.written, sum(spans.lens))
        packed = spans.packed()
        # every input passed: now (and only now) apply the queued rewinds
        for sid, (seq, target) in spans.rewinds.items():
            try:
                control.rewind(seq, target)
            except KVCacheError as exc:  # pre-checked above; reaching here is a control bug
                raise naming(exc, f"pack: rewind of session {sid} to {target}") from exc
        return packed

    def _lay(self, spans: _Spans, item: _Input) -> None:
        """`item` checked against its session's cursor, then added to `spans`."""
        i, sid, start = item.index, item.sid, item.start
        seq = self._seq_of(sid, f"pack input {i}")
        if sid in spans.cursors:
            cursor = spans.cursors[sid]
            if start < cursor:
                raise SessionError(f"pack: input {i} of session {sid} starts at {start}, "
                                   f"overlapping its earlier input which ends at {cursor}")
        else:
            cursor = int(self.control.pos(seq))
            if start < cursor:
                self._check_rewind(i, sid, seq, start, cursor)
                spans.rewinds[sid] = (seq, start)
            else:
                self._check_declarable(i, sid, seq)
        if start > cursor:
            raise SessionError(f"pack: input {i} of session {sid} starts at {start}, past "
                               f"its cursor {cursor} (a gap of {start - cursor} positions)")
        end = start + int(item.tokens.shape[0])
        if end > self.max_session_tokens:  # max_session_tokens <= capacity: covers it too
            raise CapacityError(f"pack: input {i} of session {sid} would reach position "
                                f"{end}, past max_session_tokens "
                                f"{self.max_session_tokens}; a session holds at most "
                                f"{self.max_session_tokens} positions")
        spans.add(item, seq)

    def _check_declarable(self, i: int, sid: int, seq: int) -> None:
        """The session's sequence can join a step (as `declare_step` checks)."""
        state = SlotState(int(self.control.state(seq)))
        if state not in _DECLARABLE:
            raise state_refusal(seq, state, f"pack: input {i} of session {sid}: a step",
                                [s.name for s in _DECLARABLE])

    def _check_step_limits(self, written: dict, n_tokens: int) -> None:
        """`max_write` per session and `max_step` per step, as `declare_step` checks them."""
        config = self.control.config
        sid = max(written, key=written.get)
        if written[sid] > config.max_write:
            raise CapacityError(f"pack: session {sid} writes {written[sid]} tokens in this "
                                f"step, more than max_write {config.max_write}; "
                                f"{split_hint(config)}")
        if n_tokens > config.max_step:
            raise CapacityError(f"pack: {n_tokens} tokens exceed max_step {config.max_step}")

    def _check_rewind(self, i: int, sid: int, seq: int, target: int, cursor: int) -> None:
        """Everything `control.rewind(seq, target)` would refuse, checked before any rewind."""
        where = f"pack: input {i} of session {sid} (sequence {seq})"
        if target < 0:
            raise SessionError(f"{where} starts at {target}, before position 0")
        state = SlotState(int(self.control.state(seq)))
        if state not in _REWINDABLE:
            raise state_refusal(seq, state, f"{where}: a rewind from {cursor} to {target}",
                                [s.name for s in _REWINDABLE])
        if target < int(self.control.floor(seq)):
            raise floor_refusal(f"{where}: a rewind from its cursor {cursor}", seq, target,
                                int(self.control.high_water(seq)), self.control.config)


def _input(i: int, item) -> _Input:
    """Pack input `i` (`(sid, start, tokens)` or `(sid, start, tokens, produce_output)`)
    as an `_Input`, or `SessionError` / `ShapeError`."""
    if not isinstance(item, (list, tuple)) or len(item) not in (3, 4):
        raise SessionError(f"pack: input {i} must be (sid, start, tokens) or (sid, start, "
                           f"tokens, produce_output), got {describe(item)}")
    sid, start, tokens = item[:3]
    produce = item[3] if len(item) == 4 else None
    if not isinstance(produce, (bool, np.bool_, type(None))):
        raise SessionError(f"pack: input {i}: produce_output must be True or False, got "
                           f"{describe(produce)}")
    if not is_int(sid):
        raise SessionError(f"pack: input {i}: session ids are ints, got {describe(sid)}")
    start = as_int(start, f"pack input {i} (session {sid}): start")
    try:
        arr = np.asarray(tokens)
    except (ValueError, TypeError) as exc:
        raise ShapeError(f"pack: input {i} (session {sid}): tokens must be an array-like "
                         f"with one row per token ({exc})") from None
    if arr.ndim == 0 or arr.shape[0] == 0:
        raise SessionError(f"pack: input {i} (session {sid}) has no tokens "
                           f"(shape {arr.shape})")
    return _Input(i, int(sid), start, arr, produce)
