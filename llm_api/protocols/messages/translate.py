"""Anthropic's Messages API: a body becomes our request (``parse_messages``, ``parse_count_tokens``); the
answer's encoder is ``llm_api.protocols.messages.encoder.MessagesCall``. Contract:

* ``POST v1/messages`` (also with ``?beta=true``, as Claude Code sends it; ``anthropic-version`` and
  ``anthropic-beta`` headers are accepted and change nothing): ``model`` (the base model or a LoRA
  adapter), ``max_tokens`` (required; a ceiling, as Anthropic means it: above MAX_NEW_TOKENS, or above
  what the KV cache holds after the prompt, the answer is cut there with ``stop_reason`` max_tokens),
  ``messages`` (``user``, ``assistant`` and, as Claude Code sends since 2.1.154, ``system`` turns, each a
  string or blocks), ``system`` (a string or text blocks), ``stop_sequences`` (at most 16),
  ``temperature`` (0 to 1), ``top_p``, ``top_k``, ``stream``, ``metadata.user_id``, ``tools`` (client
  tools: ``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto``, ``any``, ``tool`` with
  ``name``, ``none``; ``disable_parallel_tool_use``), ``thinking`` and ``output_config``
  (``effort``; ``format`` ``json_schema``: the answer follows the schema). Several text blocks of one
  turn are joined by a blank line. A final ``assistant`` turn (prefill) is refused: the chat template
  would open a new turn after it instead of continuing it.
* Blocks: ``text``; ``tool_use`` (assistant: the call's ``input`` object becomes the turn's tool call);
  ``tool_result`` (user: its text becomes a ``tool`` turn answering ``tool_use_id``, which must name a
  ``tool_use`` of an earlier assistant turn; ``is_error`` prefixes the text with ``Error: ``), placed
  before the turn's text; ``thinking`` (assistant: the template's ``reasoning_content``);
  ``redacted_thinking`` (left out: it is encrypted for Anthropic's models). Images, documents and server
  tools are refused by name (this server serves text models and runs no tools).
* Tools run as on chat completions (``llm_api.service.constraints.plan_tools``): rendered by the chat template
  in its tool format, or in the generic form for a template without one; the answer runs under the tool
  grammar and its calls come back as ``tool_use`` blocks (``stop_reason`` tool_use). ``any`` is chat's
  ``required``; several calls in one answer unless ``disable_parallel_tool_use`` (the generic form makes one
  call unless parallel calls are asked for in so many words: Anthropic's default does not say).
* ``thinking``: ``enabled`` (``budget_tokens`` below ``max_tokens``, as Anthropic requires; the budget is
  not enforced apart from ``max_tokens``) and ``disabled`` reach the chat template as ``enable_thinking``
  (Qwen3's switch); ``adaptive`` leaves the template's default. ``output_config.effort`` reaches it as
  ``reasoning_effort``. A reasoning model's think block comes back as a ``thinking`` block (its
  ``signature`` empty: nothing here signs).
* ``POST v1/messages/count_tokens``: the same body without the generation fields -> ``{"input_tokens"}``,
  the prompt's tokens exactly as ``v1/messages`` renders it (tools included).
* Errors: ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's type for the status
  (``llm_api.errors.ANTHROPIC_ERROR_TYPES``); a stream that breaks after it began ends with an
  ``error`` event. Auth: ``x-api-key`` as well as ``Authorization: Bearer`` (``llm_api.service.owners``).
"""

from __future__ import annotations

from typing import Any, Collection

from pydantic import BaseModel, ValidationError

from llm_api.errors import ApiError, echo
from llm_api.protocols.common.checks import apply_output
from llm_api.protocols.common.openai import api_error, check_model, decode_body
from llm_api.protocols.common.sampling import to_sampling_params
from llm_api.protocols.messages.encoder import MessagesCall
from llm_api.protocols.messages.schema import (BLOCKS, UNSERVED_BLOCKS, CountTokensBody, Message, MessagesBody,
                                               TextBlock, ToolDefinition, ToolResultBlock, ToolUseBlock)
from llm_api.service.constraints import ToolPlan, json_schema_constraint, plan_tools
from llm_api.service.request import GenerateRequest, Limits, ModelNames, WorkFields, adapter_of
from llm_api.structured.spec import Constraint

