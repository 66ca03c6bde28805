"""A corpus of malformed requests, over HTTP and gRPC, against both front ends (TorchServe in the shipped
async mode, and `llm_api serve`).

Each one gets its 4xx with the JSON error shape; none causes a 5xx or a worker restart, and a stream
running at the same time still ends with its marker.
"""

import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from llm_api.client import HTTPClient
from llm_api.proto import inference_pb2, inference_pb2_grpc

pytestmark = pytest.mark.server
MARKER = "<|endoftext|>"


def j(obj) -> bytes:
    return json.dumps(obj).encode()


CORPUS = {
    "empty body": b"",
    "whitespace body": b" \n\t ",
    "truncated json": b'{"text": "hello", "max_new_tokens": ',
    "json array": b'[{"text": "hi"}]',
    "json string": b'"hi"',
    "json number": b"42",
    "json null": b"null",
    "invalid utf-8": b'{"text": "caf\xc3"}',
    "lone surrogate": b'{"text": "a\\udc00b"}',
    "nul byte": b'{"text": "a\\u0000b"}',
    "number overflow to inf": b'{"text": "hi", "max_new_tokens": 1e400}',
    "huge integer": b'{"text": "hi", "max_new_tokens": 10000000000000000000000000000000000000000}',
    "NaN temperature": b'{"text": "hi", "temperature": NaN}',
    "Infinity top_p": b'{"text": "hi", "top_p": Infinity}',
    "deep nesting": b'{"text": "hi", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "duplicate keys": b'{"text": "hi", "text": "there"}',
    "text is a number": j({"text": 5}),
    "text is an array": j({"text": ["a"]}),
    "text is empty": j({"text": ""}),
    "messages is a string": j({"messages": "hello"}),
    "messages empty": j({"messages": []}),
    "messages bad role": j({"messages": [{"role": "wizard", "content": "x"}]}),
    "messages missing content": j({"messages": [{"role": "user"}]}),
    "messages content is a number": j({"messages": [{"role": "user", "content": 3}]}),
    "inputs_embeds wrong width": j({"inputs_embeds": [[0.1, 0.2, 0.3]]}),
    "inputs_embeds holds a string": j({"inputs_embeds": [["x"] * 576]}),
    "inputs_embeds ragged": j({"inputs_embeds": [[0.0] * 576, [0.0] * 575]}),
    "inputs_embeds empty": j({"inputs_embeds": []}),
    "inputs_embeds NaN": b'{"inputs_embeds": [[NaN]]}',
    "temperature negative": j({"text": "hi", "temperature": -0.5}),
    "temperature is a string": j({"text": "hi", "temperature": "hot"}),
    "top_p zero": j({"text": "hi", "top_p": 0}),
    "top_p above one": j({"text": "hi", "top_p": 2}),
    "top_k negative": j({"text": "hi", "top_k": -1}),
    "top_k fractional": j({"text": "hi", "top_k": 1.5}),
    "max_new_tokens zero": j({"text": "hi", "max_new_tokens": 0}),
    "max_new_tokens over MAX_NEW_TOKENS": j({"text": "hi", "max_new_tokens": 100000}),
    "max_new_tokens is a bool": j({"text": "hi", "max_new_tokens": True}),
    "repetition_penalty zero": j({"text": "hi", "repetition_penalty": 0}),
    "do_sample is not a bool": j({"text": "hi", "do_sample": "maybe"}),
    "seed negative": j({"text": "hi", "seed": -3}),
    "stop list too long": j({"text": "hi", "stop": ["x"] * 100}),
    "stop holds a number": j({"text": "hi", "stop": [1]}),
    "stop empty string": j({"text": "hi", "stop": [""]}),
    "unknown field": j({"text": "hi", "prompt": "x"}),
    "two inputs": j({"text": "hi", "messages": [{"role": "user", "content": "x"}]}),
    "no input": j({"max_new_tokens": 5}),
    "prompt over MAX_INPUT_TOKENS": j({"text": "hello " * 2100}),
    "timeout zero": j({"text": "hi", "timeout": 0}),
    "cancel with other fields": j({"cancel": "x", "text": "hi"}),
    "stream is not a bool": j({"text": "hi", "stream": "often"}),
}


def post(server, body: bytes):
    req = urllib.request.Request(
        f"{server.http}/predictions/smollm2", data=body,
        headers={"Authorization": f"Bearer {server.key()}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_corpus_size():
    assert len(CORPUS) >= 30


def test_every_malformed_request_gets_its_4xx(async_frontend):
    pid = async_frontend.worker_pid()
    assert pid
    background = {}
    http = HTTPClient(async_frontend.http, "smollm2", async_frontend.key())
    thread = threading.Thread(
        target=lambda: background.setdefault("text", http.generate({"text": "Once upon a time", "max_new_tokens": 120, "ignore_eos": True}))
    )
    thread.start()
    failures = []
    with grpc.insecure_channel(async_frontend.grpc) as channel:
        stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
        auth = (("authorization", f"Bearer {async_frontend.key()}"),)
        for name, body in CORPUS.items():
            status, answer = post(async_frontend, body)
            try:
                error = json.loads(answer)
                ok = 400 <= status < 500 and set(error) == {"code", "type", "message"} and error["code"] == status
            except ValueError:
                ok = False
            if not ok:
                failures.append(f"HTTP {name}: {status} {answer[:200]!r}")
            reply = stub.Predictions(inference_pb2.PredictionsRequest(model_name="smollm2", input={"data": body}),
                                     metadata=auth, timeout=120).prediction
            try:
                error = json.loads(reply)
                ok = 400 <= error["code"] < 500 and set(error) == {"code", "type", "message"}
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                failures.append(f"gRPC {name}: {reply[:200]!r}")
    thread.join(300)
    assert not failures, "\n".join(failures)
    assert background.get("text"), "the stream running beside the corpus did not complete"
    assert async_frontend.worker_pid() == pid, "the worker restarted"
