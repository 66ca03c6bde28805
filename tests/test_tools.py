"""Tool-call formats (llm_api.text.tools): detection from chat templates, the streaming parser, and the
grammar that makes every call well formed (random walks through it with the embedded tokenizer)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch

from llm_api.engine.request import FinishReason
from llm_api.errors import ApiError
from llm_api.protocols.common.openai_call import OpenAICall
from llm_api.service.constraints import tool_constraint
from llm_api.text.tools import (HERMES, LLAMA3_JSON, ToolCallDelta, ToolCallParser, arguments_schema, detect_tool_format,
                               tool_grammar)

ASSETS = Path(__file__).parent / "assets"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
         {"type": "function", "function": {"name": "ping"}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "ping": {"type": "object", "maxProperties": 0}}


def feed(parser: ToolCallParser, text: str, sizes=(1,)) -> list:
    """Push ``text`` in pieces of the given sizes (cycled), then finish; the events in order."""
    events, pos, i = [], 0, 0
    while pos < len(text):
        size = sizes[i % len(sizes)]
        events += parser.push(text[pos:pos + size])
        pos, i = pos + size, i + 1
    return events + parser.finish()


def summarize(events: list) -> tuple[str, list[tuple[str, str]]]:
    content = "".join(e for e in events if isinstance(e, str))
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                assert e.index not in calls and e.id.startswith("call_") and e.name
                calls[e.index] = [e.name, ""]
            calls[e.index][1] += e.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


HERMES_TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET {x}"}}\n</tool_call>')


@pytest.mark.parametrize("sizes", [(1,), (2, 5, 1), (7,), (10_000,)])
def test_hermes_calls_parse_the_same_whatever_the_chunking(sizes):
    content, calls = summarize(feed(ToolCallParser(HERMES), HERMES_TWO_CALLS, sizes))
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "CET {x}"}')]


def test_llama3_json_calls_and_separators():
    text = '{"name": "get_time", "parameters": {"zone": "a\\"}b"}}; {"name": "ping", "parameters": {}}'
    parser = ToolCallParser(LLAMA3_JSON)
    content, calls = summarize(feed(parser, text, (3,)))
    assert content == "" and calls == [("get_time", '{"zone": "a\\"}b"}'), ("ping", "{}")]
    assert parser.num_complete_calls == 2
    assert json.loads(calls[0][1]) == {"zone": 'a"}b'}


def test_plain_answers_pass_through_untouched():
    for text in ("Hello <tool and <tool_cal but no call.\n\n", "  spaces  ", "a { b } c", '{"name": x'):
        content, calls = summarize(feed(ToolCallParser(HERMES), text, (1,)))
        assert content == text and calls == []


def test_cut_short_calls():
    # Cut inside the head: that text is content; cut inside the arguments: the call keeps what it has.
    content, calls = summarize(feed(ToolCallParser(HERMES), 'Hi <tool_call>\n{"name": "get_w'))
    assert content == 'Hi <tool_call>\n{"name": "get_w' and calls == []
    parser = ToolCallParser(HERMES)
    content, calls = summarize(feed(parser, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UT'))
    assert content == "" and calls == [("get_time", '{"zone": "UT')] and parser.num_complete_calls == 0
    # Not a call after all (no head within MAX_HEAD_CHARS): content.
    text = "<tool_call> is how I would call a tool, " + "x" * 300
    assert summarize(feed(ToolCallParser(HERMES), text, (4,))) == (text, [])


def test_openai_encoding_stream_and_message_agree():
    streamed = OpenAICall("chat", "m", stream=True, include_usage=False, tool_format=HERMES)
    whole = OpenAICall("chat", "m", stream=False, include_usage=False, tool_format=HERMES)
    sse = "".join(streamed.delta(HERMES_TWO_CALLS[i:i + 3]) for i in range(0, len(HERMES_TWO_CALLS), 3))
    sse += streamed.finish(FinishReason.STOP, 10, 20)
    for i in range(0, len(HERMES_TWO_CALLS), 5):
        assert whole.delta(HERMES_TWO_CALLS[i:i + 5]) == ""
    message = json.loads(whole.finish(FinishReason.STOP, 10, 20))
    choice = message["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check."
    chunks = [json.loads(b[6:]) for b in sse.split("\n\n") if b.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk["choices"][0]["delta"].get("tool_calls", []):
            call = calls.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in delta:
                assert call["id"] is None and delta["type"] == "function"
                call["id"], call["name"] = delta["id"], delta["function"]["name"]
            call["arguments"] += delta["function"]["arguments"]
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert got == [(c["name"], c["arguments"]) for c in calls.values()] and len(got) == 2
    # Without calls: a plain message, finish reason stop.
    plain = OpenAICall("chat", "m", stream=False, include_usage=False, tool_format=HERMES)
    plain.delta("Just text.")
    choice = json.loads(plain.finish(FinishReason.STOP, 1, 2))["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Just text."} and choice["finish_reason"] == "stop"


def test_detect_tool_format(embedded_checkpoint_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint_path)
    assert detect_tool_format(tokenizer) is None  # SmolLM2's template renders no tools
    tokenizer.chat_template = (ASSETS / "hermes_tools.jinja").read_text()
    assert detect_tool_format(tokenizer) is HERMES
    tokenizer.chat_template = (ASSETS / "llama3_tools.jinja").read_text()
    assert detect_tool_format(tokenizer) is LLAMA3_JSON
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}"
    assert detect_tool_format(tokenizer) is None  # renders tools, in no format we parse


@pytest.fixture(scope="module")
def compiler(embedded_checkpoint_path):
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from llm_api.structured.compiler import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint_path)
    return tokenizer, GrammarCompiler(tokenizer, 49152, stop_token_ids=[2])


def walk(compiler, spec, seed: int, stop_bias: float, max_steps: int = 400, inject: str = "") -> str:
    """Random tokens the grammar allows (argmax over random logits after the mask) until it ends. With
    ``inject``: after a few free tokens the walk writes that text (each of its tokens must be allowed),
    then goes on at random (free text reaching a call's trigger, as a model would)."""
    from llm_api.structured.bitmask import allocate_bitmask, apply_bitmask
    from llm_api.structured.matcher import GrammarMatcher

    tokenizer, grammar_compiler = compiler
    matcher = GrammarMatcher(grammar_compiler.compile(spec))
    generator = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, 49152)
    forced = tokenizer.encode(inject) if inject else []
    ids = []
    for step in range(max_steps):
        logits = torch.randn(1, 49152, generator=generator)
        if not (forced and step < 3):
            logits[0, 2] += stop_bias
        matcher.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask, [0])
        token = int(logits.argmax())
        if forced and step >= 3:
            token = forced.pop(0)
            assert logits[0, token] > float("-inf"), "the grammar refused the trigger"
        assert matcher.accept_token(token)
        if token == 2:
            break
        ids.append(token)
    else:
        raise AssertionError("the grammar did not end")
    return tokenizer.decode(ids)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
