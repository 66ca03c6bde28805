"""OpenResponses compliance (openresponses.org): the upstream suite's cases and schema checks, written here.

Upstream (github.com/openresponses/openresponses) runs its suite as a TypeScript CLI
(``bin/compliance-test.ts`` over ``src/lib/compliance-tests.ts`` and ``src/lib/sse-parser.ts``, which
validate with zod schemas generated from ``public/openapi/openapi.json``). Neither the CLI nor its schemas
are published on npm (``npm view`` of ``openresponses``, ``@openresponses/compliance``,
``@openresponses/cli``, ``openresponses-compliance`` and ``@openresponses/openresponses``: 404; the
repository's package.json names a private ``openresponses`` 0.1.0 and CI reaches only the registries), so
this module checks the same things in Python. What was read (no code copied):

* the six cases of ``src/lib/compliance-tests.ts`` at commit 5e23378173195d4dd155d65aa63a8204f032893b
  (basic-response, streaming-response, system-prompt, tool-calling, image-input, multi-turn; a later
  commit, 0cb939ccf839234347b4f0c317569b49fad8fd0e, adds tool-calling-streaming, checked here too): each
  answer must be a 200 whose body (or, streamed, the ``response`` of ``response.completed`` /
  ``response.failed``) is a valid ``ResponseResource``, every streamed event valid against its event
  schema, with output items and ``status: completed`` (the tool cases: a ``function_call`` item, and
  streamed its added / arguments delta / arguments done / item done events);
* the schemas: ``public/openapi/openapi.json`` at 1e33c10fb3c19480751658eae966dad8e9c91514 and
  ``schema/components/schemas/{ResponseResource,OutputTextContent,ResponseOutputTextDeltaStreamingEvent,
  ResponseOutputTextDoneStreamingEvent}.json`` at 5e23378 / 3452c0125645c81acc7690ebb612b6cb1000e19f
  (the stricter of the two where they differ: ``user`` required, ``logprobs`` required on output_text and
  on the text delta / done events).

The image case is allowed to fail: the embedded model reads text only, so the server refuses an
``input_image`` part with a well-formed 400 (OpenAI's error body naming the field). Every other case must
pass: 5 of upstream's 6, and its later streamed tool case. Upstream's tool cases leave the choice to the
model (``tool_choice`` auto); the embedded SmolLM2 has no tool format, and in the generic form its prompt
nudges it to call (``llm_api.text.tools.GenericPrompt``), which it then does for the weather question. The
same cases with the call forced (ours) pass on any model. The cases run greedy
(upstream sends no temperature; sampled, "Count from 1 to 5." sometimes ran past the 256-token default). Known divergence, on
purpose: the ``error`` stream event keeps OpenAI's shape (code, message, param at the top; OpenResponses
nests them in an ``error`` object, on which the ``openai`` package raises instead of yielding the event),
and the reasoning stream events keep OpenAI's names (``response.reasoning_text.delta`` / ``.done``).
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

import pytest

from llm_api.engine.request import FinishReason
from llm_api.protocols.responses.translate import parse_responses
from llm_api.service.request import Limits
from llm_api.text.tools import HERMES

MODEL = "smollm2"

# ------------------------------------------------------------------------------------------ the checker
# A spec is: a Python type (str, int, bool, list, dict; NUMBER for int or float), None (JSON null), ANY,
# a tuple of specs (any of them), Const(value), Array(spec), Obj(required, optional) or OneOf(name -> spec
# by the value's "type").


@dataclass(frozen=True)
class Const:
    value: Any


@dataclass(frozen=True)
class Array:
    items: Any


@dataclass(frozen=True)
class Obj:
    required: dict
    optional: dict | None = None


@dataclass(frozen=True)
class OneOf:
    by_type: dict  # the value's "type" -> its spec


NUMBER, ANY = "number", "any"


def problems(value: Any, spec: Any, path: str = "$") -> list[str]:
    """What in ``value`` breaks ``spec`` (see above), one line per problem naming its JSON path."""
    if spec is ANY:
        return []
    if spec is None:
        return [] if value is None else [f"{path}: expected null, got {value!r:.60}"]
    if isinstance(spec, tuple):
        found = [problems(value, alternative, path) for alternative in spec]
        return [] if any(not p for p in found) else min(found, key=len)
    if isinstance(spec, Const):
        return [] if value == spec.value else [f"{path}: expected {spec.value!r}, got {value!r:.60}"]
    if spec == NUMBER:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return [] if ok else [f"{path}: expected a number, got {value!r:.60}"]
    if isinstance(spec, type):
        ok = isinstance(value, spec) and not (spec is int and isinstance(value, bool))
        return [] if ok else [f"{path}: expected {spec.__name__}, got {value!r:.60}"]
    if isinstance(spec, Array):
        if not isinstance(value, list):
            return [f"{path}: expected an array, got {value!r:.60}"]
        return [p for i, item in enumerate(value) for p in problems(item, spec.items, f"{path}[{i}]")]
    if isinstance(spec, OneOf):
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in spec.by_type:
            return [f"{path}: type {kind!r} is none of {sorted(spec.by_type)}"]
        return problems(value, spec.by_type[kind], path)
    assert isinstance(spec, Obj), spec
    if not isinstance(value, dict):
        return [f"{path}: expected an object, got {value!r:.60}"]
    out = [f"{path}.{name}: missing" for name in spec.required if name not in value]
    for name, field_spec in {**(spec.optional or {}), **spec.required}.items():
        if name in value:
            out += problems(value[name], field_spec, f"{path}.{name}")
    return out


# ------------------------------------------------------------------------------------------ the schemas

ITEM_STATUS = (Const("in_progress"), Const("completed"), Const("incomplete"))
LOGPROB = Obj({"token": str, "logprob": NUMBER, "bytes": Array(int),
               "top_logprobs": Array(Obj({"token": str, "logprob": NUMBER, "bytes": Array(int)}))})
OUTPUT_TEXT = Obj({"type": Const("output_text"), "text": str, "annotations": Array(dict), "logprobs": Array(LOGPROB)})
CONTENT_PART = OneOf({
    "input_text": Obj({"type": Const("input_text"), "text": str}),
    "output_text": OUTPUT_TEXT,
    "text": Obj({"type": Const("text"), "text": str}),
    "summary_text": Obj({"type": Const("summary_text"), "text": str}),
    "reasoning_text": Obj({"type": Const("reasoning_text"), "text": str}),
    "refusal": Obj({"type": Const("refusal"), "refusal": str}),
})
ITEM = OneOf({
    "message": Obj({"type": Const("message"), "id": str, "status": ITEM_STATUS,
                    "role": (Const("user"), Const("assistant"), Const("system"), Const("developer")),
                    "content": Array(CONTENT_PART)}),
    "function_call": Obj({"type": Const("function_call"), "id": str, "call_id": str, "name": str, "arguments": str,
                          "status": ITEM_STATUS}),
    "function_call_output": Obj({"type": Const("function_call_output"), "id": str, "call_id": str,
                                 "output": (str, Array(CONTENT_PART)), "status": ITEM_STATUS}),
    "reasoning": Obj({"type": Const("reasoning"), "id": str, "summary": Array(CONTENT_PART)},
                     {"content": Array(CONTENT_PART), "encrypted_content": str}),
})
FUNCTION_TOOL = Obj({"type": Const("function"), "name": str, "description": (str, None), "parameters": (dict, None),
                     "strict": (bool, None)})
TOOL_CHOICE = (Const("none"), Const("auto"), Const("required"), Obj({"type": Const("function")}, {"name": str}),
               Obj({"type": Const("allowed_tools"), "tools": Array(Obj({"type": Const("function")}, {"name": str})),
                    "mode": (Const("none"), Const("auto"), Const("required"))}))
TEXT_FORMAT = OneOf({
    "text": Obj({"type": Const("text")}),
    "json_object": Obj({"type": Const("json_object")}),
    "json_schema": Obj({"type": Const("json_schema"), "name": str}, {"description": (str, None), "strict": bool}),
})
USAGE = Obj({"input_tokens": int, "output_tokens": int, "total_tokens": int,
             "input_tokens_details": Obj({"cached_tokens": int}),
             "output_tokens_details": Obj({"reasoning_tokens": int})})
EFFORTS = tuple(Const(e) for e in ("none", "minimal", "low", "medium", "high", "xhigh"))
RESPONSE = Obj({
    "id": str, "object": Const("response"), "created_at": int, "completed_at": (int, None), "status": str,
    "incomplete_details": (Obj({"reason": str}), None), "model": str, "previous_response_id": (str, None),
    "instructions": (str, None), "output": Array(ITEM), "error": (Obj({"code": str, "message": str}), None),
    "tools": Array(FUNCTION_TOOL), "tool_choice": TOOL_CHOICE, "truncation": (Const("auto"), Const("disabled")),
    "parallel_tool_calls": bool, "text": Obj({"format": TEXT_FORMAT}), "top_p": NUMBER, "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER, "top_logprobs": int, "temperature": NUMBER,
    "reasoning": (Obj({"effort": EFFORTS + (None,), "summary": (Const("concise"), Const("detailed"), Const("auto"),
                                                                  None)}), None),
    "user": (str, None), "usage": (USAGE, None), "max_output_tokens": (int, None), "max_tool_calls": (int, None),
    "store": bool, "background": bool, "service_tier": str, "metadata": ANY, "safety_identifier": (str, None),
    "prompt_cache_key": (str, None)})


def _event(kind: str, **fields: Any) -> Obj:
    return Obj({"type": Const(kind), "sequence_number": int, **fields})


_PART_EVENT = {"item_id": str, "output_index": int, "content_index": int}
EVENT = OneOf({
    **{kind: _event(kind, response=RESPONSE) for kind in (
        "response.created", "response.queued", "response.in_progress", "response.completed", "response.failed",
        "response.incomplete")},
    "response.output_item.added": _event("response.output_item.added", output_index=int, item=(ITEM, None)),
    "response.output_item.done": _event("response.output_item.done", output_index=int, item=(ITEM, None)),
    "response.content_part.added": _event("response.content_part.added", **_PART_EVENT, part=CONTENT_PART),
    "response.content_part.done": _event("response.content_part.done", **_PART_EVENT, part=CONTENT_PART),
    "response.output_text.delta": _event("response.output_text.delta", **_PART_EVENT, delta=str,
                                         logprobs=Array(LOGPROB)),
    "response.output_text.done": _event("response.output_text.done", **_PART_EVENT, text=str, logprobs=Array(LOGPROB)),
    "response.function_call_arguments.delta": _event("response.function_call_arguments.delta", item_id=str,
                                                     output_index=int, delta=str),
    "response.function_call_arguments.done": _event("response.function_call_arguments.done", item_id=str,
                                                    output_index=int, arguments=str),
    # OpenAI's names and error shape (see the module docstring)
    "response.reasoning_text.delta": _event("response.reasoning_text.delta", **_PART_EVENT, delta=str),
    "response.reasoning_text.done": _event("response.reasoning_text.done", **_PART_EVENT, text=str),
    "error": _event("error", code=(str, None), message=str, param=(str, None)),
})


def sse_events(payload: str) -> list[dict]:
    """The data objects of a server-sent event stream, parsed as upstream's parser does (``event:`` and one
    ``data:`` line per event, a blank line ending it)."""
    events, data = [], None
    for line in payload.split("\n"):
        if line.startswith("data:"):
            data = line[5:].strip()
        elif line == "" and data:
            events.append(json.loads(data))
            data = None
    return events


def stream_problems(events: list[dict]) -> list[str]:
    out = [p for i, e in enumerate(events) for p in problems(e, EVENT, f"events[{i}]")]
    if [e["sequence_number"] for e in events] != list(range(len(events))):
        out.append("sequence numbers do not count from 0")
    return out


def final_response(events: list[dict]) -> dict | None:
    ends = [e["response"] for e in events if e["type"] in ("response.completed", "response.failed")]
    return ends[-1] if ends else None


# ------------------------------------------------------------------------------------------ the cases

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a location",
           "parameters": {"type": "object", "properties": {"location": {
               "type": "string", "description": "The city and state, e.g. San Francisco, CA"}},
               "required": ["location"]}}
WEATHER_QUESTION = {"type": "message", "role": "user", "content": "What's the weather like in San Francisco?"}
PIXEL_PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQ"
             "AAAABJRU5ErkJggg==")
CASES = {  # id -> (body, streamed, what the answer must hold besides a valid completed Response)
    "basic-response": ({"input": [{"type": "message", "role": "user", "content": "Say hello in exactly 3 words."}]},
                       False, "output"),
    "streaming-response": ({"input": [{"type": "message", "role": "user", "content": "Count from 1 to 5."}]},
                           True, "output"),
    "system-prompt": ({"input": [
        {"type": "message", "role": "system", "content": "You are a pirate. Always respond in pirate speak."},
        {"type": "message", "role": "user", "content": "Say hello."}]}, False, "output"),
    "tool-calling": ({"input": [WEATHER_QUESTION], "tools": [WEATHER]}, False, "function_call"),
    "tool-calling-streaming": ({"input": [WEATHER_QUESTION], "tools": [WEATHER]}, True, "function_call"),
    # (ours: the same with the call forced, which every model serves)
    "tool-calling-required": ({"input": [WEATHER_QUESTION], "tools": [WEATHER], "tool_choice": "required"}, False,
                              "function_call"),
    "tool-calling-required-streaming": ({"input": [WEATHER_QUESTION], "tools": [WEATHER], "tool_choice": "required"},
                                        True, "function_call"),
    "image-input": ({"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
        {"type": "input_image", "image_url": PIXEL_PNG}]}]}, False, "output"),
    "multi-turn": ({"input": [
        {"type": "message", "role": "user", "content": "My name is Alice."},
        {"type": "message", "role": "assistant", "content": "Hello Alice! Nice to meet you. How can I help you today?"},
        {"type": "message", "role": "user", "content": "What is my name?"}]}, False, "output"),
}
UPSTREAM_SIX = ("basic-response", "streaming-response", "system-prompt", "tool-calling", "image-input", "multi-turn")


def case_problems(case: str, status: int, body: str) -> list[str]:
    """Upstream's verdict on one case's answer: [] when it passes."""
    _, streamed, must_hold = CASES[case]
    if status != 200:
        return [f"HTTP {status}: {body[:300]}"]
    if streamed:
        events = sse_events(body)
        if not events:
            return ["no streaming events"]
        found = stream_problems(events)
        response = final_response(events)
    else:
        events, found, response = [], [], json.loads(body)
    found += problems(response, RESPONSE, "response")
    if found:
        return found
    assert response is not None  # (else RESPONSE's check failed)
    if not response["output"]:
        found.append("the response has no output items")
    if must_hold == "function_call":
        if not any(item["type"] == "function_call" for item in response["output"]):
            found.append("no function_call output item")
        if streamed:
            kinds = [(e["type"], (e.get("item") or {}).get("type")) for e in events]
            for wanted in (("response.output_item.added", "function_call"),
                           ("response.function_call_arguments.delta", None),
                           ("response.function_call_arguments.done", None),
                           ("response.output_item.done", "function_call")):
                if wanted not in kinds:
                    found.append(f"no {wanted[0]} event" + (f" with a {wanted[1]} item" if wanted[1] else ""))
    elif response["status"] != "completed":
        found.append(f"status {response['status']!r}, not 'completed'")
    return found


def post(server, path: str, body: dict | None, method: str = "POST") -> tuple[int, str]:
    url = urllib.parse.urlsplit(server.openai_base + path)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
    try:
        headers = {"Authorization": f"Bearer {server.key()}", "Content-Type": "application/json"}
        connection.request(method, url.path, json.dumps(body) if body is not None else None, headers)
        answer = connection.getresponse()
        return answer.status, answer.read().decode()
    finally:
        connection.close()


# ------------------------------------------------------------------------------------------ the server


@pytest.mark.server
def test_the_upstream_cases_pass_but_the_image(standalone_server):
    verdicts = {}
    answers = {}
    for case, (body, streamed, _) in CASES.items():
        # upstream's bodies (no max_output_tokens: the server's default of 256), greedy: upstream sends no
        # temperature, and a sampled "Count from 1 to 5." sometimes ran past 256 tokens (incomplete)
        status, text = post(standalone_server, "/responses", {"model": MODEL, **body, "stream": streamed,
                                                              "temperature": 0})
        verdicts[case], answers[case] = case_problems(case, status, text), (status, text)
    shown = {case: [line[:200] for line in found[:3]] for case, found in verdicts.items() if found}
    failed = [case for case, found in verdicts.items() if found]
    assert failed == ["image-input"], shown  # 5/6 of upstream's six, its later streamed tool case, ours
    status, text = answers["image-input"]  # refused, well formed, naming the part
    error = json.loads(text)["error"]
    assert status == 400 and problems(error, Obj({"message": str, "type": str, "param": (str, None),
                                                  "code": (str, None)})) == []
    assert error["param"] == "input[0].content[1].type" and "input_image" in error["message"]

    # the stored response, as GET /v1/responses/{id} returns it, is the same valid object
    created = json.loads(answers["basic-response"][1])
    status, text = post(standalone_server, f"/responses/{created['id']}", None, "GET")
    assert status == 200 and problems(json.loads(text), RESPONSE) == [] and json.loads(text) == created
    assert created["completed_at"] >= created["created_at"]
    content = created["output"][0]["content"][0]
    assert content["annotations"] == [] and content["logprobs"] == []


@pytest.mark.server
def test_incomplete_and_continued_responses_are_valid(standalone_server):
    status, text = post(standalone_server, "/responses", {"model": MODEL, "input": "Tell me a story.",
                                                          "max_output_tokens": 2, "stream": True})
    events = sse_events(text)
    assert status == 200 and stream_problems(events) == []
    cut = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and problems(cut, RESPONSE) == []
    assert cut["completed_at"] is None and cut["incomplete_details"] == {"reason": "max_output_tokens"}

    status, text = post(standalone_server, "/responses", {"model": MODEL, "input": "And then?", "max_output_tokens": 8,
                                                          "previous_response_id": cut["id"], "temperature": 0})
    follow = json.loads(text)
    assert status == 200 and problems(follow, RESPONSE) == [] and follow["previous_response_id"] == cut["id"]
    # the earlier prompt and answer came from the prefix cache (16-token blocks: all but a partial block)
    assert cut["usage"]["input_tokens"] - 16 < follow["usage"]["input_tokens_details"]["cached_tokens"] \
        < follow["usage"]["input_tokens"]


# ------------------------------------------------------------------------------------------ the encoder

THINKING = Limits(max_input_tokens=2048, max_new_tokens=512, vocab_size=49152, tool_format=HERMES,
                  reasoning_format=None)


def _feed(call, text: str) -> str:
    out = "".join(call.delta(piece, num_tokens=1) for piece in text.split(" "))
    return out + call.finish(FinishReason.STOP, 9, len(text.split(" ")), num_cached_tokens=4)


def test_every_event_and_item_of_a_reasoning_and_calling_answer_is_valid():
    from llm_api.text.reasoning import QWEN3
    from dataclasses import replace

    limits = replace(THINKING, reasoning_format=QWEN3)
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}
    text = ('<think>\nLook it up. </think>\n\nLet me look. <tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>')
    for stream in (False, True):
        _, call = parse_responses({"model": MODEL, "input": "Weather?", "tools": [tool], "stream": stream},
                                  MODEL, limits)
        payload = _feed(call, text)
        if stream:
            events = sse_events(payload)
            assert stream_problems(events) == []
            response = events[-1]["response"]
            assert problems(events[0]["response"], RESPONSE) == [] and events[0]["response"]["completed_at"] is None
        else:
            response = json.loads(payload)
        assert problems(response, RESPONSE) == []
        assert [item["type"] for item in response["output"]] == ["reasoning", "message", "function_call"]
        assert response["usage"]["input_tokens_details"]["cached_tokens"] == 4
        assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 4  # "<think>\nLook", "it", "up.", "</think>..."
        assert problems(call.response_json(), RESPONSE) == []  # what the store keeps
