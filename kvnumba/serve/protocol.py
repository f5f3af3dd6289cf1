"""OpenAI's request bodies checked and read (`completion_request`, `chat_request`) into
one `Job` each, and the error object OpenAI's clients expect (`APIError`): every refusal
names the field, what it got and what to send."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

#: fields every generation request may carry
COMMON = ("model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
          "stop", "seed", "user")
#: OpenAI fields taken only at their neutral value (what they would do is not served)
NEUTRAL = {"presence_penalty": (0, None), "frequency_penalty": (0, None),
           "logit_bias": (None, {}), "logprobs": (None, False, 0), "top_logprobs": (None, 0),
           "echo": (False, None), "best_of": (None, 1), "suffix": (None, ""),
           "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
           "response_format": (None, {"type": "text"}), "store": (None, False),
           "metadata": (None, {}), "service_tier": (None, "auto", "default"),
           "modalities": (None, ["text"])}
FIELDS = {"completion": set(COMMON) | {"prompt"},
          "chat": set(COMMON) | {"messages", "max_completion_tokens"}}
ROLES = ("system", "developer", "user", "assistant")
#: the stop strings a request may give at most (OpenAI's limit)
MAX_STOP = 4


class APIError(Exception):
    """A refused request: HTTP `status` and OpenAI's error object (`body()`): `message`,
    `type`, `param` (the field at fault, or None) and `code`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code = type, code

    def body(self) -> dict:
        """`{"error": {...}}` as OpenAI's API answers."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    """A 400 about field `param`."""
    return APIError(400, message, param=param, code="invalid_value" if param else None)


@dataclass
class Job:
    """A checked generation request: `prompt` (token ids; None until a chat's messages
    are rendered), `messages` (a chat's), `max_tokens` (None: the room the capacity
    leaves), sampling (`temperature`, `top_p`, `seed`), `n` sequences, `stop` strings,
    `stream`, `include_usage` (a streamed request's last chunk carries the usage) and
    `kind` ("completion" or "chat")."""

    kind: str
    model: str
    prompt: list | str | None
    messages: list | None
    max_tokens: int | None
    temperature: float
    top_p: float
    n: int
    seed: int | None
    stop: tuple
    stream: bool
    include_usage: bool


def parsed_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(None, f"the request body is not valid JSON ({exc}); send a JSON object, "
                        f"Content-Type: application/json") from None
    if not isinstance(body, dict):
        raise bad(None, f"the request body is a JSON {type(body).__name__}; send a JSON "
                        f"object of the request's fields")
    return body


def _number(body: dict, name: str, default: float, low: float, high: float,
            low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not (low < value if low_open else low <= value) \
            or value > high:
        side = f"above {low:g}" if low_open else f"at least {low:g}"
        raise bad(name, f"{name}={json.dumps(value)}: send a number {side} and at most "
                        f"{high:g}")
    return float(value)


def _count(body: dict, name: str, default, low: int = 1, high: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or \
            (high is not None and value > high):
        rule = f"a whole number of at least {low}" + (f" and at most {high}" if high else "")
        raise bad(name, f"{name}={json.dumps(value)}: send {rule}")
    return value


def _common(body: dict, kind: str, max_n: int) -> dict:
    """The fields both endpoints share, checked; unknown fields refused."""
    for name in body:
        if name in NEUTRAL:
            value = body[name]
            if not any(value == v and isinstance(value, bool) == isinstance(v, bool)
                       for v in NEUTRAL[name]):
                raise bad(name, f"{name}={json.dumps(body[name])}: this server does not "
                                f"serve {name}; leave it out")
        elif name not in FIELDS[kind]:
            known = ", ".join(sorted(FIELDS[kind]))
            raise bad(name, f"unknown field {name!r}; the fields of this endpoint are: "
                            f"{known}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", f"model={json.dumps(model)}: send the served model's name (GET "
                           f"/v1/models lists it)")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("stream", f"stream={json.dumps(stream)}: send true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options", "stream_options applies with stream=true only; "
                                        "leave it out or set stream to true")
        if not isinstance(options, dict) or set(options) - {"include_usage"} or \
                not isinstance(options.get("include_usage", False), bool):
            raise bad("stream_options", f"stream_options={json.dumps(options)}: send "
                                        f'{{"include_usage": true}} or {{"include_usage": '
                                        f'false}}')
        include_usage = options.get("include_usage", False)
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and \
            len(stop) <= MAX_STOP:
        stop = tuple(stop)
    else:
        raise bad("stop", f"stop={json.dumps(stop)}: send a string or a list of at most "
                          f"{MAX_STOP} strings")
    if any(not s for s in stop):
        raise bad("stop", "stop: an empty string would stop before any text; send "
                          "non-empty strings")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or
                             not 0 <= seed < 2**63):
        raise bad("seed", f"seed={json.dumps(seed)}: send a whole number in [0, 2**63)")
    return dict(model=model, stream=stream, include_usage=include_usage, stop=stop,
                seed=seed, temperature=_number(body, "temperature", 1.0, 0, 2),
                top_p=_number(body, "top_p", 1.0, 0, 1, low_open=True),
                n=_count(body, "n", 1, high=max_n))


def completion_request(body: dict, *, max_n: int, vocab: int) -> Job:
    """A `/v1/completions` body as a `Job` (`prompt`: a string, or token ids)."""
    common = _common(body, "completion", max_n)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                  # a batch of one
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        outside = [t for t in prompt if not 0 <= t < vocab]
        if outside:
            raise bad("prompt", f"prompt: token ids {outside[:4]} outside the vocabulary "
                                f"[0, {vocab})")
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", f"prompt: a batch of {len(prompt)} prompts; this server takes "
                            f"one prompt per request: send them as separate requests")
    elif not isinstance(prompt, str) or not prompt:
        raise bad("prompt", f"prompt={json.dumps(prompt)[:80]}: send a non-empty string "
                            f"or a list of token ids")
    return Job(kind="completion", prompt=prompt, messages=None,
               max_tokens=_count(body, "max_tokens", 16), **common)


def chat_request(body: dict, *, max_n: int) -> Job:
    """A `/v1/chat/completions` body as a `Job` (`messages` checked: roles and text
    content; rendered by the tokenizer's chat template later)."""
    common = _common(body, "chat", max_n)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"messages={json.dumps(messages)[:80]}: send a non-empty list "
                              f'of {{"role": ..., "content": ...}} objects')
    checked = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"}:
            raise bad(where, f"{where}: send an object with a role and a content (and "
                             f"optionally a name), got {json.dumps(message)[:80]}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise bad(f"{where}.role", f"{where}.role={json.dumps(role)}: send one of "
                                       f"{', '.join(ROLES)}")
        if isinstance(content, list):       # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and
                       isinstance(p.get("text"), str) for p in content):
                raise bad(f"{where}.content", f"{where}.content: this server takes text "
                                              f'parts only ({{"type": "text", "text": ...}})')
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"{where}.content", f"{where}.content={json.dumps(content)[:80]}: send "
                                          f"a string")
        checked.append({"role": role, "content": content})
    for name in ("max_tokens", "max_completion_tokens"):
        _count(body, name, None)
    most = body.get("max_completion_tokens", body.get("max_tokens"))
    return Job(kind="chat", prompt=None, messages=checked, max_tokens=most, **common)
