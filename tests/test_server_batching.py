"""TorchServe batching (batchSize 4): mixed HTTP and gRPC requests share one handle() call."""

import json
import re
import threading
import urllib.error
import urllib.request

import pytest

from llm_api.client import GRPCClient, HTTPClient, RequestRefused

pytestmark = pytest.mark.server
MARKER = "<|endoftext|>"


def chat(question: str) -> str:
    return json.dumps([{"role": "user", "content": question}])


def run_concurrently(calls: dict) -> dict:
    results = {}

    def run(name, fn):
        try:
            results[name] = fn()
        except Exception as exc:  # reported by the test, not swallowed
            results[name] = exc

    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


def batch_sizes(server) -> list[int]:
    return [int(n) for n in re.findall(r"handle: (\d+) requests in one call", server.model_log())]


def test_four_mixed_requests_in_one_call(batch4_server):
    http = HTTPClient(batch4_server.http, "smollm2", batch4_server.key())
    grpc_client = GRPCClient(batch4_server.grpc, "smollm2", batch4_server.key())
    before = len(batch_sizes(batch4_server))
    results = run_concurrently({
        "http_france": lambda: http.generate({"messages": json.loads(chat("What is the capital of France?")), "max_new_tokens": 24}),
        "http_sampled": lambda: http.generate({"text": "My favourite animal is", "max_new_tokens": 12, "temperature": 0.8, "top_k": 20, "seed": 3}),
        "grpc_japan": lambda: "".join(grpc_client.stream({"messages": chat("What is the capital of Japan?"), "max_new_tokens": "24"})),
        "grpc_unary": lambda: grpc_client.generate({"text": "1, 2, 3, 4,", "max_new_tokens": "30", "stop": " 7"}),
    })
    grpc_client.close()
    for name, value in results.items():
        assert isinstance(value, str), f"{name}: {value!r}"
    assert batch_sizes(batch4_server)[before:] == [4]
    assert "Paris" in results["http_france"] and "Tokyo" not in results["http_france"]
    assert "Tokyo" in results["grpc_japan"] and "Paris" not in results["grpc_japan"]
    assert " 5" in results["grpc_unary"] and " 7" not in results["grpc_unary"]
    assert results["http_sampled"] and MARKER not in "".join(results.values())


def test_bad_request_in_a_batch_harms_no_other(batch4_server):
    http = HTTPClient(batch4_server.http, "smollm2", batch4_server.key())
    before = len(batch_sizes(batch4_server))

    def bad():
        req = urllib.request.Request(
            f"{batch4_server.http}/predictions/smollm2", data=b'{"text": "a", "top_p": 9}',
            headers={"Authorization": f"Bearer {batch4_server.key()}", "Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(req, timeout=120)
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())
        return 200, None

    results = run_concurrently({
        "a": lambda: http.generate({"text": "The sun is", "max_new_tokens": 16}),
        "b": lambda: http.generate({"messages": json.loads(chat("What is the capital of France?")), "max_new_tokens": 24}),
        "c": lambda: http.generate({"text": "Dogs are", "max_new_tokens": 8}),
        "bad": bad,
    })
    assert batch_sizes(batch4_server)[before:] == [4]
    assert results["bad"][0] == 400 and results["bad"][1]["type"] == "invalid_parameter"
    assert "Paris" in results["b"] and results["a"] and results["c"]
    with pytest.raises(RequestRefused):
        http.generate({"text": "a", "max_new_tokens": -5})