TEXT_JOIN = "\n\n"  # between the text blocks of one turn
ERROR_PREFIX = "Error: "  # a tool_result with is_error


def parse_messages(body: Any, model_name: ModelNames, limits: Limits, adapters: Collection[str] = (),
                   marker: str = "") -> tuple[GenerateRequest, MessagesCall]:
    """A Messages body (bytes or an already decoded object) -> our request and the encoder of its answer."""
    call = _validated(MessagesBody, decode_body(body))
    check_model(call.model, model_name, adapters)
    if call.max_tokens < 1:
        raise ApiError(400, "invalid_value", "'max_tokens' must be at least 1", "max_tokens")
    if call.thinking is not None and call.thinking.budget_tokens is not None and \
            call.thinking.budget_tokens >= call.max_tokens:
        raise ApiError(400, "invalid_value", "'thinking.budget_tokens' must be below 'max_tokens'",
                       "thinking.budget_tokens")
    request, tool_format = _prompt(call, model_name, limits)
    request.params = to_sampling_params(
        max_tokens=min(call.max_tokens, limits.max_new_tokens), default_max_tokens=limits.max_new_tokens,
        limits=limits, temperature=call.temperature, top_p=call.top_p, top_k=call.top_k,
        stop=call.stop_sequences)
    request.max_tokens_fits = True  # a ceiling: cut to what the KV cache holds after the prompt
    request.work_fields = WorkFields("n", "max_tokens", "logprobs")
    return request, MessagesCall(model=call.model, stream=call.stream, marker=marker, tool_format=tool_format,
                                 reasoning_format=limits.reasoning_format)


def parse_count_tokens(body: Any, model_name: ModelNames, limits: Limits, adapters: Collection[str] = ()
                       ) -> GenerateRequest:
    """A count_tokens body -> the request whose prompt ``v1/messages`` would render from it."""
    call = _validated(CountTokensBody, decode_body(body))
    check_model(call.model, model_name, adapters)
    request, _ = _prompt(call, model_name, limits)
    return request


def _validated(schema: type[BaseModel], data: Any, prefix: str = "") -> Any:
    """``data`` as ``schema``, or the 400 naming the field (below ``prefix``, a block's or a tool's path)."""
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        refusal = api_error(error)
    if prefix:
        param = prefix + ("." + refusal.param if refusal.param else "")
        message = refusal.message if refusal.message.startswith("'") else f"{param!r} {refusal.message}"
        refusal = ApiError(400, refusal.code, message.replace(f"'{refusal.param}'", f"'{param}'", 1)
                           if refusal.param else message, param)
    raise refusal


def _prompt(call: CountTokensBody, model_name: ModelNames, limits: Limits) -> tuple[GenerateRequest, Any]:
    """The request's prompt: turns, tools and their plan, the output format, the template's variables."""
    request = GenerateRequest(stream=True)  # the service streams internally; the call encodes the answer
    request.messages = _turns(call)
    tools = [_tool(i, tool) for i, tool in enumerate(call.tools or ())]
    choice, parallel = _tool_choice(call, tools)
    constraint: Constraint | None = None
    text_schema = None
    output = call.output_config
    if output is not None and output.format is not None:
        constraint = json_schema_constraint(output.format.schema_, "output_config.format.schema")
        text_schema = output.format.schema_
    plan: ToolPlan | None = None
    if tools and choice != "none":
        plan = plan_tools(tools, choice, parallel, limits, text_schema)
    tool_format = apply_output(request, constraint, plan, ignore_eos=False, format_field="output_config.format",
                               limits=limits)
    variables: dict[str, Any] = {}
    if call.thinking is not None and call.thinking.type != "adaptive":
        variables["enable_thinking"] = call.thinking.type == "enabled"
    if output is not None and output.effort is not None:
        variables["reasoning_effort"] = output.effort
    request.template_kwargs = variables or None
    request.adapter, request.adapter_param = adapter_of(call.model, model_name), "model"
    return request, tool_format


