"""The standalone server's parts that need no model: the tokenizer formats, the Prometheus sink, the key."""

import json
import stat

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llm_api.errors import ApiError
from llm_api.protocols.tokenize.encoder import tokenize_answer
from llm_api.protocols.tokenize.translate import parse_detokenize, parse_tokenize
from llm_api.server.auth import BearerAuth, resolve_key
from llm_api.server.metrics import ServerMetrics
from llm_api.service.metrics import METRICS, ServingMetrics


def body(obj) -> bytes:
    return json.dumps(obj).encode()


def test_tokenize_requests():
    request = parse_tokenize(body({"prompt": "hi"}), "m")
    assert (request.text, request.messages, request.add_special_tokens) == ("hi", None, True)
    assert parse_tokenize(body({"prompt": "hi", "add_special_tokens": False}), "m").add_special_tokens is False
    chat = parse_tokenize(body({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text",
                                                                                             "text": "x"}]}]}), "m")
    assert chat.messages == [{"role": "system", "content": "x"}] and chat.add_special_tokens is False
    assert json.loads(tokenize_answer([1, 2], 99)) == {"tokens": [1, 2], "count": 2, "max_model_len": 99}


@pytest.mark.parametrize("payload, status, param", [
    ({}, 400, "prompt"), ({"prompt": ""}, 400, "prompt"), ({"prompt": 3}, 400, "prompt"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ({"messages": [{"role": "user", "content": "b"}], "add_special_tokens": True}, 400, "add_special_tokens"),
    ({"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ({"prompt": "a", "model": "other"}, 404, "model"), ({"prompt": "a", "bogus\\r\\n": 1}, 400, None),
])
def test_tokenize_refusals(payload, status, param):
    with pytest.raises(ApiError) as err:
        parse_tokenize(body(payload), "m")
    assert err.value.status == status and (param is None or err.value.param == param)
    assert "\r" not in err.value.openai_text() and "\n" not in err.value.message


def test_detokenize_requests():
    assert parse_detokenize(body({"tokens": [0, 5, 9]}), "m", vocab_size=10, max_tokens=8) == [0, 5, 9]
    for payload in ({"tokens": [10]}, {"tokens": [-1]}, {"tokens": [1.5]}, {"tokens": [False]}, {"tokens": "1"},
                    {"tokens": list(range(9))}, {}, {"tokens": [1], "model": "x"}):
        with pytest.raises(ApiError):
            parse_detokenize(body(payload), "m", vocab_size=10, max_tokens=8)
    with pytest.raises(ApiError):
        parse_detokenize(b"[1, 2]", "m", vocab_size=10, max_tokens=8)


class Stats:
    num_running, num_waiting, num_free_blocks, num_total_blocks = 2, 3, 30, 40
    num_preemptions, prefix_cache_queries, prefix_cache_hits = 1, 100, 25
    spec_decode_num_draft_tokens, spec_decode_num_accepted_tokens = 10, 7


def test_prometheus_sink_and_engine_series_parse():
    server_metrics = ServerMetrics("m")
    serving = ServingMetrics(server_metrics.sink, lambda: Stats())
    serving.announce()
    timer = serving.start(12)
    timer.tokens(1)
    timer.tokens(3)
    timer.finish()
    server_metrics.watch_engine(lambda: Stats(), lambda: 5, lambda: serving.publish_gauges(force=True))
    families = {f.name: f for f in text_string_to_metric_families(server_metrics.render().decode())}
    for name, (kind, _, _) in METRICS.items():
        assert families[name.removesuffix("_total")].type == kind, name
    value = {s.name: s.value for f in families.values() for s in f.samples if "le" not in s.labels}
    assert value["llm_prompt_tokens_total"] == 12 and value["llm_generation_tokens_total"] == 4
    assert value["llm_e2e_request_latency_seconds_count"] == 1
    assert value["vllm:num_requests_waiting"] == 3 and value["vllm:num_requests_running"] == 2
    assert value["vllm:kv_cache_usage_perc"] == 0.25 and value["vllm:prefix_cache_hits_total"] == 25
    assert value["vllm:spec_decode_num_draft_tokens_total"] == 10
    assert value["vllm:spec_decode_num_accepted_tokens_total"] == 7
    assert value["llm_spec_decode_num_accepted_tokens_total"] == 7
    assert value["llm_kv_cache_usage_ratio"] == 0.25  # refreshed at the scrape
    second = ServerMetrics("m")  # its own registry: two servers in one process do not collide
    assert b"llm_prompt_tokens_total" in second.render()


def test_bearer_auth_and_generated_key(tmp_path):
    key, path = resolve_key("", tmp_path / "k" / "llm_api.key")
    assert path.read_text().strip() == key and stat.S_IMODE(path.stat().st_mode) == 0o600 and len(key) >= 40
    auth = BearerAuth(key)
    assert auth.allows(f"Bearer {key}") and not auth.allows(None) and not auth.allows(f"Bearer {key}x")
    assert not auth.allows("Bearer \u00e9") and not auth.allows(key)
    assert resolve_key("my-own-key-123", tmp_path / "unused") == ("my-own-key-123", None)
    assert not (tmp_path / "unused").exists()
    assert BearerAuth(None).allows(None)


def test_the_standalone_edge_sends_retry_after_with_every_503():
    """Loading (the generation routes and /ready) and draining: each 503 carries Retry-After, in whole
    seconds, in the route's error shape."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from llm_api.server.http_api import ServerState, build_app
    from llm_api.server.lifecycle import Lifecycle

    class Service:  # just enough for a drain refusal: _serving only asks whether there is one
        pass

    async def answers():
        state = ServerState("<|endoftext|>", BearerAuth(None), Lifecycle(), ServerMetrics("m"), 1 << 20)
        async with TestClient(TestServer(build_app(state))) as client:
            seen = []
            for path in ("/v1/completions", "/predictions/m", "/ready"):
                method = client.get if path == "/ready" else client.post
                response = await method(path, json={"prompt": "x"})
                seen.append((path, response.status, response.headers.get("Retry-After"), await response.json()))
            state.service = Service()  # type: ignore[assignment]
            state.lifecycle.draining = True
            response = await client.post("/v1/completions", json={"prompt": "x"})
            seen.append(("draining", response.status, response.headers.get("Retry-After"), await response.json()))
            return seen

    seen = asyncio.run(answers())
    for path, status, retry_after, _error in seen:
        assert status == 503 and retry_after is not None and retry_after.isdigit(), (path, status, retry_after)
    assert [s[2] for s in seen] == ["5", "5", "1", "1"]
    assert seen[0][3]["error"]["code"] == "loading" and seen[1][3]["type"] == "loading"
    assert seen[3][3]["error"]["code"] == "shutting_down"
