"""The OpenAI Responses API (``POST /v1/responses``): request parsing and answer encoding (no server here).

Contract (docs/responses.md has the user's view):

* ``parse_responses(body, model_name, limits)`` validates a body (JSON bytes or a decoded object) into
  a ``GenerateRequest`` (chat messages for the template, sampling parameters, the structured-output or
  tool constraint) and a ``ResponsesCall``, the ``AnswerEncoder`` (``llm_api.api.encoding``) of this
  call's answer. Every error is an ``ApiError`` (400, OpenAI's error shape) naming the field: unknown
  parameters get ``unknown_parameter``; parameters we cannot honour, and values of them we cannot
  honour, are refused by name (``unsupported_parameter`` / ``invalid_value``), never ignored.
* ``input`` is a string (one user message) or a list of items: messages (``{"role", "content"}``, with
  or without ``"type": "message"``; content a string or ``input_text`` / ``output_text`` parts),
  ``function_call`` (an earlier call: ``call_id``, ``name``, ``arguments`` JSON text of an object) and
  ``function_call_output`` (its result: ``call_id``, ``output``), and ``reasoning`` items, whose text
  (``content`` reasoning_text parts, else ``summary`` parts) reaches the template as the
  ``reasoning_content`` of the assistant turn that follows it; a reasoning item no assistant turn
  follows is dropped (it belongs to no answer). ``instructions`` is a system message first. A
  ``developer`` message is a system turn. Consecutive function calls (and an assistant message right
  before them) are one assistant turn with ``tool_calls``; each ``function_call_output`` must answer a
  call of the conversation (its ``call_id``).
* ``previous_response_id`` is returned on the call (``call.previous_response_id``); the caller that
  owns the store looks it up and calls ``call.continue_from(stored_turns, request)``, which sets
  ``request.messages`` to the instructions, the stored turns and the new input. After the answer,
  ``call.conversation()`` is what to store for the next turn (the prior turns, the input, the answer as
  chat turns; without the instructions, which OpenAI does not carry over), ``call.response_json()`` the
  Response object to store and serve on ``GET /v1/responses/{id}``.
* The answer (n is always 1): not streamed, one Response object (``status`` completed, incomplete with
  ``incomplete_details.reason`` ``max_output_tokens`` when the token limit cut it, failed); streamed,
  server-sent events ``event: <type>`` / ``data: {...}``, each with a ``sequence_number`` counting from 0:
  ``response.created``, ``response.in_progress``, then per output item ``response.output_item.added``,
  for a message ``response.content_part.added``, ``response.output_text.delta``...,
  ``response.output_text.done``, ``response.content_part.done``; for a call
  ``response.function_call_arguments.delta``... and ``.done``; ``response.output_item.done``; last
  ``response.completed`` (``response.incomplete`` when cut). A failure after the stream began sends
  ``error`` (our code, message, param: OpenAI's shape, not OpenResponses' ``error`` object, on which
  the openai package would raise) and then ``response.failed`` (the Response with its ``error``): the
  openai package yields both as typed events (it raises on neither in a Responses stream).
* The Response object has every field of OpenResponses' ``ResponseResource`` (null where there is no
  value: ``completed_at`` until the response completed, ``max_tool_calls``; the penalties and
  ``top_logprobs``, 0, are what was used: ``presence_penalty`` / ``frequency_penalty`` are taken, -2 to 2,
  as on chat); an ``output_text`` part has ``annotations`` and ``logprobs``
  (both empty). ``usage.input_tokens_details.cached_tokens``: the prompt tokens the engine found in its
  prefix cache (``Finished.num_cached_tokens``: a ``previous_response_id`` turn's earlier prompt and
  answer, typically).
* ``background: true`` (with ``store``; not with ``stream``): the call is answered at once with the Response
  object (status ``queued``) and runs on; ``GET`` shows it ``in_progress`` and then as stored, ``cancel``
  ends it (the route does this: ``llm_api.protocols.responses.route``).
* ``ignore_eos`` (vLLM's extension, as on chat; true/false): the answer runs to ``max_output_tokens``
  (status incomplete, reason ``max_output_tokens``); refused with ``text.format`` json or tools' grammar.
* With tools, ``llm_api.api.constraints.plan_tools`` decides how they are served, as on chat (the
  Responses function tools converted to chat's shape, its errors renamed: ``tools[i].parameters``):
  the template renders them, or, on a template without a tool format, the generic tools block
  (``request.tool_prompt``) serves every choice (``auto``: text or a call; one call per answer unless
  ``parallel_tool_calls`` is true). The answer's text goes through ``ToolCallParser`` (the plan's
  ``ToolFormat``): content becomes a ``message`` item, each call a ``function_call`` item (``call_id``
  "call_...", arguments streamed in pieces exactly as the model wrote them).
* Reasoning models (``Limits.reasoning_format``): ``reasoning.effort`` becomes the template variables
  (``template_variables``, as chat's ``reasoning_effort``); a constraint (text.format, tools) applies to
  the answer only (``answer_only``). The output goes through ``ReasoningParser`` first: the think block
  is a ``reasoning`` item (``rs_...``, ``summary`` [], one ``reasoning_text`` content part) before the
  answer's items, streamed as ``response.output_item.added``, ``response.content_part.added``,
  ``response.reasoning_text.delta``..., ``response.reasoning_text.done``, ``response.content_part.done``,
  ``response.output_item.done``. ``conversation()`` keeps it as the answer's ``reasoning_content``.
  ``usage.output_tokens_details.reasoning_tokens``: the generated tokens whose text was the think block,
  its tags included (``delta``'s ``num_tokens``; text the parser holds back counts with the text that
  resolves it).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Collection, Literal, Union

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag,
                      ValidationError)

from llm_api.api.constraints import (ToolPlan, ignore_eos_conflict, json_object_constraint, json_schema_constraint,
                                    plan_tools)
from llm_api.api.errors import ApiError, echo
from llm_api.api.fields import (Number, StrictFlag, StrictWholeNumber, Text, check_text, fail, field_path, first_error,
                                is_type_error, message_of, unknown_fields)
from llm_api.api.logprobs import LogprobItem
from llm_api.api.openai import (JSON_CONTENT_TYPE, SSE_CONTENT_TYPE, TOOL_CHOICES, ToolName, api_error, check_model,
                            tool_choice_keyword)
from llm_api.api.reasoning import (REASONING_EFFORTS, AnswerText, ReasoningFormat, ReasoningParser, ReasoningText,
                                   answer_only, template_variables)
from llm_api.api.request import DEFAULT_MAX_NEW_TOKENS, GenerateRequest, Limits, WorkFields
from llm_api.api.tools import ToolCallDelta, ToolCallParser, ToolFormat
from llm_api.api.validation import decode_json
from llm_api.engine.request import FinishReason
from llm_api.engine.sampling_params import SamplingParams
from llm_api.structured.spec import Constraint

MAX_INPUT_ITEMS = 2048  # items of ``input`` (a conversation longer than this cannot fit a prompt here anyway)
MAX_PARTS = 256  # content parts of one message
MAX_TOOLS = 128  # OpenAI allows 128 function tools
# Texts of one request together: the service's exact prompt check (MAX_INPUT_TOKENS x the vocabulary's
# longest token) comes later; this early bound refuses a text that cannot fit whatever the tokenizer,
# naming the field, before it is copied into messages.
MAX_CHARS_PER_INPUT_TOKEN = 64
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's bounds
MAX_ID_CHARS = 256  # ids and labels the client sends (call_id, user, prompt_cache_key, ...)
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
MEDIA_PART_TYPES = ("input_image", "input_file", "input_audio", "input_video")  # refused by name: text-only models
SERVICE_TIERS = ("auto", "default")  # one tier here: these two mean it; flex/priority/scale are refused


# -------------------------------------------------------------------------------------------------
# request body


def _bounded(limit: int):
    def check(value: str) -> str:
        if len(value) > limit:
            raise fail("text_value", f"must have at most {limit} characters, got {len(value)}")
        return value

    return AfterValidator(check)


Label = Annotated[Text, _bounded(MAX_ID_CHARS)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextPart(_Strict):
    # output_text parts come back from earlier answers with their annotations and logprobs (output
    # metadata: nothing the template renders)
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = Field(default=None, max_length=0)
    logprobs: list[Any] | None = None


class InputTextPart(_Strict):
    type: Literal["input_text"]
    text: Text


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: TextOr(TextPart)
    id: Label | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Label
    name: ToolName
    arguments: Text  # JSON text of an object (checked where the error can name the item)
    id: Label | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Label
    output: TextOr(InputTextPart)
    id: Label | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningPart(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: Label | None = None
    summary: Annotated[list[ReasoningPart], Field(max_length=MAX_PARTS)] = []
    content: Annotated[list[ReasoningPart], Field(max_length=MAX_PARTS)] | None = None
    encrypted_content: None = None  # nothing here encrypts reasoning, so none can be read back
    status: ItemStatus | None = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "\n\n".join(p.text for p in parts)


# Unions are tagged, so that an error is reported for the branch the value is (a list's error, not the
# string's); tags start with TAG_MARK and are left out of the field path an error names.
TAG_MARK = "~"


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return TAG_MARK + str(value.get("type", "message"))
    kind = getattr(value, "type", None)
    return None if kind is None else TAG_MARK + kind


def _text_or_list(value: Any) -> str:
    return TAG_MARK + ("list" if isinstance(value, list) else "text")


def TextOr(parts: Any) -> Any:  # noqa: N802 (a type factory)
    """A string or a list of ``parts`` (at most MAX_PARTS), tagged by the value's JSON type."""
    return Annotated[Union[Annotated[Text, Tag(TAG_MARK + "text")],
                           Annotated[list[parts], Field(max_length=MAX_PARTS), Tag(TAG_MARK + "list")]],
                     Discriminator(_text_or_list)]


