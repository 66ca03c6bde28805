"""Speculative decoding through both front ends (the shared TorchServe async server and `llm_api serve`,
both with SPECULATIVE_TOKENS=4) and the openai client: a grounded answer streams several tokens per chunk
and equals the unary answer; a stop string inside an accepted draft ends the text, the usage and the
logprobs at the token that completed it; n > 1 with a JSON schema; the draft counters move (vLLM's names
on `llm_api serve`, ``llm_spec_decode_*`` on both)."""

from __future__ import annotations

import json
import re
import time

import openai
import pytest

CODE = "def area(width, height):\n    result = width * height\n    return result\n"
GROUNDED = (f"Rewrite this Python function with the variable `result` renamed to `total`. Reply with only the "
            f"code.\n\n```python\n{CODE}```")


@pytest.fixture()
def client(async_frontend):
    return openai.OpenAI(base_url=async_frontend.openai_base, api_key=async_frontend.key(), max_retries=0)


def _counter(server, name: str) -> float:
    """The series' value summed over its label sets (0 while TorchServe has not seen it yet)."""
    text = server.metrics_text()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([-+0-9.eE]+)$", text, re.M))


def _accepted(server) -> float:
    return _counter(server, "llm_spec_decode_num_accepted_tokens_total")


def test_grounded_answer_streams_the_unary_answer_and_counts_drafts(async_frontend, client):
    accepted_before = _accepted(async_frontend)
    messages = [{"role": "user", "content": GROUNDED}]
    unary = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=48, temperature=0)
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=48, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(chunk.choices[0].delta.content)
    assert "".join(chunks) == unary.choices[0].message.content
    assert usage is not None and usage.completion_tokens == unary.usage.completion_tokens
    # TorchServe takes the worker's metric lines from its log, which may trail the answers by a moment;
    # the service publishes engine counters when a request ends.
    deadline = time.monotonic() + 15
    while _accepted(async_frontend) <= accepted_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _accepted(async_frontend) > accepted_before
    assert _counter(async_frontend, "llm_spec_decode_num_draft_tokens_total") >= _accepted(async_frontend)


def test_vllm_named_counters_on_llm_api_serve(standalone_server):
    before = _counter(standalone_server, "vllm:spec_decode_num_accepted_tokens_total")
    client = openai.OpenAI(base_url=standalone_server.openai_base, api_key=standalone_server.key(), max_retries=0)
    client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": GROUNDED}], max_tokens=32,
                                   temperature=0)
    accepted = _counter(standalone_server, "vllm:spec_decode_num_accepted_tokens_total")
    assert before < accepted <= _counter(standalone_server, "vllm:spec_decode_num_draft_tokens_total")


def test_stop_string_inside_a_draft_ends_text_usage_and_logprobs_there(client):
    prompt = f"Copy this code:\n{CODE}\nCopy:\n{CODE}\nCopy:\n"
    full = client.completions.create(model="smollm2", prompt=prompt, max_tokens=30, temperature=0, logprobs=1)
    text = full.choices[0].text
    assert "height" in text, text  # (the stop string below is in the greedy answer)
    stopped = client.completions.create(model="smollm2", prompt=prompt, max_tokens=30, temperature=0, logprobs=1,
                                        stop=["height"])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.text == text[: text.index("height")]
    # Tokens up to and including the one that completed the stop string, never the accepted ones after it.
    assert len(choice.logprobs.tokens) == stopped.usage.completion_tokens
    assert "".join(choice.logprobs.tokens).startswith(choice.text)
    assert stopped.usage.completion_tokens < full.usage.completion_tokens
    assert full.choices[0].logprobs.tokens[: len(choice.logprobs.tokens)] == choice.logprobs.tokens


def test_n_choices_follow_a_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "sides": {"type": "integer"}}, "required": ["name", "sides"]}
    content = 'A square: {"name": "square", "sides": 4}. A triangle: {"name": "triangle", "sides": 3}. A square?'
    answer = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": content}], max_tokens=40, n=2, temperature=0.7,
        seed=3, response_format={"type": "json_schema", "json_schema": {"name": "shape", "schema": schema}})
    assert len(answer.choices) == 2
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            value = json.loads(choice.message.content)
            assert set(value) == {"name", "sides"}
