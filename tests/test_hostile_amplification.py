"""Amplification: one request that multiplies its own cost (n x max tokens x logprobs x prompt) is bounded by
one work limit, MAX_REQUEST_WORK, on every route of both front ends.

What these tests prove, against TorchServe (the shipped async mode) and `llm_api serve`, with a witness
stream running beside the hostile requests (``bench/harness/hostile.py``):

* the extreme products the separate caps let through (64 choices x 2,048 tokens x 20 logprobs: 2.9 million
  units, an answer of hundreds of MB) get a 400 ``work_limit_exceeded`` at once, in the route's error
  shape, naming MAX_REQUEST_WORK and the format's own fields: native HTTP (JSON and form, streamed and
  not), gRPC (unary and streaming), OpenAI chat (``max_tokens`` and ``max_completion_tokens``) and
  completions; ``best_of`` gets its own clear 400 (not served); the witness never stalls and the worker is
  the same process afterwards;
* the limit is one measure, prompt tokens + n x max_new_tokens x (1 + logprob entries per token), applied
  after the prompt is tokenized: a request exactly at the limit is served, the same with one prompt
  token more is refused, and the refusal counts the prompt's tokens;
* ordinary requests pass: a chat with max_tokens 2048 (as much as the KV pool lets one request hold) and
  top_logprobs 20, and n = 4 choices of as many tokens with 20 logprobs each (180,224 units and the
  prompt's).

The limit's formula and default are in ``llm_api.service.request``; the figures from a run are in
docs/reliability.md ("Hostile input, by class").
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections import Counter

import grpc
import pytest

from bench.harness.hostile import (MARKER, Answer, Witness, openai_path, native_path, outcome, post_json, raw_request, refusal_problems,
                     report, tokenizer_path)
from llm_api.proto import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.server

LIMIT = 262_144  # MAX_REQUEST_WORK's default (the shared servers run with it)
QUICK_S = 10.0  # a refusal up front takes milliseconds; this leaves room for a loaded 2-core machine
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def grpc_answer(server, fields: dict, stream: bool) -> Answer:
    """A gRPC call as an ``Answer``: the messages joined; a body holding an error object gets its code as the
    status (gRPC refusals are one OK message holding the native error object)."""
    with grpc.insecure_channel(server.grpc) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name=server.model_name,
                                                   input={k: str(v).encode() for k, v in fields.items()})
        auth = (("authorization", f"Bearer {server.key()}"),)
        if stream:
            body = b"".join(r.prediction for r in stub.StreamPredictions(request, metadata=auth, timeout=120))
        else:
            body = stub.Predictions(request, metadata=auth, timeout=120).prediction
    try:
        status = json.loads(body)["code"]
    except (ValueError, KeyError, TypeError):
        status = 200
    return Answer(status, {}, body)


def send(server, route: str, payload) -> Answer:
    if route == "native":
        return post_json(server, native_path(server), payload)
    if route == "form":
        return raw_request(server, "POST", native_path(server), urllib.parse.urlencode(payload).encode(),
                           content_type="application/x-www-form-urlencoded")
    if route in ("grpc", "grpc-stream"):
        return grpc_answer(server, payload, stream=route == "grpc-stream")
    return post_json(server, openai_path(server, route), payload)


def prompt_tokens(server, text: str) -> int:
    answer = post_json(server, tokenizer_path(server, "tokenize"), {"prompt": text})
    assert answer.status == 200, answer.body[:300]
    return answer.json()["count"]


def max_model_len(server) -> int:
    return post_json(server, tokenizer_path(server, "tokenize"), {"prompt": "x"}).json()["max_model_len"]


def extreme_cases(model: str) -> list[tuple[str, str, dict, str]]:
    """(name, route, payload, the field the refusal names)."""
    native = {"text": "Hi", "n": 64, "max_new_tokens": 2048, "logprobs": 20, "output": "jsonl"}
    chat = {"model": model, "messages": CHAT, "n": 64, "max_tokens": 2048, "logprobs": True, "top_logprobs": 20}
    return [
        ("native 64 x 2048 x 20", "native", native, "logprobs"),
        ("native unary", "native", {**native, "stream": False}, "logprobs"),
        ("native 64 x 2048 x logprobs 0", "native", {**native, "logprobs": 0}, "logprobs"),
        ("native 13 x 1000 x 20", "native", {**native, "n": 13, "max_new_tokens": 1000}, "logprobs"),
        ("native form", "form", native, "logprobs"),
        ("gRPC unary", "grpc", native, "logprobs"),
        ("gRPC streaming", "grpc-stream", {**native, "stream": "true"}, "logprobs"),
        ("chat streamed", "chat/completions", {**chat, "stream": True}, "top_logprobs"),
        ("chat whole", "chat/completions", chat, "top_logprobs"),
        ("chat max_completion_tokens", "chat/completions",
         {**{k: v for k, v in chat.items() if k != "max_tokens"}, "max_completion_tokens": 2048}, "top_logprobs"),
        ("chat 64 x 2048 x 0 alternatives", "chat/completions", {**chat, "top_logprobs": 0}, "top_logprobs"),
        ("completions 64 x 2048 x 5", "completions",
         {"model": model, "prompt": "Hi", "n": 64, "max_tokens": 2048, "logprobs": 5}, "logprobs"),
        ("completions streamed", "completions",
         {"model": model, "prompt": "Hi", "n": 64, "max_tokens": 2048, "logprobs": 5, "stream": True}, "logprobs"),
    ]


def test_amplified_requests_are_refused_up_front(async_frontend):
    server = async_frontend
    cases = extreme_cases(server.model_name)
    best_of = [
        ("completions best_of 64", "completions",
         {"model": server.model_name, "prompt": "Hi", "n": 64, "best_of": 64, "max_tokens": 2048}, "unsupported_parameter"),
        ("chat best_of", "chat/completions", {"model": server.model_name, "messages": CHAT, "best_of": 8},
         "unknown_parameter"),
        ("native best_of", "native", {"text": "Hi", "best_of": 8}, "unknown_field"),
    ]
    problems, answers, slowest = [], Counter(), 0.0
    with Witness(server) as witness:
        for name, route, payload, param in cases:
            started = time.monotonic()
            answer = send(server, route, payload)
            slowest = max(slowest, time.monotonic() - started)
            answers[outcome(answer)] += 1
            openai = route in ("chat/completions", "completions")
            if route.startswith("grpc"):
                problems += refusal_problems(name, Answer(answer.status, {}, answer.body), openai=False)
            else:
                problems += refusal_problems(name, answer, openai=openai)
            error = answer.json() if answer.status == 400 else {}
            error = error.get("error", error)
            code = error.get("code") if openai else error.get("type")
            if code != "work_limit_exceeded" or "MAX_REQUEST_WORK=262,144" not in error.get("message", ""):
                problems.append(f"{name}: {answer.status} {answer.body[:300]!r}")
            elif openai and error.get("param") != param:
                problems.append(f"{name}: param {error.get('param')!r}, not {param!r}")
        for name, route, payload, code in best_of:
            answer = send(server, route, payload)
            answers[outcome(answer)] += 1
            problems += refusal_problems(name, answer, openai=route != "native")
            error = answer.json()
            if (error["error"]["code"] if route != "native" else error["type"]) != code or "best_of" not in answer.body.decode():
                problems.append(f"{name}: {answer.body[:300]!r}")
    assert not problems, "\n".join(problems)
    assert slowest < QUICK_S, f"a refusal took {slowest:.1f} s"
    report("amplification", server, inputs=len(cases) + len(best_of), answers=answers, witness=witness,
           slowest_refusal_s=round(slowest, 3))


def test_the_limit_counts_the_prompt_and_serves_up_to_it(async_frontend):
    """16 choices x 744 tokens x (1 + 21 logprob entries) = 261,888 units: with a prompt of 256 tokens that is
    the limit exactly (served), with 257 one unit over (refused, the prompt's tokens named). The answers
    stop at once (a stop string every continuation holds), so serving costs a step."""
    server = async_frontend
    base = "Hi" + " a" * 255
    assert prompt_tokens(server, base) == 256 and prompt_tokens(server, base + " a") == 257
    fields = {"n": 16, "max_new_tokens": 744, "logprobs": 20, "output": "jsonl", "stop": [" ", "a", "\n"]}
    assert 256 + 16 * 744 * 22 == LIMIT and 256 + 744 <= max_model_len(server)
    served = post_json(server, native_path(server), {"text": base, **fields})
    assert served.status == 200, served.body[:300]
    lines = served.body.decode().removesuffix(MARKER).splitlines()
    assert sum("finish_reason" in json.loads(line) for line in lines) == 16
    over = post_json(server, native_path(server), {"text": base + " a", **fields})
    assert over.status == 400 and over.json()["type"] == "work_limit_exceeded", over.body[:300]
    assert "+ 257 prompt tokens = 262,145 units" in over.json()["message"]
    # The same bound on the OpenAI routes, named in their own fields: the output alone fits, the prompt does not.
    chat = post_json(server, openai_path(server, "chat/completions"), {
        "model": server.model_name, "messages": [{"role": "user", "content": base}], "n": 16, "max_tokens": 744,
        "logprobs": True, "top_logprobs": 20})
    assert chat.status == 400 and chat.json()["error"]["code"] == "work_limit_exceeded", chat.body[:300]
    assert "n=16 x max_tokens=744 x (1 + 21 logprob entries per token: top_logprobs=20" in chat.json()["error"]["message"]


def test_ordinary_requests_pass(async_frontend):
    """A single chat with max_tokens 2048 (or what the KV pool lets one request hold) and top_logprobs 20, and
    4 choices of as many tokens with 20 logprobs each: below the limit, served with their logprobs. The
    choices end at their first sentence (a stop string), so serving them costs a few steps."""
    server = async_frontend
    longest = min(2048, max_model_len(server) - 64)
    chat = post_json(server, openai_path(server, "chat/completions"), {
        "model": server.model_name, "messages": CHAT, "max_tokens": longest, "temperature": 0, "logprobs": True,
        "top_logprobs": 20})
    assert chat.status == 200, chat.body[:300]
    choice = chat.json()["choices"][0]
    assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop"
    assert all(len(entry["top_logprobs"]) == 20 for entry in choice["logprobs"]["content"])
    assert 4 * longest * 22 < LIMIT
    native = post_json(server, native_path(server), {"messages": CHAT, "n": 4, "max_new_tokens": longest,
                                                     "logprobs": 20, "output": "jsonl", "stop": [".", "\n"]})
    assert native.status == 200 and native.body.endswith(MARKER.encode()), native.body[-300:]
    lines = [json.loads(line) for line in native.body.decode().removesuffix(MARKER).splitlines()]
    assert sorted(line["index"] for line in lines if "finish_reason" in line) == list(range(4))
    entries = [entry for line in lines for entry in line.get("logprobs", ())]
    assert entries and all(len(entry["top_logprobs"]) == 20 for entry in entries)
