"""``llm_api.protocols.wire``: the one loop every edge writes an answer with, over each format's real encoder.

A failure of the answer's parts after the first chunk ends the stream in the route's own format (the same
text that format's ``fail`` writes: a native error line, an SSE error event, Anthropic's ``error`` event), a
failure before any chunk is raised for the edge to render as a refusal, refusals and unstreamed answers are
whole answers, and closing the writer closes the parts. The edges' use of it: tests/test_edge_failures.py (a
failure injected into real servers) and tests/test_architecture.py (no edge reads parts itself).
"""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from llm_api.errors import ApiError, internal_error
from llm_api.protocols.common.openai_call import OpenAICall
from llm_api.protocols.messages.encoder import MessagesCall
from llm_api.protocols.native.encoder import NativeStream
from llm_api.protocols.responses.encoder import ResponsesCall
from llm_api.protocols.route import Streamed, Whole
from llm_api.protocols.wire import wire
from llm_api.service.answer import Chunk, Final, Refusal

MARKER = "<|endoftext|>"


def _responses_call() -> ResponsesCall:
    from llm_api.protocols.responses.translate import parse_responses
    from llm_api.service.request import Limits

    limits = Limits(max_input_tokens=2048, max_new_tokens=512, vocab_size=49152)
    _, call = parse_responses(json.dumps({"model": "m", "input": "Hi", "stream": True}).encode(), "m", limits)
    return call


ENCODERS = {
    "native text": lambda: NativeStream(MARKER, streaming=True),
    "native json lines": lambda: NativeStream(MARKER, streaming=True, json_lines=True),
    "chat": lambda: OpenAICall("chat", "m", stream=True, include_usage=False, marker=MARKER),
    "completions": lambda: OpenAICall("completions", "m", stream=True, include_usage=False, marker=MARKER),
    "responses": _responses_call,
    "messages": lambda: MessagesCall("m", True, marker=MARKER),
}


def _events(answer, request_id="r1") -> list:
    async def collect():
        return [event async for event in wire(answer, request_id)]

    return asyncio.run(collect())


def _parts(*items):
    """Parts that yield ``items`` in turn and raise the ones that are exceptions; ``closed`` says whether they
    were closed."""
    closed = []

    async def parts():
        try:
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            closed.append(True)

    return parts(), closed


@pytest.mark.parametrize("fmt", ENCODERS)
@pytest.mark.parametrize("failure", [RuntimeError("a bug"), ApiError(408, "timeout", "the request exceeded its deadline"),
                                     None], ids=["bug", "api-error", "no-final-part"])
def test_a_failure_after_the_first_chunk_ends_the_stream_in_the_routes_format(fmt, failure):
    encoder = ENCODERS[fmt]()
    first = encoder.delta("Hello", 0)
    expected_error = failure if isinstance(failure, ApiError) else internal_error("the server failed to handle "
                                                                                  "this request")
    expected = copy.deepcopy(encoder).fail(expected_error)
    parts, closed = _parts(Chunk(first, encoder.content_type), *([failure] if failure else []))
    events = _events(Streamed(parts, encoder))
    assert events == [Chunk(first, encoder.content_type), Final(expected, encoder.content_type)] and closed
    # The ending is the route's own: SSE formats end in SSE, the native stream in its error line.
    if fmt.startswith("native"):
        assert expected_error.code in expected and not expected.lstrip().startswith(("data:", "event:"))
    else:
        assert expected.startswith(("data:", "event:")) and expected_error.code in expected
    assert MARKER not in expected


@pytest.mark.parametrize("failure", [RuntimeError("a bug"), ApiError(429, "overloaded", "later", retry_after=3)],
                         ids=["bug", "api-error"])
def test_a_failure_before_any_chunk_is_raised_for_the_edge_to_refuse(failure):
    encoder = ENCODERS["chat"]()
    parts, closed = _parts(failure)
    with pytest.raises(ApiError) as raised:
        _events(Streamed(parts, encoder))
    if isinstance(failure, ApiError):
        assert raised.value is failure
    else:
        assert raised.value.status == 500 and raised.value.code == "internal_error"
    assert closed


def test_refusals_and_unstreamed_answers_are_whole_answers():
    encoder = ENCODERS["chat"]()
    parts, _ = _parts(Refusal(503, '{"error": "busy"}', {"Retry-After": "2"}))
    assert _events(Streamed(parts, encoder)) == [Whole(503, '{"error": "busy"}', "application/json",
                                                       {"Retry-After": "2"})]
    parts, _ = _parts(Final('{"whole": true}', "application/json"))
    assert _events(Streamed(parts, encoder)) == [Whole(200, '{"whole": true}', "application/json")]
    whole = Whole(200, "body", "text/plain")
    assert _events(whole) == [whole]


def test_closing_the_writer_closes_the_answers_parts():
    encoder = ENCODERS["chat"]()
    parts, closed = _parts(Chunk("a", "text/event-stream"), Chunk("b", "text/event-stream"),
                           Final("c", "text/event-stream"))

    async def read_one_and_leave():
        events = wire(Streamed(parts, encoder), "r1")
        first = await anext(events)
        await events.aclose()  # (an edge's aclosing when its client went away)
        return first

    assert asyncio.run(read_one_and_leave()) == Chunk("a", "text/event-stream") and closed
