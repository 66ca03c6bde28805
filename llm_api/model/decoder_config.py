"""The configuration of a Llama-family decoder as our own value, read without transformers (a GGUF file's metadata:
``llm_api.model.gguf_model``; a checkpoint's config.json: ``llm_api.model.checkpoint_model``).

``DecoderConfig`` holds what the owned decoder (``llm_api.models.llama``), the engine (the KV layout, the model
length, the vocabulary) and the GGUF placer read, under transformers' attribute names, so every reader takes it
or a transformers config alike. ``to_transformers()`` makes the family's transformers config of the same
values, for the reference model (``generate()``: ENGINE=generate and the tests' oracles).

Why our own: the transformers config classes import most of transformers on first use (its activations pull in
the hub-kernel integration, torch._dynamo, torch.distributed.tensor and sympy: 2.4 of a server start's ~6 CPU
seconds on a 2-core Xeon, flags amx_int8 avx512_bf16, 2026-11-29), and a server of our families never needs them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# The rotary types the decoder computes (transformers' "rope_type" names).
ROPE_TYPES = ("default", "linear", "llama3")
# A layer's attention, as transformers' configs name it in ``layer_types``.
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str  # "llama", "mistral", "qwen2" or "qwen3" (a family of llm_api.models.families)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Llama's and Qwen3's q/k/v/o biases (Qwen2's q/k/v have theirs always)
    mlp_bias: bool = False  # Llama's gate/up/down biases
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # (a checkpoint's generation config may name several)
    pad_token_id: int | None = None
    hidden_act: str = "silu"
    sliding_window: int | None = None  # the sliding layers' window (Mistral's: every layer's)
    layer_types: tuple[str, ...] | None = None  # Qwen2/3: LAYER_TYPES per layer (None: every layer full)

    def __post_init__(self) -> None:
        if self.rope_parameters.get("rope_type") not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_parameters.get('rope_type')!r} is not computed (one of {ROPE_TYPES})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} attention heads cannot share {self.num_key_value_heads} "
                             "key/value heads")
        if self.head_dim % 2:
            raise ValueError(f"heads of {self.head_dim} values: the rotary embedding rotates pairs of a head's values")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"a sliding window of {self.sliding_window} positions")
        if self.layer_types is not None:
            if self.model_type == "mistral" or len(self.layer_types) != self.num_hidden_layers or \
                    any(kind not in LAYER_TYPES for kind in self.layer_types):
                raise ValueError(f"layer_types must give each of the {self.num_hidden_layers} layers one of "
                                 f"{LAYER_TYPES} (and Mistral's layers have none)")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("sliding layers without a sliding window")

    def window(self, layer: int) -> int | None:
        """The layer's sliding window, as the family's transformers class attends (None: the whole context)."""
        if self.model_type == "mistral":
            return self.sliding_window
        if self.layer_types is not None and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def biased(self, projection: str) -> bool:
        """Whether the family's ``projection`` (q_proj, ..., down_proj, lm_head) has a bias, as transformers'
        classes of the family build it: Qwen2's q/k/v always, Llama's and Qwen3's attention projections with
        ``attention_bias``, Llama's MLP with ``mlp_bias``; Mistral's none."""
        if projection in ("q_proj", "k_proj", "v_proj") and self.model_type == "qwen2":
            return True
        if projection in ("q_proj", "k_proj", "v_proj", "o_proj"):
            return self.attention_bias and self.model_type in ("llama", "qwen3")
        if projection in ("gate_proj", "up_proj", "down_proj"):
            return self.mlp_bias and self.model_type == "llama"
        return False

    def to_dict(self) -> dict[str, Any]:
        """The fields, as transformers' configs give theirs (the step budget's cache key reads it)."""
        return dataclasses.asdict(self)

    def to_transformers(self) -> Any:
        """The family's transformers config with these values (imports transformers: the reference model only)."""
        from transformers import AutoConfig

        values = {name: value for name, value in self.to_dict().items() if value is not None and name != "model_type"}
        if self.model_type not in ("llama", "qwen3"):
            values.pop("attention_bias")  # (fields the family's config does not have)
        if self.model_type != "llama":
            values.pop("mlp_bias")
            values["sliding_window"] = self.sliding_window  # (None too: Mistral's and Qwen's default to 4096)
        if isinstance(self.eos_token_id, tuple):
            values["eos_token_id"] = list(self.eos_token_id)
        if self.layer_types is not None:
            values.update(layer_types=list(self.layer_types), use_sliding_window=self.sliding_window is not None)
        return AutoConfig.for_model(self.model_type, **values)