InputItem = Annotated[Union[Annotated[MessageItem, Tag(TAG_MARK + "message")],
                            Annotated[FunctionCallItem, Tag(TAG_MARK + "function_call")],
                            Annotated[FunctionCallOutputItem, Tag(TAG_MARK + "function_call_output")],
                            Annotated[ReasoningItem, Tag(TAG_MARK + "reasoning")]], Discriminator(_item_kind)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: ToolName
    description: Text | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments
    strict: StrictFlag | None = None  # accepted: arguments always follow the schema here


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: ToolName | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: StrictFlag | None = None  # accepted: the answer always follows the schema here


class TextConfig(_Strict):
    format: TextFormat | None = None


class ReasoningConfig(_Strict):
    effort: Literal[REASONING_EFFORTS] | None = None
    summary: None = None  # no summaries are written here: refused unless null
    generate_summary: None = None


def _metadata(value: Any) -> Any:
    if not isinstance(value, dict):
        raise fail("metadata_type", "must be an object mapping strings to strings")
    if len(value) > MAX_METADATA_KEYS:
        raise fail("metadata_value", f"has {len(value)} keys; at most {MAX_METADATA_KEYS} are allowed")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise fail("metadata_value", f"keys must have at most {MAX_METADATA_KEY_CHARS} characters; "
                       f"{echo(key)} has {len(key)}")
        if not isinstance(item, str):
            raise fail("metadata_type", f"values must be strings; the value of {echo(key)} is not")
        if len(item) > MAX_METADATA_VALUE_CHARS:
            raise fail("metadata_value", f"values must have at most {MAX_METADATA_VALUE_CHARS} characters; the "
                       f"value of {echo(key)} has {len(item)}")
    return value


def _check_texts(value: dict) -> dict:
    for key, item in value.items():
        check_text(key)
        check_text(item)
    return value


Metadata = Annotated[dict[str, str], BeforeValidator(_metadata), AfterValidator(_check_texts)]


class ResponsesBody(_Strict):
    model: Text
    input: Annotated[Union[Annotated[Text, Tag(TAG_MARK + "text")],
                           Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS),
                                     Tag(TAG_MARK + "list")]], Discriminator(_text_or_list)]
    instructions: Text | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name"}: checked below
    parallel_tool_calls: StrictFlag | None = None
    text: TextConfig | None = None
    max_output_tokens: StrictWholeNumber | None = None
    temperature: Number(0.0, 2.0, text_ok=False) | None = None
    top_p: Number(0.0, 1.0, low_open=True, text_ok=False) | None = None
    presence_penalty: Number(-2.0, 2.0, text_ok=False) | None = None  # (OpenResponses' fields, as on chat)
    frequency_penalty: Number(-2.0, 2.0, text_ok=False) | None = None
    stream: StrictFlag = False
    store: StrictFlag = True
    previous_response_id: Label | None = None
    metadata: Metadata | None = None
    user: Label | None = None
    reasoning: ReasoningConfig | None = None
    include: Annotated[list[Text], Field(max_length=0)] | None = None  # nothing optional is served (see below)
    truncation: Literal["disabled"] | None = None
    background: StrictFlag | None = None  # queued and polled (llm_api.protocols.responses.route); needs store
    service_tier: Literal[SERVICE_TIERS] | None = None
    prompt_cache_key: Label | None = None  # a routing hint; the prefix cache here needs none
    safety_identifier: Label | None = None  # like user: a label for abuse reports; nothing here uses it
    ignore_eos: StrictFlag = False  # vLLM's extension, as on chat: generate past EOS up to max_output_tokens