@pytest.mark.parametrize("choice", ["required", "get_time", "auto"])
def test_every_call_the_grammar_allows_parses_and_validates(compiler, fmt, choice):
    spec = tool_grammar(fmt, TOOLS, choice, parallel=True)
    num_calls = 0
    for seed in range(6):
        text = walk(compiler, spec, seed, stop_bias=6.0, inject=fmt.trigger if choice == "auto" else "")
        parser = ToolCallParser(fmt)
        content, calls = summarize(feed(parser, text, (random.Random(seed).randint(1, 6),)))
        assert parser.num_complete_calls == len(calls)
        if choice != "auto":
            assert calls, text
        if choice == "get_time":
            assert [name for name, _ in calls] == ["get_time"]
        if choice != "auto":
            assert content == "", text  # only calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        num_calls += len(calls)
    assert num_calls > 0


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                                        {"type": ["object", "null"]}, {"type": "integer"}, {"type": 5}])
def test_parameters_that_allow_no_object_are_refused_naming_the_tool(parameters):
    """A call's arguments must be an object: the parser ends a call at the object's closing brace, so a
    schema allowing a string would let a call run on into the text after it (mis-parsed, never complete)."""
    tools = TOOLS + [{"type": "function", "function": {"name": "say", "parameters": parameters}}]
    with pytest.raises(ApiError) as err:
        tool_constraint(HERMES, tools, "auto", True)
    assert err.value.status == 400 and err.value.param == "tools[3].function.parameters", err.value
    assert "object" in err.value.message


def test_parameters_without_a_type_describe_an_object(compiler):
    untyped = {"properties": {"word": {"enum": ["yes", "no"]}}, "required": ["word"]}
    assert arguments_schema(untyped) == {**untyped, "type": "object"}
    assert arguments_schema({"type": "object"}) == {"type": "object"} and arguments_schema(None)["type"] == "object"
    tools = [{"type": "function", "function": {"name": "answer", "parameters": untyped}}]
    for seed in range(3):
        _, calls = summarize(feed(ToolCallParser(HERMES), walk(compiler, tool_grammar(HERMES, tools, "answer"), seed,
                                                               stop_bias=6.0)))
        assert len(calls) == 1 and json.loads(calls[0][1])["word"] in ("yes", "no")


def test_parallel_false_allows_one_call(compiler):
    spec = tool_grammar(HERMES, TOOLS, "required", parallel=False)
    for seed in range(4):
        _, calls = summarize(feed(ToolCallParser(HERMES), walk(compiler, spec, seed, stop_bias=0.0)))
        assert len(calls) == 1


def test_each_choice_has_its_own_tool_parser():
    """n > 1 with tools: the choices' texts interleave; each is parsed on its own (a call split across
    deltas of one choice is not disturbed by the other's), and each ends with its own reason."""
    streamed = OpenAICall("chat", "m", stream=True, include_usage=False, n=2, tool_format=HERMES)
    whole = OpenAICall("chat", "m", stream=False, include_usage=False, n=2, tool_format=HERMES)
    texts = {0: HERMES_TWO_CALLS, 1: "No call here."}
    sse = ""
    for i in range(0, len(HERMES_TWO_CALLS), 4):
        for index, text in texts.items():
            piece = text[i:i + 4]
            if piece:
                sse += streamed.delta(piece, index)
                assert whole.delta(piece, index) == ""
    sse += streamed.finish(FinishReason.STOP, 10, 20)
    choices = json.loads(whole.finish(FinishReason.STOP, 10, 20))["choices"]
    assert [c["finish_reason"] for c in choices] == ["tool_calls", "stop"]
    assert len(choices[0]["message"]["tool_calls"]) == 2 and choices[1]["message"] == {
        "role": "assistant", "content": "No call here."}
    chunks = [json.loads(b[6:]) for b in sse.split("\n\n") if b.startswith("data: {")]
    reasons = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
               if c["choices"][0]["finish_reason"]}
    assert reasons == {0: "tool_calls", 1: "stop"}
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"][0]["index"] == 1)
    assert content == "No call here."
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == 1)
