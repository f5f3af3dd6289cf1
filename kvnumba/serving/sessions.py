"""`SessionTable`: sessions mapped onto sequences through BatchControl alone (contract §10).

A session is what a serving loop calls a conversation; a sequence is a cache
sequence slot. The table hands out session ids (from 1, monotonic, never reused), keeps
one sequence per session, and packs a batch of `(sid, start, tokens)` inputs
into one step's token axis (`PackedStep`), queueing the rewinds that inputs
starting before a session's cursor imply. A session may have several inputs in
one batch, anywhere in it (each becomes a span of its sequence). It uses only
BatchControl verbs (`seq_new`, `seq_rm`, `seq_clone`, `rewind`, `pos`, `floor`,
`state`, `step_state`) and the control's `config` limits, so it runs over a
`BatchedSequenceCache` and over a `SequenceBatchControl` alike.

Session ids are `SessionId`s (ints the table accepts like any int); a control's
verbs refuse them where they take a sequence id. Every limit on positions or
tokens is a `CapacityError`; a `SessionError` is a refusal of session identity
(unknown, closed, too many) or of inputs that do not line up with a session's
cursor. Other refusals are the cache's own typed errors (with the session named
in their message). Every refusal changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..args import SessionId, describe, is_int
from ..host.prefix_keys import KeyChain, extra_bytes, token_ids
from ..protocol import BATCH_CONTROL_MEMBERS, BatchControl
from ..refusals import floor_refusal, split_hint
from ..errors import (CacheFullError, CapacityError, ConfigError, KVCacheError, SessionError,
                      ShapeError, StepProtocolError)
from ..host.slots import SLOT_MACHINE, SlotState, StepState, state_refusal

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


class PrefixStats(NamedTuple):
    """The prefix index seen from a session table (`SessionTable.prefix_stats`): prompt
    `tokens_looked_up` by `open(prefix=...)`, `tokens_hit` (served from the index), and
    the control's `pages_evicted`; `hit_rate` is hit over looked up."""

    tokens_looked_up: int
    tokens_hit: int
    pages_evicted: int

    @property
    def hit_rate(self) -> float:
        return self.tokens_hit / self.tokens_looked_up if self.tokens_looked_up else 0.0