# -------------------------------------------------------------------------------------------------
# parse


def parse_responses(body: Any, model_name: str, limits: Limits,
                    adapters: Collection[str] = ()) -> tuple[GenerateRequest, ResponsesCall]:
    """A ``/v1/responses`` body (bytes or an already decoded object) -> our request and its encoder
    (``model``: the base model or one of the LoRA ``adapters``)."""
    data = body
    if isinstance(data, (bytes, bytearray)):
        data = decode_json(data)
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", "the body must be a JSON object", None)
    _refuse_unsupported_kinds(data)
    try:
        call = ResponsesBody.model_validate(data, context={"limits": limits})
    except ValidationError as error:
        raise _refusal(error, data) from None
    check_model(call.model, model_name, adapters)
    items: list = [MessageItem(role="user", content=call.input)] if isinstance(call.input, str) else call.input
    _check_size(call, items, limits)
    input_turns = _turns(items)
    if call.previous_response_id is None:
        _check_call_ids([], items)

    max_tokens = call.max_output_tokens
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_new_tokens:
        raise ApiError(400, "invalid_value", f"'max_output_tokens' must be between 1 and {limits.max_new_tokens}",
                       "max_output_tokens")
    temperature = 1.0 if call.temperature is None else call.temperature
    request = GenerateRequest(stream=True)  # the service always streams; the call encodes the answer
    request.params = SamplingParams(
        # Without max_output_tokens: the native API's default (OpenAI's "until the model stops" would
        # reserve MAX_NEW_TOKENS of KV cache per request).
        max_new_tokens=max_tokens if max_tokens is not None else min(DEFAULT_MAX_NEW_TOKENS, limits.max_new_tokens),
        temperature=temperature,
        top_p=1.0 if call.top_p is None else call.top_p,
        do_sample=temperature > 0.0,
        ignore_eos=call.ignore_eos,
        presence_penalty=call.presence_penalty or 0.0,
        frequency_penalty=call.frequency_penalty or 0.0,
    )
    request.work_fields = WorkFields("n", "max_output_tokens", "include")
    request.constraint, plan, choice = _structured_output(call, limits)
    tool_format = None
    if plan is not None:
        request.constraint, request.tools, request.tool_prompt = plan.constraint, plan.tools, plan.tool_prompt
        tool_format = plan.format
    if call.ignore_eos and request.constraint is not None:
        raise ignore_eos_conflict("tools" if plan is not None else "text.format", "invalid_value")
    effort = call.reasoning.effort if call.reasoning else None
    request.template_kwargs = template_variables(None, effort, "reasoning.effort")
    if limits.reasoning_format is not None and request.constraint is not None:
        # the think block stays free text; text.format or the calls apply to the answer after it
        request.constraint = answer_only(limits.reasoning_format, request.constraint)
    system = [{"role": "system", "content": call.instructions}] if call.instructions is not None else []
    request.messages = system + input_turns

    settings = {
        "instructions": call.instructions,
        "max_output_tokens": call.max_output_tokens,
        "metadata": call.metadata or {},
        "parallel_tool_calls": call.parallel_tool_calls is not False,
        "previous_response_id": call.previous_response_id,
        "reasoning": {"effort": call.reasoning.effort if call.reasoning else None, "summary": None},
        "store": call.store,
        "temperature": temperature,
        "text": {"format": _format_echo(call.text)},
        "tool_choice": _tool_choice_echo(choice),
        "tools": [t.model_dump(by_alias=True) for t in call.tools or ()],
        "top_p": request.params.top_p,
        "presence_penalty": request.params.presence_penalty,
        "frequency_penalty": request.params.frequency_penalty,
        # no logprobs are returned here (the request refuses top_logprobs and include); the Response
        # object states the value used, as OpenResponses requires
        "top_logprobs": 0,
        "max_tool_calls": None,
        "truncation": "disabled",
        "user": call.user,
        "background": bool(call.background),
        "service_tier": "default",
        "prompt_cache_key": call.prompt_cache_key,
        "safety_identifier": call.safety_identifier,
    }
    request.adapter, request.adapter_param = (None if call.model == model_name else call.model), "model"
    if call.background and not call.store:
        raise ApiError(400, "invalid_value", "'background' needs 'store' (a background response is read back "
                       "with GET /v1/responses/{id})", "background")
    if call.background and call.stream:
        raise ApiError(400, "unsupported_parameter", "'background' with 'stream' is not served here: create the "
                       "response in the background and poll it with GET /v1/responses/{id}, or stream it in the "
                       "foreground", "background")
    responses_call = ResponsesCall(
        model=call.model, stream=call.stream, store=call.store, background=bool(call.background),
        tool_format=tool_format,
        reasoning_format=limits.reasoning_format, previous_response_id=call.previous_response_id,
        instructions=call.instructions, input_turns=input_turns, input_items=items, settings=settings)
    return request, responses_call


