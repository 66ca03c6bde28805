"""GGUF files served as they are (llm_api.model.gguf_model), on tiny random models written as llama.cpp's converter
writes them (tests/model/gguf_helpers.py): Llama (q/k rows interleaved in the file), Qwen2 (q/k/v biases) and
Qwen3 (q/k norms), tied and untied heads, every block format.

* The file loaded into transformers' classes (ENGINE=generate, the reference path) computes what the same
  transformers model holding the file's de-quantized values computes, up to its inputs' two-digit quantization:
  logits within 1e-3 of their range; every quantized linear keeps its format, repacked in groups of 8 rows where
  the format has that layout, in that tree and in our own (``llm_api.model.decoder_weights``, what the paged
  engine serves), which loads without transformers' model classes.
* Through the engine (our decoder on our tree, the CPU kernels' one-call decode step), greedy tokens equal
  ``generate()``'s on the same file in transformers' classes, with and without n-gram speculation, and with LoRA
  adapters over the quantized base equal PEFT's over the de-quantized one.
* Bad files and settings stop the load with a ConfigError naming the file and the reason.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from gguf_helpers import reference_model, tiny_model, write_gguf
from load_probe import load_in_a_fresh_process
from llm_api.engine.engine import EngineConfig, LLMEngine
from llm_api.engine.sampling_params import SamplingParams
from llm_api.kernels.cpu import library as cpu_library
from llm_api.layers.quantized import QuantizedEmbedding, QuantizedLinear
from llm_api.model.decoder_weights import CausalLMWeights
from llm_api.model.loader import load
from llm_api.model.settings import ConfigError, Settings, default_cache_dir

pytestmark = pytest.mark.skipif(cpu_library._compiler() is None, reason="no C compiler: quantized models need the CPU kernels")

PROMPT = [1, 40, 71, 200, 7, 99, 3, 150, 151, 152, 5, 60]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The models' cache (LLM_API_CACHE: the GGUF files' tokenizers); the CPU kernels' library is the host's build
    cache's, as the servers load it (a build here compiled it again in every worker: ~15-30 s of both cores)."""
    path = tmp_path_factory.mktemp("cache")
    assert cpu_library.load(default_cache_dir())
    return path


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, do_sample=False)


def assert_engine_idle(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats.num_free_blocks == stats.num_total_blocks


def _load(cache, path, **env):
    return load(Settings.from_env({"MODEL_PATH": str(path), "LLM_API_CACHE": str(cache), "DTYPE": "float32", **env}))


def _reference(cache, path, **env):
    """The file in transformers' classes over the same quantized modules (ENGINE=generate: ``generate()``)."""
    return _load(cache, path, ENGINE="generate", **env)


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


CASES = [("llama", True, "Q8_0", "Q8_0", "Q6_K"), ("llama", False, "Q4_1", "Q4_0", "Q6_K"),
         ("qwen2", False, "Q5_0", "Q8_0", "Q4_K"), ("qwen3", True, "Q4_K", "Q6_K", "Q6_K"),
         ("llama", True, "Q5_1", "Q5_K", "Q8_0"), ("llama", False, "Q6_K", "F16", "F32")]


@pytest.mark.parametrize("arch,tied,linear,embedding,head", CASES)
def test_the_served_model_computes_the_files_values(tmp_path, cache, arch, tied, linear, embedding, head):
    model = tiny_model(arch, tied)
    held = write_gguf(tmp_path / "m.gguf", model, arch, linear, embedding, head)
    lm, transformers_lm = _load(cache, tmp_path / "m.gguf"), _reference(cache, tmp_path / "m.gguf")
    assert isinstance(lm.model, CausalLMWeights) and not isinstance(transformers_lm.model, CausalLMWeights)
    reference = reference_model(model, held)
    got, want = _logits(transformers_lm.model, PROMPT), _logits(reference, PROMPT)
    assert (got - want).abs().max() <= 1e-3 * (want.max() - want.min()), (got - want).abs().max()
    for loaded in (lm.model, transformers_lm.model):
        linears = [m for m in loaded.modules() if isinstance(m, QuantizedLinear)]
        assert len(linears) == 7 * 2 + (0 if head in ("F32", "F16") and not tied else 1) - (1 if tied and embedding == "F16" else 0)
        assert {m.format.name for m in linears if m is not loaded.lm_head} == {linear}
        assert all(m.layout == ("rows8" if m.format.name != "Q5_1" else "gguf") for m in linears)
        if embedding != "F16":
            assert isinstance(loaded.model.embed_tokens, QuantizedEmbedding)
            if tied:  # one table in memory for both
                assert loaded.lm_head.blocks.data_ptr() == loaded.model.embed_tokens.blocks.data_ptr()
    assert lm.model.state_dict().keys() == transformers_lm.model.state_dict().keys()  # (LoRA and PEFT keys alike)
    assert lm.tokenizer.decode(lm.tokenizer.encode("the cat")) == "the cat"
    assert lm.tokenizer.chat_template.startswith("{% for m in messages %}")


def _engine(lm, **config):
    config.setdefault("block_size", 4)
    config.setdefault("num_blocks", 128)
    return LLMEngine(lm.model, EngineConfig(**config), eos_token_ids=set())


def _greedy_engine(engine, prompts, max_new_tokens):
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(max_new_tokens))
    tokens = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    assert_engine_idle(engine)
    return [tokens[str(i)] for i in range(len(prompts))]


