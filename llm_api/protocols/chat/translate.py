"""The OpenAI-compatible API: request translation and response encoding (no TorchServe here; the paths
are in the one route table, ``llm_api.protocols.table``). Contract:

* ``POST v1/completions`` and ``POST v1/chat/completions``: the body (JSON bytes) is validated by
  ``parse_chat`` / ``parse_completions`` into a ``GenerateRequest`` (our native request) plus an ``OpenAICall`` that knows how
  to encode the answer. The parameters OpenAI clients send are accepted (``model``, ``prompt`` /
  ``messages``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``n`` (1 to
  MAX_NUM_SEQS), ``presence_penalty`` / ``frequency_penalty`` (-2 to 2), ``logit_bias`` (token id ->
  -100 to 100, ids below the vocabulary size), ``logprobs`` (chat: true/false with ``top_logprobs`` 0 to
  20; completions: 0 to 5), ``stop``, ``seed``, ``stream``, ``stream_options.include_usage``, ``user``,
  and vLLM's extra ``ignore_eos``: true/false, clients send it in ``extra_body``; the answer then runs to
  the token limit, finish reason ``length``; refused with ``response_format`` or a tool grammar, as natively);
  parameters we cannot honour are refused by name rather than silently ignored. ``best_of`` and ``suffix``
  (completions) are taken only at their neutral values (null or 1, null or ""). What ``n``, the
  token limit, the logprobs and the prompt may cost together is bounded by MAX_REQUEST_WORK
  (``llm_api.service.admission.request_work``): a request over it gets 400 ``work_limit_exceeded`` naming them.
* ``n`` > 1: every choice and chunk carries its ``index``; a stream interleaves the choices' chunks, each
  choice ends with its own ``finish_reason`` chunk; ``usage`` counts the tokens of all choices. With a
  ``seed``, choice 0 is what n = 1 would give and the others are seeded from it (distinct, reproducible).
* logprobs (``llm_api.text.logprobs``): with the text they belong to, in every chunk of a stream and in
  the answer's choices (chat: ``logprobs.content``; completions: ``tokens``, ``token_logprobs``,
  ``top_logprobs``, ``text_offset``).
* Structured output and tools (chat): ``response_format`` (``text``, ``json_object``, ``json_schema``)
  becomes a grammar the answer must follow (``llm_api.service.constraints``). ``tools`` are rendered by the
  model's chat template and, with ``tool_choice`` ``auto`` (the default with tools), ``required`` or a
  named function, the answer runs under the tool grammar of the model's format (``llm_api.text.tools``);
  ``none`` renders no tools and allows no call. A template without a tool format (the embedded SmolLM2)
  gets every choice in the generic form (the tools listed in a system block, a call decoded as
  ``{"name", "arguments"}`` under the tool's schema; with ``auto`` the model answers in text or starts a
  call; GENERIC_TOOL_CHOICE_AUTO=false refuses ``auto`` there, as vLLM without a tool parser). With
  ``response_format`` beside tools, ``auto`` answers in text that follows the format or with calls, and
  a forced call ignores the format (OpenAI's rule). Calls in the answer are parsed into ``tool_calls``
  (streamed as ``delta.tool_calls`` with the arguments in pieces) and the finish reason is
  ``tool_calls``. Messages may carry a conversation's earlier calls: assistant ``tool_calls`` and
  ``role: "tool"`` results (``tool_call_id``).
* Chat fields the openai package and agent frameworks send, accepted: ``store`` and ``metadata`` (at most
  16 string pairs; nothing is stored: a chat completion cannot be read back, use the Responses API's
  ``store`` for that), ``service_tier`` (echoed in the answer and every chunk; every request runs alike),
  ``modalities`` (``["text"]`` only), ``prediction`` (``{"type": "content", "content"}``; not used to draft:
  the n-gram drafter already proposes from the prompt). Any other unknown field is a 400 naming it.
* Reasoning models (``llm_api.text.reasoning``): ``chat_template_kwargs`` (an object of at most 16
  identifier keys and 8 KiB of JSON) are extra variables of the chat template's render;
  ``reasoning_effort`` (none | minimal | low | medium | high | xhigh) reaches the template as the variable
  ``reasoning_effort``, and "none" also as ``enable_thinking`` false (Qwen3's switch); a kwarg that
  contradicts it is refused. When the model has a reasoning parser (``Limits.reasoning_format``), each
  choice's text is split first: the think block goes out as ``reasoning`` and ``reasoning_content``
  (both names, the same text; ``delta.reasoning`` / ``delta.reasoning_content`` when streaming), only the
  answer as ``content`` (null when the output ended inside the reasoning) and through the tool-call
  parser; the structured-output grammar applies to the answer only. Assistant messages may carry
  ``reasoning`` or ``reasoning_content`` (the same text if both): the template gets it as
  ``reasoning_content``.
* ``GET v1/models``: ``llm_api.protocols.common.openai.models_list``. ``GET v1/health``: see ``llm_api.service.metrics.Health``.
* Streaming answers are server-sent events (``text/event-stream``): one ``data: {chunk}`` per text
  delta, a last chunk carrying ``finish_reason`` (and ``usage`` when asked for), then ``data: [DONE]``.
  Non-streaming answers are one JSON object with ``usage``.
* Every error is an ``ApiError`` rendered as ``{"error": {"message", "type", "param", "code"}}`` with
  its HTTP status; after a stream began, the error is an SSE event of that shape, followed by
  ``data: [DONE]`` (the openai client raises ``APIError`` on it).
"""