def _refuse_unsupported_kinds(data: dict) -> None:
    """Item and tool types we do not serve, refused by name before pydantic (whose union errors would not
    name the type)."""
    items = data.get("input")
    if isinstance(items, list):
        for i, item in enumerate(items[:MAX_INPUT_ITEMS + 1]):
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind is None:
                raise ApiError(400, "invalid_type", f"'input[{i}]' must be an object (an input item)", f"input[{i}]")
            if kind not in ITEM_TYPES:
                raise ApiError(400, "invalid_value", f"'input[{i}].type' {echo(kind)} is not served here; input items "
                               f"may be {', '.join(ITEM_TYPES)}", f"input[{i}].type")
            content = item.get("content") if kind == "message" else None
            if isinstance(content, list):
                for j, part in enumerate(content[:MAX_PARTS + 1]):
                    part_kind = part.get("type") if isinstance(part, dict) else None
                    if part_kind in MEDIA_PART_TYPES:
                        raise ApiError(400, "invalid_value", f"'input[{i}].content[{j}].type' {echo(part_kind)} is not "
                                       "served here: the model reads text only (input_text parts)",
                                       f"input[{i}].content[{j}].type")
    tools = data.get("tools")
    if isinstance(tools, list):
        for i, tool in enumerate(tools[:MAX_TOOLS + 1]):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(tool, dict) and kind != "function":
                raise ApiError(400, "unsupported_parameter", f"'tools[{i}].type' {echo(kind)} is not served here: "
                               "only function tools", f"tools[{i}].type")


# What a refused field's value means to the client, when pydantic's own message would not say it.
_REFUSED_VALUES = {
    "truncation": "only truncation 'disabled' is served (a prompt over MAX_INPUT_TOKENS is refused, not cut)",
    "include": "no optional output data is served here ('include' must be empty)",
    "service_tier": "one service tier is served here: 'auto' or 'default'",
    "reasoning.summary": "reasoning summaries are not written here ('reasoning.summary' must be null)",
    "reasoning.generate_summary": "reasoning summaries are not written here",
    "encrypted_content": "encrypted reasoning cannot be read here (nothing here encrypts it)",
}


