"""The native body (``NativeBody``: exactly one input, the rest optional) and its field rules
(``translate`` has the contract)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import (AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Strict, TypeAdapter, ValidationError,
                      ValidationInfo, field_validator)

from llm_api.engine.sampling_params import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS
from llm_api.errors import ApiError
from llm_api.protocols.common.checks import PRIORITY_RANGE
from llm_api.protocols.common.fields import (Flag, Integer, LogitBias, NonEmptyText, Number, StopStrings, Text,
                                             WholeNumber, fail, from_form_json)
from llm_api.protocols.common.validation import decode_json
from llm_api.service.request import MAX_SEED, Limits
from llm_api.service.admission import over_input_limit

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_REQUEST_ID_CHARS = 128


class NativeMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: Text
    name: Text | None = None


def _message_list(value: Any) -> Any:
    value = from_form_json(value)
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty array of {role, content} objects")
    return value


def _schema_value(value: Any) -> Any:
    """json_schema: an object or a boolean, or its JSON text (form fields, gRPC's input map)."""
    if isinstance(value, str):
        try:
            value = decode_json(value.encode("utf-8"), what="its JSON text", code="invalid_parameter")
        except ApiError as error:
            raise ValueError(error.message) from None
    if not isinstance(value, (dict, bool)):
        raise ValueError("must be a JSON schema: an object (or its JSON text)")
    return value


CONSTRAINT_FIELDS = ("json_schema", "regex", "grammar")


# Every number of inputs_embeds, checked by pydantic-core (Rust): a 2,048 x 576 body (6 MB, the most
# max_request_size lets in) takes ~30 ms here against ~0.8 s for a Python loop, which held the GIL and
# so stalled every running stream while four such bodies were checked (docs/reliability.md, Stalls).
_FINITE_ROWS = TypeAdapter(list[list[Annotated[float, Strict(), AllowInfNan(False)]]])


def _finite_rows(value: Any) -> Any:
    """inputs_embeds: an array of arrays of finite numbers (not booleans, not numeric strings)."""
    value = from_form_json(value)
    if not isinstance(value, list) or not value:
        raise ValueError("must be a non-empty array of vectors")
    try:
        return _FINITE_ROWS.validate_python(value)
    except ValidationError as error:
        location = error.errors(include_url=False, include_input=False)[0]["loc"]
        if len(location) == 1:
            raise ValueError(f"[{location[0]}] must be an array of numbers") from None
        raise ValueError(f"[{location[0]}] holds a value that is not a finite number") from None


class NativeBody(BaseModel):
    """The native body's fields (exactly one input; the rest optional)."""

    model_config = ConfigDict(extra="forbid")

    text: NonEmptyText | None = None
    messages: Annotated[list[NativeMessage], BeforeValidator(_message_list)] | None = None
    inputs_embeds: Annotated[list[list[float]], BeforeValidator(_finite_rows)] | None = None
    max_new_tokens: WholeNumber | None = None  # range: 1 .. MAX_NEW_TOKENS (a setting), checked below
    temperature: Number(0.0, MAX_TEMPERATURE) | None = None
    top_p: Number(0.0, 1.0, low_open=True) | None = None
    top_k: Integer(0, 1_000_000) | None = None
    repetition_penalty: Number(0.0, MAX_REPETITION_PENALTY, low_open=True) | None = None
    presence_penalty: Number(-2.0, 2.0) | None = None
    frequency_penalty: Number(-2.0, 2.0) | None = None
    logit_bias: Annotated[LogitBias(), BeforeValidator(from_form_json)] | None = None
    do_sample: Flag | None = None
    seed: Integer(0, MAX_SEED) | None = None
    stop: Annotated[StopStrings(MAX_STOP_STRINGS), BeforeValidator(from_form_json)] | None = None
    ignore_eos: Flag = False
    stream: Flag | None = None
    request_id: Text | None = None
    adapter: Text | None = None  # a LoRA adapter's name (the service answers 404 for an unknown one)
    priority: Integer(*PRIORITY_RANGE) | None = None  # vLLM's: lower first (SCHEDULING_POLICY=priority)
    timeout: Number(0.0, 86400.0, low_open=True) | None = None
    n: WholeNumber = 1  # range: 1 .. MAX_NUM_SEQS (a setting), checked below
    logprobs: Integer(0, MAX_TOP_LOGPROBS) | None = None
    output: Literal["text", "jsonl"] = "text"
    json_schema: Annotated[dict | bool, BeforeValidator(_schema_value)] | None = None
    regex: NonEmptyText | None = None
    grammar: NonEmptyText | None = None

    @field_validator("n")
    @classmethod
    def _n_within_limit(cls, value, info: ValidationInfo):
        limit = _limits(info).max_n
        if not 1 <= value <= limit:
            raise ValueError(f"must be between 1 and {limit} (MAX_NUM_SEQS), got {value if abs(value) < 10**20 else 'more'}")
        return value

    @field_validator("inputs_embeds")
    @classmethod
    def _embeds_fit(cls, value, info: ValidationInfo):
        limits = _limits(info)
        too_long = None if value is None else over_input_limit(len(value), limits.max_input_tokens, "positions")
        if too_long is not None:
            raise fail("prompt_too_long", too_long)
        width = limits.hidden_size
        if value is not None and width is not None:
            for i, row in enumerate(value):
                if len(row) != width:
                    raise ValueError(f"[{i}] has width {len(row)}; the model's hidden size is {width}")
        return value

    @field_validator("max_new_tokens")
    @classmethod
    def _within_limit(cls, value, info: ValidationInfo):
        limit = _limits(info).max_new_tokens
        if value is not None and not 1 <= value <= limit:
            raise ValueError(f"must be between 1 and {limit}, got {value if abs(value) < 10**20 else 'more'}")
        return value


def _limits(info: ValidationInfo) -> Limits:
    """The model's limits: parse_request validates with ``context={"limits": limits}``."""
    return cast(dict, info.context)["limits"]
