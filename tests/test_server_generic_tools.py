"""Forced tool calls on the embedded model (its chat template has no tool-call format) through both front
ends (``async_frontend``: the TorchServe async server and ``llm_api serve``), with the openai package.

What the tests prove, with the real model writing greedily (float32 servers):

* ``tool_choice="required"`` and a named function return ``tool_calls`` (content null, finish reason
  ``tool_calls``) whose arguments validate against the tool's schema, for several schemas (a nested
  object with an enum, an integer with bounds, an array), whole and streamed (``delta.tool_calls`` with
  the arguments in pieces, which join to the same call);
* one call per answer (the generic form's rule), with ``parallel_tool_calls`` true (the default) or false;
* a follow-up turn carrying the assistant's call and a ``role: "tool"`` result is accepted and answered,
  with the tools sent again (``tool_choice`` none) or without them;
* ``tool_choice`` ``auto`` (or absent with tools) is served: a text answer or one call that parses back.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.server

WEATHER = {"type": "object", "properties": {
    "place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 2, "minLength": 2}},
              "required": ["city", "country"], "additionalProperties": False},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["place", "unit"], "additionalProperties": False}
FORECAST = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": False}
PACK = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 15},
                                                   "minItems": 1, "maxItems": 4}},
        "required": ["items"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_forecast": FORECAST, "pack_bag": PACK}
DESCRIPTIONS = {"get_weather": "Current weather in a city", "get_forecast": "Weather forecast for the next days",
                "pack_bag": "List what to pack for a trip"}
TOOLS = [{"type": "function", "function": {"name": name, "description": DESCRIPTIONS[name], "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "I am going to Paris for three days. What will the weather be like?"}]


@pytest.fixture
def client(async_frontend):
    return openai.OpenAI(base_url=async_frontend.openai_base, api_key=async_frontend.key(), max_retries=0,
                         timeout=300)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def check_calls(calls, only: str | None = None) -> list[tuple[str, dict]]:
    """Every call names a defined tool (``only`` when given) and its arguments validate; (name, arguments)."""
    assert calls, "no tool call"
    checked = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        name = call.function.name
        assert name in SCHEMAS and (only is None or name == only), name
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[name])
        checked.append((name, arguments))
    return checked


def streamed_calls(client, **fields) -> tuple[list[tuple[str, dict]], str, int]:
    """A streamed request's calls joined from their deltas, its finish reason and how many argument pieces."""
    calls: dict[int, dict] = {}
    finish, pieces = None, 0
    for chunk in client.chat.completions.create(stream=True, **fields):
        choice = chunk.choices[0]
        assert not choice.delta.content
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"name": None, "arguments": ""})
            if delta.id is not None:
                assert call["name"] is None and delta.function.name in SCHEMAS
                call["name"] = delta.function.name
            call["arguments"] += delta.function.arguments or ""
            pieces += bool(delta.function.arguments)
        finish = choice.finish_reason or finish
    joined = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    for name, arguments in joined:
        jsonschema.validate(arguments, SCHEMAS[name])
    return joined, finish, pieces


@pytest.mark.parametrize("function", list(SCHEMAS))
def test_a_named_function_is_called_with_valid_arguments_whole_and_streamed(client, function):
    fields = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice=named(function), temperature=0,
                  max_tokens=120)
    answer = client.chat.completions.create(**fields)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    whole = check_calls(choice.message.tool_calls, only=function)
    assert len(whole) == 1
    calls, finish, pieces = streamed_calls(client, **fields)
    assert finish == "tool_calls" and calls == whole and pieces > 1  # (the arguments came in pieces)


def test_required_calls_a_defined_tool_with_valid_arguments(client):
    fields = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120)
    choice = client.chat.completions.create(**fields).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    whole = check_calls(choice.message.tool_calls)
    calls, finish, _ = streamed_calls(client, **fields)
    assert finish == "tool_calls" and calls == whole and len(whole) == 1
    one = client.chat.completions.create(**{**fields, "parallel_tool_calls": False}).choices[0]
    assert one.finish_reason == "tool_calls" and len(check_calls(one.message.tool_calls)) == 1


def test_a_tool_result_turn_is_answered(client):
    first = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                           tool_choice=named("get_forecast"), temperature=0, max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C every day."}]
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        answer = client.chat.completions.create(model="smollm2", messages=history, temperature=0, max_tokens=30,
                                                **extra)
        choice = answer.choices[0]
        assert choice.message.tool_calls is None and choice.message.content
        assert choice.finish_reason in ("stop", "length") and answer.usage.completion_tokens > 0
    # The forced path again on the longer conversation: another valid call.
    again = client.chat.completions.create(model="smollm2", messages=history, tools=TOOLS, tool_choice=named("pack_bag"),
                                           temperature=0, max_tokens=80)
    check_calls(again.choices[0].message.tool_calls, only="pack_bag")


@pytest.mark.parametrize("extra", [{}, {"tool_choice": "auto"}])
def test_auto_is_served_as_text_or_a_call(client, extra):
    """auto (or no tool_choice: the default of every agent framework) in the generic form: the model answers
    in text or makes one call that parses back; either way the answer ends as it should."""
    answer = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
                                            **extra)
    choice = answer.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_a_response_format_beside_tools(client):
    """OpenAI's rule for ``response_format`` with ``tools``: with auto the answer is either text following the
    format or a call; a forced call ignores the format (instructor's and pydantic-ai's default requests)."""
    schema = {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 40}},
              "required": ["summary"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    answer = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, response_format=fmt,
                                            max_tokens=80, temperature=0)
    message = answer.choices[0].message
    if message.tool_calls:
        check_calls(message.tool_calls)
    else:
        jsonschema.validate(json.loads(message.content), schema)
    forced = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, response_format=fmt,
                                            tool_choice=named("pack_bag"), max_tokens=80, temperature=0)
    check_calls(forced.choices[0].message.tool_calls, only="pack_bag")
