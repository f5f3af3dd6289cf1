"""The ASGI app of `python -m kvnumba serve` (`Server.app`, on Starlette): OpenAI's
`/v1/completions` and `/v1/chat/completions` (streamed as server-sent events or not),
`/v1/models`, `/health` and `/metrics`, every request handed to the one `EngineLoop`;
refusals as OpenAI's error object."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .loop import EngineLoop, Ticket
from .metrics import Metrics
from .protocol import APIError, Job, bad, chat_request, completion_request, parsed_json
from .text import TextStream

#: how often a request that is not streamed looks for its client gone
DISCONNECT_POLL_S = 0.25


class Server:
    """`engine` (a `kvnumba.hf.Engine`) served over OpenAI's API as model `name`, its
    text read and written by `tokenizer` (a `transformers` tokenizer; a chat needs its
    chat template). `eos`: the token ids that end a sequence. `max_waiting`: sequences
    that may wait beyond the engine's `max_seqs` running ones; a request past that is
    refused with HTTP 429 (it may be changed while serving). `app`: the ASGI app; its
    lifespan starts and stops the engine loop."""

    def __init__(self, engine, tokenizer, *, name: str, eos=None, max_waiting: int = 64):
        self.engine, self.tokenizer, self.name, self.eos = engine, tokenizer, name, eos
        self.max_waiting = max_waiting
        self.capacity, self.max_seqs = engine.config.capacity, engine.config.max_seqs
        self.vocab = engine.vocab
        self.metrics = Metrics(self)
        self.loop = EngineLoop(engine, on_step=self.metrics.stepped)
        self.created = int(time.time())
        self._lock = threading.Lock()
        self.holding = 0                    # sequences of the requests in flight
        self.app = Starlette(
            routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                    Route("/v1/chat/completions", self.chat, methods=["POST"]),
                    Route("/v1/models", self.models, methods=["GET"]),
                    Route("/health", self.health, methods=["GET"]),
                    Route("/metrics", self.metrics.endpoint, methods=["GET"])],
            exception_handlers={APIError: self._api_error, HTTPException: self._http_error},
            lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.loop.start()
        try:
            yield
        finally:
            self.loop.stop()

    # ---------------------------------------------------------------- plain endpoints
    async def health(self, request: Request) -> Response:
        if not self.loop.alive:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.name, "object": "model", "created": self.created,
             "owned_by": "kvnumba"}]})

    @staticmethod
    async def _api_error(request: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status)

    @staticmethod
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: "
                                     f"{exc.detail}", type=kind).body(),
                            status_code=exc.status_code)

    # ---------------------------------------------------------------- generation
    async def completions(self, request: Request) -> Response:
        job = completion_request(parsed_json(await request.body()), max_n=self.max_seqs,
                                 vocab=self.vocab)
        self._check_model(job)
        prompt = job.prompt if isinstance(job.prompt, list) else \
            self.tokenizer(job.prompt, add_special_tokens=True)["input_ids"]
        return await self._serve(request, job, prompt, "prompt")

    async def chat(self, request: Request) -> Response:
        job = chat_request(parsed_json(await request.body()), max_n=self.max_seqs)
        self._check_model(job)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise bad("messages", f"model {self.name}'s tokenizer has no chat template; "
                                  f"use /v1/completions, or save a tokenizer with a "
                                  f"chat_template into the model directory")
        prompt = self.tokenizer.apply_chat_template(job.messages, add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)
        if hasattr(prompt, "keys"):
            prompt = prompt["input_ids"]
        return await self._serve(request, job, list(prompt), "messages")

    def _check_model(self, job: Job) -> None:
        if job.model != self.name:
            raise APIError(404, f"model {job.model!r} is not served here; this server "
                                f"serves {self.name!r} (GET /v1/models)", param="model",
                           type="invalid_request_error", code="model_not_found")

    def _options(self, job: Job, prompt: list, field: str) -> dict:
        """`Engine.submit`'s options for `job`, its length checked against the capacity."""
        room = self.capacity - len(prompt)
        if room < 1:
            raise bad(field, f"{field}: {len(prompt)} tokens; the server's capacity is "
                             f"{self.capacity} positions per sequence, prompt and "
                             f"completion: shorten the prompt to at most "
                             f"{self.capacity - 1} tokens")
        most = room if job.max_tokens is None else job.max_tokens
        if most > room:
            name = "max_tokens"
            raise bad(name, f"{name}={most}: a prompt of {len(prompt)} tokens and {most} "
                            f"new tokens need {len(prompt) + most} positions; the server's "
                            f"capacity is {self.capacity}: send max_tokens of at most "
                            f"{room}, or a shorter prompt")
        return dict(max_new_tokens=most, temperature=job.temperature, top_p=job.top_p,
                    seed=job.seed, n=job.n, eos_token_id=self.eos)

    def _hold(self, n: int) -> None:
        """Count `n` sequences against the server's limit, or refuse with 429."""
        limit = self.max_seqs + self.max_waiting
        with self._lock:
            if self.holding + n > limit:
                raise APIError(429, f"the server is full: {self.holding} sequences running "
                                    f"or waiting, and this request's {n} would pass its "
                                    f"limit of {limit} (max_seqs {self.max_seqs} + "
                                    f"max_waiting {self.max_waiting}); retry later, or start "
                                    f"the server with a larger --max-waiting",
                               type="rate_limit_error", code="queue_full")
            self.holding += n

    def _release(self, ticket: Ticket) -> None:
        with self._lock:
            if not ticket.ended:
                ticket.ended = True
                self.holding -= ticket.sequences

    async def _serve(self, request: Request, job: Job, prompt: list, field: str) -> Response:
        options = self._options(job, prompt, field)
        if not self.loop.alive:
            raise APIError(503, "the engine loop has stopped; restart the server",
                           type="server_error")
        self._hold(job.n)
        ticket = Ticket(job.n)
        try:
            self.loop.submit(ticket, prompt, options)
            kind, value = await ticket.events.get()
        except BaseException:
            self.loop.cancel(ticket)
            self._release(ticket)
            raise
        if kind == "refused":
            self._release(ticket)
            raise bad(field, f"refused: {value}")
        reply = Reply(self, job, options["max_new_tokens"])
        if job.stream:
            return StreamingResponse(self._stream(ticket, reply),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            while not reply.finished:
                event = await self._next(ticket, request)
                if event is None:           # the client left
                    return Response(status_code=499)
                reply.take(*event)
        finally:
            self._end(ticket, reply)
        return JSONResponse(reply.whole())

    async def _next(self, ticket: Ticket, request: Request):
        """The ticket's next event, or None once the client has disconnected."""
        while True:
            try:
                return await asyncio.wait_for(ticket.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None

    def _end(self, ticket: Ticket, reply: Reply) -> None:
        if not reply.done:                  # stopped by a stop string, failed or left
            self.loop.cancel(ticket)
        self._release(ticket)

    async def _stream(self, ticket: Ticket, reply: Reply):
        try:
            for chunk in reply.opening():
                yield sse(chunk)
            while not reply.finished:
                for chunk in reply.take(*await ticket.events.get()):
                    yield sse(chunk)
            if reply.failure is not None:
                yield sse(reply.failure.body())
            else:
                for chunk in reply.closing():
                    yield sse(chunk)
            yield "data: [DONE]\n\n"
        finally:                            # done, or the client left (cancelled)
            self._end(ticket, reply)


def sse(payload: dict) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class Reply:
    """One request's answer being built from its engine events (`take`): per choice its
    `TextStream`, its text and its finish reason; the whole answer (`whole`) or its
    stream's chunks (`opening`, `take`'s, `closing`)."""

    def __init__(self, server: Server, job: Job, max_tokens: int):
        self.server, self.job, self.max_tokens = server, job, max_tokens
        self.id = ("chatcmpl-" if job.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.texts = [TextStream(server.tokenizer, job.stop) for _ in range(job.n)]
        self.parts = [[] for _ in range(job.n)]
        self.reasons = [None] * job.n
        self.counts = [0] * job.n            # tokens each choice took
        self.usage = None
        self.done = False                    # the engine finished the request
        self.failure: APIError | None = None

    @property
    def finished(self) -> bool:
        return self.done or self.failure is not None or all(self.reasons)

    def take(self, kind: str, value) -> list:
        """Take one engine event; returns the stream chunks it makes."""
        if kind == "failed":
            self.failure = APIError(500, f"the request failed in the engine: {value}",
                                    type="server_error")
            return []
        update = value
        self.usage, self.done = update.usage, update.done
        chunks = []
        eos = self.server.eos
        eos = set([eos] if isinstance(eos, int) else eos or ())
        for i, tokens in enumerate(update.tokens):
            if self.reasons[i] is not None:
                continue
            self.counts[i] += len(tokens)
            ended = update.done or self.counts[i] >= self.max_tokens or \
                bool(tokens and tokens[-1] in eos)
            text = self.texts[i].add(tokens, last=ended)
            if self.texts[i].stopped or (ended and tokens and tokens[-1] in eos):
                self.reasons[i] = "stop"
            elif ended:
                self.reasons[i] = "length"
            self.parts[i].append(text)
            if text:
                chunks.append(self._chunk(i, text))
        return chunks

    def _usage(self) -> dict:
        prompt = self.usage.prompt_tokens if self.usage else 0
        completion = sum(self.counts)
        cached = self.usage.cached_tokens if self.usage else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _base(self) -> dict:
        chat = self.job.kind == "chat"
        return {"id": self.id, "object": "chat.completion.chunk" if chat else
                "text_completion", "created": self.created, "model": self.server.name}

    def _chunk(self, i: int, text: str | None, reason=None) -> dict:
        if self.job.kind == "chat":
            delta = {} if text is None else {"content": text}
            choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": i, "text": text or "", "finish_reason": reason,
                      "logprobs": None}
        return {**self._base(), "choices": [choice],
                **({"usage": None} if self.job.include_usage else {})}

    def opening(self) -> list:
        """A chat stream's first chunks: each choice's role."""
        if self.job.kind != "chat":
            return []
        return [{**self._base(), "choices": [{"index": i, "delta": {"role": "assistant",
                                                                   "content": ""},
                                              "finish_reason": None, "logprobs": None}],
                 **({"usage": None} if self.job.include_usage else {})}
                for i in range(self.job.n)]

    def closing(self) -> list:
        """A stream's last chunks: each choice's finish reason, then (asked for) usage."""
        chunks = [self._chunk(i, None if self.job.kind == "chat" else "", reason)
                  for i, reason in enumerate(self.reasons)]
        if self.job.include_usage:
            chunks.append({**self._base(), "choices": [], "usage": self._usage()})
        return chunks

    def whole(self) -> dict:
        """The answer not streamed: every choice's text and finish reason, and usage."""
        if self.failure is not None:
            raise self.failure
        if self.job.kind == "chat":
            choices = [{"index": i, "message": {"role": "assistant",
                                                "content": "".join(self.parts[i])},
                        "finish_reason": reason, "logprobs": None}
                       for i, reason in enumerate(self.reasons)]
            kind = "chat.completion"
        else:
            choices = [{"index": i, "text": "".join(self.parts[i]), "finish_reason": reason,
                        "logprobs": None} for i, reason in enumerate(self.reasons)]
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.server.name, "choices": choices, "usage": self._usage()}
