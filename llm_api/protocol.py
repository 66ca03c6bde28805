"""The native request format: payload -> validated ``GenerateRequest``, and errors -> JSON bodies.

A request reaches the handler as one row of TorchServe's batch: a dict of named fields whose values
are bytes (the handler asks TorchServe not to decode them, so this module owns every parsing
decision). A JSON body arrives as the single field ``body`` (gRPC clients may also send the JSON under
``data``); any other row is form fields (HTTP form, or gRPC's ``input`` map), whose values are strings
coerced to each parameter's type.

A control request ``{"cancel": "<request id>"}`` (the id TorchServe returned in ``x-request-id``, or
the ``request_id`` the client chose) parses to ``CancelRequest``. Otherwise the request carries
exactly one input: ``text``, ``messages`` (chat turns) or ``inputs_embeds`` (a list
of vectors of the model's hidden size), plus generation parameters. Anything else raises
``RequestError`` with an HTTP status, a machine-readable type and a message naming the problem; the
handler turns it into ``{"code", "type", "message"}`` for that request alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from llm_api.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams

INPUT_FIELDS = ("text", "messages", "inputs_embeds")
PARAM_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "do_sample",
    "seed",
    "stop",
    "ignore_eos",
)
CONTROL_FIELDS = ("stream", "request_id", "timeout")  # plus "cancel", alone
ALLOWED_FIELDS = INPUT_FIELDS + PARAM_FIELDS + CONTROL_FIELDS
CHAT_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MAX_NEW_TOKENS = 256
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_SEED = 2**63 - 1
MAX_JSON_DEPTH = 32


class RequestError(ValueError):
    """A request the server refuses; only that request fails."""

    def __init__(self, message: str, type_: str = "invalid_request", code: int = 400):
        super().__init__(message)
        self.message = message
        self.type = type_
        self.code = code

    def to_json(self) -> dict:
        return {"code": self.code, "type": self.type, "message": self.message}

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json()).encode("utf-8")


@dataclass(frozen=True)
class Limits:
    """What the server accepts; built from Settings and the loaded model."""

    max_input_tokens: int
    max_new_tokens: int
    hidden_size: int | None = None


@dataclass
class GenerateRequest:
    text: str | None = None
    messages: list[dict] | None = None
    inputs_embeds: list[list[float]] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = True  # HTTP always streams; gRPC streams only when asked (see torchserve-facts)
    client_request_id: str | None = None
    timeout_s: float | None = None

    @property
    def input_kind(self) -> str:
        return next(k for k in INPUT_FIELDS if getattr(self, k) is not None)


@dataclass(frozen=True)
class CancelRequest:
    target_id: str


def parse_request(row: Mapping[str, Any], limits: Limits, default_stream: bool = True) -> GenerateRequest | CancelRequest:
    """Validate one TorchServe batch row; raise ``RequestError`` naming the first problem found.

    ``default_stream``: whether the answer streams when the request does not say (False for gRPC)."""
    fields_ = _fields_of(row)
    if "cancel" in fields_:
        if set(fields_) - {"cancel"}:
            raise RequestError("a cancel request carries only the field 'cancel'", "invalid_request")
        target = _text(fields_["cancel"], "cancel")
        if not target:
            raise RequestError("'cancel' must name a request id", "invalid_request")
        return CancelRequest(target)
    unknown = sorted(set(fields_) - set(ALLOWED_FIELDS))
    if unknown:
        raise RequestError(
            f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(ALLOWED_FIELDS)}",
            "unknown_field",
        )
    given = [k for k in INPUT_FIELDS if k in fields_ and fields_[k] is not None]
    if not given:
        raise RequestError("the request needs one input: 'text', 'messages' or 'inputs_embeds'", "missing_input")
    if len(given) > 1:
        raise RequestError(f"give exactly one input, not {' and '.join(given)}", "too_many_inputs")
    kind = given[0]
    req = GenerateRequest(params=_sampling_params(fields_, limits))
    if kind == "text":
        req.text = _text(fields_["text"], "text")
        if not req.text:
            raise RequestError("'text' must not be empty", "invalid_input")
    elif kind == "messages":
        req.messages = _messages(fields_["messages"])
    else:
        req.inputs_embeds = _embeds(fields_["inputs_embeds"], limits)
    req.stream = _bool(fields_, "stream", default_stream)
    if fields_.get("request_id") is not None:
        req.client_request_id = _text(fields_["request_id"], "request_id")[:128]
    if fields_.get("timeout") is not None:
        req.timeout_s = _number(fields_, "timeout", None, low=0.0, high=86400.0, low_open=True)
    return req


# ---------------------------------------------------------------------------------------------------
# payload decoding


def _fields_of(row: Mapping[str, Any]) -> dict:
    """The request's fields: a JSON object body, or form fields (values kept as strings)."""
    if not isinstance(row, Mapping) or not row:
        raise RequestError("empty request: send a JSON object or form fields", "empty_body")
    body_key = "body" if "body" in row else "data" if ("data" in row and len(row) == 1) else None
    if body_key is not None:
        value = row[body_key]
        if isinstance(value, (bytes, bytearray)):
            value = _decode_json(bytes(value))
        elif isinstance(value, str):
            value = _decode_json(value.encode("utf-8"))
        if not isinstance(value, dict):
            raise RequestError(
                f"the JSON body must be an object, not {_json_type(value)}", "invalid_json"
            )
        return value
    return {str(k): _form_value(k, v) for k, v in row.items()}