def _generate(model, prompt, max_new_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,linear,activations", [("llama", "Q4_K", "int8x2"), ("qwen2", "Q8_0", "int8x2"),
                                                     ("qwen3", "Q6_K", "int8x2"), ("qwen2", "Q8_0", "int8")])
def test_engine_greedy_equals_generate_with_and_without_speculation(tmp_path, cache, monkeypatch, arch, linear,
                                                                    activations):
    from llm_api.kernels import cpu as cpu_kernels

    write_gguf(tmp_path / "m.gguf", tiny_model(arch, tied=True), arch, linear, "Q8_0")
    lm = _load(cache, tmp_path / "m.gguf", QUANT_ACTIVATIONS=activations)
    digits = {m.input_digits for m in lm.model.modules() if isinstance(m, QuantizedLinear)}
    assert digits == {2 if activations == "int8x2" else 1}
    prompts = [PROMPT, [1, 9, 9, 9, 9, 30, 31, 32, 30, 31, 32, 30, 31], list(range(3, 60))]
    transformers_lm = _reference(cache, tmp_path / "m.gguf", QUANT_ACTIVATIONS=activations)
    expected = [_generate(transformers_lm.model, prompt, 24) for prompt in prompts]
    engine = _engine(lm, cpu_kernels_cache=str(cache))
    # (the owned decoder, the one-call decode step over the quantized layers: Qwen2's q/k/v bias and Qwen3's q/k
    # norms included)
    assert engine.runner.path.name == "owned" and engine.runner.path.whole_layers
    one_call_steps = []
    decode_layers = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers", lambda *args: one_call_steps.append(1) or decode_layers(*args))
    assert _greedy_engine(engine, prompts, 24) == expected
    assert len(one_call_steps) >= 23
    speculative = _engine(lm, cpu_kernels_cache=str(cache), speculative_tokens=4)
    assert _greedy_engine(speculative, prompts, 24) == expected


def test_one_digit_inputs_compute_the_files_values_to_8_bits(tmp_path, cache):
    """QUANT_ACTIVATIONS=int8 (llama.cpp's Q8 activations): the same model within one 8-bit digit's error of the
    float reference, and not the two-digit numbers (the setting reaches every product)."""
    model = tiny_model("llama", True)
    held = write_gguf(tmp_path / "m.gguf", model, "llama", "Q4_0", "Q8_0", "Q6_K")
    want = _logits(reference_model(model, held), PROMPT)
    one, two = (_logits(_reference(cache, tmp_path / "m.gguf", QUANT_ACTIVATIONS=value).model, PROMPT)
                for value in ("int8", "int8x2"))
    span = want.max() - want.min()
    assert (two - want).abs().max() <= 1e-3 * span
    assert 1e-4 * span < (one - want).abs().max() <= 2e-2 * span and (one - want).abs().max() > (two - want).abs().max()


