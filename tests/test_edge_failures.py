"""The same failure, injected into real servers, ends each stream in its route's own format on every edge.

Both front ends run with ``tests/assets/inject_failure`` on their PYTHONPATH and
``LLM_API_INJECT_FAILURE=after-first-chunk``: every answer's parts raise right after their first chunk (its
``sitecustomize`` says how), as a bug in the engine or an encoder would. Each streamed route must then end with
its own in-band error (``llm_api.protocols.wire``): the native stream with its JSON error line, chat and
completions with an OpenAI error event and ``[DONE]``, Responses with ``error`` and ``response.failed``, Anthropic
Messages with its ``error`` event; over HTTP on `llm_api serve` and on TorchServe (whose SSE streams once ended
with a native error line instead), and over gRPC StreamPredictions on both. Each server keeps serving after it.
(Under ``--ray`` the replica writes through the same ``wire``: tests/test_architecture.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import pytest

from llm_api.proto import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.server

INJECT = str(Path(__file__).parent / "assets" / "inject_failure")
REPO = str(Path(__file__).resolve().parents[1])
ENV = {"LLM_API_INJECT_FAILURE": "after-first-chunk", "PYTHONPATH": f"{INJECT}:{REPO}", "MAX_NUM_SEQS": "4",
       "GRPC_STREAMING": "true", "KV_CACHE_MEMORY_MIB": "64", "DTYPE": "float32"}
MODEL = "smollm2"
# (ignore_eos on the native route: a chunk before the end on any host kind, so the failure is injected)
PROMPT = "Write a long story about a lighthouse keeper."


@pytest.fixture(scope="module", params=["standalone", "torchserve"])
def injected(request, start_standalone, start_server):
    if request.param == "standalone":
        server = start_standalone("inject-standalone", env=ENV)
    else:
        server = start_server("inject-torchserve", (Path(REPO) / "model-config.yaml").read_text(), env=ENV)
    yield server
    server.stop()


def _post(server, path: str | None, body: dict) -> str:
    """POST to ``path`` below the server's OpenAI base (``/v1/...``), or to the native route (``None``)."""
    url = server.native_url if path is None else server.openai_base.removesuffix("/v1") + path
    answer = httpx.post(url, json=body, timeout=120,
                        headers={"Authorization": f"Bearer {server.key()}"})
    assert answer.status_code == 200, answer.text  # (the stream began: a 200, and the error comes in-band)
    return answer.text


def _sse(text: str) -> list[tuple[str | None, str]]:
    """The stream's events as (event name or None, data); every line must be SSE (no native line mixed in)."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name, data = None, None
        for line in block.split("\n"):
            assert line.startswith(("event: ", "data: ", ":")), f"a line that is not SSE in {text!r}"
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
        events.append((name, data))
    return events


def test_chat_and_completions_end_with_an_openai_error_event(injected):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
                       ("/v1/completions", {"prompt": PROMPT})):
        events = _sse(_post(injected, path, {"model": MODEL, "max_tokens": 32, "stream": True, **body}))
        assert events[-1] == (None, "[DONE]") and len(events) >= 3, events
        error = json.loads(events[-2][1])
        assert error["error"]["code"] == "internal_error" and error["error"]["type"] == "server_error", events


def test_responses_end_with_error_and_response_failed(injected):
    events = _sse(_post(injected, "/v1/responses", {"model": MODEL, "input": PROMPT, "max_output_tokens": 32,
                                                     "stream": True}))
    assert [name for name, _ in events][-2:] == ["error", "response.failed"], events
    assert json.loads(events[-1][1])["response"]["status"] == "failed"


def test_messages_end_with_anthropics_error_event(injected):
    events = _sse(_post(injected, "/v1/messages", {"model": MODEL, "max_tokens": 32, "stream": True,
                                                    "messages": [{"role": "user", "content": PROMPT}]}))
    assert events[0][0] == "message_start" and events[-1][0] == "error", events
    assert json.loads(events[-1][1])["error"]["type"] == "api_error"


def test_the_native_stream_ends_with_its_error_line(injected):
    text = _post(injected, None, {"text": "The capital of France is", "stream": True, "max_new_tokens": 24,
                                  "ignore_eos": True})
    head, _, last = text.rpartition("\n")
    assert head and json.loads(last)["type"] == "internal_error", text


def test_grpc_stream_predictions_ends_with_the_native_error_line(injected):
    with grpc.insecure_channel(injected.grpc) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name=MODEL, input={
            "text": b"The capital of France is", "stream": b"true", "max_new_tokens": b"24", "ignore_eos": b"true"})
        messages = [m.prediction.decode() for m in stub.StreamPredictions(
            request, metadata=(("authorization", f"Bearer {injected.key()}"),), timeout=120)]
    assert len(messages) >= 2 and json.loads(messages[-1].lstrip("\n"))["type"] == "internal_error", messages
    # A whole answer (nothing streamed, nothing injected) still comes, so the server kept serving.
    answer = httpx.post(injected.native_url, json={"text": "Hi", "max_new_tokens": 4}, timeout=120,
                        headers={"Authorization": f"Bearer {injected.key()}"})
    assert answer.status_code == 200, answer.text