def _refusal(error: ValidationError, data: dict) -> ApiError:
    refused = _api_error(error)
    param = refused.param or ""
    include = data.get("include")
    if param == "include" and isinstance(include, list) and include and isinstance(include[0], str):
        return ApiError(400, "unsupported_parameter", f"'include' value {echo(include[0])} is not served here "
                        "(no optional output data is)", "include")
    for name, why in _REFUSED_VALUES.items():
        if param == name or param.endswith("." + name):
            return ApiError(400, "unsupported_parameter", f"{param!r}: {why}", param)
    return refused


def _api_error(error: ValidationError) -> ApiError:
    """openai.api_error, with the unions' tags left out of the field path."""
    if unknown_fields(error):
        return api_error(error)
    detail = first_error(error)
    detail = {**detail, "loc": tuple(p for p in detail["loc"] if not (isinstance(p, str) and p.startswith(TAG_MARK)))}
    param = field_path(detail["loc"]) or None
    code = ("missing_required_parameter" if detail["type"] == "missing" else
            "invalid_type" if is_type_error(detail) else "invalid_value")
    return ApiError(400, code, message_of(detail), param)  # type: ignore[arg-type]


def _check_size(call: ResponsesBody, items: list, limits: Limits) -> None:
    """The texts of the request together against MAX_INPUT_TOKENS x MAX_CHARS_PER_INPUT_TOKEN (see there),
    naming the field that crosses it."""
    limit = limits.max_input_tokens * MAX_CHARS_PER_INPUT_TOKEN
    total = len(call.instructions or "")
    if total > limit:
        _too_long("instructions", total, limit)
    for i, item in enumerate(items):
        if isinstance(call.input, str):
            total, param = total + len(call.input), "input"
        elif isinstance(item, FunctionCallItem):
            total, param = total + len(item.arguments), f"input[{i}].arguments"
        elif isinstance(item, FunctionCallOutputItem):
            total, param = total + len(item.text()), f"input[{i}].output"
        elif isinstance(item, ReasoningItem):
            total, param = total + len(item.text()), f"input[{i}].content"
        else:
            total, param = total + len(item.text()), f"input[{i}].content"
        if total > limit:
            _too_long(param, total, limit)


def _too_long(param: str, total: int, limit: int) -> None:
    raise ApiError(400, "prompt_too_long", f"the input has at least {total} characters by {param!r}, more than "
                   f"MAX_INPUT_TOKENS tokens can hold ({limit} characters); shorten it", param)


def _turns(items: list) -> list[dict]:
    """Input items -> chat turns for the template (see the module docstring)."""
    turns: list[dict] = []
    reasoning: list[str] = []  # reasoning text waiting for the assistant turn it belongs to
    for i, item in enumerate(items):
        if isinstance(item, ReasoningItem):
            reasoning.append(item.text())
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            turns.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallOutputItem):
            turns.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item.arguments, f"input[{i}].arguments")}}
            last = turns[-1] if turns else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        if turns[-1]["role"] == "assistant" and reasoning:
            previous = turns[-1].get("reasoning_content")
            turns[-1]["reasoning_content"] = "\n\n".join(([previous] if previous else []) + reasoning)
            reasoning = []
    return turns


def _arguments(text: str, param: str) -> dict:
    try:
        value = decode_json(text.encode("utf-8"), what=repr(param), code="invalid_value")
    except ApiError as error:
        raise ApiError(400, error.code, error.message, param) from None
    if not isinstance(value, dict):
        raise ApiError(400, "invalid_value", f"{param!r} must be a JSON object (as text)", param)
    return value


def _check_call_ids(prior: list[dict], items: list) -> None:
    """Every function_call_output answers a call made before it in the conversation (OpenAI refuses the
    others)."""
    known = {c["id"] for t in prior for c in t.get("tool_calls") or ()}
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            known.add(item.call_id)
        elif isinstance(item, FunctionCallOutputItem) and item.call_id not in known:
            raise ApiError(400, "invalid_value", f"'input[{i}].call_id' {echo(item.call_id)} answers no function call "
                           "of the conversation", f"input[{i}].call_id")


def _structured_output(call: ResponsesBody, limits: Limits) -> tuple[Constraint | None, ToolPlan | None, str]:
    """text.format, tools, tool_choice, parallel_tool_calls -> (text.format's constraint, the plan of the
    tools (``llm_api.api.constraints.plan_tools``, errors named in the Responses shape), the tool choice)."""
    constraint = None
    fmt = call.text.format if call.text is not None else None
    if fmt is not None and fmt.type != "json_schema":
        for name in ("name", "schema_", "description", "strict"):
            if getattr(fmt, name) is not None:
                shown = name.rstrip("_")
                raise ApiError(400, "invalid_value", f"'text.format.{shown}' is only allowed with type json_schema",
                               f"text.format.{shown}")
    if fmt is not None and fmt.type == "json_schema":
        for name, value in (("name", fmt.name), ("schema", fmt.schema_)):
            if value is None:
                raise ApiError(400, "missing_required_parameter", f"'text.format.{name}' is required with type "
                               "json_schema", f"text.format.{name}")
        constraint = json_schema_constraint(fmt.schema_, "text.format.schema")  # type: ignore[arg-type]
    elif fmt is not None and fmt.type == "json_object":
        constraint = json_object_constraint("text.format")

    choice = _tool_choice(call.tool_choice, call.tools)
    if not call.tools or choice == "none":
        return constraint, None, choice  # none: the tools are not rendered, so no call can be made
    # With tools, OpenAI's rule: auto answers in text that follows text.format, or calls; a forced call ignores it.
    text_schema = None
    if fmt is not None and fmt.type == "json_schema":
        text_schema = fmt.schema_ if isinstance(fmt.schema_, dict) else {"type": "object"}
    elif fmt is not None and fmt.type == "json_object":
        text_schema = {"type": "object"}
    # plan_tools takes chat's shape ({"type": "function", "function": {...}}) and names its errors so
    # (tools[i].function.parameters); the Responses names drop the ".function".
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in call.tools]
    try:
        plan = plan_tools(tools, choice, call.parallel_tool_calls, limits, text_schema)
    except ApiError as error:
        raise _responses_names(error) from None
    parts = tuple((param.replace(".function.", "."), spec) for param, spec in plan.constraint.parts)
    return constraint, replace(plan, constraint=Constraint(plan.constraint.spec, plan.constraint.param, parts)), choice


