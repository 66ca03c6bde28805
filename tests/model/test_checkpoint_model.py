"""Checkpoints of the families we own read into our tree without transformers (llm_api.model.checkpoint_model), on
tiny random models saved by transformers' ``save_pretrained`` with the embedded model's tokenizer:

* the loader's model is our ``CausalLMWeights`` holding the checkpoint's tensors (the same values as transformers'
  ``from_pretrained``), and the engine's greedy tokens equal ``generate()``'s of transformers' model: Llama (with
  q/k/v/o and MLP biases, tied and untied), Qwen2 (q/k/v biases), Qwen3 (q/k norms, tied), Mistral without a
  window; older config files (``rope_theta`` / ``rope_scaling``) and ``generation_config.json``'s end ids read;
* what is not ours loads through transformers, the reason logged: a sliding window, a rotary type we do not
  compute, a tensor the tree has no place for, ENGINE=generate, bitsandbytes;
* the load imports no transformers model or config class.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from load_probe import load_in_a_fresh_process
from tests.engine.engine_helpers import TINY_CONFIGS, greedy, make_engine, reference_greedy
from llm_api.model.decoder_weights import CausalLMWeights
from llm_api.model.loader import load
from llm_api.model.settings import Settings

PROMPTS = [[1, 40, 71, 200, 7, 99, 3, 150], [5, 5, 6, 7, 300, 301, 302, 303, 304, 2, 9]]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _checkpoint(folder, tokenizer_folder, arch: str, seed: int = 0, **fields):
    """A tiny random model of ``arch`` saved at ``folder`` (every weight random: biases and norms too)."""
    config = TINY_CONFIGS[arch]()
    for name, value in fields.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_folder / name, folder / name)
    return folder


def _load(folder, **env):
    return load(Settings.from_env({"MODEL_PATH": str(folder), "DTYPE": "float32", "CPU_PACKED_WEIGHTS": "false",
                                   **env}))


def _engine_tokens(model, max_new_tokens=10):
    engine = make_engine(model)
    tokens = {str(i): [] for i in range(len(PROMPTS))}
    for outputs in engine.generate_batch_stream([(str(i), p, greedy(max_new_tokens), None) for i, p in enumerate(PROMPTS)]):
        for output in outputs:
            tokens[output.request_id] += output.new_token_ids
    return [tokens[str(i)] for i in range(len(PROMPTS))]


CASES = {"llama": ("llama", {}),
         "llama-biases-tied": ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
         "qwen2": ("qwen2", {}),
         "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
         "mistral-no-window": ("mistral", {"sliding_window": None}),
         # windows of 6 positions: the prompts (8 and 11 tokens) and their answers run past them
         "mistral-window": ("mistral", {"sliding_window": 6}),
         "qwen2-window-on-layer-1": ("qwen2", {"use_sliding_window": True, "sliding_window": 6,
                                              "layer_types": ["full_attention", "sliding_attention"]}),
         # Llama 3.1's rotary: with 16-value heads and an original context of 128 positions, frequencies fall in
         # all three of its bands (divided, interpolated, kept).
         "llama3-rotary": ("llama", {"rope_parameters": {
             "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 128}})}


@pytest.mark.parametrize("case", list(CASES))
def test_our_tree_holds_the_checkpoint_and_generates_its_tokens(tmp_path, tokenizer_folder, case):
    arch, fields = CASES[case]
    folder = _checkpoint(tmp_path, tokenizer_folder, arch, **fields)
    lm = _load(folder)
    assert isinstance(lm.model, CausalLMWeights)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours, theirs = lm.model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert (lm.model.lm_head.weight is lm.model.model.embed_tokens.weight) == bool(fields.get("tie_word_embeddings"))
    assert torch.equal(lm.model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert [layer.self_attn.sliding_window for layer in lm.model.model.layers] == \
        [getattr(layer.self_attn, "sliding_window", reference.config.sliding_window if arch == "mistral" else None)
         for layer in reference.model.layers]
    expected = [reference_greedy(reference, prompt, 10) for prompt in PROMPTS]
    assert _engine_tokens(lm.model) == expected


def test_an_older_config_file_and_generation_configs_end_ids(tmp_path, tokenizer_folder):
    """rope_theta and rope_scaling (linear) instead of rope_parameters, torch_dtype, the end ids of
    generation_config.json: read as transformers reads them."""
    folder = _checkpoint(tmp_path, tokenizer_folder, "llama", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                             "rope_theta": 5000.0})
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0}, torch_dtype=config.pop("dtype"))
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    lm = _load(folder)
    assert isinstance(lm.model, CausalLMWeights)
    assert lm.model.config.rope_parameters == {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}
    assert {2, 7} <= lm.eos_token_ids
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert torch.equal(lm.model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert _engine_tokens(lm.model) == [reference_greedy(reference, prompt, 10) for prompt in PROMPTS]


@pytest.mark.parametrize("arch, removed, fields", [
    ("mistral", ("sliding_window",), {}),  # (transformers' default window: 4096)
    ("qwen2", ("layer_types",), {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    ("qwen3", ("layer_types", "sliding_window", "max_window_layers"), {"use_sliding_window": True}),
])
def test_windows_a_file_does_not_spell_out_are_transformers_defaults(tmp_path, tokenizer_folder, arch, removed, fields):
    folder = _checkpoint(tmp_path, tokenizer_folder, arch, **fields)
    config = json.loads((folder / "config.json").read_text())
    for key in removed:
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = _load(folder).model
    assert isinstance(model, CausalLMWeights)
    ours = model.config
    assert ours.sliding_window == reference.config.sliding_window
    theirs = reference.config.layer_types if arch != "mistral" else None  # (Mistral's config has none)
    assert list(ours.layer_types or []) == list(theirs or [])


def test_what_is_not_ours_loads_through_transformers(tmp_path, tokenizer_folder, caplog):
    caplog.set_level(logging.INFO, logger="llm_api.model.loader")
    window = _checkpoint(tmp_path / "window", tokenizer_folder, "qwen2", layer_types=["full_attention", "sliding_attention"])
    yarn = _checkpoint(tmp_path / "yarn", tokenizer_folder, "llama", rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128})
    extra = _checkpoint(tmp_path / "extra", tokenizer_folder, "llama")
    tensors = load_file(extra / "model.safetensors")
    save_file({**tensors, "model.layers.0.mlp.mystery.weight": torch.zeros(4)}, extra / "model.safetensors",
              metadata={"format": "pt"})
    for folder, reason in ((window, "sliding layers without a window"), (yarn, "rotary type 'yarn'"),
                           (extra, "'model.layers.0.mlp.mystery.weight', which our llama tree has no place for")):
        caplog.clear()
        assert not isinstance(_load(folder).model, CausalLMWeights)
        assert any(reason in record.getMessage() and "transformers' classes" in record.getMessage()
                   for record in caplog.records), (reason, [r.getMessage() for r in caplog.records])
    plain = _checkpoint(tmp_path / "plain", tokenizer_folder, "llama")
    assert not isinstance(_load(plain, ENGINE="generate").model, CausalLMWeights)


def test_the_load_imports_no_transformers_module(tmp_path, tokenizer_folder):
    folder = _checkpoint(tmp_path, tokenizer_folder, "qwen3")
    name, modules = load_in_a_fresh_process({"MODEL_PATH": str(folder), "DTYPE": "float32"})
    assert name == "CausalLMWeights"
    assert modules == [], modules
