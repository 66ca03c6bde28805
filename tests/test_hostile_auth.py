"""Hostile auth: no route form gives a model result without the key, and only a request's submitter can end it.

Through both front ends (TorchServe in the shipped async mode, `llm_api serve`), with a Witness stream
beside, the tests prove:

* every path form of every model route -- the root ``/v1/...`` and tokenizer routes, TorchServe's
  ``/predictions/<model>``, ``/predictions/<model>/<version>`` and ``.../<version>/v1/...`` -- written with
  a trailing slash, other letter case, percent-encoding (``%2F``, ``%76`` for ``v``, an encoded model
  name), double slashes, dot segments, a query string or a path parameter, and sent as POST, GET, HEAD or
  OPTIONS without a key, with a wrong key, or (TorchServe) with the management key, gets a refusal
  (400/401/403/404/405), never a 2xx and never generated text; the same canonical routes with the right
  key do answer 200 (so the refusals are the key's doing);
* a running request is not ended by a cancel without its key, with a wrong or the management key, by a
  cancel naming a different id (a guess, a variant of its id, its own client label) or sent to another
  route; its submitter's cancel, with the id it was given, ends it (the Witness checks that last).
"""

from __future__ import annotations

import collections
import json
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.harness import hostile
from bench.harness.hostile import MARKER, Witness, native_path, outcome, post_json, raw_request

pytestmark = pytest.mark.server

METHODS = ("POST", "GET", "HEAD", "OPTIONS")
NATIVE_BODY = json.dumps({"text": "Hello", "max_new_tokens": 2}).encode()
CHAT_BODY = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()
COMPLETION_BODY = json.dumps({"model": "smollm2", "prompt": "Hi", "max_tokens": 2}).encode()
TOKENIZE_BODY = json.dumps({"model": "smollm2", "prompt": "Hi"}).encode()


def _spellings(path: str) -> list[str]:
    """``path`` and the ways a client may write it that a careless router or check could read apart."""
    parts = path.split("/")
    last = parts[-1]
    forms = {path, path + "/", path.upper(), path.title(), "/" + path, path.replace("/", "//"),
             "/".join(parts[:-1]) + "/./" + last, "/".join(parts[:-1]) + "/x/../" + last,
             "/".join(parts[:-1]) + "%2F" + last, "/".join(parts[:-1]) + "%2f" + last,
             path + "?x=1", path + ";x=1", path + "%00", path + "%20",
             "/%%%02X" % ord(path[1]) + path[2:]}
    if "/v1/" in path:
        forms |= {path.replace("/v1/", "/%761/"), path.replace("/v1/", "/V1/"), path.replace("/v1/", "/v1//")}
    if "/predictions/" in path:
        forms |= {path.replace("/predictions/", "/%70redictions/"), path.replace("/predictions/", "/predictions%2F")}
    return sorted(forms)


def path_forms(server) -> list[tuple[str, bytes]]:
    """(path as sent, the body it would take) for each model route of either front end, in every spelling."""
    model = server.model_name
    encoded_model = "".join("%%%02X" % ord(c) for c in model)
    routes = [(f"/predictions/{model}", NATIVE_BODY), (f"/predictions/{model}/1.0", NATIVE_BODY),
              (f"/predictions/{encoded_model}", NATIVE_BODY)]
    for base in ("/v1", f"/predictions/{model}/1.0/v1", f"/predictions/{model}/v1"):
        routes += [(f"{base}/chat/completions", CHAT_BODY), (f"{base}/completions", COMPLETION_BODY),
                   (f"{base}/models", b"")]
    for base in ("", f"/predictions/{model}/1.0", f"/predictions/{model}"):
        routes += [(f"{base}/tokenize", TOKENIZE_BODY), (f"{base}/detokenize", b'{"tokens": [1, 2]}')]
    return sorted({(form, body) for path, body in routes for form in _spellings(path)})


def keys(server) -> dict[str, str | None]:
    """The keys that must not open a model route: none, a wrong one, and TorchServe's management key."""
    wrong = {"no key": None, "wrong key": "not-the-key-" + "x" * 20}
    if server.kind != "standalone":
        wrong["management key"] = server.key("management")
    return wrong


def gave_a_result(method: str, answer: hostile.Answer) -> bool:
    """A model result: any 2xx answer but TorchServe's API description to OPTIONS (served without a key,
    no model involved: ../shared/torchserve-facts.md), or any body with generated text in it."""
    if MARKER.encode() in answer.body or b'"choices"' in answer.body or b'"tokens"' in answer.body:
        return True
    if 200 <= answer.status < 300:
        return not (method == "OPTIONS" and b'"openapi"' in answer.body)
    return False


