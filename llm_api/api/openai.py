"""The OpenAI-compatible API: request translation and response encoding (no TorchServe here).

TorchServe hands the handler everything after ``/predictions/<model>/<version>/`` in the ``url_path``
header; ``route()`` maps it to one of the calls below. Contract:

* ``POST v1/completions`` and ``POST v1/chat/completions``: the body (JSON bytes) is validated by
  ``parse_call`` into a ``GenerateRequest`` (our native request) plus an ``OpenAICall`` that knows how
  to encode the answer. The parameters OpenAI clients send are accepted (``model``, ``prompt`` /
  ``messages``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``n`` (1 to
  MAX_NUM_SEQS), ``presence_penalty`` / ``frequency_penalty`` (-2 to 2), ``logit_bias`` (token id ->
  -100 to 100, ids below the vocabulary size), ``logprobs`` (chat: true/false with ``top_logprobs`` 0 to
  20; completions: 0 to 5), ``stop``, ``seed``, ``stream``, ``stream_options.include_usage``, ``user``);
  parameters we cannot honour are refused by name rather than silently ignored.
* ``n`` > 1: every choice and chunk carries its ``index``; a stream interleaves the choices' chunks, each
  choice ends with its own ``finish_reason`` chunk; ``usage`` counts the tokens of all choices. With a
  ``seed``, choice 0 is what n = 1 would give and the others are seeded from it (distinct, reproducible).
* logprobs (``llm_api.api.logprobs``): with the text they belong to, in every chunk of a stream and in
  the answer's choices (chat: ``logprobs.content``; completions: ``tokens``, ``token_logprobs``,
  ``top_logprobs``, ``text_offset``).
* ``GET v1/models``: ``models_list``. ``GET v1/health``: see ``llm_api.service.metrics.Health``.
* Streaming answers are server-sent events (``text/event-stream``): one ``data: {chunk}`` per text
  delta, a last chunk carrying ``finish_reason`` (and ``usage`` when asked for), then ``data: [DONE]``.
  Non-streaming answers are one JSON object with ``usage``.
* Every error is an ``ApiError`` rendered as ``{"error": {"message", "type", "param", "code"}}`` with
  its HTTP status; after a stream began, the error is an SSE event of that shape, followed by
  ``data: [DONE]`` (the openai client raises ``APIError`` on it).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from llm_api.api.errors import ApiError, echo
from llm_api.api.fields import (Integer, LogitBias, Number, StopStrings, StrictFlag, StrictWholeNumber, Text,
                                field_path, first_error, is_type_error, message_of, unknown_fields)
from llm_api.api.logprobs import LogprobItem, openai_chat_logprobs, openai_completion_logprobs
from llm_api.api.request import DEFAULT_MAX_NEW_TOKENS, MAX_SEED, GenerateRequest, Limits
from llm_api.api.validation import decode_json
from llm_api.engine.request import FinishReason
from llm_api.engine.sampler import SamplingParams

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
# Accepted only at the value that means "off" (what the openai client sends when a caller sets them
# explicitly to their defaults); anything else is refused, naming the parameter.
NEUTRAL_VALUES = {
    "echo": (False,), "best_of": (1,), "suffix": (None, ""),
    "response_format": (None, {"type": "text"}), "tools": (None, []), "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, False, True),
}
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


def route(url_path: str | None) -> str | None:
    """``url_path`` header -> "completions" | "chat" | "models" | "health"; None for the native API.

    Raises ``ApiError`` (404) for any other path below the model, so a typo is not served as a
    native generation request."""
    if url_path is None:
        return None
    path = url_path.split("?", 1)[0].strip("/")
    if not path:
        return None
    name = ROUTES.get(path)
    if name is None:
        raise ApiError(404, "not_found", f"unknown path {echo(path)}; served: {', '.join(ROUTES)}", None)
    return name


@dataclass
class OpenAICall:
    """One accepted completions/chat call: what the client asked for and how to encode our answer."""

    kind: str  # "completions" | "chat"
    model: str
    stream: bool
    include_usage: bool
    n: int = 1
    with_logprobs: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    _text: dict[int, list[str]] = field(default_factory=dict)  # choice -> its text so far (not streaming)
    _logprobs: dict[int, list[dict]] = field(default_factory=dict)  # choice -> rendered logprobs per delta
    _num_chars: dict[int, int] = field(default_factory=dict)  # choice -> characters sent (text_offset)
    _reasons: dict[int, str] = field(default_factory=dict)  # choice -> finish reason, once ended
    _sent_role: set[int] = field(default_factory=set)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.id

    @property
    def content_type(self) -> str:
        return SSE_CONTENT_TYPE if self.stream else JSON_CONTENT_TYPE

    def delta(self, text: str, index: int = 0, logprobs: tuple[LogprobItem, ...] = ()) -> str:
        """New text of choice ``index`` (and the logprobs of its tokens) -> what to send now ("" for a
        non-streaming call, which answers at the end)."""
        if not text and not logprobs:
            return ""
        rendered = self._render_logprobs(index, text, logprobs)
        if not self.stream:
            self._text.setdefault(index, []).append(text)
            if rendered is not None:
                self._logprobs.setdefault(index, []).append(rendered)
            return ""
        return self._role_event(index) + _sse(self._chunk(index, text, None, rendered))

    def choice_finish(self, index: int, finish_reason: FinishReason) -> str:
        """Choice ``index`` ended: its finish-reason chunk when streaming."""
        self._reasons[index] = finish_reason.value
        if not self.stream:
            return ""
        return self._role_event(index) + _sse(self._chunk(index, None, finish_reason.value, None))

    def finish(self, finish_reason: FinishReason, num_prompt_tokens: int, num_completion_tokens: int) -> str:
        """The last payload: usage (the whole answer when not streaming); ``[DONE]`` when streaming. Choices
        not ended by ``choice_finish`` end with ``finish_reason``."""
        out = "".join(self.choice_finish(i, finish_reason) for i in range(self.n) if i not in self._reasons)
        usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                 "total_tokens": num_prompt_tokens + num_completion_tokens}
        if not self.stream:
            choices = [self._whole_choice(i) for i in range(self.n)]
            return json.dumps({"id": self.response_id, "object": self._object, "created": self.created,
                               "model": self.model, "choices": choices, "usage": usage})
        if self.include_usage:
            out += _sse({**self._envelope(), "choices": [], "usage": usage})
        return out + "data: [DONE]\n\n"

    def error_event(self, err: ApiError) -> str:
        """An error after the stream began: one SSE event in OpenAI's error shape, then [DONE]."""
        return _sse(err.openai_json()) + "data: [DONE]\n\n"

    @property
    def _object(self) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if self.stream else "chat.completion"
        return "text_completion"

    def _envelope(self) -> dict:
        return {"id": self.response_id, "object": self._object, "created": self.created, "model": self.model}

    def _render_logprobs(self, index: int, text: str, items: tuple[LogprobItem, ...]) -> dict | None:
        if not self.with_logprobs:
            return None
        offset = self._num_chars.get(index, 0)
        self._num_chars[index] = offset + len(text)
        if self.kind == "chat":
            return openai_chat_logprobs(list(items))
        return openai_completion_logprobs(list(items), offset)

    def _whole_choice(self, index: int) -> dict:
        text = "".join(self._text.get(index, ()))
        logprobs = None
        if self.with_logprobs:
            parts = self._logprobs.get(index, [])
            if self.kind == "chat":
                logprobs = {"content": [entry for part in parts for entry in part["content"]], "refusal": None}
            else:
                logprobs = {key: [x for part in parts for x in part[key]]
                            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        reason = self._reasons.get(index)
        if self.kind == "chat":
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

    def _chunk(self, index: int, text: str | None, reason: str | None, logprobs: dict | None) -> dict:
        if self.kind == "chat":
            choice = {"index": index, "delta": {"content": text} if text is not None else {}, "logprobs": logprobs,
                      "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        chunk = {**self._envelope(), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI's shape: usage only on the extra last chunk
        return chunk

    def _role_event(self, index: int) -> str:
        # A chat stream opens each choice with the assistant role (what OpenAI sends first); once per choice.
        if self.kind != "chat" or index in self._sent_role:
            return ""
        self._sent_role.add(index)
        chunk = {**self._envelope(), "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None}]}
        return _sse(chunk)


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def _content_shape(value: Any) -> Any:
    if isinstance(value, list) and not all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        raise ValueError("only text parts are supported")
    return value


def _nonempty_list(value: Any) -> Any:
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty array")
    return value


def models_list(model_name: str, created: int) -> str:
    return json.dumps({"object": "list", "data": [
        {"id": model_name, "object": "model", "created": created, "owned_by": "llm_api"}]})


# -------------------------------------------------------------------------------------------------
# requests


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[Text | list[TextPart], BeforeValidator(_content_shape)]
    name: Text | None = None

    def to_turn(self) -> dict:
        """Our chat turn: text parts joined; ``developer`` (OpenAI's newer name) as the system role."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictFlag = False


class _CallBody(BaseModel):
    """What both calls accept; parameters we cannot honour are accepted only at their neutral value."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    max_tokens: StrictWholeNumber | None = None
    temperature: Number(0.0, 2.0, text_ok=False) | None = None
    top_p: Number(0.0, 1.0, low_open=True, text_ok=False) | None = None
    n: Integer(1, 128, text_ok=False) = 1
    stop: StopStrings(MAX_OPENAI_STOP) | None = None
    seed: Integer(0, MAX_SEED, text_ok=False) | None = None
    stream: StrictFlag = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    presence_penalty: Number(-2.0, 2.0, text_ok=False) | None = None
    frequency_penalty: Number(-2.0, 2.0, text_ok=False) | None = None
    logit_bias: LogitBias(text_ok=False) | None = None


class ChatBody(_CallBody):
    messages: Annotated[list[ChatMessage], BeforeValidator(_nonempty_list)]
    max_completion_tokens: StrictWholeNumber | None = None
    logprobs: StrictFlag | None = None
    top_logprobs: Integer(0, MAX_CHAT_TOP_LOGPROBS, text_ok=False) | None = None
    response_format: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None


class CompletionBody(_CallBody):
    prompt: Text | list[Text]
    logprobs: Integer(0, MAX_COMPLETION_LOGPROBS, text_ok=False) | None = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


def parse_call(kind: str, body: Any, model_name: str, limits: Limits) -> tuple[GenerateRequest, OpenAICall]:
    """A completions/chat body (bytes or an already decoded object) -> our request and its encoder."""
    data = _decode(body)
    model_class = ChatBody if kind == "chat" else CompletionBody
    try:
        call = model_class.model_validate(data, context={"limits": limits})
    except ValidationError as error:
        raise _api_error(error) from None
    for name, neutral in NEUTRAL_VALUES.items():
        if name in data and not any(_same(data[name], v) for v in neutral):
            raise ApiError(400, "unsupported_parameter", f"'{name}' is not supported by this server (only {neutral[0]!r})",
                           name)
    if call.model != model_name:
        raise ApiError(404, "model_not_found", f"The model {echo(call.model)} does not exist; this server serves "
                       f"{model_name!r}", "model")
    if call.n > limits.max_n:
        raise ApiError(400, "invalid_value", f"'n' must be between 1 and {limits.max_n} (the server's MAX_NUM_SEQS: "
                       "all choices run together)", "n")
    if call.stream_options is not None and not call.stream:
        raise ApiError(400, "invalid_value", "'stream_options' is only allowed with stream=true", "stream_options")

    request = GenerateRequest(stream=True)  # the handler streams internally; the call encodes the answer
    if isinstance(call, ChatBody):
        if call.top_logprobs and not call.logprobs:
            raise ApiError(400, "invalid_value", "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (call.top_logprobs or 0) if call.logprobs else None
    else:
        logprobs = call.logprobs
    if isinstance(call, ChatBody):
        request.messages = [m.to_turn() for m in call.messages]
        max_default = min(DEFAULT_MAX_NEW_TOKENS, limits.max_new_tokens)
        max_tokens, param = ((call.max_completion_tokens, "max_completion_tokens") if call.max_completion_tokens
                             is not None else (call.max_tokens, "max_tokens"))
    else:
        request.text = _prompt(call.prompt)
        max_default = min(DEFAULT_COMPLETION_MAX_TOKENS, limits.max_new_tokens)
        max_tokens, param = call.max_tokens, "max_tokens"
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_new_tokens:
        raise ApiError(400, "invalid_value", f"'{param}' must be between 1 and {limits.max_new_tokens}", param)
    temperature = 1.0 if call.temperature is None else call.temperature
    request.params = SamplingParams(
        # Without max_tokens a chat call gets the native API's default (OpenAI's "until the model
        # stops" would ask the KV cache for MAX_NEW_TOKENS per request and refuse long prompts).
        max_new_tokens=max_tokens if max_tokens is not None else max_default,
        temperature=temperature,
        top_p=1.0 if call.top_p is None else call.top_p,
        presence_penalty=call.presence_penalty or 0.0,
        frequency_penalty=call.frequency_penalty or 0.0,
        logit_bias=call.logit_bias or (),
        do_sample=temperature > 0.0,
        seed=call.seed,
        stop=call.stop or (),
        logprobs=logprobs,
        n=call.n,
    )
    include_usage = call.stream_options is not None and call.stream_options.include_usage
    return request, OpenAICall(kind=kind, model=model_name, stream=call.stream, include_usage=include_usage, n=call.n,
                               with_logprobs=logprobs is not None)


def _api_error(error: ValidationError) -> ApiError:
    unknown = unknown_fields(error)
    if unknown:
        return ApiError(400, "unknown_parameter", f"Unrecognized request argument supplied: {echo(unknown[0])}",
                        unknown[0])
    detail = first_error(error)
    param = field_path(tuple(detail["loc"])) or None
    if detail["type"] == "missing":
        code = "missing_required_parameter"
    elif is_type_error(detail):
        code = "invalid_type"
    else:
        code = "invalid_value"
    return ApiError(400, code, message_of(detail), param)


def _decode(body: Any) -> dict:
    if isinstance(body, (bytes, bytearray)):
        body = decode_json(bytes(body))
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "the body must be a JSON object", None)
    return body


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and value == neutral or (value is None and neutral is None) or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(neutral, (int, float))
        and not isinstance(neutral, bool) and value == neutral)


def _prompt(value: str | list[str]) -> str:
    if isinstance(value, list):
        if len(value) != 1:
            raise ApiError(400, "unsupported_parameter", "'prompt' must be one string (batches of prompts and token "
                           "arrays are not supported)", "prompt")
        value = value[0]
    if not value:
        raise ApiError(400, "missing_required_parameter", "'prompt' is required (a non-empty string)", "prompt")
    return value
