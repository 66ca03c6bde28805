"""CPU_PACKED_WEIGHTS (llm_api.model.packed_linear, llm_api.model.split_linear): which models are packed or
split, that a packed or split layer computes what ``F.linear`` does, that the engine's greedy tokens on
packed or split tiny models equal generate()'s on plain copies, and that the loader lays the embedded model
out as the setting says."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from torch import nn

from llm_api.model import cpu
from llm_api.model.loader import load
from llm_api.model.packed_linear import PackedLinear, pack_linear_weights, weight_layout
from llm_api.model.split_linear import MAX_SPLIT_ROWS, SplitLinear, split_linear_weights, split_parts
from llm_api.model.settings import ConfigError, Settings

from engine_helpers import greedy, make_engine, random_prompt, reference_greedy, run_engine, tiny_model


def test_which_models_are_packed_or_split():
    for vendor in ("GenuineIntel", "AuthenticAMD", ""):
        assert weight_layout("auto", torch.bfloat16, on_cpu=True, vendor=vendor) == "packed"
        assert weight_layout("auto", torch.float32, on_cpu=True, vendor=vendor) == (
            "split" if vendor == "AuthenticAMD" else "plain")
        assert weight_layout("true", torch.float32, on_cpu=True, vendor=vendor) == "packed"
        assert weight_layout("split", torch.bfloat16, on_cpu=True, vendor=vendor) == "split"
    assert cpu.cpu_vendor("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t: avx2\n") == "AuthenticAMD"
    assert cpu.cpu_vendor("processor\t: 0\nFeatures\t: fp asimd bf16\n") == ""
    assert weight_layout("true", torch.float16, on_cpu=True) == "plain"
    assert weight_layout("false", torch.bfloat16, on_cpu=True) == "plain"
    assert weight_layout("true", torch.bfloat16, on_cpu=False) == "plain"  # a GPU's weights stay as they are
    assert weight_layout("split", torch.float32, on_cpu=False) == "plain"
    assert Settings.from_env({"CPU_PACKED_WEIGHTS": "TRUE"}).cpu_packed_weights == "true"
    with pytest.raises(ConfigError, match="CPU_PACKED_WEIGHTS"):
        Settings.from_env({"CPU_PACKED_WEIGHTS": "yes please"})


def _bf16_packs() -> bool:
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=torch.bfloat16), 1)
        return True
    except RuntimeError:
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_layer_computes_the_linear(dtype, bias):
    if dtype == torch.bfloat16 and not _bf16_packs():
        pytest.skip("oneDNN packs bfloat16 only on CPUs with avx512/AMX bf16 support (the refusal: next test)")
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for shape in [(1, 96), (5, 96), (1, 7, 96), (2, 3, 96)]:  # decode rows, prefill chunks, batched
        x = torch.randn(shape).to(dtype)
        with torch.no_grad():
            torch.testing.assert_close(packed(x).float(), linear(x).float(), rtol=tolerance, atol=tolerance)
    assert packed.out_features == 40 and packed.packed_weight.dtype == dtype


def test_a_model_this_cpu_cannot_pack_is_left_as_it_is(caplog):
    """Where oneDNN refuses (bfloat16 without the instructions), nothing is swapped and the log says why;
    where it packs, every linear layer is swapped."""
    model = tiny_model("llama").to(torch.bfloat16)
    num_linears = sum(type(m) is nn.Linear for m in model.modules())
    with caplog.at_level(logging.INFO, logger="llm_api.model.packed_linear"):
        swapped = pack_linear_weights(model)
    if _bf16_packs():
        assert swapped == num_linears and not any(type(m) is nn.Linear for m in model.modules())
    else:
        assert swapped == 0 and "not packing" in caplog.text
        assert sum(type(m) is nn.Linear for m in model.modules()) == num_linears


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
@pytest.mark.parametrize("layout", ["packed", "split"])
def test_engine_on_packed_or_split_float32_weights_matches_generate(arch, layout):
    """float32 packed weights sum in another order than F.linear (split ones need not): the greedy tokens
    must not change either way."""
    model, reference_model = tiny_model(arch), tiny_model(arch)
    if layout == "packed":
        assert pack_linear_weights(model) > 0
    else:
        assert split_linear_weights(model, threads=2) > 0
    kind = PackedLinear if layout == "packed" else SplitLinear
    assert isinstance(model.get_output_embeddings(), kind)
    generator = torch.Generator().manual_seed(5)
    arrivals = {0: [(f"r{i}", random_prompt(generator, n), greedy(12)) for i, n in enumerate((4, 19, 33))]}
    results = run_engine(make_engine(model), arrivals)
    for request_id, prompt, params in arrivals[0]:
        assert results[request_id][0] == reference_greedy(reference_model, prompt, params.max_new_tokens)


def test_the_loader_lays_out_weights_as_the_setting_says(embedded_checkpoint_path, two_threads):
    """Through the loader (the servers' path): the weights as loaded where the CPU kernels will run (their
    products read them); else bfloat16 packed where this CPU can, float32 split on AMD CPUs; each when
    asked. (The packed embedded model's answers: tests/engine/test_bf16.py, against generate().)"""
    amd = cpu.cpu_vendor() == "AuthenticAMD"
    kernels = shutil.which("cc") is not None or shutil.which("gcc") is not None
    for dtype, mode, fused, expect in [
            ("bfloat16", "auto", "false", PackedLinear if _bf16_packs() else nn.Linear),
            ("bfloat16", "auto", "true", nn.Linear if kernels else PackedLinear if _bf16_packs() else nn.Linear),
            ("bfloat16", "false", "true", nn.Linear), ("float32", "auto", "false", SplitLinear if amd else nn.Linear),
            ("float32", "true", "true", PackedLinear), ("float32", "split", "true", SplitLinear)]:
        settings = Settings.from_env({"MODEL_PATH": str(embedded_checkpoint_path), "DTYPE": dtype,
                                      "CPU_PACKED_WEIGHTS": mode, "FUSED_KERNELS": fused})
        model = load(settings).model
        assert type(model.lm_head) is expect, (dtype, mode, fused)
        assert expect is nn.Linear or not any(type(m) is nn.Linear for m in model.modules())
        if expect is SplitLinear:  # the tied lm_head still computes with the embedding's own tensor
            assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("bias", [False, True])
def test_split_layer_computes_the_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=bias)
    split = SplitLinear(linear, parts=4)
    # decode rows, prefill chunks, batched, the largest split and the first F.linear row count, none
    for shape in [(1, 96), (5, 96), (1, 7, 96), (2, 3, 96), (MAX_SPLIT_ROWS, 96), (MAX_SPLIT_ROWS + 1, 96), (0, 96)]:
        x = torch.randn(shape)
        with torch.no_grad():
            got = split(x)
            torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
        assert got.shape == (*shape[:-1], 40)
    x = torch.randn(6, 192)[:, ::2]  # a strided view of the input
    with torch.no_grad():
        torch.testing.assert_close(split(x), linear(x), rtol=1e-5, atol=1e-5)


def test_split_parts_divide_the_output_features():
    assert split_parts(576, 2) == 2 and split_parts(49152, 16) == 16
    assert split_parts(576, 5) == 4 and split_parts(7, 2) == 1 and split_parts(10, 0) == 1
    with pytest.raises(ValueError):
        SplitLinear(nn.Linear(4, 7), parts=2)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 7))  # 7 output features: left as nn.Linear
    assert split_linear_weights(model, threads=2) == 1
    assert [type(m) for m in model] == [SplitLinear, nn.Linear]