def _turns(call: CountTokensBody) -> list[dict]:
    turns: list[dict] = []
    if call.system is not None:
        system = call.system if isinstance(call.system, str) else TEXT_JOIN.join(b.text for b in call.system)
        turns.append({"role": "system", "content": system})
    called: set[str] = set()  # tool_use ids of the assistant turns so far
    for i, message in enumerate(call.messages):
        turns.extend(_message_turns(i, message, called))
    if call.messages[-1].role == "assistant":
        raise ApiError(400, "invalid_value", "the last message is the assistant's (a prefill), which this server "
                       "does not continue; end with a user message", f"messages[{len(call.messages) - 1}]")
    return turns


def _message_turns(i: int, message: Message, called: set[str]) -> list[dict]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    results: list[dict] = []
    calls: list[dict] = []
    thinking: list[str] = []
    for j, raw in enumerate(message.content):
        block = _block(i, j, message.role, raw)
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
            called.add(block.id)
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in called:
                param = f"messages[{i}].content[{j}].tool_use_id"
                raise ApiError(400, "invalid_value", f"{param!r} {echo(block.tool_use_id)} answers no tool_use block "
                               "of an earlier assistant message", param)
            text = _result_text(i, j, block)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": ERROR_PREFIX + text if block.is_error else text})
        elif block.type == "thinking":
            thinking.append(block.thinking)
        # (redacted_thinking: left out)
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": TEXT_JOIN.join(texts)}
        if calls:
            turn["tool_calls"] = calls
        if thinking:
            turn["reasoning_content"] = TEXT_JOIN.join(thinking)  # the name Qwen3's template reads
        return [turn]
    if not texts:
        return results
    return results + [{"role": message.role, "content": TEXT_JOIN.join(texts)}]


def _block(i: int, j: int, role: str, raw: Any) -> Any:
    path = f"messages[{i}].content[{j}]"
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in UNSERVED_BLOCKS:
        article = "an" if kind[0] in "aeiou" else "a"
        raise ApiError(400, "unsupported_value", f"{path!r} is {article} {kind} block; this server reads text, "
                       "tool_use, tool_result and thinking blocks (a text model, no server tools)", f"{path}.type")
    if kind not in BLOCKS:
        raise ApiError(400, "invalid_value", f"'{path}.type' must be one of {', '.join(BLOCKS)}, got {echo(kind)}",
                       f"{path}.type")
    schema, roles = BLOCKS[kind]
    if role not in roles:
        raise ApiError(400, "invalid_value", f"{path!r}: a {kind} block belongs in a "
                       f"{' or '.join(roles)} message, not a {role} one", f"{path}.type")
    return _validated(schema, raw, path)


def _result_text(i: int, j: int, block: ToolResultBlock) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    texts = []
    for k, raw in enumerate(block.content):
        path = f"messages[{i}].content[{j}].content[{k}]"
        if not isinstance(raw, dict) or raw.get("type") != "text":
            raise ApiError(400, "unsupported_value", f"{path!r}: a tool result holds text blocks here (a text "
                           "model)", f"{path}.type")
        texts.append(_validated(TextBlock, raw, path).text)
    return TEXT_JOIN.join(texts)


def _tool(i: int, raw: Any) -> dict:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in (None, "custom"):
        raise ApiError(400, "unsupported_value", f"'tools[{i}]' is the server tool {echo(kind)}; this server runs no "
                       "tools of its own: define client tools (name, description, input_schema)", f"tools[{i}].type")
    tool = _validated(ToolDefinition, raw, f"tools[{i}]")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(call: CountTokensBody, tools: list[dict]) -> tuple[str, bool | None]:
    """tool_choice -> (none | auto | required | the tool's name, whether parallel calls are allowed: None when
    the request did not say)."""
    names = [t["function"]["name"] for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ApiError(400, "invalid_value", f"'tools[{i}].name' repeats the name {name!r}", f"tools[{i}].name")
    choice = call.tool_choice
    if choice is None:
        return ("auto" if tools else "none"), None
    parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    if choice.type == "none":
        return "none", parallel
    if not tools:
        raise ApiError(400, "invalid_value", f"'tool_choice' {choice.type} needs 'tools'", "tool_choice")
    if choice.type == "tool":
        assert choice.name is not None  # (the schema requires it with type tool)
        if choice.name not in names:
            raise ApiError(400, "invalid_value", f"'tool_choice.name' {echo(choice.name)} is not in 'tools'",
                           "tool_choice.name")
        return choice.name, parallel
    return ("required" if choice.type == "any" else "auto"), parallel
