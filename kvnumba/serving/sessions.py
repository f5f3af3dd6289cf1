"""`SessionTable`: sessions mapped onto sequences through BatchControl alone (contract §10).

A session is what a serving loop calls a conversation; a sequence is a cache
sequence slot. The table hands out session ids (from 1, monotonic, never reused), keeps
one sequence per session, and packs a batch of `(sid, start, tokens)` inputs
into one step's token axis (`PackedStep`), queueing the rewinds that inputs
starting before a session's cursor imply. A session may have several inputs in
one batch, anywhere in it (each becomes a span of its sequence). It uses only
BatchControl verbs (`seq_new`, `seq_rm`, `seq_clone`, `rewind`, `pos`, `floor`,
`state`, `step_state`) and the control's `config` limits, so it runs over a
`BatchedSequenceCache` and over a `SequenceBatchControl` alike; where the control is
also a `PrefixControl` (checked once, when the table is made) sessions share prompt
prefixes through its index.

This module keeps session identity (open, close, clone, the sequence of a session) and
composes the other parts: the packing of inputs into a step (`packing.StepPacker`) and
the prefix-index side (`prefixes.SessionPrefixes`).

Session ids are `SessionId`s (ints the table accepts like any int); a control's
verbs refuse them where they take a sequence id. Every limit on positions or
tokens is a `CapacityError`; a `SessionError` is a refusal of session identity
(unknown, closed, too many) or of inputs that do not line up with a session's
cursor. Other refusals are the cache's own typed errors (with the session named
in their message). Every refusal changes nothing.
"""
from __future__ import annotations

from ..args import SessionId, describe, is_int
from ..errors import CacheFullError, CapacityError, ConfigError, KVCacheError, SessionError
from ..arith.prefix_keys import extra_bytes, token_ids
from ..protocol import BatchControl, PrefixControl, members_lacking
from .packing import PackedStep, StepPacker
from .prefixes import PrefixStats, SessionPrefixes
from .refused import as_int, naming

__all__ = ["PackedStep", "PrefixStats", "SessionId", "SessionTable"]


class SessionTable:
    """Sessions over any BatchControl (`BatchedSequenceCache`, `SequenceBatchControl`, ...).

    control:             the BatchControl the sessions' sequences live in.
    max_sessions:        most sessions open at once (clones count).
    max_session_tokens:  most positions one session may reach.
    """

    def __init__(self, control: BatchControl, *, max_sessions: int, max_session_tokens: int):
        missing = members_lacking(control, BatchControl)
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
        self._prefixes = SessionPrefixes(control, indexed=isinstance(control, PrefixControl))
        self._packer = StepPacker(control, max_session_tokens=self.max_session_tokens,
                                  seq_of=self._seq)

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

    @property
    def indexed(self) -> bool:
        """Whether the control is a `PrefixControl` (has a prefix index)."""
        return self._prefixes.indexed

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
        try:
            seq, chain = self._prefixes.claim(tokens, extra)
        except CacheFullError as exc:
            raise SessionError(f"open: the control has no free sequence for a new session "
                               f"({exc})") from exc
        sid = self._add(seq)
        self._prefixes.opened(sid, seq, chain, tokens)
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
        return self._prefixes.register(sid, seq, ids)

    def forget(self, tokens, *, extra_key=None) -> int:
        """Drop the index entries of `tokens`' whole pages (under `extra_key`); returns
        how many were indexed (0 where the control has no index)."""
        return self._prefixes.forget(tokens, extra_key)

    @property
    def prefix_stats(self) -> PrefixStats:
        """Tokens looked up and hit by `open(prefix=...)`, pages evicted (`PrefixStats`)."""
        return self._prefixes.stats

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
            raise naming(exc, f"close session {sid} (sequence {seq})") from exc
        del self._open[int(sid)]
        self._prefixes.closed(sid)
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
        keep = pos if upto is None else as_int(upto, f"clone session {sid}: upto")
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
            raise naming(exc, f"clone session {sid} (sequence {seq}) upto {keep}") from exc
        clone = self._add(dst)
        self._prefixes.cloned(sid, clone, keep)
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
        return self._packer.pack(inputs)

    # ------------------------------------------------------------------ internals
    def _seq(self, sid, verb: str) -> int:
        if not is_int(sid):
            raise SessionError(f"{verb}: session ids are ints, got {describe(sid)}")
        session = self._open.get(int(sid))
        if session is None:
            raise SessionError(f"{verb}: unknown session {sid!r} (open: {list(self._open)})")
        return session._seq

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