class SessionTable:
    """Sessions over any BatchControl (`BatchedSequenceCache`, `SequenceBatchControl`, ...).

    control:             the BatchControl the sessions' sequences live in.
    max_sessions:        most sessions open at once (clones count).
    max_session_tokens:  most positions one session may reach.
    """

    def __init__(self, control: BatchControl, *, max_sessions: int, max_session_tokens: int):
        missing = [name for name in BATCH_CONTROL_MEMBERS if not hasattr(control, name)]
        if missing:
            raise ConfigError(f"SessionTable: control={describe(control)} is not a "
                              f"BatchControl (it lacks {', '.join(missing)}); pass a "
                              f"BatchedSequenceCache or a SequenceBatchControl")
        limits = (("max_sessions", max_sessions, int(control.max_seqs), "the control's max_seqs"),
                  ("max_session_tokens", max_session_tokens, int(control.config.capacity),
                   "the control's capacity"))
        for name, value, most, what in limits:
            if not is_int(value) or value < 1:
                raise ConfigError(f"SessionTable: {name}={describe(value)} must be an integer "
                                  f">= 1")
            if value > most:
                raise ConfigError(f"SessionTable: {name}={value} is more than the control can "
                                  f"hold ({what} is {most})")
        self.control = control
        self.max_sessions = int(max_sessions)
        self.max_session_tokens = int(max_session_tokens)
        # sid -> the SessionId handed out (it names the session's sequence), in opening order
        self._open: dict[int, SessionId] = {}
        self._next_sid = 1
        # the prefix index, where the control has one (`BatchedSequenceCache`)
        self.indexed = hasattr(control, "seq_from_prefix")
        self._chains: dict[int, KeyChain] = {}     # sid -> its page keys so far
        # sid -> (its leading pages indexed, its pages offered to the index)
        self._indexed: dict[int, tuple] = {}
        self.tokens_looked_up = self.tokens_hit = 0

    # ------------------------------------------------------------------ queries
    @property
    def sessions(self) -> tuple:
        """The open session ids, in the order they were opened."""
        return tuple(self._open.values())

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, sid) -> bool:
        return is_int(sid) and int(sid) in self._open

    def seq(self, sid: int) -> int:
        """The sequence id that holds session `sid`."""
        return self._seq(sid, "seq")

    def pos(self, sid: int) -> int:
        """Positions session `sid` holds (its cursor: the next token takes this position)."""
        return int(self.control.pos(self._seq(sid, "pos")))

    # ------------------------------------------------------------------ session verbs
    def open(self, prefix=None, *, extra_key=None) -> SessionId:
        """Open a session on a fresh sequence; returns its id (ids start at 1).

        `prefix`: the token ids the session will start with (its prompt). Where the
        control has a prefix index (contract §14), the session starts holding the
        longest indexed prefix of them, in whole pages and never all of them (the last
        token is always left to compute, for its logits): `pos(sid)` says how many, and
        the caller feeds the rest from there. `extra_key` (None, bytes or str: a tenant,
        an adapter, an image digest) is part of every key the session looks up and
        registers. `SessionError` at `max_sessions` or when the control has no free
        sequence; `ShapeError` for a malformed prefix or extra key.
        """
        extra = extra_bytes(extra_key)
        tokens = None if prefix is None else token_ids(prefix, "open prefix")
        self._require_room("open")
        chain = KeyChain(int(self.control.config.page_size), extra)
        try:
            if tokens is not None and self.indexed:
                keys = chain.keys(tokens[:max(0, tokens.size - 1)])
                seq = int(self.control.seq_from_prefix(keys))
            else:
                seq = int(self.control.seq_new())
        except CacheFullError as exc:
            raise SessionError(f"open: the control has no free sequence for a new session "
                               f"({exc})") from exc
        sid = self._add(seq)
        self._chains[int(sid)] = chain
        hit = int(self.control.pos(seq))
        self._indexed[int(sid)] = (hit // chain.page_size,) * 2
        if tokens is not None:
            self.tokens_looked_up += int(tokens.size)
            self.tokens_hit += hit
        return sid

    def register(self, sid: int, tokens) -> int:
        """Index session `sid`'s committed pages in the control's prefix index (contract
        §14), so that later sessions starting with the same tokens share them. `tokens`:
        the session's token ids from position 0 (those past `pos(sid)` are ignored).
        Register after each step the session commits: a ring layer keeps a page's rows
        only while its window covers them. Returns the leading pages indexed (0 where the
        control has no index)."""
        seq = self._seq(sid, "register")
        ids = token_ids(tokens, f"register session {sid}: tokens")
        if not self.indexed:
            return 0
        chain = self._chains[int(sid)]
        keys = chain.keys(ids[:min(ids.size, int(self.control.pos(seq)))])
        indexed, tried = self._indexed[int(sid)]
        indexed, tried = min(indexed, chain.fresh), min(tried, chain.fresh)
        if len(keys) > tried:             # pages not offered yet: one call for them all
            indexed, tried = int(self.control.prefix_register(seq, keys)), len(keys)
        self._indexed[int(sid)] = (indexed, tried)
        return indexed

    def forget(self, tokens, *, extra_key=None) -> int:
        """Drop the index entries of `tokens`' whole pages (under `extra_key`); returns
        how many were indexed (0 where the control has no index)."""
        chain = KeyChain(int(self.control.config.page_size), extra_bytes(extra_key))
        keys = chain.keys(token_ids(tokens, "forget tokens"))
        return int(self.control.prefix_forget(keys)) if self.indexed else 0

    @property
    def prefix_stats(self) -> PrefixStats:
        """Tokens looked up and hit by `open(prefix=...)`, pages evicted (`PrefixStats`)."""
        evicted = self.control.prefix_counts.pages_evicted if self.indexed else 0
        return PrefixStats(self.tokens_looked_up, self.tokens_hit, evicted)

    def close(self, sid: int) -> None:
        """Free the session's sequence (`seq_rm`) and forget it. Unknown or closed: nothing.

        A `sid` that is not an int (a bool, a list, ...) is a `SessionError`.
        """
        if not is_int(sid):
            raise SessionError(f"close: session ids are ints, got {describe(sid)}")
        session = self._open.get(int(sid))
        if session is None:
            return
        seq = session._seq
        try:
            self.control.seq_rm(seq)
        except KVCacheError as exc:
            raise _naming(exc, f"close session {sid} (sequence {seq})") from exc
        del self._open[int(sid)]
        self._chains.pop(int(sid), None)
        self._indexed.pop(int(sid), None)
        session._seq = None

    def clone(self, sid: int, upto: int | None = None) -> SessionId:
        """A new session holding session `sid`'s first `upto` positions (default all).

        `0 < upto <= pos(sid)`, else `SessionError`; `upto <= max_session_tokens`, else
        `CapacityError`; the copy is `control.seq_clone` (a single-sequence control
        refuses it with `CloneRefusedError`; a target below the ring floor is
        `RingFloorError`).
        """
        seq = self._seq(sid, "clone")
        pos = int(self.control.pos(seq))
        keep = pos if upto is None else _as_int(upto, f"clone session {sid}: upto")
        if not 0 < keep <= pos:
            raise SessionError(f"clone session {sid}: upto={keep} outside (0, {pos}] "
                               f"(the session holds {pos} positions)")
        if keep > self.max_session_tokens:
            raise CapacityError(f"clone session {sid}: upto={keep} exceeds max_session_tokens "
                                f"{self.max_session_tokens}; clone at most "
                                f"{self.max_session_tokens} positions")
        self._require_room(f"clone session {sid}")
        try:
            dst = int(self.control.seq_clone(seq, keep))
        except CacheFullError as exc:
            raise SessionError(f"clone session {sid}: the control has no free sequence for "
                               f"the clone ({exc})") from exc
        except KVCacheError as exc:
            raise _naming(exc, f"clone session {sid} (sequence {seq}) upto {keep}") from exc
        clone = self._add(dst)
        chain = self._chains[int(sid)].copy()
        self._chains[int(clone)] = chain
        self._indexed[int(clone)] = tuple(min(n, keep // chain.page_size)
                                          for n in self._indexed[int(sid)])
        return clone

    # ------------------------------------------------------------------ packing
    def pack(self, inputs) -> PackedStep:
        """Lay `inputs`, each `(sid, start, tokens)` or `(sid, start, tokens, produce_output)`,
        end to end for one step.

        Per session a cursor starts at `pos(sid)`; each input must start at its
        session's cursor, which then moves past it. A session's first input may start
        before the cursor: that queues a rewind to `start` (refused below the
        sequence's floor, `RingFloorError`, or when the sequence cannot rewind now).
        A later input of the same session may sit anywhere later in the batch; it
        becomes another span of the sequence. `logit_indices` has one entry per
        input: its last token's index if `produce_output` is true, -1 if false;
        without the fourth element, the index when the input is its session's last
        in the batch, else -1.

        Refused, before anything changes: inputs that are not a list of such tuples;
        an unknown session; an empty input; a gap (`start` past the cursor); an
        overlap (a later input starting before the cursor); `start + len(tokens) >
        max_session_tokens` (`CapacityError`); and everything the following
        `declare_step` would refuse (an open step, a sequence that cannot join a step,
        a session writing more than `max_write` tokens in all, more than `max_step`
        tokens). The queued rewinds run only after every input has passed. Then call
        `control.declare_step(packed.seq_ids)`.
        """
        if isinstance(inputs, (str, bytes, dict, set, frozenset)) or \
                not hasattr(inputs, "__iter__"):
            raise SessionError(f"pack: inputs must be a list of (sid, start, tokens), got "
                               f"{describe(inputs)}")
        inputs = list(inputs)
        if not inputs:
            raise SessionError("pack: no inputs")
        control = self.control
        if control.step_state != StepState.IDLE:
            raise StepProtocolError(f"pack: a step is open ({control.step_state.name}); pack "
                                    f"the next step after commit_step() or abort_step()")
        cursors: dict[int, int] = {}
        written: dict[int, int] = {}              # sid -> tokens in this step
        last_input: dict[int, int] = {}           # sid -> its last input's index
        rewinds: dict[int, tuple[int, int]] = {}  # sid -> (seq, target)
        chunks, seqs, starts, lens, outputs = [], [], [], [], []
        for i, item in enumerate(inputs):
            sid, start, arr, produce = self._input(i, item)
            seq = self._seq(sid, f"pack input {i}")
            n = int(arr.shape[0])
            if sid in cursors:
                cursor = cursors[sid]
                if start < cursor:
                    raise SessionError(f"pack: input {i} of session {sid} starts at {start}, "
                                       f"overlapping its earlier input which ends at {cursor}")
            else:
                cursor = int(control.pos(seq))
                if start < cursor:
                    self._check_rewind(i, sid, seq, start, cursor)
                    rewinds[sid] = (seq, start)
                else:
                    self._check_declarable(i, sid, seq)
            if start > cursor:
                raise SessionError(f"pack: input {i} of session {sid} starts at {start}, past "
                                   f"its cursor {cursor} (a gap of {start - cursor} positions)")
            end = start + n
            if end > self.max_session_tokens:  # max_session_tokens <= capacity: covers it too
                raise CapacityError(f"pack: input {i} of session {sid} would reach position "
                                    f"{end}, past max_session_tokens "
                                    f"{self.max_session_tokens}; a session holds at most "
                                    f"{self.max_session_tokens} positions")
            cursors[sid] = end
            written[sid] = written.get(sid, 0) + n
            last_input[sid] = i
            chunks.append(arr)
            seqs.append(seq)
            starts.append(start)
            lens.append(n)
            outputs.append(produce)
        self._check_step_limits(written, sum(lens))
        try:
            tokens = chunks[0] if len(chunks) == 1 else np.concatenate(chunks, axis=0)
        except ValueError as exc:
            shapes = [c.shape for c in chunks]
            raise ShapeError(f"pack: inputs do not concatenate along axis 0 (shapes {shapes}): "
                             f"{exc}") from None
        lens_a = np.asarray(lens, dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(lens_a)[:-1]))
        seq_ids = np.repeat(np.asarray(seqs, dtype=np.int64), lens_a)
        positions = np.arange(int(lens_a.sum()), dtype=np.int64) + \
            np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lens_a)
        last = set(last_input.values())
        sampled = np.array([i in last if produce is None else bool(produce)
                            for i, produce in enumerate(outputs)], dtype=bool)
        logit_indices = np.where(sampled, offsets + lens_a - 1, -1).astype(np.int64)
        # every input passed: now (and only now) apply the queued rewinds
        for sid, (seq, target) in rewinds.items():
            try:
                control.rewind(seq, target)
            except KVCacheError as exc:  # pre-checked above; reaching here is a control bug
                raise _naming(exc, f"pack: rewind of session {sid} to {target}") from exc
        for a in (positions, seq_ids, logit_indices):
            a.setflags(write=False)
        return PackedStep(tokens, positions, seq_ids, logit_indices)

    # ------------------------------------------------------------------ internals
    def _seq(self, sid, verb: str) -> int:
        if not is_int(sid):
            raise SessionError(f"{verb}: session ids are ints, got {describe(sid)}")
        session = self._open.get(int(sid))
        if session is None:
            raise SessionError(f"{verb}: unknown session {sid!r} (open: {list(self._open)})")
        return session._seq

    @staticmethod
    def _input(i: int, item):
        """One pack input as `(sid, start, tokens array, produce_output or None)`, or
        `SessionError` / `ShapeError`."""
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
        start = _as_int(start, f"pack input {i} (session {sid}): start")
        try:
            arr = np.asarray(tokens)
        except (ValueError, TypeError) as exc:
            raise ShapeError(f"pack: input {i} (session {sid}): tokens must be an array-like "
                             f"with one row per token ({exc})") from None
        if arr.ndim == 0 or arr.shape[0] == 0:
            raise SessionError(f"pack: input {i} (session {sid}) has no tokens "
                               f"(shape {arr.shape})")
        return int(sid), start, arr, produce

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

    def _require_room(self, verb: str) -> None:
        if len(self._open) >= self.max_sessions:
            raise SessionError(f"{verb}: {len(self._open)} sessions are open, the most "
                               f"max_sessions={self.max_sessions} allows")

    def _add(self, seq: int) -> SessionId:
        sid = SessionId(self._next_sid)
        sid._seq = seq
        self._open[self._next_sid] = sid
        self._next_sid += 1
        return sid

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


def _as_int(value, what: str) -> int:
    if not is_int(value):
        raise SessionError(f"{what}: expected an int, got {describe(value)}")
    return int(value)


def _naming(exc: KVCacheError, context: str) -> KVCacheError:
    """The same error type with `context` (naming the session) in front of its message."""
    try:
        return type(exc)(f"{context}: {exc}")
    except Exception:  # an error class with another constructor: keep it as it is
        return exc
