"""Anthropic's Messages API without a server: bodies -> our request (turns, tools, limits, refusals) and our
events -> Anthropic's answer, streamed and whole, read back with the ``anthropic`` SDK's own stream
accumulator (what ``messages.stream(...).get_final_message()`` runs), so the event order and shapes are
the SDK's, not ours. tests/test_messages_api.py serves the same to the SDK over both front ends."""

from __future__ import annotations

import importlib.util
import json

import pytest

from llm_api.engine.request import FinishReason
from llm_api.errors import ApiError
from llm_api.protocols import table
from llm_api.protocols.messages.encoder import MessagesCall
from llm_api.protocols.messages.translate import parse_count_tokens, parse_messages
from llm_api.protocols.route import error_body
from llm_api.service.request import Limits
from llm_api.text.detokenizer import TextStream
from llm_api.text.reasoning import QWEN3
from llm_api.text.tools import HERMES

# (imported where used: the SDK takes ~1.8 s to import, which every xdist worker would pay at collection)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("anthropic") is None, reason="needs the anthropic SDK")
LIMITS = Limits(max_input_tokens=2048, max_new_tokens=256)  # no tool format: the generic form
TOOLS = [{"name": "get_weather", "description": "The weather of a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def _body(**fields) -> bytes:
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()


def _refusal(**fields) -> ApiError:
    with pytest.raises(ApiError) as refused:
        parse_messages(_body(**fields), "m", LIMITS)
    return refused.value


# ------------------------------------------------------------------------------------------ the request


def test_a_conversation_becomes_our_turns():
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "use the tool", "signature": "sig"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no data", "is_error": True},
            {"type": "text", "text": "And"}, {"type": "text", "text": "tomorrow?"}]},
        {"role": "system", "content": "Be brief."},  # (Claude Code 2.1.154 and later)
        {"role": "user", "content": "Thanks"},
    ]
    request, call = parse_messages(_body(system=[{"type": "text", "text": "You help."},
                                                 {"type": "text", "text": "Use tools."}],
                                         messages=messages, tools=TOOLS, metadata={"user_id": "u1"}), "m", LIMITS)
    assert request.messages == [
        {"role": "system", "content": "You help.\n\nUse tools."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "use the tool", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no data"},
        {"role": "user", "content": "And\n\ntomorrow?"},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Thanks"},
    ]
    assert request.tools == [{"type": "function", "function": {
        "name": "get_weather", "parameters": TOOLS[0]["input_schema"], "description": "The weather of a city."}}]
    assert request.tool_prompt is not None and request.constraint is not None  # tool_choice auto, generic form
    assert call.tool_format is not None and not call.stream


def test_sampling_fields_and_max_tokens_as_a_ceiling():
    request, _ = parse_messages(_body(max_tokens=100_000, temperature=0.5, top_p=0.9, top_k=40,
                                      stop_sequences=["\n\n", "END"]), "m", LIMITS)
    params = request.params
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k, params.stop) == \
        (LIMITS.max_new_tokens, 0.5, 0.9, 40, ("\n\n", "END"))
    assert request.max_tokens_fits and params.n == 1


def test_tool_choice_forms():
    named, _ = parse_messages(_body(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}), "m", LIMITS)
    anything, _ = parse_messages(_body(tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True}),
                                 "m", LIMITS)
    nothing, call = parse_messages(_body(tools=TOOLS, tool_choice={"type": "none"}), "m", LIMITS)
    assert named.constraint is not None and anything.constraint is not None
    assert nothing.constraint is None and nothing.tools is None and call.tool_format is None


def test_thinking_and_effort_reach_the_template():
    request, _ = parse_messages(_body(max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 1024},
                                      output_config={"effort": "high"}), "m", LIMITS)
    assert request.template_kwargs == {"enable_thinking": True, "reasoning_effort": "high"}
    request, _ = parse_messages(_body(thinking={"type": "disabled"}), "m", LIMITS)
    assert request.template_kwargs == {"enable_thinking": False}
    request, _ = parse_messages(_body(thinking={"type": "adaptive"}), "m", LIMITS)
    assert request.template_kwargs is None


