"""The OpenAI-compatible API: request translation and response encoding (no TorchServe here).

TorchServe hands the handler everything after ``/predictions/<model>/<version>/`` in the ``url_path``
header; ``route()`` maps it to one of the calls below. Contract:

* ``POST v1/completions`` and ``POST v1/chat/completions``: the body (JSON bytes) is validated by
  ``parse_call`` into a ``GenerateRequest`` (our native request) plus an ``OpenAICall`` that knows how
  to encode the answer. The parameters OpenAI clients send are accepted (``model``, ``prompt`` /
  ``messages``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``n`` (1 only),
  ``stop``, ``seed``, ``stream``, ``stream_options.include_usage``, ``user``); parameters we cannot
  honour are refused by name rather than silently ignored.
* ``GET v1/models``: ``models_list``. ``GET v1/health``: see ``llm_api.metrics.Health``.
* Streaming answers are server-sent events (``text/event-stream``): one ``data: {chunk}`` per text
  delta, a last chunk carrying ``finish_reason`` (and ``usage`` when asked for), then ``data: [DONE]``.
  Non-streaming answers are one JSON object with ``usage``.
* Every error is ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status in
  ``OpenAIError.status``; after a stream began, the error is an SSE event of that shape, followed by
  ``data: [DONE]`` (the openai client raises ``APIError`` on it).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from llm_api.protocol import DEFAULT_MAX_NEW_TOKENS, MAX_SEED, GenerateRequest, Limits, RequestError
from llm_api.sampling import SamplingParams

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
MAX_OPENAI_STOP = 4  # OpenAI allows up to 4 stop sequences
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint
ROUTES = {
    "v1/completions": "completions",
    "v1/chat/completions": "chat",
    "v1/models": "models",
    "v1/health": "health",
}
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream", "stream_options", "user"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "best_of", "logprobs", "suffix", "presence_penalty", "frequency_penalty", "logit_bias"}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
    "logit_bias", "response_format", "tools", "tool_choice", "parallel_tool_calls",
}
# Accepted only at the value that means "off" (what the openai client sends when a caller sets them
# explicitly to their defaults); anything else is refused, naming the parameter.
NEUTRAL_VALUES = {
    "echo": (False,), "best_of": (1,), "logprobs": (False, None), "top_logprobs": (None, 0), "suffix": (None, ""),
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, False, True),
}


class OpenAIError(Exception):
    """A refused call, in OpenAI's error shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    @classmethod
    def from_request_error(cls, err: RequestError) -> "OpenAIError":
        return cls(err.message, err.code, None, err.type)

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json()).encode("utf-8")


def route(url_path: str | None) -> str | None:
    """``url_path`` header -> "completions" | "chat" | "models" | "health"; None for the native API.

    Raises ``OpenAIError`` (404) for any other path below the model, so a typo is not served as a
    native generation request."""
    if url_path is None:
        return None
    path = url_path.split("?", 1)[0].strip("/")
    if not path:
        return None
    name = ROUTES.get(path)
    if name is None:
        raise OpenAIError(f"unknown path {path!r}; served: {', '.join(ROUTES)}", 404, None, "not_found")
    return name