def test_auto_activations_take_one_digit_from_a_parameter_count_up(tmp_path, cache, monkeypatch):
    from llm_api.layers import quantized

    model = tiny_model("llama", True)
    write_gguf(tmp_path / "m.gguf", model, "llama", "Q4_K", "Q8_0")
    lm = _load(cache, tmp_path / "m.gguf")  # (QUANT_ACTIVATIONS unset: auto)
    count = quantized.parameter_count(lm.model)
    assert count == sum(p.numel() for p in model.parameters())  # (the tied head's table counted once)
    assert {m.input_digits for m in lm.model.modules() if isinstance(m, QuantizedLinear)} == {2}
    monkeypatch.setattr(quantized, "AUTO_ONE_DIGIT_PARAMETERS", count)
    lm = _load(cache, tmp_path / "m.gguf", QUANT_ACTIVATIONS="auto")
    assert {m.input_digits for m in lm.model.modules() if isinstance(m, QuantizedLinear)} == {1}


def test_a_gguf_model_loads_without_transformers(tmp_path, cache):
    """The paged engine's GGUF load builds our tree (``llm_api.model.decoder_weights``) from our config and reads
    the tokenizer the first start saved (``llm_api.model.tokenizer``): no transformers module at all, nor what
    its model and config classes import (torch._dynamo, sympy: a third of a server's start)."""
    write_gguf(tmp_path / "m.gguf", tiny_model("qwen3", tied=True), "qwen3", "Q4_K", "Q8_0")
    _load(cache, tmp_path / "m.gguf")  # (the tokenizer converted once, into the cache, as a server's first start)
    name, modules = load_in_a_fresh_process({"MODEL_PATH": str(tmp_path / "m.gguf"), "LLM_API_CACHE": str(cache)})
    assert name == "CausalLMWeights"
    assert modules == [], modules


def test_lora_over_a_quantized_base_is_pefts_over_the_dequantized_one(tmp_path, cache):
    pytest.importorskip("peft")
    from lora_helpers import make_adapter, peft_greedy
    from llm_api.lora.registry import LoraRegistry

    model = tiny_model("llama", tied=False)
    held = write_gguf(tmp_path / "m.gguf", model, "llama", "Q4_K", "Q8_0", "Q8_0")
    reference = reference_model(model, held)
    folder = make_adapter(reference, tmp_path / "adapter", seed=3, scale=2.0)
    lm = _load(cache, tmp_path / "m.gguf")
    base_expected = _generate(_reference(cache, tmp_path / "m.gguf").model, PROMPT, 16)
    registry = LoraRegistry(lm.model, max_loras=1, max_rank=16, model_name="m")
    lora_id = registry.load("a", folder).lora_id
    engine = LLMEngine(lm.model, EngineConfig(block_size=4, num_blocks=128, cpu_kernels_cache=str(cache)), set(),
                       lora=registry)
    expected = peft_greedy(reference, folder, PROMPT, 16)
    assert expected != _generate(reference, PROMPT, 16)  # (the adapter changes the answer)
    engine.add_request("a", PROMPT, greedy(16), lora_id=lora_id)
    engine.add_request("base", PROMPT, greedy(16))
    tokens = {"a": [], "base": []}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id].extend(output.new_token_ids)
    assert tokens["a"] == expected
    assert tokens["base"] == base_expected


# ---------------------------------------------------------------------------------------------------------
# bad files and settings: a ConfigError naming the file and the reason, before anything is served