def _decode_json(raw: bytes) -> Any:
    if not raw.strip():
        raise RequestError("empty request body: send a JSON object", "empty_body")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"the body is not valid UTF-8 (byte {exc.start})", "invalid_encoding") from None
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except RequestError:
        raise
    except RecursionError:
        raise RequestError("the JSON body is nested too deeply", "invalid_json") from None
    except json.JSONDecodeError as exc:
        raise RequestError(f"invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", "invalid_json") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise RequestError(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
    return value


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise RequestError(f"duplicate JSON key {key!r}", "invalid_json")
        seen[key] = value
    return seen


def _no_constant(name: str) -> Any:
    raise RequestError(f"{name} is not a valid JSON number", "invalid_json")


def _depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        if depth > MAX_JSON_DEPTH:
            return depth
        nxt = []
        for item in level:
            if isinstance(item, dict):
                nxt.extend(item.values())
            elif isinstance(item, list):
                nxt.extend(x for x in item if isinstance(x, (list, dict)))
        level = nxt
    return depth


def _form_value(name: Any, value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"field {name!r} is not valid UTF-8 (byte {exc.start})", "invalid_encoding") from None
    return value


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


def _maybe_json(value: Any, name: str) -> Any:
    """Form fields carry structured values (messages, stop lists, embeddings) as JSON strings."""
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        try:
            return json.loads(value, parse_constant=_no_constant)
        except json.JSONDecodeError as exc:
            raise RequestError(f"field {name!r} is not valid JSON: {exc.msg}", "invalid_parameter") from None
    return value


# ---------------------------------------------------------------------------------------------------
# inputs


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{name!r} must be a string, not {_json_type(value)}", "invalid_input")
    if "\x00" in value:
        raise RequestError(f"{name!r} contains a NUL character", "invalid_input")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{name!r} contains a lone surrogate (not valid Unicode)", "invalid_input") from None
    return value


def _messages(value: Any) -> list[dict]:
    value = _maybe_json(value, "messages")
    if not isinstance(value, list) or not value:
        raise RequestError("'messages' must be a non-empty array of {role, content} objects", "invalid_input")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'", "invalid_input")
        extra = set(msg) - {"role", "content", "name"}
        if extra:
            raise RequestError(f"messages[{i}] has unknown key(s) {sorted(extra)}", "invalid_input")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise RequestError(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, not {role!r}", "invalid_input"
            )
        content = _text(msg.get("content"), f"messages[{i}].content")
        out.append({"role": role, "content": content})
    return out


def _embeds(value: Any, limits: Limits) -> list[list[float]]:
    value = _maybe_json(value, "inputs_embeds")
    if not isinstance(value, list) or not value:
        raise RequestError("'inputs_embeds' must be a non-empty array of vectors", "invalid_input")
    if len(value) > limits.max_input_tokens:
        raise RequestError(
            f"'inputs_embeds' has {len(value)} positions; the limit is MAX_INPUT_TOKENS={limits.max_input_tokens}",
            "prompt_too_long",
        )
    width = limits.hidden_size
    for i, vec in enumerate(value):
        if not isinstance(vec, list):
            raise RequestError(f"inputs_embeds[{i}] must be an array of numbers", "invalid_input")
        if width is not None and len(vec) != width:
            raise RequestError(
                f"inputs_embeds[{i}] has width {len(vec)}; the model's hidden size is {width}", "invalid_input"
            )
        for x in vec:
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise RequestError(f"inputs_embeds[{i}] holds a value that is not a finite number", "invalid_input")
    return value


# ---------------------------------------------------------------------------------------------------
# generation parameters


def _sampling_params(f: dict, limits: Limits) -> SamplingParams:
    max_new = _integer(f, "max_new_tokens", min(DEFAULT_MAX_NEW_TOKENS, limits.max_new_tokens), 1, limits.max_new_tokens)
    temperature = _number(f, "temperature", 1.0, low=0.0, high=MAX_TEMPERATURE)
    top_p = _number(f, "top_p", 1.0, low=0.0, high=1.0, low_open=True)
    top_k = _integer(f, "top_k", 0, 0, 1_000_000)
    penalty = _number(f, "repetition_penalty", 1.0, low=0.0, high=MAX_REPETITION_PENALTY, low_open=True)
    seed = _integer(f, "seed", None, 0, MAX_SEED)
    # Like TGI: asking for a sampling control without do_sample means sampling.
    wants_sampling = any(f.get(k) is not None for k in ("temperature", "top_p", "top_k"))
    do_sample = _bool(f, "do_sample", wants_sampling)
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        repetition_penalty=penalty,
        do_sample=do_sample,
        seed=seed,
        stop=_stop(f.get("stop")),
        ignore_eos=_bool(f, "ignore_eos", False),
    )


