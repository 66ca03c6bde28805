"""Structured-output and tool fields of the request formats, without a server: what they become, and a 400
naming the field for every bad value (response_format, tools, tool_choice, tool messages; the native
json_schema / regex / grammar), including grammars over the compile-cost limits."""

from __future__ import annotations

import dataclasses
import json

import pytest

from llm_api.errors import ApiError
from llm_api.protocols.chat.translate import parse_chat
from llm_api.protocols.completions.translate import parse_completions
from llm_api.protocols.native.translate import parse_request
from llm_api.service.request import Limits
from llm_api.text.tools import HERMES

LIMITS = Limits(max_input_tokens=2048, max_new_tokens=2048, hidden_size=576, tool_format=HERMES)
NO_TOOLS = Limits(max_input_tokens=2048, max_new_tokens=2048, hidden_size=576)
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}


def chat(limits=LIMITS, **fields):
    return parse_chat(json.dumps({"model": "smollm2", "messages": USER, **fields}).encode(), "smollm2", limits)


def native(**fields):
    return parse_request({"body": json.dumps(fields).encode()}, LIMITS)


def refused(fn, *args, **kw) -> ApiError:
    with pytest.raises(ApiError) as err:
        fn(*args, **kw)
    assert err.value.status == 400, err.value
    return err.value


def test_response_formats():
    request, _ = chat(response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER,
                                                                              "strict": True}})
    assert request.constraint.spec.kind == "json_schema" and json.loads(request.constraint.spec.source) == WEATHER
    assert request.constraint.param == "response_format.json_schema.schema"
    request, _ = chat(response_format={"type": "json_object"})
    assert request.constraint.spec.kind == "json_object"
    request, _ = chat(response_format={"type": "json_schema", "json_schema": {"name": "any"}})
    assert request.constraint.spec.kind == "json_object"
    request, _ = chat(response_format={"type": "text"})
    assert request.constraint is None and request.params.grammar is None


def test_tools_and_tool_choices():
    request, call = chat(tools=[TOOL])
    assert request.tools == [TOOL] and request.constraint.param == "tools" and call.tool_format is not None
    tag = json.loads(request.constraint.spec.source)["format"]
    assert tag["type"] == "triggered_tags" and not tag["at_least_one"] and not tag["stop_after_first"]
    assert request.constraint.parts[0][0] == "tools[0].function.parameters"
    request, _ = chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
    tag = json.loads(request.constraint.spec.source)["format"]
    assert tag["type"] == "tags_with_separator" and tag["at_least_one"] and tag["stop_after_first"]
    request, _ = chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(request.constraint.spec.source)["format"]["begin"].startswith('<tool_call>\n{"name": "get_weather"')
    # none: no tools rendered, nothing constrained, nothing parsed
    request, call = chat(tools=[TOOL], tool_choice="none")
    assert request.tools is None and request.constraint is None and call.tool_format is None
    request, call = chat(tools=[], parallel_tool_calls=True)
    assert request.tools is None and call.tool_format is None


def test_tool_conversation_history_is_accepted():
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C, sunny"}]},
    ]
    request, _ = parse_chat(json.dumps({"model": "smollm2", "messages": messages, "tools": [TOOL]}).encode(),
                            "smollm2", LIMITS)
    assert request.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert request.messages[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}


CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": WEATHER}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": WEATHER}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "maxLength": 300}}}}}}, "response_format.json_schema.schema"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [TOOL, TOOL]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 40 + i} for i in range(8)}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": f"f{j}", "parameters": {  # each under the limit, not all
        "type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 40 + i + 4 * j} for i in range(4)}}}}
        for j in range(2)]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice.function.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[0]"),
    ({"messages": [{"role": "assistant"}]}, "messages[0]"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}]}, "messages[0].tool_calls[0].type"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{nope"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"ignore_eos": True, "tools": [TOOL]}, "ignore_eos"),
    ({"ignore_eos": True, "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}},
     "ignore_eos"),
    ({"ignore_eos": "false"}, "ignore_eos"),
    ({"ignore_eos": 0}, "ignore_eos"),
])
def test_bad_values_are_400s_naming_the_field(fields, param):
    error = refused(chat, **fields)
    assert error.param == param, error
    assert set(error.openai_json()["error"]) == {"message", "type", "param", "code"}


