"""``QUANTIZATION=q8_0|q4_0|q4_k`` (llm_api.model.quantize): a Hugging Face checkpoint's linear layers quantized at
load into GGUF's block formats, by llama-quantize's rules (which tensor gets which format), and served as a GGUF
file of those formats would be: the same logits as the float model holding the quantized values."""

from __future__ import annotations

import pytest
import torch

from gguf_helpers import tiny_model, write_gguf
from llm_api.kernels.cpu import library as cpu_library
from llm_api.kernels.cpu import quant
from llm_api.layers.quantized import QuantizedEmbedding, QuantizedLinear
from llm_api.model.loader import load
from llm_api.model.settings import ConfigError, Settings, default_cache_dir

pytestmark = pytest.mark.skipif(cpu_library._compiler() is None, reason="no C compiler: quantized models need the CPU kernels")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Llama as a Hugging Face checkpoint folder (tied and untied heads), with a tokenizer."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("checkpoints")
    assert cpu_library.load(default_cache_dir())  # (the host's build cache, as the servers load the library)
    write_gguf(root / "tokenizer.gguf", tiny_model("llama"), "llama")  # (for its tokenizer only)
    tokenizer = AutoTokenizer.from_pretrained(root, gguf_file="tokenizer.gguf")
    folders = {}
    for tied in (True, False):
        folder = root / ("tied" if tied else "untied")
        tiny_model("llama", tied=tied, seed=4).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[tied] = folder
    return folders


def _load(folder, cache, scheme, **env):
    return load(Settings.from_env({"MODEL_PATH": str(folder), "QUANTIZATION": scheme, "DTYPE": "float32",
                                   "LLM_API_CACHE": str(cache), **env}))


# scheme -> (the layers' format, down_proj's (input 512: a multiple of 256), the head's)
EXPECTED = {"q8_0": ("Q8_0", "Q8_0", "Q8_0"), "q4_0": ("Q4_0", "Q4_0", "Q6_K"), "q4_k": ("Q4_K", "Q4_K", "Q6_K")}


def _check_formats(lm, scheme, tied):
    layers_format, down_format, head_format = EXPECTED[scheme]
    layer = lm.model.model.layers[0]
    assert {type(m) for m in (layer.self_attn.q_proj, layer.mlp.down_proj, lm.model.lm_head)} == {QuantizedLinear}
    assert layer.self_attn.q_proj.format.name == layers_format and layer.mlp.down_proj.format.name == down_format
    assert lm.model.lm_head.format.name == head_format
    embedding = lm.model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)
    if tied:  # the head's blocks, one copy
        assert embedding.blocks.data_ptr() == lm.model.lm_head.blocks.data_ptr()
    else:
        assert embedding.format.name == layers_format


@pytest.mark.parametrize("scheme", sorted(EXPECTED))
@pytest.mark.parametrize("tied", [True, False])
def test_formats_follow_llama_quantizes_rules_and_the_logits_hold(checkpoints, tmp_path, scheme, tied):
    """In our tree (the paged engine's: llm_api.model.checkpoint_model) and in transformers' classes (ENGINE=generate),
    whose forward gives the logits."""
    ours, lm = _load(checkpoints[tied], tmp_path, scheme), _load(checkpoints[tied], tmp_path, scheme, ENGINE="generate")
    assert type(ours.model).__name__ == "CausalLMWeights" and type(lm.model).__name__ != "CausalLMWeights"
    _check_formats(ours, scheme, tied)
    _check_formats(lm, scheme, tied)
    embedding = lm.model.model.embed_tokens
    float_model = tiny_model("llama", tied=tied, seed=4)
    with torch.no_grad():  # the float model holding the quantized values
        for name, module in lm.model.named_modules():
            if isinstance(module, QuantizedLinear):
                float_model.get_submodule(name).weight.copy_(quant.dequantize(module.quantized))
        if not tied:
            float_model.model.embed_tokens.weight.copy_(quant.dequantize(embedding.quantized))
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 3]])
    with torch.no_grad():
        got, want = lm.model(ids).logits, float_model(ids).logits
    assert (got - want).abs().max() <= 1e-3 * (want.max() - want.min())


def test_quant_activations_reach_every_quantized_layer(checkpoints, tmp_path):
    lm = _load(checkpoints[True], tmp_path, "q4_0", QUANT_ACTIVATIONS="int8")
    layers = [m for m in lm.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) > 1 and {m.input_digits for m in layers} == {1} and lm.model.lm_head.product.input_digits == 1


def test_quantization_needs_the_cpu(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_library, "load", lambda cache_dir: False)
    with pytest.raises(ConfigError, match="QUANTIZATION=q4_k runs on the CPU kernels"):
        _load(checkpoints[True], tmp_path, "q4_k")


def test_a_quantized_model_counts_its_products_in_the_step_budgets_floor(checkpoints, tmp_path):
    """The step budget's analytic floor (llm_api.engine.step_budget) counts a quantized linear's in x out
    products: its weights are blocks in a buffer, not parameters, and left out the floor of a GGUF model was
    its norms' alone (the embedded Q4_1 model's step budget went to 2,048 tokens: 10 s steps on 2 cores)."""
    from llm_api.engine.step_budget import analytic_floor

    quantized = analytic_floor(_load(checkpoints[False], tmp_path, "q8_0").model, 2).per_token_s
    plain = analytic_floor(tiny_model("llama", tied=False, seed=4), 2).per_token_s
    # (the float model counts its embedding as parameters too; the quantized one's is a buffer)
    assert 0.7 * plain <= quantized <= plain, (quantized, plain)
