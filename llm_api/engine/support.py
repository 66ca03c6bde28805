"""Which models the paged engine can drive, decided from the model before any engine is built.

``unsupported_reason(model)`` returns ``None`` for a decoder the engine runs exactly like ``generate()``,
else one sentence saying why not; ``check_supported`` raises ``UnsupportedModelError`` (a
``NotImplementedError``) with it. The handler then serves the model with the ``generate()`` reference
path. Our module tree (``llm_api.model.decoder_weights``: GGUF files, our families' checkpoints on a CPU) is
always driven: our decoder runs it. A transformers model needs all of:

1. A causal decoder: an encoder-decoder's cross-attention K/V would need a second, unpaged cache.
2. A class that declares ``_supports_attention_backend`` and whose module calls
   ``ALL_ATTENTION_FUNCTIONS.get_interface`` (transformers' own test for ``set_attn_implementation``):
   only then does every attention layer call the function we register.
3. Every layer an attention layer of a kind the paged function implements (``layer_types`` /
   ``block_types`` of full or sliding attention). Hybrid models (Mamba, linear attention, short
   convolutions, recurrent blocks) keep per-request state in transformers' cache object, which the
   engine never passes (it calls the model with ``use_cache=False``).
4. No layer that reads another layer's K/V (Gemma-3n's shared-KV layers) and no attention sinks
   (GPT-OSS's ``s_aux``): the paged function has neither.
5. One attention module per layer carrying ``layer_idx`` 0..n-1, which indexes the KV pool.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from llm_api.engine.kv_cache import attention_modules
from llm_api.model.decoder_weights import CausalLMWeights

# Layer kinds the paged attention function implements (causal, optionally within a sliding window).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})


class UnsupportedModelError(NotImplementedError):
    """The paged engine cannot drive this model; serve it with the generate() reference path."""


def unsupported_reason(model: nn.Module) -> str | None:
    name = type(model).__name__
    config: Any = model.config  # (nn.Module's __getattr__ is typed Tensor | Module)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if isinstance(model, CausalLMWeights):  # (our module tree, which our decoder runs: llm_api.models.families)
        return None
    if getattr(config, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder model (its cross-attention K/V are not paged)"
    if not getattr(type(model), "_supports_attention_backend", False):
        return (f"{name} does not declare support for transformers' AttentionInterface "
                f"(_supports_attention_backend is False): its attention or cache logic is its own")
    can_set = getattr(type(model), "_can_set_attn_implementation", None)
    if can_set is not None and not can_set():
        return f"{name}'s attention layers do not call ALL_ATTENTION_FUNCTIONS.get_interface()"
    for attribute in ("layer_types", "block_types"):
        kinds = getattr(text_config, attribute, None)
        other = sorted({str(k) for k in kinds or ()} - ATTENTION_LAYER_TYPES)
        if other:
            return (f"{name} has layers of kind {other} ({attribute}), which keep state outside the KV cache; "
                    f"the engine implements only {sorted(ATTENTION_LAYER_TYPES)}")
    if getattr(text_config, "num_kv_shared_layers", 0):
        return f"{name} has layers that reuse another layer's K/V (num_kv_shared_layers)"
    modules = attention_modules(model)
    if any(getattr(module, "sinks", None) is not None for module in modules.values()):
        return f"{name}'s attention has sink logits (s_aux), which the paged attention function does not implement"
    num_layers = getattr(text_config, "num_hidden_layers", None)
    if num_layers is None or sorted(modules) != list(range(num_layers)):
        return (f"{name}: expected one attention module per layer with layer_idx 0..{num_layers}-1, "
                f"found {sorted(modules)}")
    return None


def check_supported(model: nn.Module) -> None:
    reason = unsupported_reason(model)
    if reason is not None:
        raise UnsupportedModelError(reason)
