"""The Llama family as our own code: one decoder, a few flags, on one kernel set (issue 53).

``CausalLM(hf_model, kernels, family)`` is built from a loaded transformers model of the family (Llama 2/3,
SmolLM, Mistral, Qwen2/2.5, Qwen3: ``llm_api.models.families``) without copying a weight: it holds the loaded
model's own modules under transformers' names (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``,
``lm_head``, ...), so the state dict, the LoRA registry (which wraps linears by name before the engine
exists) and PEFT keys find them as before, and ``generate()`` on the transformers model, which shares them,
stays the oracle. The modules' forwards are never called where this code computes the same thing (the norms,
the rotary, the attention, the MLP); the projections are called as modules, whatever their kind
(``llm_api.models.linear``), unless the kernel set takes the product itself.

The forward is the engine's step only: a packed batch ``[1, T]`` with its positions and the attention
metadata (``llm_api.engine.attention``); it returns ``Output(logits)`` at ``logits_to_keep``. Per layer, in
vLLM's shape:

    normed = the input norm of hidden (computed by the layer before, with its residual sum: ``add_rms_norm``)
    q, k, v = one merged product (``MergedProjection``; the modules' own where it does not hold), q/k norms
              (Qwen3), the rotary embedding (the kernel set's, else the torch set's)
    attention = the engine's backend over the paged cache (with the layer's sliding window), then o_proj
    hidden, normed = residual + attention and the post-attention norm of it (one kernel)
    mlp = down(SiLU(gate) x up), gate/up one merged product
    hidden, normed = residual + mlp and the next layer's input norm (the final norm after the last layer)

Rounding is transformers' at every step (each sum rounded to the dtype before its norm reads it), so on the
torch set the logits are transformers' bit for bit, and on the compiled sets greedy output is
``generate()``'s in float32 (tests/models/test_owned_model.py, tests/engine/test_cpu_layers.py).

Where the kernel set runs whole layers (the C set, ``runs_whole_layers``), a step of few rows runs each layer as
two calls around its attention, or every layer in one call (``llm_api.models.whole_layers``). On the Triton set
with the Triton attention backend, q and k are rotated and k/v stored in one kernel (``rotary_store_kv``) and the
backend ``attend``s the stored rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llm_api.kernels.kernel_set import KernelSet, runs_whole_layers
from llm_api.kernels.torch_set import TORCH_KERNELS
from llm_api.models.linear import GATE_UP, QKV, MergedProjection, linear, merge, project
from llm_api.models.whole_layers import decoder_stack, layer_weights, run_layer

# The engine's ``llm_api.engine.attention.PagedAttentionMetadata`` of the step (the engine is a layer above: the
# model reads its fields and calls its backend, never imports it).
StepMetadata = Any


@dataclass
class Output:
    logits: torch.Tensor  # [1, kept positions, vocab]


@dataclass(frozen=True)
class LayerFlags:
    """What differs between the family's layers, read from the checkpoint's config and modules."""

    sliding_window: int | None  # Mistral's, Qwen2/3's on their sliding layers
    qk_norm: bool  # Qwen3: an RMSNorm over each head of q and of k before the rotary


class DecoderLayer(nn.Module):
    """One decoder layer over the loaded layer's modules (registered under their transformers names)."""

    def __init__(self, hf_layer: nn.Module, layer_idx: int, flags: LayerFlags, merged: bool, through_lora: bool):
        super().__init__()
        loaded: Any = hf_layer
        self.input_layernorm = loaded.input_layernorm
        self.self_attn = loaded.self_attn
        self.post_attention_layernorm = loaded.post_attention_layernorm
        self.mlp = loaded.mlp
        self.layer_idx = layer_idx
        self.flags = flags
        self.head_dim = int(loaded.self_attn.head_dim)
        self.scaling = float(loaded.self_attn.scaling)
        self.qkv: MergedProjection | None = merge(self.self_attn, QKV, through_lora) if merged else None
        self.gate_up: MergedProjection | None = merge(self.mlp, GATE_UP, through_lora) if merged else None
        self.plan: Any = None  # (whole_layers' cached plan of this layer for the kernel set)

    def forward(self, hidden: torch.Tensor, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                metadata: StepMetadata, next_norm: nn.Module | None, kernels: KernelSet
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [1, T, H], its input norm) -> (the layer's output, its ``next_norm``'s output, or None)."""
        attention = self.attention(normed, cos, sin, metadata, kernels)
        post: Any = self.post_attention_layernorm
        residual, normed = kernels.add_rms_norm(attention, hidden, post.weight, post.variance_epsilon)
        mlp = self.feed_forward(normed, kernels)
        if next_norm is None:
            return residual + mlp, None
        following: Any = next_norm
        return kernels.add_rms_norm(mlp, residual, following.weight, following.variance_epsilon)

    def attention(self, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: StepMetadata,
                  kernels: KernelSet) -> torch.Tensor:
        attn: Any = self.self_attn
        tokens = normed.shape[1]
        shape = (1, tokens, -1, self.head_dim)
        qkv = self.qkv
        if qkv is not None and qkv.holds(attn):
            query, key, value = (t.view(shape) for t in qkv(normed, kernels).split(qkv.sizes, -1))
        else:
            query, key, value = (project(getattr(attn, name), normed, kernels).view(shape) for name in QKV)
        if self.flags.qk_norm:  # (per head, on strided views: torch's, as transformers computes it)
            query = TORCH_KERNELS.rms_norm(query, attn.q_norm.weight, attn.q_norm.variance_epsilon)
            key = TORCH_KERNELS.rms_norm(key, attn.k_norm.weight, attn.k_norm.variance_epsilon)
        backend = metadata.backend
        if kernels.rotary_stores_kv and backend.attends_stored_rows:
            from llm_api.kernels.rotary import rotary_store_kv, rotary_store_kv_supported

            key_cache, value_cache = metadata.key_caches[self.layer_idx], metadata.value_caches[self.layer_idx]
            if rotary_store_kv_supported(query[0], key[0], value[0], cos, sin, key_cache, value_cache):
                rotated = rotary_store_kv(query[0], key[0], value[0], cos, sin, key_cache, value_cache,
                                          metadata.slot_mapping_on(key_cache.device))
                output = backend.attend(metadata, self.layer_idx, rotated, self.scaling, self.flags.sliding_window, None)
                return project(attn.o_proj, output.reshape(1, tokens, -1), kernels)
        query, key = query.transpose(1, 2), key.transpose(1, 2)  # [1, H, T, D]: the rotary kernels' layout
        rotary = kernels if kernels.rotary_supported(query, key, cos, sin) else TORCH_KERNELS
        query, key = rotary.apply_rotary(query, key, cos, sin)
        output = backend.forward(metadata, self.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0],
                                 self.scaling, self.flags.sliding_window, None)
        return project(attn.o_proj, output.reshape(1, tokens, -1).contiguous(), kernels)

    def feed_forward(self, normed: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        """down(SiLU(gate) x up); merged, the SiLU x up is the down product's own (one row: as it reads its input)."""
        mlp: Any = self.mlp
        gate_up = self.gate_up
        if gate_up is not None and gate_up.holds(mlp):
            return project(mlp.down_proj, gate_up(normed, kernels), kernels, silu_mul=True)
        gate, up = project(mlp.gate_proj, normed, kernels), project(mlp.up_proj, normed, kernels)
        return project(mlp.down_proj, F.silu(gate) * up, kernels)


