"""Load the tokenizer and causal LM that ``Settings`` describe.

Turns DTYPE, DEVICE_MAP and QUANTIZATION into ``from_pretrained`` arguments, and fails with a
``ConfigError`` naming the variable when a combination cannot work on this machine. The tokenizer gets
a pad token (falling back to EOS) and left padding, which batched ``generate()`` needs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from llm_api.config import ConfigError, Settings, parse_device_map

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class LoadedModel:
    tokenizer: object
    model: torch.nn.Module
    eos_token_ids: frozenset[int]
    hidden_size: int
    device: torch.device  # where input ids and embeddings go (the input embedding's device)


def resolve_dtype(settings: Settings, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    if settings.dtype != "auto":
        return _DTYPES[settings.dtype]
    dtype = checkpoint_dtype or torch.float32
    if not torch.cuda.is_available() and dtype == torch.float16:
        return torch.float32  # float16 matmuls are slow (or missing) on CPU
    return dtype


def quantization_config(settings: Settings, compute_dtype: torch.dtype):
    if settings.quantization == "none":
        return None
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise ConfigError(
            f"QUANTIZATION={settings.quantization} needs bitsandbytes: pip install 'llm_api[quant]'"
        ) from None
    if settings.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def load(settings: Settings) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(settings.model_path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"MODEL_PATH={settings.model_path!r} is not a Hugging Face checkpoint folder (no config.json)")
    config = AutoConfig.from_pretrained(path)
    dtype = resolve_dtype(settings, getattr(config, "dtype", None) or getattr(config, "torch_dtype", None))
    device_map = parse_device_map(settings.device_map)
    if not torch.cuda.is_available() and _wants_cuda(device_map):
        raise ConfigError(f"DEVICE_MAP={settings.device_map!r} asks for CUDA, but no CUDA device is available")
    kwargs = {"dtype": dtype, "device_map": device_map}
    quant = quantization_config(settings, dtype)
    if quant is not None:
        kwargs["quantization_config"] = quant

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.eval()
    logger.info(
        "loaded %s: dtype=%s device_map=%s quantization=%s", path.name, dtype, settings.device_map, settings.quantization
    )
    return LoadedModel(
        tokenizer=tokenizer,
        model=model,
        eos_token_ids=eos_token_ids(model, tokenizer),
        hidden_size=model.get_input_embeddings().embedding_dim,
        device=model.get_input_embeddings().weight.device,
    )


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _wants_cuda(device_map) -> bool:
    if isinstance(device_map, int):
        return True
    if isinstance(device_map, str):
        return device_map.startswith("cuda")
    if isinstance(device_map, dict):
        return any(isinstance(d, int) or str(d).startswith("cuda") for d in device_map.values())
    return False