def _responses_names(error: ApiError) -> ApiError:
    param = error.param.replace(".function.", ".") if error.param else None
    return ApiError(error.status, error.code, error.message.replace(".function.", "."), param)


def _tool_choice(value: Any, tools: list[FunctionTool] | None) -> str:
    """tool_choice -> "none" | "auto" | "required" | the name of the function to call."""
    keyword = tool_choice_keyword(value, bool(tools), '{"type": "function", "name": ...}')
    if keyword is not None:
        return keyword
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(value, dict) and kind != "function":
        raise ApiError(400, "unsupported_parameter", f"'tool_choice.type' {echo(kind)} is not served here: only "
                       "none, auto, required or {\"type\": \"function\", \"name\": ...}", "tool_choice.type")
    name = value.get("name") if isinstance(value, dict) else None
    if not isinstance(value, dict) or set(value) != {"type", "name"} or not isinstance(name, str):
        raise ApiError(400, "invalid_value", "'tool_choice' must be none, auto, required or "
                       "{\"type\": \"function\", \"name\": ...}", "tool_choice")
    if not any(t.name == name for t in tools or ()):
        raise ApiError(400, "invalid_value", f"'tool_choice' names the function {echo(name)}, which is not in 'tools'",
                       "tool_choice.name")
    return name


def _tool_choice_echo(choice: str) -> str | dict:
    return choice if choice in TOOL_CHOICES else {"type": "function", "name": choice}