def test_a_model_without_a_tool_format_serves_tools_in_the_generic_form():
    """(The generic form: tests/test_generic_tools.py.) auto too, unless the server refuses it."""
    request, call = chat(NO_TOOLS, tools=[TOOL])
    assert request.tool_prompt and call.tool_format is not None
    error = refused(chat, dataclasses.replace(NO_TOOLS, generic_tool_choice_auto=False), tools=[TOOL])
    assert error.param == "tool_choice" and "tool-call format" in error.message
    request, call = chat(NO_TOOLS, tools=[TOOL], tool_choice="required")
    assert request.tools == [TOOL] and request.tool_prompt and call.tool_format is not None
    request, _ = chat(NO_TOOLS, tools=[TOOL], tool_choice="none")  # nothing to parse: fine
    assert request.tools is None and request.tool_prompt is None


def test_ignore_eos_reaches_the_sampler_without_a_grammar():
    assert chat(ignore_eos=True)[0].params.ignore_eos and not chat()[0].params.ignore_eos
    request, _ = chat(ignore_eos=True, tools=[TOOL], tool_choice="none", response_format={"type": "text"})
    assert request.params.ignore_eos and request.constraint is None
    assert parse_completions(json.dumps({"model": "smollm2", "prompt": "x", "ignore_eos": True}).encode(),
                             "smollm2", LIMITS)[0][0].params.ignore_eos


def test_native_constraints():
    request = native(text="x", json_schema=WEATHER)
    assert request.constraint.spec.kind == "json_schema" and request.constraint.param == "json_schema"
    assert native(text="x", json_schema=json.dumps(WEATHER)).constraint == request.constraint
    assert native(text="x", regex="[0-9]+").constraint.spec.kind == "regex"
    assert native(text="x", grammar='root ::= "a"').constraint.spec.kind == "ebnf"
    # Form fields / gRPC: JSON text
    form = parse_request({"text": b"x", "json_schema": json.dumps(WEATHER).encode()}, LIMITS)
    assert form.constraint == request.constraint


@pytest.mark.parametrize("fields, param", [
    ({"json_schema": "{nope"}, "json_schema"),
    ({"json_schema": 5}, "json_schema"),
    ({"json_schema": "[1, 2]"}, "json_schema"),
    ({"json_schema": {"type": "string", "maxLength": 10**40}}, "json_schema"),
    ({"json_schema": "[" * 40 + "]" * 40}, "json_schema"),  # nested deeper than any body may be
    ({"regex": ""}, "regex"),
    ({"regex": 5}, "regex"),
    ({"regex": "[a-z]{0,300}"}, "regex"),
    ({"grammar": 'root ::= [a-z]{0,200} [0-9]{0,100}'}, "grammar"),
    ({"grammar": "x" * 70_000}, "grammar"),
    ({"regex": "a", "grammar": 'root ::= "a"'}, "grammar"),
    ({"json_schema": {}, "regex": "a"}, "regex"),
    ({"regex": "a", "ignore_eos": True}, "ignore_eos"),
])
def test_native_bad_constraints_are_400s_naming_the_field(fields, param):
    error = refused(native, text="x", **fields)
    assert error.param == param, error


def test_long_tool_definitions_count_towards_the_prompt_length():
    request, _ = chat(tools=[{"type": "function", "function": {"name": "f", "description": "d" * 5000}}])
    assert request.num_input_chars() > 5000


# A schema of megabytes (the hostile-tools class sends 5.8 MB) is refused by a walk that stops past the
# grammar's source limit, before any of it is written out as JSON: writing it all held the GIL for 0.2-0.3 s
# and stalled the running streams (docs/reliability.md, "Hostile input, by class").
HUGE = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(66_000)}}
MANY_TOOLS = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(10_000)]


