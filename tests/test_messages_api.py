"""Anthropic's Messages API served to the real ``anthropic`` SDK over both front ends (TorchServe in the shipped
async mode, and ``llm_api serve``), with the embedded model (a chat template without a tool format: tools in
the generic form): messages create and stream (the SDK's own accumulator), a tool loop that finishes,
count_tokens, stop sequences, errors as the SDK's typed exceptions, what Claude Code sends, and a corpus of
hostile bodies and keys while a witness streams.

Auth: ``llm_api serve`` takes the key in ``x-api-key`` (the SDK's ``api_key``) as well as ``Authorization``;
TorchServe's frontend checks ``Authorization`` only, so there the SDK gets the key as ``auth_token``."""

from __future__ import annotations

import importlib.util
import json
import urllib.parse

import pytest

from bench.harness.hostile import Witness, post_json, raw_request, refusal_problems, report

# (the SDK imported in _sdk(): ~1.8 s, which every xdist worker would pay at collection)
pytestmark = [pytest.mark.server, pytest.mark.skipif(importlib.util.find_spec("anthropic") is None,
                                                     reason="needs the anthropic SDK")]
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}  # (the SDK of 2026 no longer names temperature; clients send it as extra_body)
TOOLS = [{"name": "get_weather", "description": "The current weather of a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def _sdk():
    import anthropic

    return anthropic


def _client(server, key: str | None = None):
    anthropic = _sdk()
    base = server.openai_base.removesuffix("/v1")
    key = server.key() if key is None else key
    if server.kind == "standalone":
        return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=120)
    return anthropic.Anthropic(base_url=base, auth_token=key, api_key=None, max_retries=0, timeout=120)


def _path(server) -> str:
    """``/v1/messages`` on this front end (below the model's path on TorchServe)."""
    return urllib.parse.urlsplit(server.openai_base).path + "/messages"


def test_create_stream_and_count_tokens(async_frontend):
    client = _client(async_frontend)
    asked = {"model": async_frontend.model_name, "max_tokens": 24, "system": "You are a helpful assistant.",
             "messages": [{"role": "user", "content": QUESTION}]}
    message = client.messages.create(**asked, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant" and message.stop_reason == "end_turn"
    assert [b.type for b in message.content] == ["text"] and "Paris" in message.content[0].text, message
    with client.messages.stream(**asked, extra_body=GREEDY) as stream:
        texts = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert "".join(texts) == streamed.content[0].text == message.content[0].text
    assert streamed.stop_reason == "end_turn" and streamed.usage.output_tokens == message.usage.output_tokens
    counted = client.messages.count_tokens(model=asked["model"], system=asked["system"], messages=asked["messages"])
    for usage in (message.usage, streamed.usage):
        assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens > 0
    assert streamed.usage.cache_read_input_tokens > 0  # (the second time, the prompt was in the prefix cache)


def test_stop_sequences_end_the_answer_and_are_named(async_frontend):
    message = _client(async_frontend).messages.create(
        model=async_frontend.model_name, max_tokens=24, system="You are a helpful assistant.", stop_sequences=["zzz", "Paris"],
        messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "Paris"), message
    assert "Paris" not in message.content[0].text


def test_a_tool_loop_finishes(async_frontend):
    """The agent loop every Anthropic tool user runs: a call (``tool_use``), its result sent back
    (``tool_result``), then an answer in text from it; streamed for the call, whole for the answer."""
    client = _client(async_frontend)
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    with client.messages.stream(model=async_frontend.model_name, max_tokens=48, tools=TOOLS, messages=messages,
                                extra_body=GREEDY) as stream:
        first = stream.get_final_message()
    calls = [b for b in first.content if b.type == "tool_use"]
    assert first.stop_reason == "tool_use" and [c.input for c in calls] == [{"city": "Paris"}], first
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                               "content": "Sunny and 24 degrees Celsius in Paris."}]}]
    answer = client.messages.create(model=async_frontend.model_name, max_tokens=48, tools=TOOLS, messages=messages,
                                    extra_body=GREEDY)
    assert answer.stop_reason == "end_turn" and answer.content[0].type == "text", answer
    assert "sunny" in answer.content[0].text.lower(), answer
    forced = client.messages.create(model=async_frontend.model_name, max_tokens=48, tools=TOOLS,
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    messages=[{"role": "user", "content": "Hello!"}], extra_body=GREEDY)
    assert forced.stop_reason == "tool_use" and forced.content[-1].name == "get_weather", forced


def test_errors_are_the_sdks_typed_exceptions(async_frontend):
    anthropic = _sdk()
    client = _client(async_frontend)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-unknown", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=async_frontend.model_name, max_tokens=8,
                               messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x",
                                                                       "content": "42"}]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "toolu_x" in bad.value.message
    answer = post_json(async_frontend, _path(async_frontend), {"model": async_frontend.model_name,
                                                               "messages": [{"role": "user", "content": "x"}]})
    assert answer.status == 400 and answer.json()["error"]["code"] == "missing_required_parameter", answer
    if async_frontend.kind == "standalone":  # (TorchServe's frontend answers a wrong key in its own shape)
        with pytest.raises(anthropic.AuthenticationError):
            _client(async_frontend, key="wrong").messages.create(
                model=async_frontend.model_name, max_tokens=8, messages=[{"role": "user", "content": "x"}])