class Decoder(nn.Module):
    """Embedding, layers, final norm: the last hidden state (after the final norm) of a step. The model runner
    hooks this module's forward for pooling (``get_decoder()``)."""

    def __init__(self, hf_decoder: nn.Module, flags: list[LayerFlags], kernels: KernelSet, merged: bool):
        super().__init__()
        loaded: Any = hf_decoder
        self.embed_tokens = loaded.embed_tokens
        through_lora = runs_whole_layers(kernels)  # (whole layers add the LoRA deltas themselves)
        self.layers = nn.ModuleList(DecoderLayer(layer, i, flags[i], merged, through_lora)
                                    for i, layer in enumerate(loaded.layers))
        self.norm = loaded.norm
        self.rotary_emb = loaded.rotary_emb
        self.kernels = kernels
        self.one_call_steps = True  # (a step of few rows as one call of the set, where it runs whole layers)
        self.stack: Any = None  # (whole_layers' cached plan of every layer)
        self.lora_rows: Any = None  # (whole_layers' LoRA rows of the last step seen)

    def following_norms(self) -> list[nn.Module]:
        """Each layer's next norm: the next layer's input norm, the final norm after the last."""
        layers: list[Any] = list(self.layers)
        return [layer.input_layernorm for layer in layers[1:]] + [self.norm]

    def forward(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor,
                inputs_embeds: torch.Tensor | None, metadata: StepMetadata) -> torch.Tensor:
        kernels = self.kernels
        if (runs_whole_layers(kernels) and self.one_call_steps and input_ids is not None and inputs_embeds is None
                and kernels.takes(input_ids)):
            out = decoder_stack(self, kernels, input_ids, position_ids, metadata)
            if out is not None:
                return out
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if not kernels.takes(hidden):
            kernels = TORCH_KERNELS
        cos, sin = self.rotary_emb(hidden, position_ids=position_ids)
        layers: list[Any] = list(self.layers)
        first: Any = layers[0].input_layernorm
        normed: torch.Tensor | None = kernels.rms_norm(hidden, first.weight, first.variance_epsilon)
        whole_set = kernels if runs_whole_layers(kernels) else None
        for layer, next_norm in zip(layers, self.following_norms()):
            assert normed is not None  # (every layer has a next norm: the final one after the last)
            whole = None if whole_set is None else layer_weights(layer, whole_set, next_norm, hidden, cos, sin)
            if whole_set is not None and whole is not None:
                hidden, normed = run_layer(self, layer, whole_set, whole, hidden, normed, cos, sin, metadata)
            else:
                hidden, normed = layer(hidden, normed, cos, sin, metadata, next_norm, kernels)
        assert normed is not None
        return normed


class CausalLM(nn.Module):
    """The decoder and the output head: the engine's model (``forward`` returns ``Output(logits)``)."""

    def __init__(self, hf_model: nn.Module, flags: list[LayerFlags], kernels: KernelSet, merged: bool = True):
        super().__init__()
        loaded: Any = hf_model
        self.config = loaded.config
        self.model = Decoder(loaded.get_decoder(), flags, kernels, merged)
        self.lm_head = loaded.get_output_embeddings()
        self.kernels = kernels

    def get_decoder(self) -> Decoder:
        return self.model

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0,
                use_cache: bool = False, paged_attention_metadata: StepMetadata | None = None) -> Output:
        if paged_attention_metadata is None or position_ids is None:
            raise ValueError("the owned model runs the engine's packed step: position_ids and "
                             "paged_attention_metadata are required")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        hidden = self.model(input_ids, position_ids, inputs_embeds, paged_attention_metadata)
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:, :] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep, :]
        head: Any = self.lm_head
        if type(head) is nn.Linear:  # (a few rows by the set's product: a batch-1 step's largest)
            kernels = self.kernels if self.kernels.takes(hidden) else TORCH_KERNELS
            return Output(linear(hidden, head.weight, head.bias, kernels))
        return Output(head(hidden))