def _error(cache, path, **env) -> str:
    with pytest.raises(ConfigError) as caught:
        _load(cache, path, **env)
    return str(caught.value)


def test_a_truncated_file(tmp_path, cache):
    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama")
    data = (tmp_path / "m.gguf").read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 1000, 30):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        message = _error(cache, tmp_path / "cut.gguf")
        assert str(tmp_path / "cut.gguf") in message and "truncated" in message, message


def test_an_architecture_we_do_not_serve(tmp_path, cache):
    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama")
    data = (tmp_path / "m.gguf").read_bytes().replace(b"llama", b"gpt9x")  # (the architecture and its keys' prefix)
    (tmp_path / "gpt.gguf").write_bytes(data)
    assert "architecture 'gpt9x' is not served" in _error(cache, tmp_path / "gpt.gguf")


def test_a_quant_type_we_do_not_serve(tmp_path, cache):
    import gguf

    # blk.0.k_proj as Q2_K bytes (a real format: 84 bytes a block of 256 values) that this server does not compute;
    # the file's rows of 64 values are padded to a block of 256 so the reader takes the shape
    rows = 32
    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama",
               raw={"blk.0.attn_k.weight": (np.zeros((rows, 84), np.uint8), gguf.GGMLQuantizationType.Q2_K)})
    message = _error(cache, tmp_path / "m.gguf")
    assert "blk.0.attn_k.weight" in message and ("Q2_K" in message or "shape" in message), message


def test_a_shape_that_disagrees_with_the_metadata(tmp_path, cache):
    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama", metadata={"llama.feed_forward_length": 128})
    message = _error(cache, tmp_path / "m.gguf")
    assert "blk.0.ffn_gate.weight" in message and "the metadata says" in message, message


def test_heads_of_an_odd_width_and_numbers_that_are_not_positive(tmp_path, cache):
    """Well-formed files whose model the first request could not compute: refused at load."""
    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama", metadata={"llama.attention.key_length": 15})
    assert "heads of 15 values" in _error(cache, tmp_path / "m.gguf")
    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama", metadata={"llama.attention.head_count_kv": 3})
    assert "4 attention heads cannot share 3 key/value heads" in _error(cache, tmp_path / "m.gguf")
    for key, value in (("llama.rope.freq_base", float("nan")), ("llama.rope.freq_base", -1.0),
                       ("llama.attention.layer_norm_rms_epsilon", 0.0), ("llama.rope.freq_base", float("inf"))):
        write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama", metadata={key: value})
        assert f"{key!r} = {value} is not a positive finite number" in _error(cache, tmp_path / "m.gguf"), (key, value)


def test_missing_and_unexpected_tensors(tmp_path, cache):
    write_gguf(tmp_path / "a.gguf", tiny_model("llama"), "llama", skip=("blk.1.ffn_up.weight",))
    assert "no tensor 'blk.1.ffn_up.weight'" in _error(cache, tmp_path / "a.gguf")
    write_gguf(tmp_path / "b.gguf", tiny_model("llama"), "llama", extra={"blk.7.mystery.weight": np.zeros(4, np.float32)})
    assert "no place" in _error(cache, tmp_path / "b.gguf") and "mystery" in _error(cache, tmp_path / "b.gguf")


def test_settings_a_gguf_file_cannot_run_with(tmp_path, cache):
    write_gguf(tmp_path / "m.gguf", tiny_model("llama"), "llama")
    assert "already quantized" in _error(cache, tmp_path / "m.gguf", QUANTIZATION="q8_0")
    (tmp_path / "other.gguf").write_bytes((tmp_path / "m.gguf").read_bytes())
    assert "several GGUF files" in _error(cache, tmp_path)
    os.unlink(tmp_path / "other.gguf")
    assert _load(cache, tmp_path).model is not None  # (a folder holding one GGUF file)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    os.unlink(tmp_path / "m.gguf")
    assert "not a GGUF file" in _error(cache, tmp_path / "junk.gguf")