@dataclass
class OpenAICall:
    """One accepted completions/chat call: what the client asked for and how to encode our answer."""

    kind: str  # "completions" | "chat"
    model: str
    stream: bool
    include_usage: bool
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    _text: list[str] = field(default_factory=list)
    _sent_role: bool = False

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id

    @property
    def content_type(self) -> str:
        return SSE_CONTENT_TYPE if self.stream else JSON_CONTENT_TYPE

    def delta(self, text: str) -> str:
        """New text -> what to send now ("" for a non-streaming call, which answers at the end)."""
        if not text:
            return ""
        if not self.stream:
            self._text.append(text)
            return ""
        return self._role_event() + _sse(self._chunk(text, None))

    def finish(self, tail: str, finish_reason: str | None, num_prompt_tokens: int, num_completion_tokens: int) -> str:
        """The last payload: remaining text, the finish reason and usage; ``[DONE]`` when streaming."""
        reason = finish_reason_of(finish_reason)
        usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                 "total_tokens": num_prompt_tokens + num_completion_tokens}
        if not self.stream:
            text = "".join(self._text) + tail
            if self.kind == "chat":
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                          "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            return json.dumps({"id": self.response_id, "object": self._object, "created": self.created,
                               "model": self.model, "choices": [choice], "usage": usage})
        out = self._role_event()
        if tail:
            out += _sse(self._chunk(tail, None))
        out += _sse(self._chunk(None, reason))
        if self.include_usage:
            out += _sse({**self._envelope(), "choices": [], "usage": usage})
        return out + "data: [DONE]\n\n"

    def error_event(self, err: OpenAIError) -> str:
        """An error after the stream began: one SSE event in OpenAI's error shape, then [DONE]."""
        return _sse(err.to_json()) + "data: [DONE]\n\n"

    @property
    def _object(self) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if self.stream else "chat.completion"
        return "text_completion"

    def _envelope(self) -> dict:
        return {"id": self.response_id, "object": self._object, "created": self.created, "model": self.model}

    def _chunk(self, text: str | None, reason: str | None) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "delta": {"content": text} if text is not None else {}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        chunk = {**self._envelope(), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's shape: usage only on the extra last chunk
        return chunk

    def _role_event(self) -> str:
        # A chat stream opens with the assistant role (what OpenAI sends first); once only.
        if self.kind != "chat" or self._sent_role:
            return ""
        self._sent_role = True
        chunk = {**self._envelope(), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]}
        return _sse(chunk)


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def finish_reason_of(reason: str | None) -> str:
    """Our finish reasons ("stop": EOS or a stop string, "length") -> OpenAI's ("stop" | "length")."""
    return "length" if reason == "length" else "stop"


def models_list(model_name: str, created: int) -> str:
    return json.dumps({"object": "list", "data": [
        {"id": model_name, "object": "model", "created": created, "owned_by": "llm_api"}]})


# -------------------------------------------------------------------------------------------------
# requests


def parse_call(kind: str, body: Any, model_name: str, limits: Limits) -> tuple[GenerateRequest, OpenAICall]:
    """A completions/chat body (bytes or an already decoded object) -> our request and its encoder."""
    data = _decode(body)
    allowed = CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise OpenAIError(f"Unrecognized request argument supplied: {unknown[0]}", 400, unknown[0], "unknown_parameter")
    for name, neutral in NEUTRAL_VALUES.items():
        if name in data and not any(_same(data[name], v) for v in neutral):
            raise OpenAIError(f"'{name}' is not supported by this server (only {neutral[0]!r})", 400, name, "unsupported_parameter")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required (a string)", 400, "model", "missing_required_parameter")
    if model != model_name:
        raise OpenAIError(f"The model '{model}' does not exist; this server serves '{model_name}'", 404, "model", "model_not_found")
    n = _int(data, "n", 1, 1, 128)
    if n != 1:
        raise OpenAIError("only n=1 is supported: send n separate requests (they are batched together)", 400, "n", "unsupported_parameter")
    stream = _bool(data, "stream", False)
    include_usage = False
    options = data.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise OpenAIError("'stream_options' may only hold 'include_usage'", 400, "stream_options", "invalid_value")
        if not stream:
            raise OpenAIError("'stream_options' is only allowed with stream=true", 400, "stream_options", "invalid_value")
        include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
    if "user" in data and not isinstance(data["user"], (str, type(None))):
        raise OpenAIError("'user' must be a string", 400, "user", "invalid_type")

    request = GenerateRequest(stream=True)  # the handler streams internally; the call encodes the answer
    if kind == "chat":
        request.messages = _messages(data.get("messages"))
        max_default = min(DEFAULT_MAX_NEW_TOKENS, limits.max_new_tokens)
        max_tokens = _int(data, "max_completion_tokens", None, 1, limits.max_new_tokens)
        if max_tokens is None:
            max_tokens = _int(data, "max_tokens", None, 1, limits.max_new_tokens)
    else:
        request.text = _prompt(data.get("prompt"))
        max_default = min(DEFAULT_COMPLETION_MAX_TOKENS, limits.max_new_tokens)
        max_tokens = _int(data, "max_tokens", None, 1, limits.max_new_tokens)
    temperature = _float(data, "temperature", 1.0, 0.0, 2.0)
    top_p = _float(data, "top_p", 1.0, 0.0, 1.0, low_open=True)
    request.params = SamplingParams(
        # Without max_tokens a chat call gets the native API's default (OpenAI's "until the model
        # stops" would ask the KV cache for MAX_NEW_TOKENS per request and refuse long prompts).
        max_new_tokens=max_tokens if max_tokens is not None else max_default,
        temperature=temperature,
        top_p=top_p,
        do_sample=temperature > 0.0,
        seed=_int(data, "seed", None, 0, MAX_SEED),
        stop=_stop(data.get("stop")),
    )
    return request, OpenAICall(kind=kind, model=model_name, stream=stream, include_usage=include_usage)


