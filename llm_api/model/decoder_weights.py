"""A Llama-family model's weights as modules under transformers' names, built without transformers.

``CausalLMWeights(config, dtype)`` is the tree a GGUF file's tensors are placed into (``llm_api.model.gguf_model``),
and a checkpoint's of our families on a CPU (``llm_api.model.checkpoint_model``):
``model.embed_tokens``, ``model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm (Qwen3),
post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``model.norm``, ``model.rotary_emb``, ``lm_head``; linears
and norms start on the meta device, with no bytes, and the placer puts every one in its place. It is what
``llm_api.models.llama.CausalLM`` reads from a loaded transformers model, so the owned decoder, the LoRA
registry (which wraps linears by these names) and the engine take either alike.

These modules hold weights; they compute nothing but the rotary's cos and sin (``RotaryEmbedding``, transformers'
arithmetic, so that the decoder's output is the same whichever tree it reads). The computation is the owned
decoder's: ``llm_api.models.families.own_model`` always takes this tree, and the paged engine runs it
(``llm_api.engine.support``). ``generate()`` needs transformers' classes: ENGINE=generate and the tests' oracles
build those instead (``gguf_model.build_model(..., reference=True)``, ``from_pretrained``).

Why not transformers' classes here too: building them imports most of transformers (see
``llm_api.model.decoder_config``), a third of a server's start, and a transformers release that renames a module
would change what our paths load into.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llm_api.model.decoder_config import DecoderConfig


class RMSNorm(nn.Module):
    """An RMS norm's weight and epsilon (the kernel sets compute it: ``rms_norm(x, weight, variance_epsilon)``)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device="meta"), requires_grad=False)
        self.variance_epsilon = eps


class RotaryEmbedding(nn.Module):
    """cos and sin of each position's rotary angles, as transformers computes them (``default``, ``linear``, and
    ``llama3``: Llama 3.1's long-context frequencies, long wavelengths divided by ``factor``, short ones kept, the
    band between interpolated)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        rope = config.rope_parameters
        dim = config.head_dim
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if rope["rope_type"] == "linear":
            inv_freq /= rope["factor"]
        elif rope["rope_type"] == "llama3":
            inv_freq = _llama3_frequencies(inv_freq, rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]  # (a buffer)
        freqs = position_ids[..., None].float() * inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def _llama3_frequencies(inv_freq: torch.Tensor, rope: dict) -> torch.Tensor:
    """Llama 3.1's frequencies, in transformers' arithmetic (float32 tensors against Python floats, the same
    order of operations: the tests compare the buffers bit for bit)."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    low_wavelength, high_wavelength = context / low, context / high
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
    smooth = (context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelength < high_wavelength) * ~(wavelength > low_wavelength)
    return torch.where(between, smoothed, scaled)


def _linear(config: DecoderConfig, name: str, inputs: int, outputs: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=config.biased(name), dtype=dtype, device="meta").requires_grad_(False)


class Attention(nn.Module):
    """A layer's q/k/v/o projections (and Qwen3's per-head q/k norms); ``layer_idx`` indexes the KV pool."""

    def __init__(self, config: DecoderConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        c, d = config, config.head_dim
        self.layer_idx = layer_idx
        self.head_dim = d
        self.scaling = d ** -0.5
        self.sliding_window = config.window(layer_idx)
        self.q_proj = _linear(c, "q_proj", c.hidden_size, c.num_attention_heads * d, dtype)
        self.k_proj = _linear(c, "k_proj", c.hidden_size, c.num_key_value_heads * d, dtype)
        self.v_proj = _linear(c, "v_proj", c.hidden_size, c.num_key_value_heads * d, dtype)
        self.o_proj = _linear(c, "o_proj", c.num_attention_heads * d, c.hidden_size, dtype)
        if c.model_type == "qwen3":
            self.q_norm = RMSNorm(d, c.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, c.rms_norm_eps, dtype)


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig, dtype: torch.dtype):
        super().__init__()
        c = config
        self.gate_proj = _linear(c, "gate_proj", c.hidden_size, c.intermediate_size, dtype)
        self.up_proj = _linear(c, "up_proj", c.hidden_size, c.intermediate_size, dtype)
        self.down_proj = _linear(c, "down_proj", c.intermediate_size, c.hidden_size, dtype)


class DecoderLayerWeights(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)


class DecoderWeights(nn.Module):
    def __init__(self, config: DecoderConfig, dtype: torch.dtype):
        super().__init__()
        # (given its weight: an embedding's own initialization on the meta device imports torch._dynamo, 1 s)
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size, _weight=torch.empty(
            config.vocab_size, config.hidden_size, dtype=dtype, device="meta"), _freeze=True)
        self.layers = nn.ModuleList(DecoderLayerWeights(config, i, dtype) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config)


class CausalLMWeights(nn.Module):
    """The decoder's weights and the output head, with the accessors the engine and the owned decoder read."""

    def __init__(self, config: DecoderConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.model = DecoderWeights(config, dtype)
        self.lm_head: nn.Module = _linear(config, "lm_head", config.hidden_size, config.vocab_size, dtype)
        self._dtype = dtype

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (activations and K/V; quantized weights hold integers)."""
        return self._dtype

    def get_decoder(self) -> DecoderWeights:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_input_embeddings(self, module: nn.Module) -> None:  # (QUANTIZATION at load: llm_api.model.quantize)
        self.model.embed_tokens = module

    def set_output_embeddings(self, module: nn.Module) -> None:
        self.lm_head = module