def test_what_claude_code_sends(async_frontend):
    """Claude Code's request: ``?beta=true``, the ``anthropic-beta`` and ``anthropic-version`` headers, system
    blocks with cache marks, a ``system`` turn inside ``messages`` (2.1.154 and later), tools with cache
    marks, ``metadata.user_id``, thinking off, streamed."""
    body = {
        "model": async_frontend.model_name, "max_tokens": 32000, "stream": True, "temperature": 0,
        "system": [{"type": "text", "text": "You are a coding agent."},
                   {"type": "text", "text": "Answer briefly.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "<system-reminder>cwd: /w</system-reminder>"},
                                                  {"type": "text", "text": QUESTION,
                                                   "cache_control": {"type": "ephemeral"}}]},
                     {"role": "system", "content": "Reply in English."}],
        "tools": [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}], "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "user_abc_account_x_session_y"}, "thinking": {"type": "disabled"},
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "x-app": "cli", "accept": "application/json"}
    key: str | None = "server"
    if async_frontend.kind == "standalone":
        headers["x-api-key"], key = async_frontend.key(), None
    answer = raw_request(async_frontend, "POST", _path(async_frontend) + "?beta=true", json.dumps(body).encode(),
                         key=key, headers=headers)
    assert answer.status == 200 and answer.headers["content-type"].startswith("text/event-stream"), answer
    events = [json.loads(line[6:]) for line in answer.body.decode().splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop", events[-3:]
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "tool_use")


HOSTILE = {  # name -> the body (bytes, or an object)
    "not json": b'{"model": ',
    "a list": [1, 2],
    "lone surrogate in text": b'{"model": "smollm2", "max_tokens": 5, "messages": [{"role": "user", "content": "a\\udc00"}]}',
    "nul in a tool name": {"tools": [{"name": "a\u0000b", "input_schema": {"type": "object"}}]},
    "CRLF in a tool_use id": {"messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "x\r\nSet-Cookie: evil=1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "y\r\nevil: 1", "content": "r"}]}]},
    "a deep tool input": {"messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {"a": [[[[[[[[[[]]]]]]]]]]}}]},
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
    "a hostile schema": {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(a+)+$" * 50}}}}], "tool_choice": {"type": "any"}},
    "a prompt over MAX_INPUT_TOKENS": {"messages": [{"role": "user", "content": "hello " * 5000}]},
    "ten thousand blocks": {"messages": [{"role": "user", "content": [{"type": "bogus"}] * 10000}]},
    # (greedy and cut at the first sentence: sampled at Anthropic's default temperature 1 the answer ran on to
    # the KV room, ~1,300 tokens, and outlasted the witness on a loaded host)
    "max_tokens huge": {"max_tokens": 10 ** 30, "temperature": 0, "stop_sequences": [".", "\n"]},
    "max_tokens a string": {"max_tokens": "5"},
    "stop_sequences a hundred": {"stop_sequences": ["x"] * 100},
    "temperature NaN": b'{"model": "smollm2", "max_tokens": 5, "temperature": NaN, "messages": [{"role": "user", "content": "a"}]}',
    "thinking budget negative": {"thinking": {"type": "enabled", "budget_tokens": -1}},
    "a server tool": {"tools": [{"type": "bash_20250124", "name": "bash"}]},
    "an image": {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64",
                                                                                         "media_type": "image/png", "data": "AAAA"}}]}]},
    "count_tokens with max_tokens": ("/count_tokens", {"max_tokens": 5}),
    "count_tokens without messages": ("/count_tokens", {"messages": None}),
}
# Served, not refused: max_tokens is a ceiling (the answer is cut at MAX_NEW_TOKENS); a schema xgrammar
# compiles within its limits is served (or refused if it does not: either way in time, with the witness flowing).
MAY_BE_SERVED = {"max_tokens huge": (200,), "a hostile schema": (200, *range(400, 500))}


def _hostile_body(server, value) -> tuple[str, bytes]:
    suffix = ""
    if isinstance(value, tuple):
        suffix, value = value
    if isinstance(value, dict):
        base = {"model": server.model_name, "messages": [{"role": "user", "content": "Hi"}]}
        if not suffix:  # (count_tokens takes no max_tokens)
            base["max_tokens"] = 5
        body = {**base, **value}
        value = json.dumps({k: v for k, v in body.items() if v is not None}).encode()
    elif not isinstance(value, bytes):
        value = json.dumps(value).encode()
    return _path(server) + suffix, value


def test_hostile_bodies_and_keys_get_their_4xx_while_a_stream_runs(async_frontend):
    problems, answers = [], {}
    with Witness(async_frontend) as witness:
        for name, value in HOSTILE.items():
            path, body = _hostile_body(async_frontend, value)
            answer = post_json(async_frontend, path, body)
            answers[name] = answer.status
            problems += refusal_problems(name, answer, openai=False, anthropic=True,
                                         statuses=MAY_BE_SERVED.get(name, range(400, 500)))
        if async_frontend.kind == "standalone":
            for name, headers in {"a wrong x-api-key": {"x-api-key": "wrong"},
                                  "a non-ASCII x-api-key": {"x-api-key": "k\u00e9y".encode().decode("latin-1")},
                                  "an empty x-api-key": {"x-api-key": ""}}.items():
                path, body = _hostile_body(async_frontend, {})
                answer = raw_request(async_frontend, "POST", path, body, key=None, headers=headers)
                answers[name] = answer.status
                problems += refusal_problems(name, answer, openai=False, anthropic=True, statuses=(401,))
    report("messages", async_frontend, inputs=len(answers), answers=answers, witness=witness)
    assert not problems, "\n".join(problems)
