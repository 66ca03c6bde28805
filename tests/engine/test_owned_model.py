"""The model layer we own (``llm_api.models``): which families run as our decoder, and that it computes what
transformers' classes compute.

The path is pinned for every tiny family the tests build (a transformers release that renames a module the
decoder reads shows here as a family falling to transformers' path, with the reason). On the torch kernel set
with unmerged products the owned decoder is transformers' arithmetic op for op: every token and every logprob of
an engine on it equals, bit for bit, those of an engine running transformers' classes with the paged attention
(the same model's modules). Merged q/k/v and gate/up products change only the products' summation order: the
same greedy tokens, logprobs within float32 rounding. The C and Triton sets are checked against ``generate()``
in tests/engine/test_cpu_layers.py and test_triton_set.py."""

from __future__ import annotations

import copy

import pytest
import torch

from engine_helpers import TINY_CONFIGS, greedy, make_engine, on_transformers_path, random_prompt, step_outputs, tiny_model
from llm_api.kernels.torch_set import TORCH_KERNELS
from llm_api.models.families import FAMILIES, TRANSFORMERS, own_model
from llm_api.models.linear import QKV

OWNED = ("llama", "mistral", "qwen2", "qwen3")


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_each_family_takes_the_path_we_list(arch):
    model = tiny_model(arch)
    owned, path = own_model(model, TORCH_KERNELS)
    if arch in OWNED:
        assert owned is not None and (path.name, path.family, path.kernels) == ("owned", arch, "torch")
    else:
        assert owned is None and path.name == TRANSFORMERS
        assert "is not one of the families" in path.reason and path.family in path.reason
    assert set(FAMILIES) == set(OWNED)


def test_an_offloaded_model_keeps_transformers_classes():
    """accelerate's hooks move an offloaded model's weights around transformers' forwards (DEVICE_MAP): such a
    model is never run as ours."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = tiny_model("llama")
    add_hook_to_module(model.model.layers[1].mlp, ModelHook())
    owned, path = own_model(model, TORCH_KERNELS)
    assert owned is None and "DEVICE_MAP" in path.reason


def test_the_owned_model_keeps_transformers_names_and_weights():
    """The owned model holds the loaded modules themselves: the same parameter names (what the LoRA registry
    and PEFT keys find), the same tensors, and no second copy of a merged weight."""
    model = tiny_model("llama")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    owned, _ = own_model(model, TORCH_KERNELS)
    assert owned is not None
    assert sorted(name for name, _ in owned.named_parameters()) == sorted(before)
    for name, param in owned.named_parameters():
        assert torch.equal(param, before[name]) and param is model.get_parameter(name), name
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in before.values())
    layer = owned.model.layers[0]
    assert layer.qkv is not None
    storage = layer.qkv.weight.untyped_storage().data_ptr()
    assert all(getattr(layer.self_attn, name).weight.untyped_storage().data_ptr() == storage for name in QKV)


def _arrivals(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {step: [(f"r{step}", random_prompt(generator, 4 + 3 * step), greedy(8, logprobs=3))] for step in (0, 2, 3)}


@pytest.mark.parametrize("arch", OWNED)
@pytest.mark.parametrize("merged", [False, True], ids=["unmerged", "merged"])
def test_the_owned_decoder_computes_what_transformers_does(monkeypatch, arch, merged):
    model = tiny_model(arch)
    oracle_model = copy.deepcopy(model)
    owned = make_engine(model, num_blocks=64, fused_layers=merged)
    assert owned.runner.path.name == "owned"
    with monkeypatch.context() as patch:
        on_transformers_path(patch)
        oracle = make_engine(oracle_model, num_blocks=64, fused_layers=merged)
    assert oracle.runner.path.name == TRANSFORMERS
    arrivals = _arrivals(4)
    got, expected = step_outputs(owned, arrivals, 60), step_outputs(oracle, arrivals, 60)
    if not merged:
        assert got == expected  # (bit for bit)
        return
    assert {r: [ids for ids, _ in steps] for r, steps in got.items()} == {
        r: [ids for ids, _ in steps] for r, steps in expected.items()}
    for request_id, steps in got.items():
        for (_, logprobs), (_, wanted) in zip(steps, expected[request_id]):
            for row, wanted_row in zip(logprobs, wanted, strict=True):
                assert row.token_id == wanted_row.token_id
                assert [(t, round(lp, 4)) for t, lp in row.top] == [(t, round(lp, 4)) for t, lp in wanted_row.top]
