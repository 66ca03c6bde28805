"""LoRA adapters served by ``llm_api serve`` (one server for the module): two PEFT adapters beside the base,
runtime loading confined to a root, and the hostile inputs of the new fields and routes.

* requests for the base model and both adapters, sent at once with the openai client, each answer PEFT's
  own greedy generate() for its adapter (DTYPE=float32);
* ``/v1/models`` lists each adapter with ``parent`` = the base (vLLM's shape);
* an unknown adapter is 404 ``model_not_found`` on chat, completions, Responses and the native route
  (``adapter``), each in its own error shape;
* runtime loading: refused outside LORA_ADAPTER_ROOT (``..``, absolute paths, symlinks out, hub-like ids),
  for wrong shapes and NaN weights, odd names; a good adapter loads, serves, unloads; and the shared
  server (LORA_RUNTIME_LOADING off) refuses it;
* ``vllm:lora_requests_info`` and the per-adapter counts on ``/metrics``.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import re
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.harness.hostile import (STALL_LIMIT_S, Witness, native_path, openai_path, post_json, raw_request, refusal_problems,
                     report)
from lora_helpers import HOSTILE_ADAPTERS, make_adapter, make_hostile_adapters, peft_greedy

# (peft is imported where used, by lora_helpers: ~2.2 s, which every xdist worker would pay at collection)
pytestmark = [pytest.mark.server, pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")]
MAX_TOKENS = 10
PROMPT = "The three most useful kitchen tools are"


@pytest.fixture(scope="module")
def oracle(embedded_checkpoint_path):
    return (AutoModelForCausalLM.from_pretrained(embedded_checkpoint_path, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(embedded_checkpoint_path))


@pytest.fixture(scope="module")
def root(tmp_path_factory, oracle):
    """LORA_ADAPTER_ROOT with the served adapters, one to load at run time, and bad ones."""
    model, _ = oracle
    root = tmp_path_factory.mktemp("lora-root")
    make_adapter(model, root / "alpha", seed=11, r=8, alpha=16, scale=1.0)
    make_adapter(model, root / "beta", seed=12, r=4, alpha=8, use_rslora=True, scale=2.0,
                 targets=["q_proj", "v_proj", "gate_proj"])
    make_adapter(model, root / "gamma", seed=13, r=2, targets=["o_proj"])
    nan = make_adapter(model, root / "nan", seed=14, r=2, targets=["q_proj"])
    weights = load_file(str(nan / "adapter_model.safetensors"))
    for key in weights:
        weights[key][0, 0] = float("nan")
    save_file(weights, str(nan / "adapter_model.safetensors"))
    wide = make_adapter(model, root / "wide", seed=15, r=2, targets=["q_proj"])
    weights = load_file(str(wide / "adapter_model.safetensors"))
    save_file({k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in weights.items()},
              str(wide / "adapter_model.safetensors"))
    make_hostile_adapters(model, root)
    outside = tmp_path_factory.mktemp("outside")
    make_adapter(model, outside / "evil", seed=16, r=2, targets=["q_proj"])
    (root / "escape").symlink_to(outside / "evil", target_is_directory=True)
    return root


ALIASES = ("smollm2-chat", "org/smollm2:latest")  # SERVED_MODEL_NAME: more names of the base model


@pytest.fixture(scope="module")
def lora_server(start_standalone, root):
    server = start_standalone("lora", env={
        "DTYPE": "float32", "KV_CACHE_MEMORY_MIB": "64", "MAX_LORAS": "2",
        "LORA_ADAPTERS": f"alpha={root / 'alpha'},beta={root / 'beta'}",
        "LORA_RUNTIME_LOADING": "true", "LORA_ADAPTER_ROOT": str(root), "SERVED_MODEL_NAME": " ".join(ALIASES)})
    yield server
    server.stop()


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.openai_base, api_key=server.key(), max_retries=0)


def test_mixed_requests_match_peft(lora_server, oracle, root):
    model, tokenizer = oracle
    prompt_ids = tokenizer(PROMPT).input_ids
    expected = {"base": tokenizer.decode(model.generate(input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(
        1, len(prompt_ids), dtype=torch.long), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt_ids):],
        skip_special_tokens=True)}
    for name in ("alpha", "beta"):
        expected[name] = tokenizer.decode(peft_greedy(model, root / name, prompt_ids, MAX_TOKENS), skip_special_tokens=True)
    assert len(set(expected.values())) == 3, expected  # the adapters change the answer
    client = _client(lora_server)
    model_names = {"base": lora_server.model_name, "alias": ALIASES[1], "alpha": "alpha", "beta": "beta"}
    expected["alias"] = expected["base"]

    def complete(kind):
        answer = client.completions.create(model=model_names[kind], prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        return kind, answer.model, answer.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:  # each kind twice, all at once
        results = list(pool.map(complete, ["base", "alias", "alpha", "beta"] * 2))
    for kind, answered_model, text in results:
        assert answered_model == model_names[kind]
        # (a last token that ends inside a UTF-8 character is held back by the server's detokenizer, where
        # decode() writes U+FFFD: the tokens are the same)
        assert text == expected[kind].rstrip("\ufffd"), kind


def test_models_list_adapters_with_their_parent(lora_server):
    data = _client(lora_server).models.list().model_dump()["data"]
    by_id = {m["id"]: m for m in data}
    base = lora_server.model_name
    assert [m["id"] for m in data[:3]] == [base, *ALIASES]
    for name in (base, *ALIASES):
        assert by_id[name]["parent"] is None and by_id[name]["root"] == base
    for name in ("alpha", "beta"):
        assert by_id[name]["parent"] == base and by_id[name]["root"] == base and by_id[name]["object"] == "model"


@pytest.mark.parametrize("name", ["nope", "alpha\x00", "ALPHA", "../alpha", "al\u202epha", "a" * 300])
def test_unknown_adapter_is_404_on_every_route(lora_server, name):
    routes = [
        ("chat", openai_path(lora_server, "chat/completions"),
         {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, True),
        ("completions", openai_path(lora_server, "completions"), {"model": name, "prompt": "hi", "max_tokens": 2}, True),
        ("responses", openai_path(lora_server, "responses"), {"model": name, "input": "hi", "max_output_tokens": 2}, True),
        ("native", native_path(lora_server), {"text": "hi", "adapter": name, "max_new_tokens": 2}, False),
    ]
    problems = []
    # (a NUL is refused by the field's own text check first: 400 invalid_value)
    status, code = (400, "invalid_value") if "\x00" in name else (404, "model_not_found")
    for route, path, body, is_openai in routes:
        answer = post_json(lora_server, path, body)
        problems += refusal_problems(f"{route} {name!r}", answer, openai=is_openai, statuses=(status,))
        got = answer.json()["error"]["code"] if is_openai else answer.json().get("type")
        if got != (code if is_openai or status == 404 else "invalid_parameter"):  # (the native format's name)
            problems.append(f"{route} {name!r}: {answer.body[:200]!r}")
    assert not problems, problems


def test_native_adapter_field_selects_the_adapter(lora_server):
    def native(adapter):
        body = {"text": PROMPT, "max_new_tokens": 6, "do_sample": False, "output": "jsonl"}
        if adapter:
            body["adapter"] = adapter
        answer = post_json(lora_server, native_path(lora_server), body)
        assert answer.status == 200, answer.body[:300]
        return answer.body

    assert native("alpha") != native(None)


def _load(server, body):
    return post_json(server, "/v1/load_lora_adapter", body)


@pytest.mark.parametrize("path", ["../outside", "/etc", "escape", "alpha/../../outside", "HuggingFaceTB/SmolLM2-lora",
                                  "https://example.com/adapter", "nan", "wide", "a\x00b", "", 7, None])
def test_runtime_load_refuses(lora_server, path):
    answer = _load(lora_server, {"lora_name": "bad", "lora_path": path})
    assert not refusal_problems(f"load {path!r}", answer, openai=True, statuses=(400,)), answer.body[:300]
    assert "bad" not in {m["id"] for m in json.loads(raw_request(lora_server, "GET", "/v1/models").body)["data"]}


def test_hostile_adapters_are_refused_beside_a_witness(lora_server):
    """The red team's adapters (finite but huge weights, an enormous scaling, a 100,000-deep config) get a 400
    naming the adapter and the reason, while a stream of another tenant goes on untouched."""
    with Witness(lora_server) as witness:
        for path, reason in HOSTILE_ADAPTERS.items():
            answer = _load(lora_server, {"lora_name": f"hostile-{path}", "lora_path": path})
            assert not refusal_problems(f"load {path}", answer, openai=True, statuses=(400,)), answer.body[:300]
            message = answer.json()["error"]["message"]
            assert f"hostile-{path}" in message and reason in message, message
    report("LoRA: hostile adapters at runtime load", lora_server, inputs=3, answers={"400 refused, reason named": 3},
           witness=witness)
    assert witness.max_gap < STALL_LIMIT_S


def test_every_route_takes_each_name_of_the_base_model(lora_server):
    """SERVED_MODEL_NAME: each alias is the base model on every route that names one, and answers name it."""
    import anthropic

    client = _client(lora_server)
    for name in ALIASES:
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert chat.model == name
        assert client.responses.create(model=name, input="Hi", max_output_tokens=3).model == name
        messages = anthropic.Anthropic(base_url=lora_server.http, api_key=lora_server.key(), max_retries=0)
        assert messages.messages.create(model=name, max_tokens=3, messages=[{"role": "user", "content": "Hi"}]).model == name
        assert post_json(lora_server, "/tokenize", {"model": name, "prompt": "Hi"}).status == 200
    native = post_json(lora_server, f"/predictions/{ALIASES[0]}", {"text": "Hi", "max_new_tokens": 2})
    assert native.status == 200, native.body[:300]
    unknown = post_json(lora_server, openai_path(lora_server, "completions"), {"model": "smollm3", "prompt": "Hi"})
    assert unknown.status == 404 and all(repr(n) in unknown.json()["error"]["message"] for n in ALIASES)
    refused = _load(lora_server, {"lora_name": ALIASES[0], "lora_path": "gamma"})
    assert refused.status == 400 and refused.json()["error"]["param"] == "lora_name", refused.body[:300]


@pytest.mark.parametrize("name", ["", "a b", "x\x00", "é", "a" * 65, "-x", 5, "../gamma"])
def test_runtime_load_refuses_odd_names(lora_server, name):
    answer = _load(lora_server, {"lora_name": name, "lora_path": "gamma"})
    assert not refusal_problems(f"load name {name!r}", answer, openai=True, statuses=(400,)), answer.body[:300]


def test_runtime_load_serve_unload(lora_server):
    assert _load(lora_server, {"lora_name": "gamma", "lora_path": "gamma"}).status == 200
    again = _load(lora_server, {"lora_name": "gamma", "lora_path": "gamma"})
    assert again.status == 400 and again.json()["error"]["code"] == "adapter_exists"
    client = _client(lora_server)
    assert "gamma" in {m.id for m in client.models.list().data}
    assert client.completions.create(model="gamma", prompt=PROMPT, max_tokens=3, temperature=0).model == "gamma"
    assert post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "gamma"}).status == 200
    assert "gamma" not in {m.id for m in client.models.list().data}
    gone = post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert gone.status == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert post_json(lora_server, "/v1/load_lora_adapter", {"lora_name": "gamma"}).status == 400


def test_lora_metrics(lora_server):
    _client(lora_server).completions.create(model="alpha", prompt="hi", max_tokens=2)
    text = lora_server.metrics_text()
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0], info
    assert re.search(r'running_lora_adapters="[^"]*"', info[0]) and re.search(r'waiting_lora_adapters="[^"]*"', info[0])
    count = re.search(r'llm_lora_requests_total\{lora_name="alpha",model_name="[^"]+"\} (\d+)', text)
    assert count and int(count.group(1)) >= 1, text[-2000:]


def test_runtime_loading_is_off_by_default(standalone_server):
    answer = post_json(standalone_server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x"})
    assert not refusal_problems("load when off", answer, openai=True, statuses=(403,))
    assert answer.json()["error"]["code"] == "lora_runtime_loading_disabled"


def test_grpc_adapter_field(lora_server):
    """gRPC takes the native body in its input map: ``adapter`` selects the adapter; an unknown one is refused
    at admission with ``model_not_found``, which the standalone gRPC edge answers as the status NOT_FOUND (as
    for an unknown model name; other refusals travel as a message holding the native error object)."""
    import grpc

    from llm_api.client import GRPCClient, HTTPClient

    inputs = {"text": PROMPT, "max_new_tokens": "6", "do_sample": "false"}
    http = HTTPClient(lora_server.http, lora_server.model_name, lora_server.key())
    with GRPCClient(lora_server.grpc, lora_server.model_name, key=lora_server.key()) as client:
        assert client.generate({**inputs, "adapter": "alpha"}) == http.generate({**inputs, "adapter": "alpha"})
        assert client.generate({**inputs, "adapter": "alpha"}) != client.generate(inputs)
        with pytest.raises(grpc.RpcError) as refused:
            client.generate({**inputs, "adapter": "nope"})
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in refused.value.details()


def _metrics(server) -> str:
    return server.metrics_text()


def test_unload_refuses_while_in_use_and_the_gauge_shows_it(lora_server):
    """An adapter with a live request is not unloaded (409 adapter_in_use); meanwhile
    vllm:lora_requests_info lists it as running; once the request ended it unloads."""
    assert _load(lora_server, {"lora_name": "gamma2", "lora_path": "gamma"}).status == 200
    stream = _client(lora_server).completions.create(model="gamma2", prompt=PROMPT, max_tokens=400, temperature=0,
                                                     stream=True)
    try:
        next(iter(stream))
        busy = post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "gamma2"})
        assert busy.status == 409 and busy.json()["error"]["code"] == "adapter_in_use", busy.body[:300]
        info = next(line for line in _metrics(lora_server).splitlines() if line.startswith("vllm:lora_requests_info{"))
        assert re.search(r'running_lora_adapters="([^"]*,)?gamma2(,[^"]*)?"', info), info
    finally:
        stream.close()
    deadline = time.monotonic() + 30
    while (answer := post_json(lora_server, "/v1/unload_lora_adapter", {"lora_name": "gamma2"})).status == 409:
        assert time.monotonic() < deadline, "the closed stream's request never ended"
        time.sleep(0.2)
    assert answer.status == 200, answer.body[:300]
