"""Model options end to end on CPU: quantization, dtypes and inputs_embeds through the engine.

* The embedded model loaded with QUANTIZATION=8bit and 4bit (bitsandbytes on CPU) answers "What is the
  capital of France?" with Paris, through the paged engine and through the generate() reference path.
* Settings for the options (BNB_4BIT_QUANT_TYPE, OFFLOAD_FOLDER, device-map values) and the combinations
  that cannot work here fail with a ConfigError naming the variables.
* A request with ``inputs_embeds`` equal to the model's own input embeddings of a text runs in the
  engine and generates the same tokens as the text.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from llm_api.model import loader as model_loader
from llm_api.model.settings import ConfigError, Settings
from llm_api.protocols.native.translate import parse_request
from llm_api.service.events import TextDelta
from llm_api.service.service import ModelService

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _run(service: ModelService, rows: dict) -> dict[str, str]:
    """Native rows sent together through the service: request id -> the answer's text."""

    async def one(request_id, row):
        request = parse_request(row, service.limits)
        events = [e async for e in service.generate(request, request_id)]
        assert events[-1].error is None, events[-1].error
        return "".join(e.text for e in events if isinstance(e, TextDelta))

    async def main():
        return dict(zip(rows, await asyncio.gather(*(one(i, row) for i, row in rows.items()))))

    return asyncio.run(main())


# ------------------------------------------------------------------------------------------ settings


def test_4bit_quant_type_setting():
    assert Settings.from_env({}).bnb_4bit_quant_type == "nf4"
    assert Settings.from_env({"BNB_4BIT_QUANT_TYPE": "FP4"}).bnb_4bit_quant_type == "fp4"
    with pytest.raises(ConfigError, match="BNB_4BIT_QUANT_TYPE='int4' is not supported; allowed values: nf4, fp4"):
        Settings.from_env({"BNB_4BIT_QUANT_TYPE": "int4"})
    settings = Settings.from_env({"QUANTIZATION": "4bit", "BNB_4BIT_QUANT_TYPE": "fp4"})
    config = model_loader.quantization_config(settings, torch.bfloat16, on_gpu=False)
    assert (config.load_in_4bit, config.bnb_4bit_quant_type, config.bnb_4bit_use_double_quant) == (True, "fp4", True)
    assert config.bnb_4bit_compute_dtype == torch.bfloat16


def test_offload_folder_and_device_map_values():
    assert Settings.from_env({"HOME": "/h", "MODEL_NAME": "m"}).offload_folder == "/h/.cache/llm_api/offload/m"
    assert Settings.from_env({"OFFLOAD_FOLDER": "/x"}).offload_folder == "/x"
    Settings.from_env({"DEVICE_MAP": '{"model.layers.0": "disk", "model.layers.1": "cuda:1", "lm_head": 0}'})
    with pytest.raises(ConfigError, match="DEVICE_MAP=.*unknown devices {'lm_head': 'gpu'}"):
        Settings.from_env({"DEVICE_MAP": '{"model.layers.0": "cpu", "lm_head": "gpu"}'})


def test_auto_dtype_is_the_checkpoints_but_float32_for_float16_on_cpu():
    auto = Settings.from_env({"DTYPE": "auto"})
    assert model_loader.resolve_dtype(auto, torch.bfloat16, on_gpu=False) == torch.bfloat16
    assert model_loader.resolve_dtype(auto, "float16", on_gpu=False) == torch.float32
    assert model_loader.resolve_dtype(auto, torch.float16, on_gpu=True) == torch.float16
    assert model_loader.resolve_dtype(auto, None, on_gpu=False) == torch.float32
    assert model_loader.resolve_dtype(Settings.from_env({"DTYPE": "float16"}), None, on_gpu=False) == torch.float16


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"QUANTIZATION": "4bit", "DEVICE_MAP": '{"model": "cpu", "lm_head": "disk"}'},
         "QUANTIZATION=4bit cannot offload to disk"),
        ({"DEVICE_MAP": "cuda:0"}, "DEVICE_MAP='cuda:0' asks for CUDA"),
    ],
)
def test_combinations_that_cannot_work_here_name_the_variables(embedded_checkpoint_path, env, needle):
    if torch.cuda.is_available():
        pytest.skip("these combinations are CPU-only failures")
    with pytest.raises(ConfigError, match=needle):
        model_loader.load(Settings.from_env({"MODEL_PATH": str(embedded_checkpoint_path), **env}))


# ------------------------------------------------------------------------------------------ quantized


@pytest.mark.parametrize("quantization", ["8bit", "4bit", "q8_0", "q4_0"])
def test_quantized_embedded_model_answers_paris(embedded_checkpoint_path, quantization):
    """bitsandbytes' 8bit and 4bit, and the GGUF formats quantized at load (llm_api.model.quantize). (Not q4_k:
    at 4.5 bits this 135M model no longer names Paris, "L'Étoile de la Cité, also known as the City of the City,
    is the capital of France"; llama.cpp's own llama-quantize Q4_K_M file of it answers "La femme de France, le
    Grand Croix...": docs/model-options.md.)"""
    env = {"MODEL_PATH": str(embedded_checkpoint_path), "QUANTIZATION": quantization, "KV_CACHE_MEMORY_MIB": "16"}
    answers = {}
    lm = None
    for engine in ("generate", "paged"):  # (as each server loads it: our tree for q8_0/q4_0's paged engine;
        settings = Settings.from_env({**env, "ENGINE": engine})  # bitsandbytes' model the same for both)
        if lm is None or quantization not in ("8bit", "4bit"):
            lm = model_loader.load(settings)
        if quantization in ("8bit", "4bit"):
            assert lm.model.is_quantized
        else:
            assert type(lm.model.model.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"
        service = ModelService(settings, lm)
        try:
            answers[service.path_name] = _run(service, {"q": {"messages": QUESTION, "max_new_tokens": 24}})["q"]
        finally:
            service.shutdown()
    assert set(answers) == {"generate() reference", "paged engine"}
    for path_name, answer in answers.items():
        assert "Paris" in answer, (quantization, path_name, answer)


# ------------------------------------------------------------------------------------------ inputs_embeds


def test_inputs_embeds_through_the_engine_equal_the_text(embedded_model_path):
    # A model of its own: the engine switches the model's attention to the paged function, which would
    # break generate() for later tests sharing the session's `embedded_lm_fp32`. float32 pinned on every host:
    # in bfloat16 a row may part from itself in another batch at a one-ulp tie.
    settings = Settings.from_env({"KV_CACHE_MEMORY_MIB": "16", "MODEL_PATH": str(embedded_model_path),
                                  "DTYPE": "float32"})
    lm = model_loader.load(settings)
    service = ModelService(settings, lm)
    assert service.path_name == "paged engine"
    text = "The three primary colours are"
    token_ids = lm.tokenizer(text)["input_ids"]
    with torch.inference_mode():
        embeds = lm.model.get_input_embeddings()(torch.tensor(token_ids))  # [T, H], the model's dtype
    rows = {"r0": {"text": text, "max_new_tokens": 20, "ignore_eos": True},
            "r1": {"inputs_embeds": embeds.float().tolist(), "max_new_tokens": 20, "ignore_eos": True}}
    # In the same batch and each alone: the embeddings request matches the text request token for token.
    try:
        together = _run(service, rows)
        alone = _run(service, {"r1": rows["r1"]})
    finally:
        service.shutdown()
    assert together["r1"] == together["r0"] == alone["r1"]
    assert len(together["r0"]) > 0
