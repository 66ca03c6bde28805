"""LoRA adapters under TorchServe: adapters packaged into the archive with ``torch-model-archiver
--extra-files`` and named relative to it in LORA_ADAPTERS, served beside the base model, and the runtime
load/unload routes behind TorchServe's management key (``X-Management-Key``) on top of its inference key, and
the red team's hostile adapters refused there as on ``llm_api serve`` while another stream goes on (issue 34)."""

from __future__ import annotations

from pathlib import Path

import importlib.util
import pytest
import torch
from transformers import AutoModelForCausalLM

from bench.harness.hostile import STALL_LIMIT_S, Witness, openai_path, post_json, raw_request, refusal_problems, report
from lora_helpers import HOSTILE_ADAPTERS, make_adapter, make_hostile_adapters

# (peft is imported where used, by lora_helpers: ~2.2 s, which every xdist worker would pay at collection)
pytestmark = [pytest.mark.server, pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")]


@pytest.fixture(scope="module")
def lora_torchserve(start_server, tmp_path_factory, embedded_checkpoint_path):
    model = AutoModelForCausalLM.from_pretrained(embedded_checkpoint_path, dtype=torch.float32)
    package = tmp_path_factory.mktemp("package")
    make_adapter(model, package / "lora" / "alpha", seed=21, r=8, scale=1.0)  # -> <archive>/lora/alpha
    root = tmp_path_factory.mktemp("ts-root")
    make_adapter(model, root / "delta", seed=22, r=2, targets=["q_proj"])
    make_hostile_adapters(model, root)
    del model
    server = start_server("lora-ts", (Path(__file__).parent.parent / "model-config.yaml").read_text(),
                          extra_files=(package,),
                          env={"DTYPE": "float32", "KV_CACHE_MEMORY_MIB": "64", "LORA_ADAPTERS": "alpha=lora/alpha",
                               "LORA_RUNTIME_LOADING": "true", "LORA_ADAPTER_ROOT": str(root)})
    yield server
    server.stop()


def _models(server) -> dict:
    answer = raw_request(server, "GET", openai_path(server, "models"))
    assert answer.status == 200, answer.body[:300]
    return {m["id"]: m for m in answer.json()["data"]}


def test_packaged_adapter_is_served(lora_torchserve):
    models = _models(lora_torchserve)
    assert models["alpha"]["parent"] == lora_torchserve.model_name
    body = {"prompt": "The three most useful kitchen tools are", "max_tokens": 8, "temperature": 0}
    base = post_json(lora_torchserve, openai_path(lora_torchserve, "completions"), {**body, "model": lora_torchserve.model_name})
    alpha = post_json(lora_torchserve, openai_path(lora_torchserve, "completions"), {**body, "model": "alpha"})
    assert base.status == alpha.status == 200, (base.body[:300], alpha.body[:300])
    assert alpha.json()["model"] == "alpha"
    assert alpha.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]


def test_runtime_loading_needs_the_management_key(lora_torchserve):
    path = openai_path(lora_torchserve, "load_lora_adapter")
    body = {"lora_name": "delta", "lora_path": "delta"}
    for key in (None, "not-the-key", lora_torchserve.key("inference")):
        headers = {"X-Management-Key": key} if key else {}
        answer = post_json(lora_torchserve, path, body, headers=headers)
        assert not refusal_problems(f"load with {key!r}", answer, openai=True, statuses=(403,)), answer.body[:300]
    assert "delta" not in _models(lora_torchserve)
    management = {"X-Management-Key": lora_torchserve.key("management")}
    outside = post_json(lora_torchserve, path, {"lora_name": "x", "lora_path": "../x"}, headers=management)
    assert outside.status == 400 and outside.json()["error"]["code"] == "invalid_lora_path"
    assert post_json(lora_torchserve, path, body, headers=management).status == 200
    assert "delta" in _models(lora_torchserve)
    unload = openai_path(lora_torchserve, "unload_lora_adapter")
    assert post_json(lora_torchserve, unload, {"lora_name": "delta"}).status == 403
    assert post_json(lora_torchserve, unload, {"lora_name": "delta"}, headers=management).status == 200
    assert "delta" not in _models(lora_torchserve)


def test_hostile_adapters_are_refused_beside_a_witness(lora_torchserve):
    """Finite but huge weights, an enormous scaling and a 100,000-deep config, loaded with the management key:
    each a 400 naming the adapter and the reason, never listed, while another stream goes on untouched."""
    management = {"X-Management-Key": lora_torchserve.key("management")}
    with Witness(lora_torchserve) as witness:
        for path, reason in HOSTILE_ADAPTERS.items():
            answer = post_json(lora_torchserve, openai_path(lora_torchserve, "load_lora_adapter"),
                               {"lora_name": f"hostile-{path}", "lora_path": path}, headers=management)
            assert not refusal_problems(f"load {path}", answer, openai=True, statuses=(400,)), answer.body[:300]
            message = answer.json()["error"]["message"]
            assert f"hostile-{path}" in message and reason in message, message
    assert not any(name.startswith("hostile-") for name in _models(lora_torchserve))
    report("LoRA: hostile adapters at runtime load", lora_torchserve, inputs=len(HOSTILE_ADAPTERS),
           answers={"400 refused, reason named": len(HOSTILE_ADAPTERS)}, witness=witness)
    assert witness.max_gap < STALL_LIMIT_S
