"""What only the standalone front end (`llm_api serve`) does, against a real server process.

* a client that goes away (HTTP stream, HTTP one-body answer, SSE, gRPC stream, gRPC unary past its
  deadline) has its request aborted and every KV block free within one second, read from /metrics;
* SIGTERM: readiness false at once, new requests 503, the stream in flight ends with its marker, exit 0;
  with a short grace period the stream left ends with its error line (never cut), exit 0;
* bearer auth on every route but /health and /ready (/metrics too unless METRICS_PUBLIC), over HTTP and gRPC;
* /metrics parses with prometheus_client's parser and carries vLLM's series and long-stream buckets;
* /tokenize and /detokenize in vLLM's shapes; the request ids in x-request-id cancel HTTP and gRPC calls;
* bad settings and flags stop the command before anything loads, naming the value.
"""

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from llm_api.proto import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.server
MARKER = "<|endoftext|>"
REPO = Path(__file__).resolve().parent.parent
LONG = {"text": "Write a very long story about a dragon and a knight. " * 8, "max_new_tokens": 1500, "ignore_eos": True}
FREE_WITHIN_S = 3.0  # one engine step is well under a second here; the rest is room for a loaded CI machine


def get(url, key=None, timeout=30):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read().decode()


def post(url, body, key=None, timeout=120):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read().decode()


def engine_state(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    _, _, text = get(server.metrics_url, server.key())
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("vllm:")}


def wait_until_free(server, timeout=5.0) -> float:
    """Seconds until no request runs and no KV block is in use (or ``timeout``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        state = engine_state(server)
        if state["vllm:kv_cache_usage_perc"] == 0 and state["vllm:num_requests_running"] == 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    return float("inf")


def wait_until_busy(server, timeout=60.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if engine_state(server)["vllm:kv_cache_usage_perc"] > 0:
            return
        time.sleep(0.05)
    raise AssertionError("the request never reached the engine")


def open_raw(server, path, body) -> socket.socket:
    """An HTTP/1.1 POST on a raw socket (so the test controls exactly when the connection goes away)."""
    host, port = server.http.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {server.key()}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def vanish(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    sock.close()


# ---------------------------------------------------------------------------------------------------
# disconnects


@pytest.mark.parametrize("path, extra", [("/predictions/smollm2", {}), ("/predictions/smollm2", {"stream": False}),
                                         ("/v1/completions", None)], ids=["stream", "one-body", "sse"])
def test_http_client_that_goes_away_frees_its_blocks_within_a_second(standalone_server, path, extra):
    server = standalone_server
    assert wait_until_free(server) < 5
    if extra is None:
        body = {"model": "smollm2", "prompt": LONG["text"], "max_tokens": 1500, "stream": True}
    else:
        body = {**LONG, **extra}
    sock = open_raw(server, path, body)
    if extra == {}:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # tokens are flowing
    wait_until_busy(server)
    before = len(server.wait_for_log_lines("the client went away", timeout=0))
    vanish(sock)
    assert wait_until_free(server) < FREE_WITHIN_S
    assert len(server.wait_for_log_lines("the client went away", count=before + 1)) == before + 1


@pytest.mark.parametrize("call", ["stream", "unary-deadline"])
def test_grpc_client_that_goes_away_frees_its_blocks_within_a_second(standalone_server, call):
    server = standalone_server
    assert wait_until_free(server) < 5
    inputs = {"text": LONG["text"].encode(), "max_new_tokens": b"1500", "ignore_eos": b"true"}
    auth = (("authorization", f"Bearer {server.key()}"),)
    with grpc.insecure_channel(server.grpc) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        if call == "stream":
            responses = stub.StreamPredictions(inference_pb2.PredictionsRequest(
                model_name="smollm2", input={**inputs, "stream": b"true"}), metadata=auth, timeout=120)
            next(responses)
            assert dict(responses.initial_metadata())["x-request-id"]
            wait_until_busy(server)
            responses.cancel()
            t0 = time.monotonic()
        else:
            # The client's deadline passes while the answer (one message) is being generated.
            with pytest.raises(grpc.RpcError) as err:
                stub.Predictions(inference_pb2.PredictionsRequest(model_name="smollm2", input=inputs),
                                 metadata=auth, timeout=4)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            t0 = time.monotonic()
        freed_after = wait_until_free(server)
    assert freed_after < FREE_WITHIN_S, freed_after
    assert time.monotonic() - t0 < 5


# ---------------------------------------------------------------------------------------------------
# auth, ids, metrics, tokenizer


def test_every_route_but_the_probes_needs_the_key(standalone_server):
    server = standalone_server
    for path in ("/health", "/ready"):
        assert get(server.http + path)[0] == 200, path
    for key in (None, "wrong-key-123", server.key() + "x"):
        status, _, body = post(server.native_url, {"text": "hi"}, key)
        assert status == 401 and json.loads(body)["type"] == "unauthorized"
        for path, payload in (("/v1/completions", {"model": "smollm2", "prompt": "hi"}), ("/tokenize", {"prompt": "hi"}),
                              ("/detokenize", {"tokens": [1]}), ("/v1/nothing", {})):
            status, _, body = post(server.http + path, payload, key)
            assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized", path
        assert get(server.http + "/v1/models", key)[0] == 401
        assert get(server.http + "/no/such/path", key)[0] == 401  # no key: nothing about which paths exist
    assert get(server.http + "/no/such/path", server.key())[0] == 404
    with grpc.insecure_channel(server.grpc) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name="smollm2", input={"text": b"hi"})
        for metadata in ((), (("authorization", "Bearer nope-nope-nope"),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.Predictions(request, metadata=metadata, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.Predictions(inference_pb2.PredictionsRequest(model_name="other", input={"text": b"hi"}),
                             metadata=(("authorization", f"Bearer {server.key()}"),), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_generated_key_file_is_private(standalone_server):
    path = standalone_server.workdir / "llm_api.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text().strip()) >= 32
    assert standalone_server.key() not in standalone_server.model_log()
    assert str(path) in standalone_server.model_log()  # the log says where it is


def test_the_log_says_which_model_path_runs(standalone_server):
    """The start-up log names the path the model takes and why (llm_api.models.families): the embedded model is
    a Llama, run as llm_api's own decoder."""
    assert re.search(r"model path: llama as llm_api's decoder on the (CPU|torch) kernels \(model_type 'llama'\)",
                     standalone_server.model_log()), standalone_server.model_log()[-3000:]