def test_count_tokens_body_builds_the_same_prompt():
    fields = {"system": "S", "tools": TOOLS, "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    generate, _ = parse_messages(_body(**fields), "m", LIMITS)
    count = parse_count_tokens(json.dumps({"model": "m", **fields}).encode(), "m", LIMITS)
    assert (count.messages, count.tools, count.tool_prompt) == (generate.messages, generate.tools, generate.tool_prompt)
    with pytest.raises(ApiError) as refused:
        parse_count_tokens(json.dumps({"model": "m", "max_tokens": 5, **fields}).encode(), "m", LIMITS)
    assert refused.value.param == "max_tokens"  # (a generation field: not part of a count)


REFUSALS = {  # fields -> (code, param)
    "no max_tokens": ({"max_tokens": None}, "missing_required_parameter", "max_tokens"),
    "max_tokens zero": ({"max_tokens": 0}, "invalid_value", "max_tokens"),
    "no messages": ({"messages": []}, "invalid_value", "messages"),
    "an unknown field": ({"n": 2}, "unknown_parameter", "n"),
    "temperature above 1": ({"temperature": 1.5}, "invalid_value", "temperature"),
    "an image": ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                 "unsupported_value", "messages[0].content[0].type"),
    "an unknown block": ({"messages": [{"role": "user", "content": [{"type": "video"}]}]},
                         "invalid_value", "messages[0].content[0].type"),
    "a block that is not an object": ({"messages": [{"role": "user", "content": ["hi"]}]},
                                      "invalid_value", "messages[0].content[0].type"),
    "a text block without text": ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                                  "missing_required_parameter", "messages[0].content[0].text"),
    "a tool_result for an unknown id": (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]},
        "invalid_value", "messages[0].content[0].tool_use_id"),
    "a tool_use from the user": (
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
        "invalid_value", "messages[0].content[0].type"),
    "a tool_use whose input is not an object": (
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": []}]},
                      {"role": "user", "content": "x"}]}, "invalid_type", "messages[0].content[0].input"),
    "a prefill": ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
                  "invalid_value", "messages[1]"),
    "a server tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                      "unsupported_value", "tools[0].type"),
    "a tool without a schema": ({"tools": [{"name": "f"}]}, "missing_required_parameter", "tools[0].input_schema"),
    "a tool schema that is not an object's": ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]},
                                              "invalid_value", "tools[0]"),
    "a bad tool name": ({"tools": [{"name": "a b", "input_schema": {"type": "object"}}]},
                        "invalid_value", "tools[0].name"),
    "a repeated tool name": ({"tools": TOOLS * 2}, "invalid_value", "tools[1].name"),
    "tool_choice tool without tools": ({"tool_choice": {"type": "tool", "name": "f"}}, "invalid_value", "tool_choice"),
    "tool_choice naming a missing tool": ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
                                          "invalid_value", "tool_choice.name"),
    "tool_choice tool without a name": ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "invalid_value",
                                        "tool_choice"),
    "a thinking budget over max_tokens": ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "invalid_value",
                                          "thinking.budget_tokens"),
    "a container": ({"container": "c1"}, "invalid_value", "container"),
    "a system block that is not text": ({"system": [{"type": "image"}]}, "*", "*"),
    "an output schema that is not an object": ({"output_config": {"format": {"type": "json_schema", "schema": "x"}}},
                                               "invalid_type", "output_config.format.schema"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_bad_bodies_get_their_400(name):
    fields, code, param = REFUSALS[name]
    error = _refusal(**fields)
    assert error.status == 400, error
    assert code == "*" or error.code == code, error
    assert param == "*" or error.param == param, error


def test_the_model_must_be_served():
    with pytest.raises(ApiError) as refused:
        parse_messages(_body(model="other"), "m", LIMITS)
    assert refused.value.status == 404
    request, _ = parse_messages(_body(model="adapter"), "m", LIMITS, adapters={"adapter"})
    assert request.adapter == "adapter"


def test_errors_take_anthropics_shape_on_its_paths():
    for path, edge in (("/v1/messages", "server"), ("/v1/messages/count_tokens", "server"),
                       ("v1/messages", "torchserve")):
        assert table.error_shape(path, edge) == "anthropic"
        assert table.find("POST", path, edge)[0].errors == "anthropic"
    assert table.find("POST", "/v1/messages?beta=true", "server")[0].name == "messages"
    shapes = {status: json.loads(error_body("anthropic", ApiError(status, "x", "m<|endoftext|>"), "<|endoftext|>"))
              for status in (400, 401, 403, 404, 408, 413, 429, 500, 503)}
    assert {s: e["error"]["type"] for s, e in shapes.items()} == {
        400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
        408: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
        503: "overloaded_error"}
    assert all(e["type"] == "error" and e["error"]["message"] == "m<|endoftext|>" for e in shapes.values())
    assert "<|endoftext|>" not in error_body("anthropic", ApiError(400, "x", "<|endoftext|>"), "<|endoftext|>")


def test_the_stop_string_that_ended_the_text_is_named(embedded_checkpoint_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_checkpoint_path)
    stream = TextStream(tokenizer, ["zzz", "Paris", "is P"], "<|endoftext|>")
    delta = stream.push(tokenizer.encode("The capital is Paris."))
    assert (delta.text, delta.stopped, stream.matched_stop) == ("The capital ", True, "is P")


# ------------------------------------------------------------------------------------------ the answer


def _sse_events(text: str) -> list[dict]:
    events = []
    for chunk in text.split("\n\n"):
        if not chunk.strip():
            continue
        name, data = chunk.split("\n", 1)
        payload = json.loads(data.removeprefix("data: "))
        assert name == f"event: {payload['type']}", chunk
        events.append(payload)
    return events


def _answer(call: MessagesCall, pieces: list[str], reason=FinishReason.STOP, stop_sequence=None) -> str:
    call.num_prompt_tokens = 9
    out = "".join(call.delta(p) for p in pieces)
    out += call.choice_finish(0, reason, len(pieces), stop_sequence=stop_sequence)
    return out + call.finish(reason, 9, len(pieces), num_cached_tokens=4)


def _accumulated(sse: str):
    """The final message as the anthropic SDK's stream helper builds it from our events."""
    from anthropic.lib.streaming._messages import accumulate_event

    snapshot, buffers = None, {}
    for payload in _sse_events(sse):
        if payload["type"] == "ping":
            continue
        snapshot = accumulate_event(event=payload, current_snapshot=snapshot, json_bufs=buffers)
    return snapshot


CASES = {  # name -> (encoder fields, the model's text, finish reason, stop sequence, the whole answer's blocks, stop reason)
    "text": ({}, "The capital of France is Paris.", FinishReason.STOP, None,
             [{"type": "text", "text": "The capital of France is Paris."}], "end_turn"),
    "cut by max_tokens": ({}, "The capital", FinishReason.LENGTH, None, [{"type": "text", "text": "The capital"}],
                          "max_tokens"),
    "a stop sequence": ({}, "The capital ", FinishReason.STOP, "is", [{"type": "text", "text": "The capital "}],
                        "stop_sequence"),
    "thinking, then text": ({"reasoning_format": QWEN3}, "<think>Paris, surely.</think>\n\nParis.", FinishReason.STOP,
                            None, [{"type": "thinking", "thinking": "Paris, surely.", "signature": ""},
                                   {"type": "text", "text": "Paris."}], "end_turn"),
    "text, then two calls": (
        {"tool_format": HERMES}, 'Looking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        FinishReason.STOP, None,
        [{"type": "text", "text": "Looking."}, {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}},
         {"type": "tool_use", "name": "get_weather", "input": {"city": "Rome"}}], "tool_use"),
    "a call cut short": ({"tool_format": HERMES}, '<tool_call>\n{"name": "get_weather", "arguments": {"ci',
                         FinishReason.LENGTH, None, [{"type": "tool_use", "name": "get_weather", "input": {}}],
                         "max_tokens"),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("pieces", ["whole", "characters"])
def test_answers_streamed_and_whole_agree_through_the_sdk(name, pieces):
    fields, text, reason, stop_sequence, blocks, stop_reason = CASES[name]
    split = [text] if pieces == "whole" else list(text)
    whole = json.loads(_answer(MessagesCall("m", False, **fields), split, reason, stop_sequence))
    streamed_text = _answer(MessagesCall("m", True, **fields), split, reason, stop_sequence)
    streamed = _accumulated(streamed_text).to_dict()
    import anthropic

    message = anthropic.types.Message.model_validate(whole)  # (the SDK's own model of a whole answer)
    for answer in (whole, streamed):
        got = [{k: v for k, v in b.items() if k != "id" and v is not None} for b in answer["content"]]
        assert got == blocks, (answer, blocks)
        assert all(b["id"].startswith("toolu_") for b in answer["content"] if b["type"] == "tool_use")
        assert (answer["stop_reason"], answer["stop_sequence"]) == (stop_reason, stop_sequence)
        assert answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"] == 9
        assert answer["usage"]["output_tokens"] == len(split)
        assert answer["role"] == "assistant" and answer["model"] == "m" and answer["id"].startswith("msg_")
    assert message.stop_reason == stop_reason
    events = [e["type"] for e in _sse_events(streamed_text)]
    assert events[:2] == ["message_start", "ping"] and events[-2:] == ["message_delta", "message_stop"]
    # every block opens, takes its deltas and closes before the next opens
    opened = [e for e in events if e.startswith("content_block_")]
    assert opened.count("content_block_start") == opened.count("content_block_stop") == len(blocks)
    depth = 0
    for kind in opened:
        depth += {"content_block_start": 1, "content_block_stop": -1}.get(kind, 0)
        assert depth in (0, 1) and (kind != "content_block_delta" or depth == 1)


def test_an_answer_without_output_still_ends_its_stream():
    events = _sse_events(_answer(MessagesCall("m", True), [], FinishReason.LENGTH))
    assert [e["type"] for e in events] == ["message_start", "ping", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] == 9


def test_a_failure_mid_stream_is_an_error_event():
    call = MessagesCall("m", True, marker="<|endoftext|>")
    started = call.delta("Hello")
    tail = call.fail(ApiError(408, "timeout", "the request exceeded its deadline <|endoftext|>"))
    assert started and tail.startswith("event: error\n")
    error = json.loads(tail.split("data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "<|endoftext|>" not in tail
