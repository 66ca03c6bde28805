"""Which models the engine drives, and where their layers may live.

* Models the engine cannot drive (a state-space model with its own cache, a hybrid with convolution
  layers) are recognised before any engine is built, and the service falls back to the generate()
  reference path with one log line.
* A model placed by a JSON device map with layers offloaded to disk (weights on "meta", moved in by
  accelerate's hooks for each forward) runs in the engine and generates the same greedy tokens as the
  same checkpoint in one piece; split over GPU and CPU too (``gpu`` marker).
"""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Lfm2Config, MambaConfig

from llm_api.model import loader as model_loader
from llm_api.model.settings import Settings
from llm_api.engine.support import UnsupportedModelError, check_supported, unsupported_reason
from llm_api.service.service import ModelService

from engine_helpers import assert_engine_idle, greedy, make_engine, random_prompt, reference_greedy

VOCAB_SIZE = 1000


def _service_for(model) -> ModelService:
    lm = model_loader.LoadedModel(tokenizer=SimpleNamespace(pad_token_id=0), model=model, eos_token_ids=frozenset(),
                                  hidden_size=model.get_input_embeddings().embedding_dim, device=torch.device("cpu"))
    return ModelService(Settings.from_env({}), lm)


def _tiny(config):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


UNDRIVABLE = {
    # Mamba: no attention at all; its recurrent state lives in its own cache object.
    "mamba": (lambda: MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB_SIZE, state_size=8),
              "_supports_attention_backend is False"),
    # LFM2: attention layers use the interface, but its short-convolution layers keep state in the cache.
    "lfm2": (lambda: Lfm2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=128, vocab_size=VOCAB_SIZE, layer_types=["conv", "full_attention"]),
             "layers of kind ['conv']"),
}


@pytest.mark.parametrize("arch", sorted(UNDRIVABLE))
def test_undrivable_model_falls_back_to_generate_with_one_log_line(arch, caplog):
    make_config, why = UNDRIVABLE[arch]
    model = _tiny(make_config())
    assert why in unsupported_reason(model)
    with pytest.raises(UnsupportedModelError):
        check_supported(model)
    with caplog.at_level(logging.INFO, logger="llm_api.service.service"):
        service = _service_for(model)
    assert service.engine is None and service.path_name == "generate() reference"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cannot drive" in warnings[0] and why in warnings[0]

    # The fallback answers through the engine loop, token for token as a plain generate() call.
    prompt = random_prompt(torch.Generator().manual_seed(0), 7)

    async def run():
        return [t async for o in service.loop.generate("r", prompt, greedy(6)) for t in o.new_token_ids]

    try:
        assert asyncio.run(run()) == reference_greedy(model, prompt, 6)
    finally:
        service.shutdown()


def test_supported_families_pass_the_check(tiny_models):
    from engine_helpers import TINY_CONFIGS, get_model

    for arch in TINY_CONFIGS:
        model, _ = get_model(tiny_models, arch)
        assert unsupported_reason(model) is None, arch


# ---------------------------------------------------------------------------------------------- placement

NUM_LAYERS = 4


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tokenizer_folder):
    """A tiny random Llama with the embedded model's tokenizer, saved as a checkpoint folder."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=len(tokenizer), max_position_embeddings=512,
                         tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-llama")
    _tiny(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _load(path, **env):
    return model_loader.load(Settings.from_env({"MODEL_PATH": str(path), "DTYPE": "float32", **env}))


def _engine_tokens(model, prompts, max_new_tokens=12):
    engine = make_engine(model)
    tokens = {str(i): [] for i in range(len(prompts))}
    for outputs in engine.generate_batch_stream(
            [(str(i), p, greedy(max_new_tokens), None) for i, p in enumerate(prompts)]):
        for output in outputs:
            tokens[output.request_id] += output.new_token_ids
    assert_engine_idle(engine)
    return [tokens[str(i)] for i in range(len(prompts))]


def _prompts(tokenizer):
    return [tokenizer(text)["input_ids"] for text in ("The capital of France is", "Once upon a time, in a land")]


def test_disk_and_cpu_offload_device_map_matches_model_in_one_piece(tiny_checkpoint, tmp_path):
    whole = _load(tiny_checkpoint, DEVICE_MAP="cpu", ENGINE="generate")  # (transformers' classes: generate())
    device_map = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.layers.2": "cpu", "model.layers.3": "disk",
                  "model.norm": "cpu", "lm_head": "disk"}
    offloaded = _load(tiny_checkpoint, DEVICE_MAP=json.dumps(device_map), OFFLOAD_FOLDER=str(tmp_path / "offload"))
    model = offloaded.model
    # Really offloaded: those weights are on "meta" until accelerate's hook brings them in.
    assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    assert model.model.embed_tokens.weight.device.type == "meta"
    assert offloaded.device == torch.device("cpu")

    prompts = _prompts(whole.tokenizer)
    expected = [reference_greedy(whole.model, p, 12) for p in prompts]  # before the engine switches attention
    assert _engine_tokens(model, prompts) == expected
    assert _engine_tokens(whole.model, prompts) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_split_over_gpu_and_cpu_matches_model_in_one_piece(tiny_checkpoint):
    whole = _load(tiny_checkpoint, DEVICE_MAP="cuda:0")  # the same device's arithmetic as the split model
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": "cpu", "model.layers.3": "cpu", "model.norm": 0, "lm_head": 0}
    split = _load(tiny_checkpoint, DEVICE_MAP=json.dumps(device_map))
    engine_model = split.model
    layer_devices = make_engine(engine_model).kv_cache.layout.layer_devices
    assert {d.type for d in layer_devices} == {"cuda"}  # the CPU layers execute on the GPU (accelerate hooks)

    prompts = _prompts(whole.tokenizer)
    expected = [reference_greedy(whole.model, p, 12) for p in prompts]
    assert _engine_tokens(engine_model, prompts) == expected