from __future__ import annotations

from typing import Any, Collection

from llm_api.errors import ApiError, echo
from llm_api.protocols.chat.schema import ChatBody, ChatMessage, ToolDefinition
from llm_api.protocols.common.checks import apply_output, call_arguments, check_priority, tool_choice_keyword
from llm_api.protocols.common.openai import validate_call
from llm_api.protocols.common.openai_call import OpenAICall
from llm_api.protocols.common.sampling import check_token_range, to_sampling_params
from llm_api.service.constraints import ToolPlan, json_object_constraint, json_schema_constraint, plan_tools
from llm_api.service.request import DEFAULT_MAX_NEW_TOKENS, GenerateRequest, Limits, ModelNames, WorkFields, adapter_of
from llm_api.structured.spec import Constraint
from llm_api.text.reasoning import template_variables


def parse_chat(body: Any, model_name: ModelNames, limits: Limits, adapters: Collection[str] = (),
               marker: str = "") -> tuple[GenerateRequest, OpenAICall]:
    """A chat body (bytes or an already decoded object) -> our request and the encoder of its answer. ``model``
    is the base model's name or one of the LoRA ``adapters`` (the answer names the one asked); ``marker``:
    the native end-of-stream marker, which the encoder keeps out of its error texts."""
    call, _ = validate_call(ChatBody, body, model_name, limits, adapters)
    request = GenerateRequest(stream=True)  # the handler streams internally; the call encodes the answer
    if call.top_logprobs and not call.logprobs:
        raise ApiError(400, "invalid_value", "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (call.top_logprobs or 0) if call.logprobs else None
    _check_tool_call_arguments(call.messages)
    _check_reasoning(call.messages)
    request.messages = [m.to_turn() for m in call.messages]
    request.template_kwargs = template_variables(call.chat_template_kwargs, call.reasoning_effort)
    output = _structured_output(call, limits)
    plan, constraint = (output, None) if isinstance(output, ToolPlan) else (None, output)
    tool_format = apply_output(request, constraint, plan, ignore_eos=call.ignore_eos, format_field="response_format",
                               limits=limits)
    max_tokens, param = ((call.max_completion_tokens, "max_completion_tokens") if call.max_completion_tokens
                         is not None else (call.max_tokens, "max_tokens"))
    check_token_range(max_tokens, param, limits, note=" (0 only with 'echo')")
    request.params = to_sampling_params(
        max_tokens=max_tokens, default_max_tokens=DEFAULT_MAX_NEW_TOKENS, limits=limits,
        temperature=call.temperature, top_p=call.top_p, presence_penalty=call.presence_penalty,
        frequency_penalty=call.frequency_penalty, logit_bias=call.logit_bias, seed=call.seed, stop=call.stop,
        ignore_eos=call.ignore_eos, logprobs=logprobs, n=call.n)
    request.work_fields = WorkFields("n", param, "top_logprobs")
    request.adapter, request.adapter_param = adapter_of(call.model, model_name), "model"
    request.priority = check_priority(call.priority, limits)
    include_usage = call.stream_options is not None and call.stream_options.include_usage
    return request, OpenAICall(kind="chat", marker=marker, model=call.model, stream=call.stream, include_usage=include_usage,
                               n=call.n, with_logprobs=logprobs is not None, tool_format=tool_format,
                               reasoning_format=limits.reasoning_format, service_tier=call.service_tier)


def _check_reasoning(messages: list[ChatMessage]) -> None:
    for i, message in enumerate(messages):
        if message.reasoning is not None and message.reasoning_content is not None and \
                message.reasoning != message.reasoning_content:
            param = f"messages[{i}].reasoning_content"
            raise ApiError(400, "invalid_value", f"{param!r} differs from 'messages[{i}].reasoning': send the "
                           "thinking once, in either field", param)


def _check_tool_call_arguments(messages: list[ChatMessage]) -> None:
    for i, message in enumerate(messages):
        for j, item in enumerate(message.tool_calls or ()):
            call_arguments(item.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")


def _structured_output(call: ChatBody, limits: Limits) -> Constraint | ToolPlan | None:
    """response_format, tools, tool_choice, parallel_tool_calls -> the response format's constraint, or the
    plan of the tools (``llm_api.service.constraints.plan_tools``: with ``auto`` a text answer follows the
    response format; a forced call ignores it, as OpenAI does), or None."""
    constraint = None
    text_schema = None  # the response format as a JSON schema (for a text answer beside tools)
    response_format = call.response_format
    if response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise ApiError(400, "missing_required_parameter", "'response_format.json_schema' is required when "
                           "'response_format.type' is json_schema", "response_format.json_schema")
        schema = response_format.json_schema.schema_
        constraint = (json_schema_constraint(schema, "response_format.json_schema.schema") if schema is not None
                      else json_object_constraint("response_format"))
        text_schema = schema if schema is not None else {"type": "object"}
    elif response_format is not None and response_format.json_schema is not None:
        raise ApiError(400, "invalid_value", "'response_format.json_schema' is only allowed with type json_schema",
                       "response_format.json_schema")
    elif response_format is not None and response_format.type == "json_object":
        constraint = json_object_constraint("response_format")
        text_schema = {"type": "object"}

    choice = _tool_choice(call.tool_choice, call.tools)
    if not call.tools or choice == "none":
        return constraint  # "none": the tools are not rendered, so no call can be made
    tools = [t.model_dump(exclude_none=True) for t in call.tools]
    return plan_tools(tools, choice, call.parallel_tool_calls, limits, text_schema)


def _tool_choice(value: Any, tools: list[ToolDefinition] | None) -> str:
    """tool_choice -> "none" | "auto" | "required" | the name of the function to call."""
    keyword = tool_choice_keyword(value, bool(tools), '{"type": "function", "function": {"name": ...}}')
    if keyword is not None:
        return keyword
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if (not isinstance(value, dict) or set(value) != {"type", "function"} or value["type"] != "function"
            or set(function or ()) != {"name"} or not isinstance(name, str)):
        raise ApiError(400, "invalid_value", "'tool_choice' must be none, auto, required or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if not any(t.function.name == name for t in tools or ()):
        raise ApiError(400, "invalid_value", f"'tool_choice' names the function {echo(name)}, which is not in 'tools'",
                       "tool_choice.function.name")
    return name