def _format_echo(text: TextConfig | None) -> dict:
    fmt = text.format if text is not None else None
    if fmt is None:
        return {"type": "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)


# -------------------------------------------------------------------------------------------------
# answer


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


@dataclass
class ResponsesCall:
    """One accepted /v1/responses call: the AnswerEncoder of its answer and what the store needs.

    ``input_turns``: the new input as chat turns; ``settings``: the request's settings the Response
    object echoes. Built by ``parse_responses``."""

    model: str
    stream: bool
    store: bool = True
    background: bool = False  # answered at once (status queued) and run on; polled with GET
    tool_format: ToolFormat | None = None
    previous_response_id: str | None = None
    reasoning_format: ReasoningFormat | None = None  # a reasoning model's: the think block is a reasoning item
    instructions: str | None = None
    input_turns: list[dict] = field(default_factory=list)
    input_items: list = field(default_factory=list)  # the parsed input items (call ids are checked on them)
    settings: dict = field(default_factory=dict)
    id: str = field(default_factory=lambda: _new_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    prior_turns: list[dict] = field(default_factory=list)  # a stored conversation this call continues
    _items: list[dict] = field(default_factory=list)  # the output items, in order (updated in place)
    _open: dict | None = None  # the item text or arguments are being added to
    _sequence: int = 0
    _started: bool = False
    _parser: ToolCallParser | None = None
    _thinking: ReasoningParser | None = None  # splits the think block off first (a reasoning model)
    _num_reasoning_tokens: int = 0  # generated tokens whose text was the think block (its tags included)
    _num_unsorted_tokens: int = 0  # tokens of text the reasoning parser holds back, not yet known to be either
    _pieces: list[str] = field(default_factory=list)  # the open item's text or arguments (joined at its end)
    _status: str = "in_progress"
    _incomplete_reason: str | None = None
    _error: dict | None = None
    _usage: dict | None = None
    _completed_at: int | None = None

    # -- the store's hooks ------------------------------------------------------------------------

    def continue_from(self, prior_turns: list[dict], request: GenerateRequest) -> None:
        """Continue a stored conversation (``previous_response_id``): ``request.messages`` becomes this
        call's instructions, ``prior_turns`` (what ``conversation()`` returned for that response) and the
        new input. Raises ApiError (400) when a function_call_output answers no call of the conversation."""
        _check_call_ids(prior_turns, self.input_items)
        self.prior_turns = list(prior_turns)
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        request.messages = system + self.prior_turns + self.input_turns

    def output_items(self) -> list[dict]:
        """The answer's output items (message and function_call items) as in the Response object, once
        ``finish`` or ``fail`` ran."""
        return [dict(item) for item in self._items]

    def response_json(self) -> dict:
        """The Response object as it stands (complete after ``finish`` or ``fail``)."""
        return self._response()

    def conversation(self) -> list[dict]:
        """The conversation to store for a later ``previous_response_id``: the prior turns, this input and
        the answer, as chat turns (no instructions: a continuation brings its own)."""
        answer: list[dict] = []
        reasoning = None  # the think block, for the assistant turn that follows it (interleaved thinking)
        for item in self._items:
            if item["type"] == "reasoning":
                reasoning = item["content"][0]["text"]
                continue
            if item["type"] == "message":
                answer.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
                continue
            try:
                arguments: Any = json.loads(item["arguments"])
            except ValueError:  # a call cut short by the token limit
                arguments = item["arguments"]
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                             "arguments": arguments}}
            if answer and answer[-1]["role"] == "assistant":
                answer[-1].setdefault("tool_calls", []).append(call)
            else:
                answer.append({"role": "assistant", "content": "", "tool_calls": [call]})
        if reasoning is not None:
            if not answer:  # cut inside the reasoning: an assistant turn of thinking only
                answer.append({"role": "assistant", "content": ""})
            answer[0]["reasoning_content"] = reasoning
        return self.prior_turns + self.input_turns + answer

    # -- AnswerEncoder ----------------------------------------------------------------------------

    @property
    def content_type(self) -> str:
        return SSE_CONTENT_TYPE if self.stream else JSON_CONTENT_TYPE

    def delta(self, text: str, index: int = 0, logprobs: tuple[LogprobItem, ...] = (), num_tokens: int = 0) -> str:
        out = self._start()
        if self.reasoning_format is None:
            return out + self._answer(text) if text else out
        if self._thinking is None:
            self._thinking = ReasoningParser(self.reasoning_format)
        self._num_unsorted_tokens += num_tokens
        if not text:
            return out
        thinking = self._thinking
        was_ended = thinking.reasoning_ended
        events = thinking.push(text)
        self._sort_tokens(events, thinking.in_reasoning or thinking.reasoning_ended and not was_ended)
        return out + self._split(events)

    def _sort_tokens(self, events: list[ReasoningText | AnswerText], in_reasoning: bool) -> None:
        """The tokens of the text just pushed (and of text held before it) are reasoning tokens when it gave
        reasoning text, or is still inside (or just closed) the think block; answer tokens when it gave
        answer text only; else the parser holds it all back and the next text decides."""
        if in_reasoning or any(isinstance(e, ReasoningText) for e in events):
            self._num_reasoning_tokens += self._num_unsorted_tokens
            self._num_unsorted_tokens = 0
        elif events:
            self._num_unsorted_tokens = 0

    def _split(self, events: list[ReasoningText | AnswerText]) -> str:
        return "".join(self._answer(e.text) if isinstance(e, AnswerText) else self._reasoning(e.text) for e in events)

    def _answer(self, text: str) -> str:
        if self.tool_format is None:
            return self._text(text)
        if self._parser is None:
            self._parser = ToolCallParser(self.tool_format)
        return self._parsed(self._parser.push(text))

    def choice_finish(self, index: int, reason: FinishReason, num_generated_tokens: int = 0) -> str:
        return ""  # one choice: everything ends in finish

    def finish(self, reason: FinishReason, num_prompt_tokens: int, num_generated_tokens: int,
               num_cached_tokens: int = 0) -> str:
        out = self._start()
        if self._thinking is not None:
            events = self._thinking.finish()
            self._sort_tokens(events, False)
            out += self._split(events)
        if self._parser is not None:
            out += self._parsed(self._parser.finish())
        cut = reason is FinishReason.LENGTH
        out += self._close("incomplete" if cut else "completed")
        self._status = {FinishReason.LENGTH: "incomplete", FinishReason.ABORT: "cancelled"}.get(reason, "completed")
        self._incomplete_reason = "max_output_tokens" if cut else None
        if self._status == "completed":
            self._completed_at = int(time.time())
        self._usage = {"input_tokens": num_prompt_tokens, "output_tokens": num_generated_tokens,
                       "total_tokens": num_prompt_tokens + num_generated_tokens,
                       # cached: the prompt tokens the engine found in its prefix cache (cache_write_tokens,
                       # which the openai package requires, is a billing figure: 0)
                       "input_tokens_details": {"cached_tokens": num_cached_tokens, "cache_write_tokens": 0},
                       "output_tokens_details": {"reasoning_tokens": min(self._num_reasoning_tokens,
                                                                         num_generated_tokens)}}
        if not self.stream:
            return json.dumps(self._response(), ensure_ascii=False)
        kind = "response.completed" if self._status == "completed" else "response.incomplete"
        return out + self._event(kind, response=self._response())

    def fail(self, error: ApiError) -> str:
        """An error after the answer began: in a stream, ``error`` then ``response.failed``. A cancel (the
        service ends a cancelled request with its 499 ``cancelled`` error) is no failure: the response is
        ``cancelled``, as the docs say, and a stream ends with ``response.incomplete``."""
        if error.code == "cancelled":
            self._status, self._error = "cancelled", None
            if not self.stream:
                return json.dumps(self._response(), ensure_ascii=False)
            out = self._start() + self._close("incomplete")
            return out + self._event("response.incomplete", response=self._response())
        self._status = "failed"
        self._error = {"code": "server_error" if error.status >= 500 else "invalid_prompt", "message": error.message}
        if not self.stream:
            return json.dumps(self._response(), ensure_ascii=False)
        out = self._start() + self._close("incomplete", events=False)
        # OpenAI's shape (fields at the top). OpenResponses' schema nests them in an ``error`` object, but
        # the openai package raises on any event whose data has an ``error`` key instead of yielding it.
        out += self._event("error", code=error.code, message=error.message, param=error.param)
        return out + self._event("response.failed", response=self._response())

    def refusal(self, error: ApiError) -> str:
        return error.openai_text()

    # -- events -----------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def _start(self) -> str:
        if self._started:
            return ""
        self._started = True
        if not self.stream:
            return ""
        return (self._event("response.created", response=self._response())
                + self._event("response.in_progress", response=self._response()))

    def _parsed(self, events: list[str | ToolCallDelta]) -> str:
        out = ""
        for event in events:
            if isinstance(event, str):
                out += self._text(event)
            elif event.id is not None:
                out += self._close("completed")
                item = {"id": _new_id("fc_"), "type": "function_call", "status": "in_progress", "arguments": "",
                        "call_id": event.id, "name": event.name}
                out += self._add(item) + self._arguments(event.arguments)
            else:
                out += self._arguments(event.arguments)
        return out

    def _add(self, item: dict) -> str:
        self._items.append(item)
        self._open = item
        return self._event("response.output_item.added", output_index=len(self._items) - 1, item=dict(item)) \
            if self.stream else ""

    def _reasoning(self, text: str) -> str:
        """Text of the think block: a reasoning item (one reasoning_text part), before the answer's items."""
        out = ""
        item = self._open
        if item is None or item["type"] != "reasoning":
            out += self._close("completed")
            item = {"id": _new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            out += self._add(item)
            item["content"].append({"type": "reasoning_text", "text": ""})
            if self.stream:
                out += self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self._items) - 1, content_index=0,
                                   part={"type": "reasoning_text", "text": ""})
        self._pieces.append(text)
        if self.stream:
            out += self._event("response.reasoning_text.delta", item_id=item["id"],
                               output_index=len(self._items) - 1, content_index=0, delta=text)
        return out

    def _text(self, text: str) -> str:
        out = ""
        item = self._open
        if item is None or item["type"] != "message":
            out += self._close("completed")
            item = {"id": _new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            out += self._add(item)  # (the added event shows it with no content yet, as OpenAI's)
            item["content"].append(_output_text(""))
            if self.stream:
                out += self._event("response.content_part.added", item_id=item["id"],
                                   output_index=len(self._items) - 1, content_index=0, part=_output_text(""))
        self._pieces.append(text)
        if self.stream:
            out += self._event("response.output_text.delta", item_id=item["id"],
                               output_index=len(self._items) - 1, content_index=0, delta=text, logprobs=[])
        return out

    def _arguments(self, piece: str) -> str:
        if not piece:
            return ""
        assert self._open is not None and self._open["type"] == "function_call"  # (the parser named the call first)
        self._pieces.append(piece)
        if not self.stream:
            return ""
        return self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                           output_index=len(self._items) - 1, delta=piece)

    def _close(self, status: str, events: bool = True) -> str:
        """The open item ends with ``status`` (a call the parser did not see complete: incomplete)."""
        item, self._open = self._open, None
        if item is None:
            return ""
        text = "".join(self._pieces)
        self._pieces = []
        if item["type"] == "function_call":
            item["arguments"] = text
        else:
            item["content"][0]["text"] = text
        if item["type"] == "function_call":
            complete = self._parser is not None and any(
                c.id == item["call_id"] and c.complete for c in self._parser.calls)
            status = status if complete else "incomplete"
        item["status"] = status
        if not (self.stream and events):
            return ""
        output_index = len(self._items) - 1
        out = ""
        if item["type"] == "message":
            part = item["content"][0]
            out += self._event("response.output_text.done", item_id=item["id"], output_index=output_index,
                               content_index=0, text=part["text"], logprobs=[])
            out += self._event("response.content_part.done", item_id=item["id"], output_index=output_index,
                               content_index=0, part=dict(part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            out += self._event("response.reasoning_text.done", item_id=item["id"], output_index=output_index,
                               content_index=0, text=part["text"])
            out += self._event("response.content_part.done", item_id=item["id"], output_index=output_index,
                               content_index=0, part=dict(part))
        else:
            out += self._event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=output_index, name=item["name"], arguments=item["arguments"])
        return out + self._event("response.output_item.done", output_index=output_index, item=_copy(item))

    def _response(self) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": self._completed_at,
            "status": self._status,
            "error": self._error,
            "incomplete_details": {"reason": self._incomplete_reason} if self._incomplete_reason else None,
            "model": self.model,
            "output": [_copy(item) for item in self._items] if self._status != "in_progress" else [],
            "usage": self._usage,
            **self.settings,
        }


def _output_text(text: str) -> dict:
    """An output_text part (no annotations are made and no logprobs returned here: both empty)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict) -> dict:
    if item["type"] in ("message", "reasoning"):
        return {**item, "content": [dict(p) for p in item["content"]]}
    return dict(item)
