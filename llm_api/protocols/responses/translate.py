"""The OpenAI Responses API (``POST /v1/responses``): a body -> ``GenerateRequest`` and its encoder (no server
here). The body's models are in ``schema``, the encoder (``ResponsesCall``) in ``encoder``, the routes in ``route``.

Contract (docs/responses.md has the user's view):

* ``parse_responses(body, model_name, limits)`` validates a body (JSON bytes or a decoded object) into
  a ``GenerateRequest`` (chat messages for the template, sampling parameters, the structured-output or
  tool constraint) and a ``ResponsesCall``, the ``AnswerEncoder`` (``llm_api.service.encoding``) of this
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
  owns the store looks it up and calls ``continued(request, call, stored_turns)``: the request whose
  messages are the instructions, the stored turns and the new input. After the answer,
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
  ends it (the route does this: ``route``).
* ``ignore_eos`` (vLLM's extension, as on chat; true/false): the answer runs to ``max_output_tokens``
  (status incomplete, reason ``max_output_tokens``); refused with ``text.format`` json or tools' grammar.
* With tools, ``llm_api.service.constraints.plan_tools`` decides how they are served, as on chat (the
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

from dataclasses import replace
from typing import Any, Collection

from pydantic import ValidationError

from llm_api.errors import ApiError, echo
from llm_api.protocols.common.checks import (TOOL_CHOICES, apply_output, call_arguments, check_priority,
                                             tool_choice_keyword)
from llm_api.protocols.common.fields import field_path, first_error, is_type_error, message_of, unknown_fields
from llm_api.protocols.common.openai import api_error, check_model, decode_body
from llm_api.protocols.common.sampling import check_token_range, to_sampling_params
from llm_api.protocols.responses.encoder import ResponsesCall
from llm_api.protocols.responses.schema import (ITEM_TYPES, MAX_CHARS_PER_INPUT_TOKEN, MAX_INPUT_ITEMS, MAX_PARTS,
                                                MAX_TOOLS, MEDIA_PART_TYPES, TAG_MARK, FunctionCallItem,
                                                FunctionCallOutputItem, FunctionTool, MessageItem, ReasoningItem,
                                                ResponsesBody, TextConfig, check_call_ids)
from llm_api.service.constraints import ToolPlan, json_object_constraint, json_schema_constraint, plan_tools
from llm_api.service.request import DEFAULT_MAX_NEW_TOKENS, GenerateRequest, Limits, ModelNames, WorkFields, adapter_of
from llm_api.structured.spec import Constraint
from llm_api.text.reasoning import template_variables


def continued(request: GenerateRequest, call: ResponsesCall, prior_turns: list[dict]) -> GenerateRequest:
    """``request`` continuing the stored conversation ``prior_turns`` (``previous_response_id``): its
    messages become the call's instructions, the prior turns and the new input; ``call`` stores them again
    with its answer. ApiError (400) when a function_call_output answers no call of the conversation."""
    call.continue_from(prior_turns)
    return replace(request, messages=call.prompt_turns())


def parse_responses(body: Any, model_name: ModelNames, limits: Limits,
                    adapters: Collection[str] = ()) -> tuple[GenerateRequest, ResponsesCall]:
    """A ``/v1/responses`` body (bytes or an already decoded object) -> our request and its encoder
    (``model``: the base model or one of the LoRA ``adapters``)."""
    data = decode_body(body)
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
        check_call_ids([], items)

    max_tokens = call.max_output_tokens
    check_token_range(max_tokens, "max_output_tokens", limits)
    temperature = 1.0 if call.temperature is None else call.temperature
    request = GenerateRequest(stream=True)  # the service always streams; the call encodes the answer
    # Without max_output_tokens: the native API's default (OpenAI's "until the model stops" would
    # reserve MAX_NEW_TOKENS of KV cache per request).
    request.params = to_sampling_params(
        max_tokens=max_tokens, default_max_tokens=DEFAULT_MAX_NEW_TOKENS, limits=limits, temperature=call.temperature,
        top_p=call.top_p, ignore_eos=call.ignore_eos, presence_penalty=call.presence_penalty,
        frequency_penalty=call.frequency_penalty)
    request.work_fields = WorkFields("n", "max_output_tokens", "include")
    constraint, plan, choice = _structured_output(call, limits)
    effort = call.reasoning.effort if call.reasoning else None
    tool_format = apply_output(request, constraint, plan, ignore_eos=call.ignore_eos, format_field="text.format",
                               limits=limits)
    request.template_kwargs = template_variables(None, effort, "reasoning.effort")
    system = [{"role": "system", "content": call.instructions}] if call.instructions is not None else []
    request.messages = system + input_turns  # (the encoder's prompt_turns() before any continuation)

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
    request.adapter, request.adapter_param = adapter_of(call.model, model_name), "model"
    request.priority = check_priority(call.priority, limits)
    if call.background and not call.store:
        raise ApiError(400, "invalid_value", "'background' needs 'store' (a background response is read back "
                       "with GET /v1/responses/{id})", "background")
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
                    "function": {"name": item.name, "arguments": call_arguments(item.arguments, f"input[{i}].arguments")}}
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


def _structured_output(call: ResponsesBody, limits: Limits) -> tuple[Constraint | None, ToolPlan | None, str]:
    """text.format, tools, tool_choice, parallel_tool_calls -> (text.format's constraint, the plan of the
    tools (``llm_api.service.constraints.plan_tools``, errors named in the Responses shape), the tool choice)."""
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