def test_metrics_parse_and_carry_the_router_series(standalone_server):
    from prometheus_client.parser import text_string_to_metric_families

    server = standalone_server
    from llm_api.client import HTTPClient

    HTTPClient(server.http, "smollm2", server.key()).generate({"text": "Hello there", "max_new_tokens": 4})
    assert get(server.metrics_url)[0] == 401  # (behind the key by default: METRICS_PUBLIC)
    status, headers, text = get(server.metrics_url, server.key())
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in (("vllm:num_requests_waiting", "gauge"), ("vllm:num_requests_running", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prefix_cache_queries", "counter"),
                       ("vllm:prefix_cache_hits", "counter"), ("vllm:num_preemptions", "counter"),
                       ("vllm:spec_decode_num_draft_tokens", "counter"),
                       ("vllm:spec_decode_num_accepted_tokens", "counter"),
                       ("llm_e2e_request_latency_seconds", "histogram"), ("llm_generation_tokens", "counter")):
        assert families[name].type == kind, name
    e2e = families["llm_e2e_request_latency_seconds"]
    buckets = [float(s.labels["le"]) for s in e2e.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]
    assert max(buckets) >= 600  # a 10-minute stream lands in a bucket of its own
    count = next(s.value for s in e2e.samples if s.name.endswith("_count"))
    assert count >= 1
    usage = next(s.value for s in families["vllm:kv_cache_usage_perc"].samples)
    assert 0 <= usage <= 1
    assert next(s for s in families["vllm:num_requests_waiting"].samples).labels["model_name"] == "smollm2"


def test_request_ids_cancel_http_and_grpc_requests(standalone_server):
    server, key = standalone_server, standalone_server.key()
    sock = open_raw(server, "/predictions/smollm2", LONG)
    head = sock.recv(4096).decode(errors="replace")
    request_id = next(line.split(":", 1)[1].strip() for line in head.split("\r\n") if line.lower().startswith("x-request-id"))
    assert len(request_id) >= 20
    assert json.loads(post(server.native_url, {"cancel": request_id}, key)[2]) == {"cancelled": True}
    rest = head
    sock.settimeout(30)
    while not rest.endswith("0\r\n\r\n"):
        data = sock.recv(65536)
        if not data:
            break
        rest += data.decode(errors="replace")
    sock.close()
    assert '"type": "cancelled"' in rest and MARKER not in rest
    with grpc.insecure_channel(server.grpc) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        responses = stub.StreamPredictions(inference_pb2.PredictionsRequest(model_name="smollm2", input={
            "text": b"Once upon a time", "max_new_tokens": b"1500", "ignore_eos": b"true", "stream": b"true"}),
            metadata=(("authorization", f"Bearer {key}"),), timeout=120)
        next(responses)
        grpc_id = dict(responses.initial_metadata())["x-request-id"]
        assert json.loads(post(server.native_url, {"cancel": grpc_id}, key)[2]) == {"cancelled": True}
        tail = b"".join(r.prediction for r in responses).decode()
    assert json.loads(tail.strip().splitlines()[-1])["type"] == "cancelled"


# ---------------------------------------------------------------------------------------------------
# SIGTERM


def _stream_in_background(server, payload):
    out = {}

    def run():
        status, _, body = post(server.native_url, payload, server.key(), timeout=120)
        out.update(status=status, body=body, at=time.monotonic())

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


@pytest.mark.parametrize("grace, finishes", [("60", True), ("2", False)], ids=["in-grace", "past-grace"])
def test_sigterm_drains(start_standalone, grace, finishes):
    server = start_standalone(f"drain-{grace}", {"DTYPE": "float32", "DRAIN_GRACE_S": grace,
                                                 "MAX_NUM_BATCHED_TOKENS": "256"})
    try:
        # In grace: long enough to still run through the checks below (a stream that ended first would let
        # the server drain and exit under them), short enough to end well inside the 60 s grace.
        max_new = 200 if finishes else 1500
        thread, out = _stream_in_background(server, {"text": "Once upon a time", "max_new_tokens": max_new,
                                                     "ignore_eos": True})
        wait_until_busy(server)
        os.kill(server.server_pid(), signal.SIGTERM)  # (the server, not its guard)
        t0 = time.monotonic()
        while get(server.ready_url)[0] != 503:
            assert time.monotonic() - t0 < 2.0, "readiness still true after SIGTERM"
            time.sleep(0.01)
        status, _, body = post(server.native_url, {"text": "hi", "max_new_tokens": 2}, server.key())
        assert status == 503 and json.loads(body)["type"] == "shutting_down"
        assert get(server.http + "/health")[0] == 200  # still alive while draining
        thread.join(120)
        assert out["status"] == 200
        if finishes:
            assert out["body"].endswith(MARKER) and out["body"].count(MARKER) == 1
        else:  # past the grace period: an error line ends the stream, which is never cut
            assert json.loads(out["body"].strip().splitlines()[-1])["type"] == "cancelled"
            assert out["at"] - t0 < float(grace) + 5
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------------
# the command


@pytest.mark.parametrize("env, args, needle", [
    ({"DRAIN_GRACE_S": "soon"}, [], "DRAIN_GRACE_S='soon' is not a number"),
    ({"LLM_API_KEY": "short"}, [], "LLM_API_KEY is not usable"),
    ({"LLM_API_KEY": "has a space in it"}, [], "LLM_API_KEY is not usable"),
    ({"MAX_REQUEST_BYTES": "12"}, [], "MAX_REQUEST_BYTES='12' is out of range"),
    ({}, ["--port", "70000"], "is not a port number"),
    ({}, ["--host", "not-an-address"], "is not an IP address"),
    ({}, ["--port", "9100", "--grpc-port", "9100"], "different ports"),
])
def test_bad_settings_stop_the_command_naming_the_value(tmp_path, env, args, needle):
    run = subprocess.run([sys.executable, "-m", "llm_api.server", "serve", *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert run.returncode == 2 and needle in run.stderr, run.stderr
    assert "has a space" not in run.stderr  # the key is never echoed


def test_console_script_is_declared():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["llm_api"] == "llm_api.server.cli:main"
    from llm_api.server.cli import parser

    args = parser().parse_args(["serve"])
    assert (args.host, args.port, args.grpc_port) == ("127.0.0.1", 8000, 50051)
