"""The one engine loop that serves every client (`EngineLoop`): a thread that takes
submissions and cancellations from a thread-safe inbox, drives `Engine.stream_step` while
any request runs, and hands each request's updates to its `Ticket` on the event loop
that waits for them; the figures `/metrics` reads, taken between steps (`Snapshot`)."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import NamedTuple

from ..errors import RankFailureError

log = logging.getLogger("kvnumba.serve")

#: how long the idle loop waits on its inbox before looking again for a stop
IDLE_WAIT_S = 0.05


class Ticket:
    """One request in flight, seen from the event loop that serves its client: the
    events the engine thread posts to it, in order, on `events` (an asyncio queue fed
    through `loop.call_soon_threadsafe`): `("accepted", rid)`, `("refused", exc)`,
    `("update", Update)`, `("failed", exc)`. `sequences`: the sequences it holds (its
    `n`), counted against the server's limit until it ends."""

    def __init__(self, sequences: int):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.sequences = sequences
        self.rid: int | None = None
        self.ended = False              # done, refused, failed or cancelled

    def post(self, kind: str, value) -> None:
        """Post an event (from any thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Snapshot(NamedTuple):
    """What `/metrics` reports, taken by the engine thread between steps: requests
    `running` and `waiting`, the model cache's pages `held` (by sequences), `cached`
    (by the prefix index alone) and `free`, the prefix cache's prompt tokens and hits,
    the draft tokens proposed and accepted."""

    running: int
    waiting: int
    held: int
    cached: int
    free: int
    prompt_tokens: int
    cached_tokens: int
    proposed: int
    accepted: int


class EngineLoop:
    """A thread driving `engine` for every client: `submit` and `cancel` queue commands on
    its inbox (thread-safe); the thread runs them between steps and posts each request's
    events to its `Ticket`. `on_step(seconds, tokens)` is called after each step with its
    time and the tokens it generated. `snapshot` is refreshed between steps."""

    def __init__(self, engine, *, on_step=None):
        self.engine = engine
        # a split model's rank 0: an empty step at least this often (seconds), so the
        # other ranks, waiting for its next step, never wait past its rank_timeout
        lockstep = engine.lockstep
        self.beat = lockstep.timeout / 4 if lockstep is not None else None
        self._stepped = time.monotonic()
        self.on_step = on_step
        self.inbox: queue.Queue = queue.Queue()
        self.snapshot = Snapshot(*(0,) * len(Snapshot._fields))
        self.tickets: dict = {}         # rid -> Ticket, the engine thread's own
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kvnumba-engine", daemon=True)
        self.error: BaseException | None = None     # what ended the loop, if it broke

    def start(self) -> None:
        self._take_snapshot()
        self.thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; every open request is cancelled and
        told (`("failed", ...)`)."""
        self._stop.set()
        self.inbox.put(("wake", None, None))
        if self.thread.is_alive():
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self._stop.is_set()

    def submit(self, ticket: Ticket, prompt: list, options: dict) -> None:
        """Queue `prompt` with `Engine.submit`'s `options` for `ticket` (answered by an
        `accepted` or `refused` event)."""
        self.inbox.put(("submit", ticket, (prompt, options)))

    def cancel(self, ticket: Ticket) -> None:
        """End `ticket`'s request (its sequences freed between steps)."""
        self.inbox.put(("cancel", ticket, None))

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._take_commands(wait=not self.engine.busy)
                if self._stop.is_set():
                    break
                if self.engine.busy:
                    self._step()
                elif self.beat is not None and time.monotonic() - self._stepped > self.beat:
                    self.engine.step()      # empty: the other ranks' wait starts again
                    self._stepped = time.monotonic()
        except BaseException as exc:         # a bug: tell every client, keep the cause
            self.error = exc
            log.exception("the engine loop stopped")
        finally:
            for rid, ticket in list(self.tickets.items()):
                self.engine.cancel(rid)
                ticket.post("failed", self.error if isinstance(self.error, RankFailureError)
                            else RuntimeError("the server is shutting down"))
            self.tickets.clear()
            self._close()

    def _close(self) -> None:
        """A split model's other ranks stop following (`Engine.close`), unless the ranks
        already lost each other."""
        try:
            self.engine.close()
        except Exception:                   # noqa: BLE001  (logged: the loop is ending)
            log.exception("the other ranks were not told to stop")

    def _take_commands(self, wait: bool) -> None:
        try:
            command = self.inbox.get(timeout=IDLE_WAIT_S) if wait else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._command(*command)
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
        self._take_snapshot()

    def _command(self, kind: str, ticket, payload) -> None:
        if kind == "submit":
            prompt, options = payload
            try:
                rid = self.engine.submit(prompt, **options)
            except Exception as exc:        # a refusal: nothing was queued
                ticket.post("refused", exc)
                return
            ticket.rid = rid
            self.tickets[rid] = ticket
            ticket.post("accepted", rid)
        elif kind == "cancel" and ticket.rid in self.tickets:
            del self.tickets[ticket.rid]
            self.engine.cancel(ticket.rid)

    def _step(self) -> None:
        started = time.perf_counter()
        self._stepped = time.monotonic()
        try:
            updates = self.engine.stream_step()
        except RankFailureError:            # the ranks lost each other: the loop ends
            raise
        except Exception as exc:            # the step's requests ended; the others go on
            log.exception("a step failed")
            for rid in getattr(exc, "failed_requests", ()):
                ticket = self.tickets.pop(rid, None)
                if ticket is not None:
                    ticket.post("failed", exc)
            self._take_snapshot()
            return
        seconds = time.perf_counter() - started
        generated = 0
        for update in updates:
            generated += sum(map(len, update.tokens))
            ticket = self.tickets.get(update.rid)
            if ticket is None:
                continue
            if update.done:
                del self.tickets[update.rid]
            ticket.post("update", update)
        self._take_snapshot()
        if self.on_step is not None:
            self.on_step(seconds, generated)

    def _take_snapshot(self) -> None:
        engine = self.engine
        pools = engine.target.cache.pool_pages()
        counts = engine.counts
        self.snapshot = Snapshot(
            running=engine.running, waiting=engine.waiting,
            held=sum(p.in_use for p in pools), cached=sum(p.cached for p in pools),
            free=sum(p.free for p in pools), prompt_tokens=counts.prompt_tokens,
            cached_tokens=counts.cached_tokens, proposed=counts.proposed,
            accepted=counts.accepted)
