"""The Responses API through the real `openai` package, on both front ends (TorchServe in the shipped async
mode, below /predictions/<model>/1.0/v1, and `llm_api serve`, at /v1), with the real embedded model.

What it proves: `responses.create` whole and streamed (the typed events in the order the package parses
them, the same text both ways), `.retrieve` and `.delete` (TorchServe: the method override the handler
needs, and a DELETE without it refused, never taken for a GET), a `previous_response_id` chain that
remembers a fact, a function-call round trip on a model whose template has no tool format (call,
`function_call_output`, answer), `text.format` json_schema output that validates, another key reading
nothing of a stored response (the standalone server takes two keys), and the store's bound under a flood
(the oldest evicted)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse

import jsonschema
import pytest

pytestmark = pytest.mark.server
MODEL = "smollm2"
QUESTION = "What is the capital of France?"
DELETE_OVERRIDE = {"X-HTTP-Method-Override": "DELETE"}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


def client_of(server, key: str | None = None):
    import openai

    return openai.OpenAI(base_url=server.openai_base, api_key=key or server.key(), max_retries=0, timeout=120)


def test_create_whole_and_streamed(async_frontend):
    client = client_of(async_frontend)
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    assert whole.status == "completed" and "Paris" in whole.output_text
    assert whole.usage.input_tokens > 5 and 0 < whole.usage.output_tokens <= 24
    assert whole.output[0].type == "message" and whole.output[0].content[0].type == "output_text"

    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(deltas) > 2
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == whole.output_text == events[-1].response.output_text  # (float32: greedy is exact)

    cut = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert async_frontend.worker_status() == "READY"


def test_retrieve_delete_and_the_method_torchserve_cannot_see(async_frontend, request):
    import openai

    client = client_of(async_frontend)
    created = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8, temperature=0)
    got = client.responses.retrieve(created.id)
    assert got.id == created.id and got.output_text == created.output_text and got.status == "completed"
    torchserve = "torchserve" in request.node.callspec.id
    if torchserve:
        # TorchServe hands the handler no method: a DELETE must say so, and one that does not is refused.
        with pytest.raises(openai.BadRequestError, match="X-HTTP-Method-Override") as refused:
            client.responses.delete(created.id)
        assert refused.value.body["code"] == "method_unknown"
        assert client.responses.retrieve(created.id).id == created.id  # (still there)
    client.responses.delete(created.id, extra_headers=DELETE_OVERRIDE if torchserve else None)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete("resp_" + "0" * 32, extra_headers=DELETE_OVERRIDE)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="hi", previous_response_id=created.id)
    unstored = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_previous_response_id_chain_remembers(async_frontend):
    client = client_of(async_frontend)
    first = client.responses.create(model=MODEL, input="Remember: the secret code word is PINEAPPLE. Reply OK.",
                                    max_output_tokens=12, temperature=0)
    assert "PINEAPPLE" not in first.output_text
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="What is the secret code word?", max_output_tokens=16, temperature=0)
    assert "PINEAPPLE" in second.output_text
    # its prompt began with the first turn's prompt and answer, whose full blocks the prefix cache held
    assert first.usage.input_tokens - 16 < second.usage.input_tokens_details.cached_tokens < second.usage.input_tokens
    # Without the chain the model cannot know it (the word is only in the stored conversation).
    alone = client.responses.create(model=MODEL, input="What is the secret code word?", max_output_tokens=16,
                                    temperature=0)
    assert "PINEAPPLE" not in alone.output_text


def test_a_function_call_round_trip(async_frontend):
    client = client_of(async_frontend)
    called = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                     tool_choice="required", max_output_tokens=64, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"  # (the generic form: one call per answer)
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    answer = client.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[WEATHER], tool_choice="none", max_output_tokens=24,
        temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 degrees"}])
    assert answer.status == "completed" and answer.output_text

    streamed = list(client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], stream=True,
                                            tool_choice={"type": "function", "name": "get_weather"},
                                            max_output_tokens=64, temperature=0))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert len(done) == 1 and "".join(pieces) == done[0].arguments
    jsonschema.validate(json.loads(done[0].arguments), WEATHER["parameters"])


def test_text_format_json_schema(async_frontend):
    client = client_of(async_frontend)
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30},
                                               "population_millions": {"type": "integer", "minimum": 0}},
              "required": ["capital", "population_millions"], "additionalProperties": False}
    answer = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=60, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "city", "schema": schema}})
    value = json.loads(answer.output_text)
    assert set(value) == {"capital", "population_millions"} and isinstance(value["population_millions"], int)


def test_another_key_reads_nothing_and_the_store_stays_bounded(start_standalone):
    """Two keys are two owners; a flood of stored responses keeps the newest RESPONSES_STORE_MAX_ENTRIES, and a
    key's flood evicts its own entries before another key's."""
    import openai

    server = start_standalone("responses-owners", {"LLM_API_KEY": "first-key-123,second-key-456",
                                                   "RESPONSES_STORE_MAX_ENTRIES": "4", "MAX_NEW_TOKENS": "8"})
    try:
        first, second = client_of(server, "first-key-123"), client_of(server, "second-key-456")
        mine = first.responses.create(model=MODEL, input="hi", max_output_tokens=2)
        assert first.responses.retrieve(mine.id).id == mine.id
        streamed = first.responses.create(model=MODEL, input="hi", max_output_tokens=2, background=True, stream=True)
        streamed_id = next(iter(streamed)).response.id
        streamed.close()
        with pytest.raises(openai.NotFoundError):  # (another key's stream: 404, as for an unknown id)
            list(second.responses.retrieve(streamed_id, stream=True))
        assert list(first.responses.retrieve(streamed_id, stream=True))[-1].type in ("response.completed",
                                                                                   "response.incomplete")
        for attempt in (lambda: second.responses.retrieve(mine.id), lambda: second.responses.delete(mine.id),
                        lambda: second.responses.create(model=MODEL, input="hi", previous_response_id=mine.id)):
            with pytest.raises(openai.NotFoundError):
                attempt()
        # One identity per request: the second key's holder sending its own key and then the first key's
        # header text (a revoked key, a colleague's) is refused, on read and delete, before any route runs.
        for method in ("GET", "DELETE"):
            status, body = _twice_authorized(server, method, f"/v1/responses/{mine.id}",
                                             ["Bearer second-key-456", "Bearer first-key-123"])
            assert status == 400 and json.loads(body)["error"]["code"] == "duplicate_authorization", body
        assert first.responses.retrieve(mine.id).id == mine.id  # (still there, still its owner's)
        ids = [first.responses.create(model=MODEL, input=f"count {i}", max_output_tokens=2).id for i in range(6)]
        for response_id in [mine.id] + ids[:2]:
            with pytest.raises(openai.NotFoundError):
                first.responses.retrieve(response_id)
        assert [first.responses.retrieve(i).id for i in ids[2:]] == ids[2:]
        # One key's flood of large responses (30 tools of 2,000-character descriptions echoed into each stored
        # object) evicts its own history first: the other key's responses stay readable.
        kept = [second.responses.create(model=MODEL, input=f"keep {i}", max_output_tokens=2).id for i in range(2)]
        tools = [{"type": "function", "name": f"tool_{i}", "description": "d" * 2000,
                  "parameters": {"type": "object", "properties": {}}} for i in range(30)]
        flood = [first.responses.create(model=MODEL, input=f"flood {i}", tools=tools, tool_choice="none",
                                        max_output_tokens=2).id for i in range(6)]
        assert [second.responses.retrieve(i).id for i in kept] == kept
        assert first.responses.retrieve(flood[-1]).id == flood[-1]
    finally:
        server.stop()


def _twice_authorized(server, method: str, path: str, authorizations: list[str]) -> tuple[int, bytes]:
    """A request carrying one Authorization header per entry of ``authorizations``, in that order."""
    url = urllib.parse.urlsplit(server.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.putrequest(method, path)
        for value in authorizations:
            conn.putheader("Authorization", value)
        conn.putheader("Content-Length", "0")
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _poll(client, response_id: str, until: tuple[str, ...], timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = client.responses.retrieve(response_id)
        if got.status in until or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def test_background_responses_are_queued_polled_and_cancelled(async_frontend):
    """``background: true``: answered at once (queued), polled with GET until completed and stored as a
    foreground answer is (the same greedy text); a long one cancelled mid-way ends cancelled (stored so);
    without ``store`` it is refused. (Owners: the same store as foreground responses, tested above.)"""
    import openai

    client = client_of(async_frontend)
    queued = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0, background=True)
    assert queued.status == "queued" and queued.background is True
    done = _poll(client, queued.id, ("completed", "incomplete", "failed"))
    foreground = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=24, temperature=0)
    assert done.status == "completed" and done.output_text == foreground.output_text and done.background is True
    long = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1000, temperature=0,
                                   background=True, extra_body={"ignore_eos": True})
    assert _poll(client, long.id, ("in_progress",), 60).status == "in_progress"
    # (cancel answers once the response ended, or after 5 s as it stands: a loaded 2-core host may take longer)
    assert client.responses.cancel(long.id).status in ("cancelled", "in_progress")
    assert _poll(client, long.id, ("cancelled", "completed", "incomplete"), 60).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=QUESTION, background=True, store=False)
    assert err.value.body["param"] == "background"


def test_background_responses_stream_and_resume(async_frontend):
    """``background`` with ``stream``: the answer streams its events (``sequence_number`` 0, 1, ...); a client
    that drops the stream leaves the response running, and ``retrieve(id, stream=True, starting_after=N)``
    (what the openai package sends as ``GET ...?stream=true&starting_after=N``) gives every event after N to the
    end; after the end the whole stream can be read again, and the stored response holds the same text. A
    foreground response has no stream to read (400)."""
    import openai

    client = client_of(async_frontend)
    stream = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, temperature=0,
                                     background=True, stream=True, extra_body={"ignore_eos": True})
    first = []
    for event in stream:
        first.append(event)
        if sum(e.type == "response.output_text.delta" for e in first) >= 3:
            break
    stream.close()  # (the client goes away: the response runs on)
    response_id = first[0].response.id
    assert first[0].type == "response.created" and first[0].response.background is True
    # (TorchServe's frontend drops the query: there the client says it in headers, which every edge takes)
    resume = {"Accept": "text/event-stream", "X-Starting-After": str(first[-1].sequence_number)}
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=first[-1].sequence_number,
                                          extra_headers=resume))
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert rest[-1].type == "response.incomplete"  # (ignore_eos: cut by max_output_tokens)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    stored = client.responses.retrieve(response_id)
    assert stored.status == "incomplete" and stored.output_text == text and len(text) > 0
    again = list(client.responses.retrieve(response_id, stream=True, extra_headers={"Accept": "text/event-stream"}))
    assert [(e.type, e.sequence_number) for e in again] == [(e.type, e.sequence_number) for e in events]
    foreground = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        list(client.responses.retrieve(foreground.id, stream=True, extra_headers={"Accept": "text/event-stream"}))
    assert err.value.body["param"] == "stream"
    with pytest.raises(openai.NotFoundError):
        list(client.responses.retrieve("resp_unknown", stream=True, extra_headers={"Accept": "text/event-stream"}))


def test_background_responses_are_capped_per_key(async_frontend):
    """RESPONSES_BACKGROUND_PER_OWNER (8): the ninth background response of one key in flight is a 429 until
    one ends."""
    import openai

    client = client_of(async_frontend)
    ids: list[str] = []
    refused = None
    try:
        for _ in range(9):  # (a test before may have left one of this key's running: the 429 comes by the ninth)
            try:
                ids.append(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1000,
                                                   background=True, extra_body={"ignore_eos": True}).id)
            except openai.RateLimitError as err:
                refused = err
                break
    finally:
        for response_id in ids:
            client.responses.cancel(response_id)
    assert refused is not None and refused.body["code"] == "too_many_background_responses", len(ids)
    assert refused.response.headers.get("retry-after") == "1"
    for response_id in ids:
        assert _poll(client, response_id, ("cancelled", "completed", "incomplete", "failed"), 60).status == "cancelled"
    again = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2, background=True)
    assert _poll(client, again.id, ("completed", "incomplete", "failed")).status in ("completed", "incomplete")


def test_a_crash_leaves_its_background_responses_failed_not_queued(start_standalone, tmp_path):
    """A server killed (SIGKILL) with a background response running, then started again on the same SQLite store
    (RESPONSES_STORE_PATH): the response reads ``failed``, its error saying the server stopped (not resumed)."""
    import os
    import signal

    env = {"LLM_API_KEY": "crash-key-12345", "RESPONSES_STORE_PATH": str(tmp_path / "responses.db"),
           "DTYPE": "float32", "KV_CACHE_MEMORY_MIB": "64"}
    first = start_standalone("responses-crash-1", env)
    try:
        client = client_of(first, "crash-key-12345")
        running = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1000, background=True,
                                          extra_body={"ignore_eos": True})
        assert _poll(client, running.id, ("in_progress",), 60).status == "in_progress"
        os.kill(first.server_pid(), signal.SIGKILL)
    finally:
        first.stop()
    second = start_standalone("responses-crash-2", env)
    try:
        after = client_of(second, "crash-key-12345").responses.retrieve(running.id)
        assert after.status == "failed" and "not resumed" in after.error.message, after
    finally:
        second.stop()
