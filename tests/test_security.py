"""Closed by default: loopback only, token auth on, no model registration, bounded request size."""

import json
import re
import socket
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from llm_api.proto import inference_pb2, inference_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


def shipped_properties() -> dict:
    lines = (REPO / "config.properties").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def test_shipped_config_is_closed():
    props = shipped_properties()
    for key in ("inference_address", "management_address", "metrics_address"):
        assert props[key].startswith("http://127.0.0.1:"), key
    assert props["grpc_inference_address"] == props["grpc_management_address"] == "127.0.0.1"
    assert props["enable_model_api"] == "false"
    assert props.get("disable_token_authorization", "false") == "false"
    assert "model-store" in props["allowed_urls"] and ".*" != props["allowed_urls"]


def test_docker_image_opens_only_inference_and_metrics():
    dockerfile = (REPO / "Dockerfile").read_text()
    exposed = {int(p) for line in re.findall(r"(?m)^EXPOSE (.*)$", dockerfile) for p in line.split()}
    # TorchServe's inference, gRPC inference and metrics ports; llm_api serve's HTTP and gRPC (no management API).
    assert exposed == {8080, 7070, 8082, 8000, 50051}
    assert "TS_MANAGEMENT_ADDRESS" not in dockerfile and "TS_GRPC_MANAGEMENT_ADDRESS" not in dockerfile
    assert re.search(r"(?m)^USER (?!root)", dockerfile)


def http(server, path, body=b"{}", key=None, port="inference", method="POST"):
    url = f"http://127.0.0.1:{server.ports[port]}{path}"
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body if method == "POST" else None, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


PAYLOAD = json.dumps({"text": "hi", "max_new_tokens": 2}).encode()


@pytest.mark.server
@pytest.mark.parametrize("which", ["none", "wrong", "management"])
def test_http_inference_refuses_bad_keys(async_server, which):
    key = {"none": None, "wrong": "not-a-key", "management": async_server.key("management")}[which]
    status, _ = http(async_server, "/predictions/smollm2", PAYLOAD, key)
    assert 400 <= status < 500
    assert http(async_server, "/predictions/smollm2", PAYLOAD, async_server.key())[0] == 200


@pytest.mark.server
@pytest.mark.parametrize("which", ["none", "wrong", "management"])
def test_grpc_inference_refuses_bad_keys(async_server, which):
    key = {"none": None, "wrong": "not-a-key", "management": async_server.key("management")}[which]
    with grpc.insecure_channel(async_server.grpc) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        request = inference_pb2.PredictionsRequest(model_name="smollm2", input={"text": b"hi"})
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        with pytest.raises(grpc.RpcError) as err:
            stub.Predictions(request, metadata=metadata, timeout=30)
        assert err.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


@pytest.mark.server
def test_model_registration_is_off(async_server):
    status, _ = http(async_server, "/models?url=smollm2", b"", async_server.key("management"), port="management")
    assert status == 405


@pytest.mark.server
def test_oversized_body_gets_413(async_server):
    # With "Expect: 100-continue" the server answers before the client sends the body (otherwise it
    # answers 413 and resets the connection while the client is still writing).
    body_len = 7_000_000
    with socket.create_connection(("127.0.0.1", async_server.ports["inference"]), timeout=30) as sock:
        sock.sendall(
            f"POST /predictions/smollm2 HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {async_server.key()}\r\nContent-Length: {body_len}\r\n"
            f"Expect: 100-continue\r\n\r\n".encode()
        )
        status_line = sock.recv(4096).split(b"\r\n", 1)[0].decode()
    assert status_line.split()[1] == "413", status_line
