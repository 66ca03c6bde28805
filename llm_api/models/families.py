"""Which loaded models run as our own code (``llm_api.models.llama``), read from the checkpoint's config.

``own_model(model, kernels)`` returns ``(CausalLM, ModelPath)`` for a family we list, or ``(None, ModelPath)``
with the reason it keeps transformers' classes (with the paged attention function, ``llm_api.engine.attention``):
another family, bitsandbytes' linears, an offloaded model (``DEVICE_MAP``: accelerate's hooks move weights in and
out around transformers' forwards), a config our decoder does not compute (an activation other than SiLU, a
module it expects that is missing). The decision reads ``config.model_type`` and the config's fields, never the
code of transformers' modules; tests/models/test_owned_model.py pins the path of every family we test, so a
transformers release that renames a module shows there (and in the start-up log), not as a silent slow path.

Families and their flags (what the one decoder reads):

    llama (Llama 2/3, SmolLM, TinyLlama, ...)   q/k/v and o biases and an MLP bias from the config
    mistral                                     a sliding window on every layer (config.sliding_window)
    qwen2 (Qwen2, Qwen2.5)                      q/k/v bias; a window on the layers config.layer_types says
    qwen3                                       q/k norms per head; windows as Qwen2
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from llm_api.kernels.kernel_set import KernelSet
from llm_api.models.llama import CausalLM, LayerFlags

logger = logging.getLogger(__name__)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
OWNED, TRANSFORMERS = "owned", "transformers"


@dataclass(frozen=True)
class ModelPath:
    """How the engine runs a model: ``owned`` (our decoder on ``kernels``) or ``transformers`` (its classes with
    the paged attention), and why."""

    name: str
    family: str
    kernels: str  # the kernel set's name ("" on transformers' path)
    reason: str
    whole_layers: bool = False  # the set runs a step of few rows as whole layers (the C set)

    def describe(self) -> str:
        if self.name == OWNED:
            return f"{self.family} as llm_api's decoder on the {self.kernels} kernels ({self.reason})"
        return f"{self.family or 'this model'} on transformers' classes with the paged attention ({self.reason})"


def _layer_flags(model_type: str, config: Any, layers: list) -> list[LayerFlags]:
    flags = []
    for layer in layers:
        attn = layer.self_attn
        window = getattr(config, "sliding_window", None) if model_type == "mistral" else getattr(attn, "sliding_window", None)
        flags.append(LayerFlags(sliding_window=window, qk_norm=model_type == "qwen3"))
    return flags


REQUIRED = {"layer": ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"),
            "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"),
            "mlp": ("gate_proj", "up_proj", "down_proj")}


def _refusal(model: Any, model_type: str) -> str | None:
    """Why ``model`` keeps transformers' classes (None: it can run as ours)."""
    if model_type not in FAMILIES:
        return f"model_type {model_type!r} is not one of the families llm_api runs as its own code ({', '.join(FAMILIES)})"
    config = model.config
    for module in model.modules():
        if hasattr(module, "_hf_hook"):
            return "accelerate hooks place its weights (DEVICE_MAP offload): transformers' forwards move them"
        if type(module).__module__.startswith("bitsandbytes"):
            return "bitsandbytes' quantized linears run under transformers' forwards"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}: the decoder computes SiLU x up"
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    decoder = model.get_decoder() if callable(getattr(model, "get_decoder", None)) else None
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if decoder is None or head is None:
        return "no decoder or output head to read"
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if getattr(decoder, name, None) is None:
            return f"its decoder has no {name!r} (a transformers release that renamed it?)"
    for i, layer in enumerate(decoder.layers):
        for part, names in REQUIRED.items():
            owner = layer if part == "layer" else getattr(layer, part)
            missing = [name for name in names if getattr(owner, name, None) is None]
            if missing:
                return f"layer {i}'s {part} has no {', '.join(missing)} (a transformers release that renamed it?)"
        norms = [layer.input_layernorm, layer.post_attention_layernorm, *(
            [layer.self_attn.q_norm, layer.self_attn.k_norm] if model_type == "qwen3" else [])]
        if not all(hasattr(norm, "weight") and hasattr(norm, "variance_epsilon") for norm in norms):
            return f"layer {i}'s norms are not RMSNorms with a weight and variance_epsilon"
    if not hasattr(decoder.norm, "variance_epsilon"):
        return "its final norm is not an RMSNorm with a weight and variance_epsilon"
    return None


def own_model(model: nn.Module, kernels: KernelSet, merged: bool = True) -> tuple[CausalLM | None, ModelPath]:
    """The model as our decoder on ``kernels`` where its family is ours (``merged``: q/k/v and gate/up as one
    product each), else None; with the path taken and why (logged)."""
    from llm_api.kernels.kernel_set import runs_whole_layers

    loaded: Any = model
    model_type = str(getattr(loaded.config, "model_type", ""))
    reason = _refusal(loaded, model_type)
    if reason is not None:
        path = ModelPath(TRANSFORMERS, model_type, "", reason)
        logger.info("model path: %s", path.describe())
        return None, path
    decoder = loaded.get_decoder()
    owned = CausalLM(loaded, _layer_flags(model_type, loaded.config, list(decoder.layers)), kernels, merged)
    whole = runs_whole_layers(kernels) and merged
    path = ModelPath(OWNED, model_type, kernels.name, "model_type " + repr(model_type)
                     + ("" if merged else "; products unmerged"), whole_layers=whole)
    logger.info("model path: %s", path.describe())
    return owned, path
