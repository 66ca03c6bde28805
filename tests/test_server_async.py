"""The shipped async mode against a real TorchServe: requests join a running generation, cancels and
deadlines end streams at once and free their KV blocks, HTTP and gRPC both stream."""

import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from llm_api.client import GRPCClient, HTTPClient, RequestRefused

pytestmark = pytest.mark.server
MARKER = "<|endoftext|>"
# Fits the fixture's 64 MiB KV pool (float32: about 1.4k tokens, see the startup test).
LONG = {"text": "Write a very long story about a dragon and a knight.", "max_new_tokens": 1000, "ignore_eos": True}


def open_stream(server, payload):
    req = urllib.request.Request(
        f"{server.http}/predictions/smollm2", data=json.dumps(payload).encode(),
        headers={"Authorization": f"Bearer {server.key()}", "Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=300)


def post_json(server, payload):
    with open_stream(server, payload) as resp:
        return json.loads(resp.read())


def read_rest(resp) -> str:
    return resp.read().decode()


def test_second_request_streams_before_first_finishes(async_server):
    first = open_stream(async_server, {"text": "Tell me about the ocean.", "max_new_tokens": 120, "ignore_eos": True})
    first.read1(1)  # the first request is generating
    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    second = http.stream({"text": "The capital of France is", "max_new_tokens": 4})
    t0 = time.monotonic()
    next(second)
    got_second = time.monotonic()
    rest_of_second = "".join(second)
    rest = read_rest(first)
    first_done = time.monotonic()
    assert got_second < first_done and rest.endswith(MARKER)
    assert MARKER not in rest_of_second
    assert got_second - t0 < (first_done - t0) / 2


def test_cancel_ends_stream_and_frees_blocks(async_server):
    resp = open_stream(async_server, {**LONG, "request_id": "job-cancel-1"})
    resp.read1(1)
    request_id = resp.headers["x-request-id"]  # the server-issued handle
    t0 = time.monotonic()
    answer = post_json(async_server, {"cancel": request_id})
    body = read_rest(resp)
    elapsed = time.monotonic() - t0
    assert answer == {"cancelled": True}
    assert elapsed < 5.0, elapsed  # uncancelled, the 1000-token stream would run for tens of seconds
    assert not body.endswith(MARKER)
    error = json.loads(body.strip().splitlines()[-1])
    assert error["type"] == "cancelled"
    line = async_server.wait_for_log_lines(f"request {request_id} ended")[0]
    free, total = map(int, re.search(r"KV blocks free (\d+)/(\d+)", line).groups())
    assert free == total
    assert post_json(async_server, {"cancel": request_id})["cancelled"] is False


def test_cancel_by_torchserve_request_id(async_server):
    resp = open_stream(async_server, LONG)
    resp.read1(1)
    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    assert http.cancel(resp.headers["x-request-id"]) is True
    assert json.loads(read_rest(resp).strip().splitlines()[-1])["type"] == "cancelled"



def test_cancel_over_grpc(async_server):
    """A cancel sent as a unary gRPC call (the default, one-message gRPC answers) ends an HTTP stream."""
    resp = open_stream(async_server, LONG)
    resp.read1(1)
    with GRPCClient(async_server.grpc, "smollm2", async_server.key()) as client:
        # (the client's generate() expects an answer ending in the marker; a cancel answers JSON alone)
        response = client._stub.Predictions(client._request({"cancel": resp.headers["x-request-id"]}, False),
                                            metadata=client._metadata, timeout=60)
    assert json.loads(response.prediction) == {"cancelled": True}
    assert json.loads(read_rest(resp).strip().splitlines()[-1])["type"] == "cancelled"


def test_deadline_ends_stream(async_server):
    t0 = time.monotonic()
    try:
        with open_stream(async_server, {**LONG, "timeout": 1.5}) as resp:
            body = read_rest(resp)
    except urllib.error.HTTPError as err:  # a deadline that passes before the first token is the status
        assert err.code == 408
        body = err.read().decode()
    assert time.monotonic() - t0 < 10
    assert json.loads(body.strip().splitlines()[-1])["type"] == "timeout" and MARKER not in body


def test_paris_and_grpc_in_async_mode(async_server):
    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    assert "Paris" in http.generate({"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_new_tokens": 24})
    with GRPCClient(async_server.grpc, "smollm2", async_server.key()) as client:
        chunks = list(client.stream({"text": "The capital of France is", "max_new_tokens": "16"}))
        assert len(chunks) > 2
        assert client.generate({"text": "Hello", "max_new_tokens": "8"})
        with pytest.raises(RequestRefused):
            client.generate({"text": "x", "top_p": "3"})
        with pytest.raises(RequestRefused):
            list(client.stream({"text": "x", "top_p": "3"}))
    assert async_server.worker_status() == "READY"


def test_errors_are_per_request_in_async_mode(async_server):
    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    results = {}

    def good():
        results["good"] = http.generate({"text": "Once upon a time", "max_new_tokens": 40})

    thread = threading.Thread(target=good)
    thread.start()
    for bad in ({"text": "x", "temperature": -1}, {"messages": []}, {"text": ""}):
        with pytest.raises(RequestRefused) as err:
            http.generate(bad)
        assert err.value.status == 400 and set(err.value.error) == {"code", "type", "message"}
    thread.join(120)
    assert results["good"]


def test_request_that_cannot_fit_the_kv_pool_is_refused(async_server):
    # 64 MiB of KV for this model holds about 2.9k tokens in bfloat16, 1.4k in float32.
    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    with pytest.raises(RequestRefused) as err:
        http.generate({"text": "word " * 1900, "max_new_tokens": 1500})
    assert err.value.status == 400 and err.value.error["type"] == "prompt_too_long"
    assert "KV cache" in err.value.error["message"]


def test_startup_log_states_the_kv_pool(async_server):
    """The worker says at startup how many KV blocks it has and how many tokens they hold at once
    (KV_CACHE_MEMORY_MIB=64 here: SmolLM2-135M's K/V take 30 layers x 2 x 3 heads x 64 x dtype bytes per
    token), and whether the decode step is captured (never on CPU). The fixture pins float32; the line
    is read for the dtype the worker says it loaded."""
    loaded = async_server.wait_for_log_lines("loaded SmolLM2")[0]
    dtype_bytes = {"torch.bfloat16": 2, "torch.float32": 4}[re.search(r"dtype=(\S+)", loaded).group(1)]
    # (the embedded GGUF file: 135M parameters, so QUANT_ACTIVATIONS=auto keeps two input digits)
    assert "GGUF" not in loaded or loaded.endswith("(QUANT_ACTIVATIONS=auto: int8x2)"), loaded
    line = async_server.wait_for_log_lines("paged engine:")[0]
    blocks, block_size, max_tokens = map(int, re.search(
        r"(\d+) KV blocks of (\d+) tokens, max concurrent tokens (\d+)", line).groups())
    assert blocks == (64 << 20) // (30 * 2 * 3 * 64 * dtype_bytes * block_size) and max_tokens == blocks * block_size
    assert "attention torch" in line and "CUDA graphs for batch sizes none" in line


def test_cancel_needs_the_server_issued_id(async_server):
    """A client's own request_id is a label: it cancels nothing, and no answer tells whether it exists."""
    resp = open_stream(async_server, {**LONG, "request_id": "guessable-1"})
    resp.read1(1)
    try:
        for guess in ("guessable-1", "00000000-0000-0000-0000-000000000000", "x" * 64):
            assert post_json(async_server, {"cancel": guess}) == {"cancelled": False}
        assert post_json(async_server, {"cancel": resp.headers["x-request-id"]}) == {"cancelled": True}
    finally:
        body = read_rest(resp)
    assert json.loads(body.strip().splitlines()[-1])["type"] == "cancelled"


def test_a_live_request_id_label_is_unique(async_server):
    resp = open_stream(async_server, {**LONG, "request_id": "mine-1"})
    resp.read1(1)
    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    try:
        with pytest.raises(RequestRefused) as err:
            http.generate({"text": "hi", "max_new_tokens": 2, "request_id": "mine-1"})
        assert err.value.status == 409 and err.value.error["type"] == "duplicate_request_id"
    finally:
        post_json(async_server, {"cancel": resp.headers["x-request-id"]})
        read_rest(resp)
    # Once the first one ended, the label is free again.
    assert http.generate({"text": "hi", "max_new_tokens": 2, "request_id": "mine-1"}) is not None


def test_grpc_refusal_raises_in_every_client_even_with_the_marker_in_it(async_server):
    with GRPCClient(async_server.grpc, "smollm2", async_server.key()) as client:
        for call in (client.generate, lambda inputs: list(client.stream(inputs))):
            with pytest.raises(RequestRefused) as err:
                call({"text": "x", "top_p": MARKER})
            assert err.value.status == 400
    http = HTTPClient(async_server.http, "smollm2", async_server.key())
    with pytest.raises(RequestRefused):
        http.generate({"text": "x", "top_p": MARKER})