@pytest.fixture
def nothing_written_out(monkeypatch):
    """Fails any request that gets as far as writing a schema or a structural tag out as JSON text."""
    from llm_api.structured.spec import GrammarSpec

    def written(*args):
        raise AssertionError("an over-limit schema was written out before it was refused")

    monkeypatch.setattr(GrammarSpec, "json_schema", classmethod(lambda cls, value: written()))
    monkeypatch.setattr(GrammarSpec, "structural_tag", classmethod(lambda cls, value: written()))


@pytest.mark.parametrize("send, param", [
    (lambda: chat(tools=[{"type": "function", "function": {"name": "huge", "parameters": HUGE}}], tool_choice="required"),
     "tools[0].function.parameters"),
    (lambda: chat(limits=NO_TOOLS, tools=[{"type": "function", "function": {"name": "huge", "parameters": HUGE}}],
                  tool_choice="required"), "tools[0].function.parameters"),
    (lambda: chat(response_format={"type": "json_schema", "json_schema": {"name": "huge", "schema": HUGE}}),
     "response_format.json_schema.schema"),
    (lambda: native(text="x", json_schema=HUGE), "json_schema"),
    (lambda: chat(tools=MANY_TOOLS, tool_choice="required"), "tools"),
    (lambda: chat(limits=NO_TOOLS, tools=MANY_TOOLS, tool_choice="required"), "tools"),
], ids=["tool parameters", "tool parameters, generic form", "response_format", "native json_schema",
        "10,000 tools", "10,000 tools, generic form"])
def test_an_oversized_schema_is_refused_before_it_is_written_out(nothing_written_out, send, param):
    error = refused(send)
    assert error.code == "invalid_grammar" and error.param == param, error
    assert "more than 65536 characters" in error.message, error.message


def test_the_size_walk_never_counts_more_than_the_schema_writes():
    """``source_chars`` is a lower bound of the compact JSON's length (so it refuses nothing that fits),
    and a schema of exactly the limit's length passes it (the written source's own check decides)."""
    import random

    from llm_api.service.constraints import MAX_SOURCE_CHARS, source_chars

    def compact(value) -> int:
        return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))

    rng = random.Random(7)

    def value(depth=0):
        kind = rng.random()
        if depth > 4 or kind < 0.3:
            return rng.choice([0, -1.5e300, True, False, None, "", "é\n\"\\", "x" * rng.randint(0, 9)])
        if kind < 0.65:
            return {f"k{rng.randint(0, 99)}ü": value(depth + 1) for _ in range(rng.randint(0, 6))}
        return [value(depth + 1) for _ in range(rng.randint(0, 6))]

    for _ in range(3000):
        item = value()
        assert source_chars(item, 10**9) <= compact(item), item
    at_limit = {"type": "object", "description": ""}
    at_limit["description"] = "d" * (MAX_SOURCE_CHARS - compact(at_limit))
    assert compact(at_limit) == MAX_SOURCE_CHARS and source_chars(at_limit, MAX_SOURCE_CHARS) <= MAX_SOURCE_CHARS
    request, _ = chat(response_format={"type": "json_schema", "json_schema": {"name": "edge", "schema": at_limit}})
    assert len(request.constraint.spec.source) == MAX_SOURCE_CHARS
    assert source_chars(HUGE, MAX_SOURCE_CHARS) > MAX_SOURCE_CHARS


def test_a_refused_parse_lets_go_of_what_it_made_on_its_own_thread():
    """A parse run off the event loop (``ModelService.offload``) that ends in a refusal leaves its error
    without the traceback whose frames hold the decoded body, so the body is freed on the worker thread,
    not on the event loop that receives the error (freeing a 5.8 MB schema's objects there held the GIL
    0.07-0.2 s)."""
    import weakref

    from llm_api.service.input import _refusal_let_go

    class Held:
        pass

    held: list = []

    def parse():
        body = Held()  # (stands for the decoded body the parse's frames hold)
        held.append(weakref.ref(body))
        chat(tools=[{"type": "function", "function": {"name": "huge", "parameters": HUGE}}], tool_choice="required")

    with pytest.raises(ApiError) as refusal:
        _refusal_let_go(parse)
    assert refusal.value.param == "tools[0].function.parameters"
    assert held[0]() is None, "the refused parse's objects outlived it"
    assert refusal.value.__context__ is None and refusal.value.__cause__ is None
