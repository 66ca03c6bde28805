"""A Hugging Face checkpoint of a family we own, read into our module tree without transformers (on a CPU).

``checkpoint_config(folder)`` reads ``config.json`` (and ``generation_config.json``'s end-of-sequence ids) into our
``DecoderConfig``, or says why the checkpoint loads through transformers instead; ``load_weights(folder, config,
dtype)`` reads its safetensors files into ``CausalLMWeights`` (``llm_api.model.decoder_weights``), or says why
not, before a byte of weights is read. The loader (``llm_api.model.loader``) takes this path for the paged engine
on a CPU (no CUDA placement, no offload, no bitsandbytes: those are transformers' loading) and falls back to
transformers' ``from_pretrained`` for every reason given here, logged.

Ours: ``model_type`` llama, mistral, qwen2 or qwen3; SiLU; the rotary ``default``, ``linear`` or ``llama3`` (Llama
3.1-3.3's; in the ``rope_parameters`` that transformers 5 writes or the ``rope_theta`` / ``rope_scaling`` of older
files); sliding windows as each family's transformers config reads them (``_windows``); every field the decoder
reads present and well-typed; the weights in safetensors files (one, or an index's shards), every tensor the tree
holds present with its shape and a float type, nothing else in the files (but the rotary frequencies older Llama
checkpoints saved), the output head tied to the embedding where ``tie_word_embeddings`` says so.

Why our own: transformers' config and model classes import torch._dynamo, torch.distributed.tensor and sympy
(``llm_api.model.decoder_config``): the embedded float32 checkpoint's server reached ready in 3.1 CPU seconds
instead of 4.8 and held 130 MB less (docs/benchmarks.md, 2-core Intel Xeon), and a transformers release cannot
change the tree the engine runs. The tokenizer is read by ``llm_api.model.tokenizer`` where tokenizer.json alone
makes it; otherwise ``llm_api.model.loader`` gives transformers' AutoTokenizer a bare config of the model's type
where tokenizer_config.json names its class, so that it does not load the family's config class either.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llm_api.model.decoder_config import LAYER_TYPES, ROPE_TYPES, DecoderConfig
from llm_api.model.decoder_weights import CausalLMWeights

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
FLOAT_DTYPES = ("F32", "BF16", "F16")  # (safetensors' names)
# Tensors older checkpoints hold that the tree computes itself.
IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _positive_int(raw: dict, key: str, default: Any = None) -> int | None:
    return _positive_int_value(raw.get(key, default))


def _positive_int_value(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31 else None


def _positive_float(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf:
        return float(value)
    return None


def _rope(raw: dict) -> dict[str, Any] | str:
    """The rotary parameters (transformers' ``rope_parameters`` form), or why they are not ours."""
    parameters, older = raw.get("rope_parameters"), raw.get("rope_scaling")
    scaling: dict
    if isinstance(parameters, dict):  # (transformers 5's files)
        scaling, theta = parameters, parameters.get("rope_theta", raw.get("rope_theta", 10000.0))
    elif parameters is None:  # (older files: rope_theta, and rope_scaling where scaled)
        if older is not None and not isinstance(older, dict):
            return "rope_scaling is not an object"
        scaling, theta = older or {}, raw.get("rope_theta", 10000.0)
    else:
        return "rope_parameters is not an object"
    kind, factor = scaling.get("rope_type", scaling.get("type", "default")), scaling.get("factor")
    if kind not in ROPE_TYPES:
        return f"rotary type {str(kind)[:40]!r} (ours: {', '.join(ROPE_TYPES)})"
    if raw.get("partial_rotary_factor", 1.0) != 1.0 or (isinstance(parameters, dict)
                                                       and parameters.get("partial_rotary_factor", 1.0) != 1.0):
        return "a partial rotary factor"
    rope: dict[str, Any] = {"rope_type": kind, "rope_theta": _positive_float(theta)}
    if rope["rope_theta"] is None:
        return "rope_theta is not a positive number"
    if kind in ("linear", "llama3"):
        rope["factor"] = _positive_float(factor)
        if rope["factor"] is None:
            return f"the {kind} rotary's factor is not a positive number"
    if kind == "llama3":  # (the context it was trained at, where transformers looks: the config's own field first)
        context = raw["original_max_position_embeddings"] if "original_max_position_embeddings" in raw else \
            scaling.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
        rope.update(low_freq_factor=_positive_float(scaling.get("low_freq_factor")),
                    high_freq_factor=_positive_float(scaling.get("high_freq_factor")),
                    original_max_position_embeddings=_positive_int_value(context))
        if None in rope.values() or rope["low_freq_factor"] >= rope["high_freq_factor"]:
            return "the llama3 rotary's low/high frequency factors or original context are not positive numbers " \
                   "with low < high"
    return rope


def _windows(raw: dict, model_type: str, layers: int) -> tuple[int | None, tuple[str, ...] | None] | str:
    """(the sliding window, each layer's type) as the family's transformers config reads them, or why not ours.
    Mistral: ``sliding_window`` on every layer (4096 where the file does not say: transformers' default). Qwen2/3:
    a window only with ``use_sliding_window`` (``sliding_window``, default 4096), on the layers ``layer_types``
    names, or where the file has none, from ``max_window_layers`` (default 28) on. Llama: none."""
    types = raw.get("layer_types")
    if model_type == "mistral":
        window = raw.get("sliding_window", 4096)
        if types is not None:
            return "layer_types on a Mistral checkpoint (transformers' Ministral classes read those)"
        return (window, None) if window is None or _positive_int_value(window) else \
            "sliding_window is not a positive integer"
    if model_type == "llama":
        if any(kind != "full_attention" for kind in types or ()):
            return "layer types other than full attention on a Llama checkpoint"
        return None, None
    use = raw.get("use_sliding_window", False)
    window = raw.get("sliding_window", 4096) if use is True else None
    if not isinstance(use, bool) or (window is not None and not _positive_int_value(window)):
        return "use_sliding_window is not a boolean or sliding_window not a positive integer"
    if types is None:
        start = raw.get("max_window_layers", 28)
        if not isinstance(start, int) or isinstance(start, bool):
            return "max_window_layers is not an integer"
        types = ["sliding_attention" if window is not None and i >= start else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(kind not in LAYER_TYPES for kind in types):
        return f"layer_types is not one of {LAYER_TYPES} per layer"
    if "sliding_attention" in types and window is None:
        return "sliding layers without a window (use_sliding_window is false)"
    return window, tuple(types)


def checkpoint_dtype(folder: Path) -> str | None:
    """The dtype config.json names the weights in (``dtype``, or the older ``torch_dtype``), if any."""
    raw = _read_json(Path(folder) / "config.json") or {}
    value = raw.get("dtype", raw.get("torch_dtype"))
    return value if isinstance(value, str) else None


def checkpoint_config(folder: Path) -> tuple[DecoderConfig | None, str]:
    """Our configuration of the checkpoint in ``folder``, or None and why transformers loads it."""
    raw = _read_json(Path(folder) / "config.json")
    if raw is None:
        return None, "no readable config.json object"
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        return None, f"model_type {str(model_type)[:40]!r} is not a family of ours ({', '.join(FAMILIES)})"
    if raw.get("quantization_config") is not None:
        return None, "a quantized checkpoint (quantization_config)"
    if raw.get("hidden_act", "silu") != "silu":
        return None, f"hidden_act {str(raw.get('hidden_act'))[:40]!r}"
    if raw.get("pretraining_tp", 1) not in (1, None):
        return None, "pretraining_tp > 1"
    rope = _rope(raw)
    if isinstance(rope, str):
        return None, rope
    ints = {key: _positive_int(raw, key) for key in ("vocab_size", "hidden_size", "intermediate_size",
                                                     "num_hidden_layers", "num_attention_heads",
                                                     "max_position_embeddings")}
    missing = [key for key, value in ints.items() if value is None]
    if missing:
        return None, f"config.json has no positive integer {missing[0]}"
    heads, hidden = ints["num_attention_heads"], ints["hidden_size"]
    assert heads is not None and hidden is not None
    kv_heads = _positive_int(raw, "num_key_value_heads", heads)
    head_dim = _positive_int(raw, "head_dim", None) if raw.get("head_dim") is not None else hidden // heads
    eps = _positive_float(raw.get("rms_norm_eps"))
    flags: dict[str, Any] = {key: raw.get(key, False) for key in ("attention_bias", "mlp_bias", "tie_word_embeddings")}
    if kv_heads is None or head_dim is None or eps is None or not all(isinstance(v, bool) for v in flags.values()):
        return None, "num_key_value_heads, head_dim, rms_norm_eps or a bias/tie flag is not of the expected type"
    if (flags["mlp_bias"] and model_type != "llama") or (flags["attention_bias"] and model_type not in ("llama", "qwen3")):
        return None, f"a bias flag {model_type} does not read"
    windows = _windows(raw, model_type, ints["num_hidden_layers"])  # type: ignore[arg-type]
    if isinstance(windows, str):
        return None, windows
    # (as transformers: the generation config's end ids where the file exists, else the model config's)
    generation = _read_json(Path(folder) / "generation_config.json")
    eos = generation.get("eos_token_id") if generation is not None else raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else eos
    token_ids: dict[str, Any] = {"bos_token_id": raw.get("bos_token_id"), "pad_token_id": raw.get("pad_token_id"),
                                 "eos_token_id": eos_ids}
    if not all(v is None or isinstance(v, int) or (isinstance(v, tuple) and all(isinstance(i, int) for i in v))
               for v in token_ids.values()):
        return None, "a token id (bos, eos, pad) that is not an integer"
    try:
        config = DecoderConfig(
            model_type=model_type, vocab_size=ints["vocab_size"], hidden_size=hidden,  # type: ignore[arg-type]
            intermediate_size=ints["intermediate_size"], num_hidden_layers=ints["num_hidden_layers"],  # type: ignore[arg-type]
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=ints["max_position_embeddings"], rms_norm_eps=eps,  # type: ignore[arg-type]
            rope_parameters=rope, sliding_window=windows[0], layer_types=windows[1], **flags, **token_ids)
    except ValueError as error:  # (heads that do not share, an odd head width)
        return None, str(error)
    return config, ""


def _files(folder: Path) -> list[Path] | str:
    index = _read_json(folder / "model.safetensors.index.json")
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            return "model.safetensors.index.json has no weight_map"
        names = sorted({str(v) for v in weight_map.values()})
        if any("/" in name or name.startswith(".") for name in names):
            return "a shard named outside the checkpoint's folder"
        return [folder / name for name in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    return "no safetensors weights (model.safetensors or an index of shards)"


def load_weights(folder: Path, config: DecoderConfig, dtype: torch.dtype) -> CausalLMWeights | str:
    """The checkpoint's weights in our tree, in ``dtype``; or why not (checked before any weight is read)."""
    from safetensors import safe_open

    files = _files(Path(folder))
    if isinstance(files, str):
        return files
    model = CausalLMWeights(config, dtype)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    found: dict[str, Path] = {}
    try:
        for path in files:
            with safe_open(str(path), framework="pt") as file:
                for name in file.keys():
                    if IGNORED.fullmatch(name) or (config.tie_word_embeddings and name == "lm_head.weight"):
                        continue
                    if name not in expected:
                        return f"{path.name} holds {name[:80]!r}, which our {config.model_type} tree has no place for"
                    tensor_slice = file.get_slice(name)
                    shape = tuple(tensor_slice.get_shape())
                    if shape != expected[name]:
                        return f"{name[:80]!r} has shape {shape}, the config says {expected[name]}"
                    if tensor_slice.get_dtype() not in FLOAT_DTYPES:
                        return f"{name[:80]!r} is {str(tensor_slice.get_dtype())[:20]}, not a float tensor"
                    found[name] = path
    except Exception as error:  # (safetensors' own errors: a truncated or foreign file)
        return f"its safetensors files could not be read ({type(error).__name__}: {str(error)[:200]})"
    missing = sorted(set(expected) - set(found))
    if missing:
        return f"the checkpoint has no {missing[0]!r}"
    for path in files:
        with safe_open(str(path), framework="pt") as file:
            for name in file.keys():
                if found.get(name) != path:
                    continue
                tensor = file.get_tensor(name)
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, nn.Parameter(tensor.to(dtype), requires_grad=False))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