def _number(f: dict, name: str, default, low: float, high: float, low_open: bool = False):
    value = f.get(name)
    if value is None:
        return default
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise RequestError(f"{name!r} must be a number, got {value!r}", "invalid_parameter") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name!r} must be a number, not {_json_type(value)}", "invalid_parameter")
    value = float(value)
    lo_ok = value > low if low_open else value >= low
    if not math.isfinite(value) or not lo_ok or value > high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise RequestError(f"{name!r} must be in {interval}, got {value:g}", "invalid_parameter")
    return value


def _integer(f: dict, name: str, default, low: int, high: int):
    value = f.get(name)
    if value is None:
        return default
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise RequestError(f"{name!r} must be an integer, got {value[:40]!r}", "invalid_parameter") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name!r} must be an integer, not {_json_type(value)}", "invalid_parameter")
    if not low <= value <= high:
        raise RequestError(f"{name!r} must be between {low} and {high}, got {value}", "invalid_parameter")
    return value


def _bool(f: dict, name: str, default: bool) -> bool:
    value = f.get(name)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no"):
        return False
    raise RequestError(f"{name!r} must be true or false, got {str(value)[:40]!r}", "invalid_parameter")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    value = _maybe_json(value, "stop")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise RequestError("'stop' must be a string or an array of strings", "invalid_parameter")
    if len(items) > MAX_STOP_STRINGS:
        raise RequestError(f"'stop' has {len(items)} strings; at most {MAX_STOP_STRINGS} are allowed", "invalid_parameter")
    for s in items:
        _text(s, "stop")
        if not s or len(s) > MAX_STOP_STRING_CHARS:
            raise RequestError(
                f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters", "invalid_parameter"
            )
    return tuple(items)