def test_no_path_form_gives_a_model_result_without_the_key(async_frontend):
    server = async_frontend
    forms = path_forms(server)
    cases = [(method, path, body, key_name, key) for path, body in forms for method in METHODS
             for key_name, key in keys(server).items()]

    def send(case):
        method, path, body, _, key = case
        return raw_request(server, method, path, body if method in ("POST", "PUT") else None, key=key, timeout=60)

    with Witness(server) as witness:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(send, cases))
    problems, counts = [], collections.Counter()
    for (method, path, _, key_name, _), answer in zip(cases, answers):
        counts[f"{outcome(answer)}"] += 1
        if gave_a_result(method, answer):
            problems.append(f"{method} {path} with {key_name}: {answer.status} {answer.body[:200]!r}")
        elif answer.status >= 500 or (answer.status >= 300 and answer.status not in (400, 401, 403, 404, 405)):
            problems.append(f"{method} {path} with {key_name}: {answer.status} (not a refusal)")
    hostile.report("auth: path forms x methods x keys", server, inputs=len(cases), answers=dict(counts),
                   witness=witness, path_forms=len(forms))
    assert not problems, f"{len(problems)} of {len(cases)}: " + "\n".join(problems[:30])

    # the control: the canonical routes do answer with the key, so the refusals above were the key's doing
    openai_base = urllib.parse.urlsplit(server.openai_base).path
    for path, body in ((native_path(server), NATIVE_BODY), (f"{openai_base}/chat/completions", CHAT_BODY)):
        answer = raw_request(server, "POST", path.format(model=server.model_name), body)
        assert answer.status == 200, (path, answer.status, answer.body[:300])


def test_only_the_submitter_can_cancel_a_request(async_frontend):
    server = async_frontend
    problems, counts = [], collections.Counter()
    with Witness(server) as witness:
        assert witness._resp is not None
        request_id = witness._resp.headers["x-request-id"]
        path = native_path(server)
        openai_base = urllib.parse.urlsplit(server.openai_base).path
        attempts = [(f"{key_name}", path, {"cancel": request_id}, key) for key_name, key in keys(server).items()]
        attempts += [(f"the key, id {variant!r}", path, {"cancel": variant}, "server")
                     for variant in (request_id.upper() if request_id.upper() != request_id else request_id.lower(),
                                     request_id[:-1], request_id + "x", " " + request_id, request_id + "\n",
                                     "*", "", "00000000-0000-0000-0000-000000000000", "a" * 64)]
        attempts += [("the key, to the chat route", f"{openai_base}/chat/completions", {"cancel": request_id},
                      "server"),
                     ("the key, to another model", "/predictions/other-model", {"cancel": request_id}, "server"),
                     ("the key, id in a list", path, {"cancel": [request_id]}, "server"),
                     ("the key, cancel with text", path, {"cancel": request_id, "text": "hi"}, "server")]
        for name, target, payload, key in attempts:
            answer = post_json(server, target, payload, key=key)
            counts[outcome(answer) + (f" {answer.body.decode()}" if answer.status == 200 else "")] += 1
            if answer.status == 200 and answer.json() != {"cancelled": False}:
                problems.append(f"{name}: {answer.status} {answer.body[:200]!r}")
            elif answer.status >= 500:
                problems.append(f"{name}: {answer.status} {answer.body[:200]!r}")
        # still streaming: the witness's own cancel on leaving must find it running ({"cancelled": true})
    hostile.report("auth: cancel by others", server, inputs=len(attempts), answers=dict(counts), witness=witness)
    assert not problems, problems


def test_a_second_authorization_header_is_refused(async_frontend):
    """One identity per request (llm_api.service.owners): a request carrying the right key and then another
    Authorization header is refused 400 on both front ends (so no route can read an owner from the header
    auth did not check), over HTTP and, for `llm_api serve`, gRPC metadata; one header still answers.
    `llm_api serve` also refuses the same key sent twice; TorchServe's frontend hands the handler one value
    per header name (the last: it is the first case's second header that its handler sees and refuses), so
    there two copies of the one key it checked are one identity and are served."""
    import http.client

    import grpc

    from llm_api.proto import inference_pb2, inference_pb2_grpc

    server = async_frontend
    url = urllib.parse.urlsplit(server.http)
    with Witness(server) as witness:
        cases = [[f"Bearer {server.key()}", "Bearer someone-else"]]
        if server.kind == "standalone":
            cases.append([f"Bearer {server.key()}"] * 2)
        for values in cases:
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
            conn.putrequest("POST", native_path(server))
            for value in values:
                conn.putheader("Authorization", value)
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(NATIVE_BODY)))
            conn.endheaders(NATIVE_BODY)
            response = conn.getresponse()
            body = response.read()
            conn.close()
            assert response.status == 400 and json.loads(body)["type"] == "duplicate_authorization", (values, body)
        assert post_json(server, native_path(server), {"text": "Hello", "max_new_tokens": 2}).status == 200
        if server.kind == "standalone":
            with grpc.insecure_channel(server.grpc) as channel:
                stub = inference_pb2_grpc.InferenceAPIsServiceStub(channel)
                request = inference_pb2.PredictionsRequest(model_name=server.model_name, input={"text": b"Hello"})
                with pytest.raises(grpc.RpcError) as refused:
                    list(stub.StreamPredictions(request, metadata=[("authorization", f"Bearer {server.key()}"),
                                                                   ("authorization", "Bearer someone-else")]))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    hostile.report("identity: a second Authorization header", server, inputs=len(cases) + (server.kind == "standalone"),
                   answers={"400 duplicate_authorization": len(cases) + (server.kind == "standalone")}, witness=witness)
    assert witness.max_gap < hostile.STALL_LIMIT_S