def _decode(body: Any) -> dict:
    if isinstance(body, (bytes, bytearray)):
        if not body.strip():
            raise OpenAIError("the request body is empty: send a JSON object", 400, None, "invalid_json")
        try:
            body = json.loads(bytes(body).decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise OpenAIError(f"the body is not valid JSON: {exc}", 400, None, "invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError("the body must be a JSON object", 400, None, "invalid_json")
    return body


def _no_constant(name: str):
    raise json.JSONDecodeError(f"{name} is not a valid JSON number", name, 0)


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and value == neutral or (value is None and neutral is None) or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(neutral, (int, float))
        and not isinstance(neutral, bool) and value == neutral)


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, list):
        raise OpenAIError("'prompt' must be one string (batches of prompts and token arrays are not supported)",
                          400, "prompt", "unsupported_parameter")
    if not isinstance(value, str) or not value:
        raise OpenAIError("'prompt' is required (a non-empty string)", 400, "prompt", "missing_required_parameter")
    return _check_text(value, "prompt")


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise OpenAIError("'messages' must be a non-empty array", 400, "messages", "invalid_value")
    out = []
    for i, msg in enumerate(value):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise OpenAIError(f"{param} must be an object", 400, param, "invalid_type")
        role = msg.get("role")
        if role == "developer":  # OpenAI's newer name for the system role
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise OpenAIError(f"{param}.role must be system, developer, user or assistant, not {role!r}", 400,
                              f"{param}.role", "invalid_value")
        extra = set(msg) - {"role", "content", "name"}
        if extra:
            raise OpenAIError(f"{param} has unsupported key(s) {sorted(extra)}", 400, param, "unsupported_parameter")
        content = msg.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(f"{param}.content: only text parts are supported", 400, f"{param}.content", "invalid_value")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise OpenAIError(f"{param}.content must be a string or text parts", 400, f"{param}.content", "invalid_type")
        out.append({"role": role, "content": _check_text(content, f"{param}.content")})
    return out


def _check_text(value: str, param: str) -> str:
    if "\x00" in value:
        raise OpenAIError(f"'{param}' contains a NUL character", 400, param, "invalid_value")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise OpenAIError(f"'{param}' contains a lone surrogate", 400, param, "invalid_value") from None
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in items):
        raise OpenAIError("'stop' must be a string or an array of non-empty strings (256 characters at most)", 400,
                          "stop", "invalid_value")
    if len(items) > MAX_OPENAI_STOP:
        raise OpenAIError(f"'stop' may hold at most {MAX_OPENAI_STOP} sequences", 400, "stop", "invalid_value")
    return tuple(_check_text(s, "stop") for s in items)


def _float(data: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OpenAIError(f"'{name}' must be a number", 400, name, "invalid_type")
    if (value <= low if low_open else value < low) or value > high:
        raise OpenAIError(f"'{name}' must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value:g}", 400, name,
                          "invalid_value")
    return float(value)


def _int(data: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(f"'{name}' must be an integer", 400, name, "invalid_type")
    if not low <= value <= high:
        raise OpenAIError(f"'{name}' must be between {low} and {high}, got {value}", 400, name, "invalid_value")
    return value


def _bool(data: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"'{param or name}' must be a boolean", 400, param or name, "invalid_type")
    return value
