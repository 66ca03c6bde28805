"""The pieces of OpenAI's wire format that chat, completions and the Responses API share.

Content types; ``sse`` (one server-sent event); ``decode_body`` (the body's JSON object); ``api_error`` (a
pydantic validation error -> the OpenAI-shaped 400 naming the field: ``unknown_parameter``,
``missing_required_parameter``, ``invalid_type``, ``invalid_value``); ``check_model`` (404
``model_not_found`` unless the base model or a served LoRA adapter); ``models_list`` (``GET v1/models``);
``ToolName`` (OpenAI's rule for function and schema names); and, for chat and completions, the fields both
bodies take (``OpenAIBody``) and ``validate_call``, the steps both run before their own (decode, validate,
neutral-only parameters, model, ``n``, ``stream_options``).
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Collection, Iterable

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from llm_api.errors import ApiError, echo, model_not_found
from llm_api.protocols.common.checks import PRIORITY_RANGE
from llm_api.protocols.common.fields import (Integer, LogitBias, Number, StopStrings, StrictFlag, StrictWholeNumber,
                                             Text, field_path, first_error, is_type_error, message_of, unknown_fields)
from llm_api.protocols.common.validation import decode_json
from llm_api.service.request import MAX_SEED, Limits, ModelNames, adapter_of, names_of

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"
MAX_OPENAI_STOP = 4  # OpenAI allows up to 4 stop sequences
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function and schema names


def sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def models_list(model_names: ModelNames, created: int, adapters: Iterable[str] = ()) -> str:
    """The base model under each of its names, then each LoRA adapter with ``parent`` (and ``root``) naming
    the base, as vLLM lists them."""
    names = names_of(model_names)
    model_name = names[0]
    bases = [{"id": name, "object": "model", "created": created, "owned_by": "llm_api", "root": model_name,
              "parent": None} for name in names]
    return json.dumps({"object": "list", "data": bases + [
        {"id": name, "object": "model", "created": created, "owned_by": "llm_api", "root": model_name,
         "parent": model_name} for name in sorted(adapters)]})


def check_model(model: str, model_names: ModelNames, adapters: Collection[str] = ()) -> None:
    """404 ``model_not_found`` unless ``model`` is a name of the base model or a served LoRA adapter."""
    if adapter_of(model, model_names) is not None and model not in adapters:
        raise model_not_found(model, names_of(model_names), adapters)


def _tool_name(value: str) -> str:
    if not TOOL_NAME.fullmatch(value):
        raise ValueError("must be 1 to 64 characters a-z, A-Z, 0-9, _ or -")
    return value


ToolName = Annotated[Text, AfterValidator(_tool_name)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictFlag = False


class OpenAIBody(BaseModel):
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
    # vLLM's extension (benchmark clients send it to get outputs of a fixed length): generate past EOS
    ignore_eos: StrictFlag = False
    priority: Integer(*PRIORITY_RANGE, text_ok=False) | None = None  # vLLM's (common.checks.check_priority)


def api_error(error: ValidationError) -> ApiError:
    """A pydantic validation error -> the OpenAI-shaped 400 naming the field (shared by the tokenizer routes)."""
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


def decode_body(body: Any) -> dict:
    """A body (JSON bytes, or an already decoded object) -> its JSON object (400 ``invalid_json`` otherwise)."""
    if isinstance(body, (bytes, bytearray)):
        body = decode_json(body)
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", "the body must be a JSON object", None)
    return body


def _same(value: Any, neutral: Any) -> bool:
    return type(value) is type(neutral) and value == neutral or (value is None and neutral is None) or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(neutral, (int, float))
        and not isinstance(neutral, bool) and value == neutral)


def validate_call(model_class: type[OpenAIBody], body: Any, model_name: ModelNames, limits: Limits,
                  adapters: Collection[str] = (), neutral: dict[str, tuple] | None = None) -> tuple[Any, dict]:
    """A chat or completions body (bytes or an already decoded object) -> the validated ``model_class`` and the
    decoded object: parameters accepted only at their ``neutral`` values (anything else refused by name),
    ``model`` the base model or a served adapter, ``n`` within MAX_NUM_SEQS, ``stream_options`` with ``stream``."""
    data = decode_body(body)
    try:
        call = model_class.model_validate(data, context={"limits": limits})
    except ValidationError as error:
        raise api_error(error) from None
    for name, values in (neutral or {}).items():
        if name in data and not any(_same(data[name], v) for v in values):
            raise ApiError(400, "unsupported_parameter", f"'{name}' is not supported by this server (only {values[0]!r})",
                           name)
    check_model(call.model, model_name, adapters)
    if call.n > limits.max_n:
        raise ApiError(400, "invalid_value", f"'n' must be between 1 and {limits.max_n} (the server's MAX_NUM_SEQS: "
                       "all choices run together)", "n")
    if call.stream_options is not None and not call.stream:
        raise ApiError(400, "invalid_value", "'stream_options' is only allowed with stream=true", "stream_options")
    return call, data
