"""The same failure, injected into real servers, ends each stream in its route's own format on every edge.

Both front ends run with ``tests/assets/inject_failure`` on their PYTHONPATH and
``LLM_API_INJECT_FAILURE=after-first-chunk``: every answer's parts raise right after their first chunk (its
``sitecustomize`` says how), as a bug in the engine or an encoder would. Each streamed route must then end with
its own in-band error (``llm_api.protocols.wire``): the native stream with its JSON error line, chat and
completions with an OpenAI error event and ``[DONE]``, Responses with ``error`` and ``response.failed``, Anthropic
Messages with its ``error`` event; over HTTP on `llm_api serve` and on TorchServe (whose SSE streams once ended
with a native error line instead), and over gRPC StreamPredictions on both. Each server keeps serving after it.
(Under ``--ray``, the same checks through Ray Serve's ingress: tests/test_scale_out.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import pytest

from edge_failure_checks import MODEL, check_chat_and_completions, check_messages, check_native, check_responses
from llm_api.proto import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.server

INJECT = str(Path(__file__).parent / "assets" / "inject_failure")
REPO = str(Path(__file__).resolve().parents[1])
ENV = {"LLM_API_INJECT_FAILURE": "after-first-chunk", "PYTHONPATH": f"{INJECT}:{REPO}", "MAX_NUM_SEQS": "4",
       "GRPC_STREAMING": "true", "KV_CACHE_MEMORY_MIB": "64", "DTYPE": "float32"}
# (ignore_eos on the native route: a chunk before the end on any host kind, so the failure is injected)


@pytest.fixture(scope="module", params=["standalone", "torchserve"])
def injected(request, start_standalone, start_server):
    if request.param == "standalone":
        server = start_standalone("inject-standalone", env=ENV)
    else:
        server = start_server("inject-torchserve", (Path(REPO) / "model-config.yaml").read_text(), env=ENV)
    yield server
    server.stop()


def test_chat_and_completions_end_with_an_openai_error_event(injected):
    check_chat_and_completions(injected, injected.key())


def test_responses_end_with_error_and_response_failed(injected):
    check_responses(injected, injected.key())


def test_messages_end_with_anthropics_error_event(injected):
    check_messages(injected, injected.key())


def test_the_native_stream_ends_with_its_error_line(injected):
    check_native(injected, injected.key())


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
