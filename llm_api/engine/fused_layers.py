"""Decoder layers whose code is Llama's, run as fewer and larger kernels: Triton's on a GPU (issue 39), C
on a CPU (issue 37; below, "On the CPU").

With ``llm_api.engine.fused_ops`` (one kernel per RMSNorm and per rotary embedding) a batch-1 decode step
of Llama-3.1-8B on an H200 still launched 17 kernels a layer, 7 of them products, and took 5.3 ms
against 3.6 ms of weight reads (docs/benchmarks.md, "Measured on an H200"). ``enable(model)`` swaps the
forward of each decoder layer whose code is ``LlamaDecoderLayer.forward`` (bytecode, as ``fused_ops``
decides) and whose two norms ``fused_ops`` swapped, for one that runs, per layer:

    input norm          done by the previous layer's last kernel, which hands it over (below)
    q/k/v               one product over the three weights concatenated (vLLM's QKVParallelLinear)
    rotary + KV write   one kernel: q rotated, k rotated and v written into the paged cache
                        (``kernels.rotary.rotary_store_kv``; where the engine's Triton backend runs the
                        attention, else the rotary kernel and the attention interface as before)
    attention           the backend's decode kernels over the cache (``TritonBackend.attend``), then o_proj
    sum + norm          one kernel: ``residual + attention`` and the post-attention norm of it
    gate/up             one product over the two weights concatenated
    SiLU x up           one kernel (``kernels.activation``); for one row, none: the down product computes it
    down                as it reads its input
    sum + next norm     one kernel: ``residual + mlp`` and the next layer's input norm (the model's final
                        norm after the last layer) of it

that is 10 launches and 4 products a layer where transformers' code (after ``fused_ops``) launches 17 and
7. For one row (a batch-1 decode step) every product, the output head's too (``enable`` swaps its forward),
is ``kernels.gemv``'s, without cuBLAS's split-K reduce: 9 launches a layer (docs/benchmarks.md, "Fused
decoder layers").

Merged products: at ``enable`` the q, k and v weights (and gate and up) are copied into one tensor and the
modules' own parameters become views of it, so the model holds no more memory and every other path
(LoRA wrappers, a state dict, ``generate()``) sees the modules as before. The merged product runs only
while that still holds, checked at each call: the projections are plain ``nn.Linear`` (not wrapped by
LoRA, not quantized) whose weights still point into the merged tensor (a model moved or deep-copied
since has its own, separate parameters). Otherwise, and for attention or MLP code that is not Llama's
(Mistral's sliding window, Qwen3's q/k norms, a GELU MLP), the layer calls the module itself.

The handover: the fused sum + norm computes the next norm's output, and stores it on that norm module
with the tensor it normalized; the norm's fused forward (``fused_ops``) returns it when it is called on
that same tensor object (the model's layer loop passes each layer's output straight to the next), and
computes the norm itself otherwise. Python runs once per captured CUDA graph, so this costs nothing on
replay.

Rounding is transformers' at every step (each sum rounded to its dtype before the norm reads it, the
activation rounded before its product), so greedy output stays token-identical to ``generate()`` in
float32 (tests/engine/test_gpu_fast_path.py; on CPU under Triton's interpreter,
tests/engine/test_fused_layers.py). Hand-written rather than compiled, for the reason ``fused_ops``
gives.

Kernel sets: every kernel above is called through the set ``enable`` gave the module (``kernels_of``), a
``llm_api.kernels.kernel_set.KernelSet``: ``TRITON_KERNELS`` (``llm_api.kernels.triton_set``), or
``llm_api.kernels.cpu`` (the same functions, C compiled for the host, and a ``WholeLayerKernels``). What a set's
products take is its own rule (``takes_product``: Triton one row, the CPU set up to 16 rows).

On the CPU: a step of rows the set's products take runs a layer whole where it can (``_whole_layer``: the
layer's q/k/v and gate/up merged and holding, plain o_proj and down, Llama's rotary, one dtype): the set's
``layer_in`` (input norm, q/k/v product, rotary), the attention, and ``layer_out`` (o_proj, sum + norm,
gate/up, SiLU x up, down, sum + next norm), two calls where the forward above makes ~20 Python-level calls,
each ~10-25 us on a CPU (a decode step of the embedded model made ~600 of them). What they read is planned
once a layer (the set's ``LayerWeights``, kept while the layer holds the same modules and merged weights).
The attention on the engine's torch backend is one more call (``paged_decode``: every row's K/V stored,
then each row attends its sequence's blocks up to its own position, ``_row_tables``: decode rows, drafted
rows and prompt chunks alike). The rounding is the same as op by op (tests/engine/test_cpu_layers.py:
float32 greedy tokens equal ``generate()``'s).

Such a step goes further where the decoder's forward is Llama's (``LlamaModel.forward``): ``enable`` swaps
it for ``_fused_decoder``, which embeds the ids, computes the rotary tables and hands every layer to the
set's ``decode_layers`` (``layer_in``, ``paged_decode``, ``layer_out`` per layer in C, the same calls in the
same order: the same numbers), planned as the set's ``DecodeStack`` while every layer's plan holds and each
hands its output's norm to the next; anything else asked of the forward runs the model's own.

LoRA: a projection wrapped by ``llm_api.lora`` (``LoraLinear`` around a plain ``nn.Linear``) keeps its
layer on these CPU paths. ``enable`` merges the wrapped linears' weights for the CPU set (``merge(...,
through_lora=True)``; the op-by-op path still calls the wrappers, whose base linears read the views), the
plan keeps each projection's adapter slots, and the set's calls add each row's own adapter's delta after
the base product (``_lora``: the step's rows from ``llm_api.lora.context``, each module's concatenated
adapters with B transposed, ``ModuleSlots.concatenated_t``).
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llm_api.kernels.cpu.layers import check_step_tables
from llm_api.kernels.kernel_set import KernelSet, WholeLayerKernels, runs_whole_layers
from llm_api.kernels.triton_set import TRITON_KERNELS
from llm_api.layers.quantized import QuantizedLinear, embedding_dtype
from llm_api.lora.context import current_step
from llm_api.lora.layer import LoraLinear

# Attributes this module keeps in a module's __dict__ (set with object.__setattr__: a module or tensor
# stored through nn.Module.__setattr__ would join the module tree or its state).
_NEXT_NORM = "_llm_api_next_norm"  # decoder layer -> the norm that reads its output
_MERGED = "_llm_api_merged"  # attention / MLP -> MergedProjection
_HANDOFF = "_llm_api_handoff"  # norm -> (the tensor it is to normalize, its output)
_FUSED_ROTARY = "_llm_api_fused_rotary"  # attention -> True: its modeling module's rotary is Llama's (fused_ops)
_KERNELS = "_llm_api_kernels"  # a swapped module (and the model) -> the kernel set its forward calls
_STACK = "_llm_api_stack"  # decoder model -> (its layers' plans, the kernel set's DecodeStack of them)
_PLAN = "_llm_api_layer_plan"  # decoder layer -> (its modules, the kernel set's LayerWeights or None, pointers)

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def same_code(a: Any, b: Any) -> bool:
    """Two functions run the same bytecode on the same global and attribute names, compared below any
    decorator that keeps ``__wrapped__`` (transformers wraps every decoder layer's forward in one
    checkpointing wrapper, whose code alone is the same for all families)."""
    a, b = getattr(_unwrap(a), "__code__", None), getattr(_unwrap(b), "__code__", None)
    return a is not None and b is not None and a.co_code == b.co_code and a.co_names == b.co_names


def _unwrap(function: Any) -> Any:
    try:
        return inspect.unwrap(function) if callable(function) else function
    except ValueError:  # (a cycle of __wrapped__)
        return function


def llama_modeling():
    """transformers' Llama modeling module: the code every swap here and in ``fused_ops`` compares with."""
    from transformers.models.llama import modeling_llama

    return modeling_llama


def set_kernels(module: nn.Module, kernels: KernelSet) -> None:
    object.__setattr__(module, _KERNELS, kernels)


def kernels_of(module: nn.Module) -> KernelSet:
    """The kernel set ``enable`` gave ``module`` (Triton's where none was given)."""
    return module.__dict__.get(_KERNELS, TRITON_KERNELS)


def kernel_sets_in(model: nn.Module) -> list[str]:
    """The names of the kernel sets installed in ``model``'s modules (empty: transformers' code throughout)."""
    return sorted({kernels.name for module in model.modules() if (kernels := module.__dict__.get(_KERNELS)) is not None})


class MergedProjection:
    """Several linears of one input as one product, their outputs side by side (``sizes``). Plain ``nn.Linear``:
    ``weight`` [sum of outputs, in] and ``bias`` (or None), the modules' parameters views of them (``merge``).
    ``QuantizedLinear`` (GGUF blocks, ``llm_api.layers.quantized``): the modules themselves (``quantized``), each
    part kept in its own format (a Q4_K_M file's q/k and v differ), the product one C call over the parts;
    ``bias`` their biases concatenated."""

    def __init__(self, names: tuple[str, ...], weight: torch.Tensor | None, bias: torch.Tensor | None,
                 sizes: list[int], quantized: list[QuantizedLinear] | None = None):
        self.names = names
        self.weight = weight
        self.bias = bias
        self.sizes = sizes
        self.quantized = quantized
        self.kind = nn.Linear if quantized is None else QuantizedLinear
        self.pointers = self._pointers_expected()
        self._product: Any = None

    def _pointers_expected(self) -> list[int]:
        if self.quantized is not None:
            return [m.blocks.data_ptr() for m in self.quantized]
        assert self.weight is not None
        offsets = [0]
        for size in self.sizes[:-1]:
            offsets.append(offsets[-1] + size)
        row = self.weight.stride(0) * self.weight.element_size()
        return [self.weight.data_ptr() + offset * row for offset in offsets]

    def _hold(self, modules: list) -> bool:
        return (all(type(m) is self.kind for m in modules)
                and [weight_tensor(m).data_ptr() for m in modules] == self.pointers
                and all((m.bias is None) == (self.bias is None) for m in modules))

    def holds(self, owner: nn.Module) -> bool:
        """The modules are still the linears this was made of (plain ones: whose weights are views of this tensor)."""
        return self._hold([getattr(owner, name, None) for name in self.names])

    def holds_bases(self, owner: nn.Module) -> bool:
        """``holds``, where a module may also be a LoRA wrapper around such a linear (``base_linear``): what
        a kernel set's whole layer runs, adding the adapters' deltas itself."""
        return self._hold([base_linear(getattr(owner, name, None)) for name in self.names])

    def product(self, kernels: WholeLayerKernels) -> Any:
        """The kernel set's ``Product`` of this (the CPU set's: ``llm_api.kernels.cpu.quant``)."""
        if self._product is None:
            if self.quantized is not None:
                self._product = kernels.Product([m.quantized for m in self.quantized], self.quantized[0].in_features)
            else:
                assert self.weight is not None
                self._product = kernels.Product([self.weight], self.weight.shape[1])
        return self._product

    def __call__(self, x: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
        if self.quantized is not None:
            if not runs_whole_layers(kernels):  # (only the C set reads blocks: each part by its own forward)
                return torch.cat([m(x) for m in self.quantized], dim=-1)
            from llm_api.kernels.cpu import quant

            return quant.product(x, self.product(kernels), self.bias)
        assert self.weight is not None
        return linear(x, self.weight, self.bias, kernels)


LINEAR_KINDS = (nn.Linear, QuantizedLinear)


def base_linear(module: Any) -> nn.Linear | QuantizedLinear | None:
    """``module`` if it is a plain ``nn.Linear`` or a ``QuantizedLinear``, the one a LoRA wrapper
    (``llm_api.lora.layer``) wraps, else None."""
    if type(module) is LoraLinear:
        module = module.base
    return module if type(module) in LINEAR_KINDS else None


def weight_tensor(linear: Any) -> torch.Tensor:
    """Where a linear's weights are: an ``nn.Linear``'s weight, a ``QuantizedLinear``'s blocks."""
    return linear.blocks if type(linear) is QuantizedLinear else linear.weight


def lora_slots(module: Any) -> Any:
    """The adapters' weights of a LoRA-wrapped projection (``llm_api.lora.ops.ModuleSlots``), else None."""
    return module.slots if type(module) is LoraLinear else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: KernelSet) -> torch.Tensor:
    """``F.linear``; the few rows the kernel set's product takes (Triton: one, a batch-1 step's products)
    by it, where the set runs."""
    if kernels.takes(x) and kernels.takes_product(x, weight, bias):
        return kernels.row_product(x, weight, bias)
    return F.linear(x, weight, bias)


def _product(projection: nn.Module, x: torch.Tensor, kernels: KernelSet, silu_mul: bool = False) -> torch.Tensor:
    """``projection(x)`` (with ``silu_mul``, ``projection(silu_and_mul(x))``); the rows the kernel set's
    product takes, through a plain ``nn.Linear``, by it (a wrapped or quantized module runs its own forward)."""
    if type(projection) is nn.Linear and kernels.takes_product(x, projection.weight, projection.bias):
        return kernels.row_product(x, projection.weight, projection.bias, silu_mul=silu_mul)
    if silu_mul:
        x = kernels.silu_and_mul(x)
    return projection(x)


def merge(owner: nn.Module, names: tuple[str, ...], through_lora: bool = False) -> MergedProjection | None:
    """Concatenate the weights (and biases) of ``owner``'s linears ``names`` into one tensor and make the
    modules' parameters views of it; None (nothing changed) unless they are plain ``nn.Linear`` (with
    ``through_lora``, also LoRA wrappers of one: their base linears are merged, for a kernel set that adds
    the deltas itself) of one input size, dtype and device, all with or all without a bias. ``QuantizedLinear``
    modules are merged without a copy: the product runs over their blocks side by side (their biases are
    concatenated)."""
    modules = [base_linear(m) if through_lora else m if type(m) in LINEAR_KINDS else None
               for m in (getattr(owner, name, None) for name in names)]
    if not all(m is not None for m in modules):
        return None
    if all(type(m) is QuantizedLinear for m in modules):
        parts: list[QuantizedLinear] = modules  # type: ignore[assignment]
        if any(m.in_features != parts[0].in_features or (m.bias is None) != (parts[0].bias is None) for m in parts):
            return None
        with torch.no_grad():
            bias = torch.cat([m.bias.detach() for m in parts if m.bias is not None]) if parts[0].bias is not None else None
        return MergedProjection(names, None, bias, [m.out_features for m in parts], quantized=parts)
    if not all(type(m) is nn.Linear for m in modules):
        return None
    linears: list[nn.Linear] = modules  # type: ignore[assignment]
    first = linears[0].weight
    if any(m.weight.shape[1] != first.shape[1] or m.weight.dtype != first.dtype or m.weight.device != first.device
           or m.weight.device.type == "meta" or (m.bias is None) != (linears[0].bias is None) for m in linears):
        return None
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
        sizes = [m.weight.shape[0] for m in linears]
        offset = 0
        for m, size in zip(linears, sizes):
            # (.data: the same Parameter objects stay in the model, now views of the merged tensor)
            m.weight.data = weight[offset:offset + size]
            if bias is not None and m.bias is not None:
                m.bias.data = bias[offset:offset + size]
            offset += size
    if weight.is_cuda:
        # The separate weights just freed go back to the device: the KV pool was sized before this runs,
        # and a cache of every layer's old weights (13 GB for an 8B model) would not fit beside it.
        torch.cuda.empty_cache()
    return MergedProjection(names, weight, bias, sizes)


def merged_projection(owner: nn.Module) -> MergedProjection | None:
    """The merged product of ``owner``'s projections while it still holds (else None)."""
    merged = owner.__dict__.get(_MERGED)
    return merged if merged is not None and merged.holds(owner) else None


def hand_over(norm: nn.Module, source: torch.Tensor, normed: torch.Tensor) -> None:
    object.__setattr__(norm, _HANDOFF, (source, normed))


def take_handed(norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor | None:
    """The output handed to ``norm`` for exactly this tensor (else None: the norm computes it)."""
    handed = norm.__dict__.pop(_HANDOFF, None)
    return handed[1] if handed is not None and handed[0] is hidden_states else None


def _attention(attn: nn.Module, hidden_states: torch.Tensor, kernels: KernelSet, position_embeddings, attention_mask,
               past_key_values, **kwargs) -> torch.Tensor:
    """``LlamaAttention.forward``'s output with one q/k/v product (the module itself where it is not
    Llama's code or its projections are no longer merged)."""
    merged = merged_projection(attn)
    if merged is None:
        output, _ = attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                         attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
        return output
    module: Any = attn
    modeling = sys.modules[type(attn).__module__]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query, key, value = (t.view(hidden_shape) for t in merged(hidden_states, kernels).split(merged.sizes, -1))
    cos, sin = position_embeddings
    metadata = _paged_metadata(attn, kwargs) if attn.__dict__.get(_FUSED_ROTARY) and past_key_values is None else None
    if metadata is not None and query.shape[0] == 1:  # (the engine's packed step: one row of T tokens)
        from llm_api.kernels.rotary import rotary_store_kv, rotary_store_kv_supported

        key_cache, value_cache = metadata.key_caches[module.layer_idx], metadata.value_caches[module.layer_idx]
        if rotary_store_kv_supported(query[0], key[0], value[0], cos, sin, key_cache, value_cache):
            rotated = rotary_store_kv(query[0], key[0], value[0], cos, sin, key_cache, value_cache,
                                      metadata.slot_mapping_on(key_cache.device))
            # (Llama's attention passes no sliding window or softcap to the attention function)
            output = metadata.backend.attend(metadata, module.layer_idx, rotated, module.scaling, None, None)
            return _product(module.o_proj, output.reshape(*input_shape, -1), kernels)
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    query, key = modeling.apply_rotary_pos_emb(query, key, cos, sin)  # (fused_ops' dispatcher, where installed)
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, module.layer_idx)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation,
                                                      modeling.eager_attention_forward)
    output, _ = interface(attn, query, key, value, attention_mask,
                          dropout=0.0 if not attn.training else module.attention_dropout, scaling=module.scaling,
                          **kwargs)
    return _product(module.o_proj, output.reshape(*input_shape, -1).contiguous(), kernels)


def _paged_metadata(attn: nn.Module, kwargs: dict):
    """This forward's paged-attention metadata, when its attention runs through the engine's Triton backend,
    which can attend over K/V already written (else None)."""
    from llm_api.engine.attention.base import ATTENTION_NAME, METADATA_KWARG

    module: Any = attn
    metadata = kwargs.get(METADATA_KWARG)
    if module.config._attn_implementation != ATTENTION_NAME or metadata is None:
        return None
    return metadata if metadata.backend.attends_stored_rows else None


def _mlp(mlp: nn.Module, hidden_states: torch.Tensor, kernels: KernelSet) -> torch.Tensor:
    """``LlamaMLP.forward`` with one gate/up product and one SiLU x up kernel, or at one row none: the down
    projection computes it as it reads its input (where it applies)."""
    merged = merged_projection(mlp)
    if merged is None:
        return mlp(hidden_states)
    module: Any = mlp
    return _product(module.down_proj, merged(hidden_states, kernels), kernels, silu_mul=True)


def _one_row_head(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The output head's forward: one row by ``kernels.gemv`` (a batch-1 step's largest product: 1 GB for
    Llama-3.1-8B), other inputs by ``F.linear`` as ``nn.Linear.forward``."""
    return linear(hidden_states, self.weight, self.bias, kernels_of(self))


def _fused_layer(self: Any, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, past_key_values=None,
                 use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
    kernels = kernels_of(self)
    if not kernels.takes(hidden_states):
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_values=past_key_values, use_cache=use_cache,
                                  position_embeddings=position_embeddings, **kwargs)
    if runs_whole_layers(kernels):
        weights = _whole_layer_weights(self, kernels, hidden_states, position_embeddings, past_key_values)
        if weights is not None:
            return _whole_layer(self, kernels, weights, hidden_states, position_embeddings, attention_mask,
                                position_ids=position_ids, use_cache=use_cache, **kwargs)
    normed = take_handed(self.input_layernorm, hidden_states)
    if normed is None:
        normed = self.input_layernorm(hidden_states)
    attention = _attention(self.self_attn, normed, kernels, position_embeddings, attention_mask, past_key_values,
                           position_ids=position_ids, use_cache=use_cache, **kwargs)
    post = self.post_attention_layernorm
    residual, normed = kernels.add_rms_norm(attention, hidden_states, post.weight, post.variance_epsilon)
    mlp = _mlp(self.mlp, normed, kernels)
    next_norm = self.__dict__.get(_NEXT_NORM)
    if next_norm is None:
        return residual + mlp
    output, next_normed = kernels.add_rms_norm(mlp, residual, next_norm.weight, next_norm.variance_epsilon)
    hand_over(next_norm, output, next_normed)
    return output


def _plan_key(layer: Any) -> tuple:
    """The modules a whole-layer plan was made from: a plan holds while the layer still has these. (Read from the
    modules' own dicts: this runs for every layer at every decode step, and ``nn.Module.__getattr__`` cost ~1 us a
    read, most of a 30-layer model's 0.95 ms a step of plan checks.)"""
    modules = layer._modules
    self_attn, mlp = modules.get("self_attn"), modules.get("mlp")
    attention, mlp_modules = self_attn._modules, mlp._modules
    return (self_attn, mlp, attention.get("q_proj"), attention.get("k_proj"), attention.get("v_proj"),
            attention.get("o_proj"), mlp_modules.get("gate_proj"), mlp_modules.get("up_proj"),
            mlp_modules.get("down_proj"), modules.get("input_layernorm"), modules.get("post_attention_layernorm"),
            layer.__dict__.get(_NEXT_NORM))


def _make_plan(layer: Any, kernels: WholeLayerKernels) -> Any:
    """The kernel set's ``LayerWeights`` for ``layer``, or None where it cannot run whole: its q/k/v and
    gate/up merged (and still holding), o_proj and down plain or quantized linears, Llama's rotary, one dtype
    the set takes, contiguous float weights on its device. A projection may be LoRA-wrapped (``base_linear``):
    the plan keeps its adapters' slots, and the set adds their deltas."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = attn.__dict__.get(_MERGED), mlp.__dict__.get(_MERGED)
    if (qkv is None or gate_up is None or not qkv.holds_bases(attn) or not gate_up.holds_bases(mlp)
            or not attn.__dict__.get(_FUSED_ROTARY) or len(qkv.sizes) != 3):
        return None
    o_proj, down, next_norm = base_linear(attn.o_proj), base_linear(mlp.down_proj), layer.__dict__.get(_NEXT_NORM)
    norms = [layer.input_layernorm, layer.post_attention_layernorm, *([] if next_norm is None else [next_norm])]
    if o_proj is None or down is None or qkv.sizes[1] != qkv.sizes[2]:
        return None
    dtype = layer.input_layernorm.weight.dtype
    floats = [qkv.weight, qkv.bias, o_proj.bias, gate_up.weight, gate_up.bias, down.bias,
              *(norm.weight for norm in norms), *(m.weight for m in (o_proj, down) if type(m) is nn.Linear)]
    if kernels.max_rows(dtype) < 1 or not all(t is None or (t.dtype == dtype and t.is_contiguous()
                                                            and kernels.takes(t)) for t in floats):
        return None
    adapted = tuple(lora_slots(getattr(attn, name)) for name in (*QKV, "o_proj")) + tuple(
        lora_slots(getattr(mlp, name)) for name in (*GATE_UP, "down_proj"))
    return kernels.LayerWeights(layer.input_layernorm, layer.post_attention_layernorm, next_norm, qkv.product(kernels),
                                tuple(qkv.sizes), qkv.bias, attn.head_dim, _linear_product(o_proj, kernels), o_proj.bias,
                                gate_up.product(kernels), gate_up.bias, _linear_product(down, kernels), down.bias, adapted)


def _linear_product(linear: nn.Linear | QuantizedLinear, kernels: WholeLayerKernels) -> Any:
    """The kernel set's ``Product`` of one linear (its float weight or its blocks)."""
    if type(linear) is QuantizedLinear:
        return linear.product
    return kernels.Product([linear.weight], linear.in_features)


def _first_pointers(key: tuple) -> tuple[int, int]:
    """Where the q and gate projections' weights (the merged tensors' first rows, or their blocks) are now."""
    return _weight_pointer(key[2]), _weight_pointer(key[6])


def _weight_pointer(module: Any) -> int:
    """``weight_tensor(base_linear(module)).data_ptr()``, read from the modules' own dicts (per layer and step)."""
    if type(module) is LoraLinear:
        module = module._modules["base"]
    tensor = (module._buffers["blocks"] if type(module) is QuantizedLinear
              else module._parameters["weight"] if type(module) is nn.Linear else None)
    return 0 if tensor is None else tensor.data_ptr()


def _layer_plan(layer: Any, kernels: WholeLayerKernels) -> Any:
    """The layer's ``LayerWeights`` (``_make_plan``), made once a layer and kept while the layer has the same
    modules (``_plan_key``) and its merged weights (their first pointers) where they were: a plan costs ~70
    attribute reads and checks, its check ~15. None where the layer cannot run whole."""
    key = _plan_key(layer)
    cached = layer.__dict__.get(_PLAN)
    if (cached is None or cached[0] != key
            or (cached[1] is not None and _first_pointers(key) != cached[2])):
        weights = _make_plan(layer, kernels)
        pointers = None if weights is None else _first_pointers(key)
        cached = (key, weights, pointers)
        object.__setattr__(layer, _PLAN, cached)
    return cached[1]


def _takes_rotary(weights: Any, position_embeddings) -> bool:
    """The rotary's cos/sin [1, T, head_dim] are what the set's ``layer_in`` reads."""
    cos, sin = position_embeddings
    return (cos.dtype == weights.dtype and sin.dtype == weights.dtype and cos.dim() == 3 and cos.shape[0] == 1
            and cos.stride() == sin.stride() and cos.stride(-1) == 1)


def _whole_layer_weights(layer: Any, kernels: WholeLayerKernels, hidden_states: torch.Tensor, position_embeddings,
                         past_key_values) -> Any:
    """The layer's ``LayerWeights`` when the kernel set can run it whole in two calls (``layer_in`` and
    ``layer_out``) for this input: the engine's paged step (no transformers cache) of no more rows than the
    set's products take, in the plan's dtype. Else None (the layer runs op by op)."""
    if (past_key_values is not None or position_embeddings is None or hidden_states.dim() != 3
            or hidden_states.shape[0] != 1 or not hidden_states.is_contiguous()):
        return None
    weights = _layer_plan(layer, kernels)
    if (weights is None or hidden_states.dtype != weights.dtype
            or hidden_states.shape[1] > kernels.max_rows(weights.dtype)
            or not _takes_rotary(weights, position_embeddings)):
        return None
    return weights


def _paged_step(attn_implementation: str, kernels: KernelSet, kwargs: dict, rows: int) -> Any:
    """The engine's attention metadata of this call where the step's ``rows`` tokens attend on the engine's
    torch backend, which the kernel set's ``paged_decode`` replaces (``_row_tables``); else None."""
    from llm_api.engine.attention.base import ATTENTION_NAME, METADATA_KWARG

    metadata = kwargs.get(METADATA_KWARG)
    if (metadata is None or not runs_whole_layers(kernels) or attn_implementation != ATTENTION_NAME
            or not metadata.backend.kernel_set_may_attend or metadata.query_start_loc[-1] != rows
            or len(metadata.query_start_loc) != len(metadata.context_lens_list) + 1):
        return None
    return metadata


def _row_tables(metadata: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slots, block tables, context lengths) a row each, as the C side reads them (int64, contiguous, on the
    CPU), made once a step for every layer. A decode row attends its sequence's whole context; a row of a
    sequence with several new tokens (speculation's drafts, a prompt chunk) attends its sequence's blocks up
    to and including its own position: ``paged_decode`` stores every row's K/V before any row attends, so
    this is the causal attention of the step, one query row at a time. Checked against the pool once a step
    (``check_step_tables``): the C side reads the pool through these indices."""

    def build() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slots = metadata.slot_mapping.to("cpu", torch.int64).contiguous()
        tables = metadata.block_tables.to("cpu", torch.int64)
        starts, ends = metadata.query_start_loc, metadata.context_lens_list
        counts = [b - a for a, b in zip(starts, starts[1:])]
        if all(count == 1 for count in counts):
            tables, lengths = tables.contiguous(), metadata.context_lens.to("cpu", torch.int64).contiguous()
        else:
            lengths = torch.tensor([end - count + j + 1 for end, count in zip(ends, counts) for j in range(count)],
                                   dtype=torch.int64)
            tables = tables.repeat_interleave(torch.tensor(counts), dim=0).contiguous()
        pool = metadata.key_caches[0]
        check_step_tables(slots, tables, lengths, blocks=pool.shape[0], block_size=pool.shape[1])
        return slots, tables, lengths

    return metadata.cached("cpu-kernels", build)


def _paged_decode(attn: Any, kernels: WholeLayerKernels, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  kwargs: dict) -> torch.Tensor | None:
    """The attention of a step as the kernel set's one call (``paged_decode``: the K/V store and every row's
    attention, ``_row_tables``) where the engine's torch backend would run it (a gather and SDPA, ~13 tensor
    ops a layer); None elsewhere (the attention interface runs). Llama's attention passes no sliding window
    or softcap, so there is none to honour here."""
    metadata = _paged_step(attn.config._attn_implementation, kernels, kwargs, query.shape[0])
    if metadata is None:
        return None
    key_cache, value_cache = metadata.key_caches[attn.layer_idx], metadata.value_caches[attn.layer_idx]
    if (key_cache.dtype != query.dtype or value_cache.dtype != query.dtype or not key_cache.is_contiguous()
            or not value_cache.is_contiguous() or key_cache.device.type != "cpu"):
        return None
    slots, tables, lengths = _row_tables(metadata)
    return kernels.paged_decode(query, key, value, key_cache, value_cache, slots, tables, lengths, attn.scaling)


_LORA_STEP: dict = {}  # the last LoRA step seen -> its rows as the kernel set takes them


def _lora(kernels: WholeLayerKernels, holder: Any, plans: list, rows: int) -> tuple | None:
    """The kernel set's LoRA arguments (its ``LoraRows`` and ``LoraProducts``) for the products of ``plans``
    (one layer's, or every layer's) in this step of ``rows`` rows: each row's adapter, from the step the
    engine entered (``llm_api.lora.context``), made once a step and shared by its layers. The products are
    kept on ``holder`` (the layer's plan, or the stack's) and remade only when an adapter's concatenated
    tensors change (a slot refilled). None where no row runs an adapter."""
    step = current_step()
    if step is None:
        return None
    if _LORA_STEP.get("step") is not step:
        slots = step.token_slots.tolist()
        offsets = [step.columns[slot][0] for slot in slots]
        widths = [step.columns[slot][1] if slot else 0 for slot in slots]
        columns = sum(width for _, width in step.columns)
        _LORA_STEP.clear()
        _LORA_STEP.update(step=step, rows=kernels.LoraRows(offsets, widths, step.row_scaling, columns))
    lora_rows = _LORA_STEP["rows"]
    if lora_rows.rows != rows:
        raise ValueError(f"the LoRA step has {lora_rows.rows} rows, the forward {rows}")
    pairs = [None if slots is None else slots.concatenated_t(step) for plan in plans for slots in plan.lora_slots]
    products = getattr(holder, "lora_products", None)
    if (products is None or products.columns != lora_rows.columns or len(products.pairs) != len(pairs)
            or any(p is not q for p, q in zip(pairs, products.pairs))):
        sizes = [size for plan in plans for size in plan.product_sizes]
        products = kernels.LoraProducts(pairs, sizes, plans[0].dtype, lora_rows.columns)
        holder.lora_products = products
    return lora_rows, products


def _whole_layer(layer: Any, kernels: WholeLayerKernels, weights: Any, hidden_states: torch.Tensor, position_embeddings,
                 attention_mask, **kwargs) -> torch.Tensor:
    """A Llama decoder layer as two kernel-set calls around the engine's attention (``_whole_layer_weights``):
    the same ops and rounding as the layer op by op."""
    attn: Any = layer.self_attn
    modeling = sys.modules[type(attn).__module__]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    tokens, width = hidden_states.shape[1], hidden_states.shape[2]
    rows = hidden_states.view(tokens, width)
    handed = take_handed(layer.input_layernorm, hidden_states)
    cos, sin = position_embeddings
    lora = _lora(kernels, weights, [weights], tokens)
    query, key, value = kernels.layer_in(weights, rows, None if handed is None else handed.reshape(tokens, width),
                                         cos[0], sin[0], lora)
    output = _paged_decode(attn, kernels, query, key, value, kwargs)
    if output is None:
        shape = (1, tokens, -1, attn.head_dim)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation,
                                                          modeling.eager_attention_forward)
        output, _ = interface(attn, query.view(shape).transpose(1, 2), key.view(shape).transpose(1, 2),
                              value.view(shape).transpose(1, 2), attention_mask,
                              dropout=0.0 if not attn.training else attn.attention_dropout, scaling=attn.scaling,
                              **kwargs)
        output = output.reshape(tokens, -1)
        if output.stride(-1) != 1:
            output = output.contiguous()
    hidden_out, normed_out = kernels.layer_out(weights, output, rows, lora)
    result = hidden_out.view(hidden_states.shape)
    if normed_out is not None:
        hand_over(layer.__dict__[_NEXT_NORM], result, normed_out.view(hidden_states.shape))
    return result


def _stack_plan(decoder: Any, kernels: WholeLayerKernels, layers: list) -> Any:
    """The kernel set's ``DecodeStack`` of ``decoder``'s layers, where every one runs whole and hands its
    output's norm to the next one's input norm (the last one's to the model's final norm, or to none):
    the chain ``decode_layers`` runs in C. Kept while the layers' plans (``_layer_plan``) are the same
    objects; None where any layer cannot run whole."""
    plans = []
    for i, layer in enumerate(layers):
        swapped = getattr(layer.__dict__.get("forward"), "__func__", None) is _fused_layer
        weights = _layer_plan(layer, kernels) if swapped else None
        if weights is None:
            return None
        following = layers[i + 1]._modules.get("input_layernorm") if i + 1 < len(layers) else decoder._modules.get("norm")
        next_norm = layer.__dict__.get(_NEXT_NORM)
        if next_norm is not None and next_norm is not following:
            return None
        plans.append(weights)
    cached = decoder.__dict__.get(_STACK)
    if cached is None or len(cached[0]) != len(plans) or any(a is not b for a, b in zip(cached[0], plans)):
        stack = kernels.DecodeStack(plans, [float(layer.self_attn.scaling) for layer in layers])
        cached = (plans, stack)
        object.__setattr__(decoder, _STACK, cached)
    return cached[1]


def _decoder_stack(decoder: Any, input_ids, position_ids, past_key_values, inputs_embeds, kwargs: dict) -> Any:
    """The model's last hidden state (the final norm's output) of a step of a few rows computed by the kernel
    set's ``decode_layers`` in one call, where it can run: ids in (not embeddings), the engine's paged step
    on its torch backend and nothing else asked of the forward, every layer whole (``_stack_plan``), rows the
    set's products take. Else None (the model's own forward runs, layer by layer)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    kernels = kernels_of(decoder)
    if (not runs_whole_layers(kernels) or input_ids is None or inputs_embeds is not None or past_key_values is not None
            or position_ids is None or len(kwargs) != 1 or input_ids.dim() != 2 or input_ids.shape[0] != 1
            or not kernels.takes(input_ids)):
        return None
    rows = input_ids.shape[1]
    if rows > kernels.max_rows(embedding_dtype(decoder.embed_tokens)):  # (a prefill: no plan checks a step)
        return None
    metadata = _paged_step(decoder.config._attn_implementation, kernels, kwargs, rows)
    layers = list(decoder.layers._modules.values())[: decoder.config.num_hidden_layers]  # (a slice: a new ModuleList)
    if metadata is None or not layers:
        return None
    stack = _stack_plan(decoder, kernels, layers)
    if stack is None or rows > kernels.max_rows(stack.dtype):
        return None
    hidden = decoder.embed_tokens(input_ids)
    if hidden.dtype != stack.dtype or not hidden.is_contiguous():
        return None
    position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
    if not _takes_rotary(stack, position_embeddings):
        return None
    cos, sin = position_embeddings
    slots, tables, lengths = _row_tables(metadata)
    out = kernels.decode_layers(stack, hidden.view(rows, -1), cos[0], sin[0], metadata.key_caches,
                                metadata.value_caches, slots, tables, lengths, _lora(kernels, stack, stack.layers, rows))
    if out is None:
        return None
    hidden_out, normed_out = out
    last = normed_out if normed_out is not None else decoder.norm(hidden_out.view(hidden.shape))
    return BaseModelOutputWithPast(last_hidden_state=last.view(hidden.shape), past_key_values=None)


def _fused_decoder(self: Any, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                   inputs_embeds=None, use_cache=None, **kwargs):
    """The decoder model's forward (Llama's ``LlamaModel.forward``): a step of a few rows in one kernel-set call
    where ``_decoder_stack`` can run it, else the model's own forward."""
    out = _decoder_stack(self, input_ids, position_ids, past_key_values, inputs_embeds, kwargs)
    if out is not None:
        return out
    return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                              **kwargs)


def _is_llama_layer(layer: nn.Module, swapped_norms: set[int]) -> bool:
    return (same_code(type(layer).forward, llama_modeling().LlamaDecoderLayer.forward)
            and getattr(layer.__dict__.get("forward"), "__func__", _fused_layer) is _fused_layer
            and not hasattr(layer, "_hf_hook")
            and all(id(getattr(layer, name, None)) in swapped_norms
                    for name in ("input_layernorm", "post_attention_layernorm")))


def _is_silu(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def enable(model: nn.Module, swapped_norms: list[nn.Module], rotary_modules: list[types.ModuleType],
           kernels: KernelSet = TRITON_KERNELS) -> dict[str, int]:
    """Swap the fused forward into ``model``'s Llama-code decoder layers (``swapped_norms``: the norms
    ``fused_ops`` gave the fused forward; ``rotary_modules``: the modeling modules whose rotary it swapped),
    merging their projections. Returns {"layers", "merged", "head", "stack"}: the output head runs one row by
    ``kernels.gemv`` too ("head": 1) where it is a plain ``nn.Linear`` with its own forward (no accelerate
    hook), once any layer is fused; with a kernel set that has ``decode_layers`` (the CPU's), the decoder
    model's forward, where its code is Llama's, hands it every step of as many rows as the set's products take
    ("stack": 1)."""
    llama = llama_modeling()
    swapped = {id(m) for m in swapped_norms}
    get_decoder = getattr(model, "get_decoder", None)  # (transformers' base model under a task head)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = list(getattr(decoder, "layers", None) or [])
    fused = [layer for layer in layers if _is_llama_layer(layer, swapped)]
    through_lora = runs_whole_layers(kernels)  # (whole layers add LoRA deltas themselves)
    merged = 0
    for layer in fused:
        attn, mlp = layer.self_attn, layer.mlp
        if same_code(type(attn).forward, llama.LlamaAttention.forward) and _MERGED not in attn.__dict__:
            projection = merge(attn, QKV, through_lora)
            if projection is not None:
                object.__setattr__(attn, _MERGED, projection)
        if sys.modules.get(type(attn).__module__) in rotary_modules:
            object.__setattr__(attn, _FUSED_ROTARY, True)
        if (same_code(type(mlp).forward, llama.LlamaMLP.forward) and _is_silu(mlp)
                and _MERGED not in mlp.__dict__):
            projection = merge(mlp, GATE_UP, through_lora)
            if projection is not None:
                object.__setattr__(mlp, _MERGED, projection)
        merged += (_MERGED in attn.__dict__) + (_MERGED in mlp.__dict__)
    fused_ids = {id(layer) for layer in fused}
    final_norm = getattr(decoder, "norm", None)
    for i, layer in enumerate(layers):
        if id(layer) not in fused_ids:
            continue
        following = getattr(layers[i + 1], "input_layernorm", None) if i + 1 < len(layers) else final_norm
        # Hand over only to a norm whose fused forward looks for it (else the work would be done twice).
        if following is not None and id(following) in swapped:
            object.__setattr__(layer, _NEXT_NORM, following)
        set_kernels(layer, kernels)
        layer.forward = types.MethodType(_fused_layer, layer)
    get_head = getattr(model, "get_output_embeddings", None)
    head: Any = get_head() if callable(get_head) else None
    swap_head = (bool(fused) and type(head) is nn.Linear and not hasattr(head, "_hf_hook")
                 and getattr(head.__dict__.get("forward"), "__func__", _one_row_head) is _one_row_head)
    if swap_head:
        set_kernels(head, kernels)
        head.forward = types.MethodType(_one_row_head, head)
    # A kernel set that runs a decode step's layers in one call: the decoder's forward hands it the step.
    swap_decoder = (runs_whole_layers(kernels) and decoder is not None and bool(fused)
                    and same_code(type(decoder).forward, llama.LlamaModel.forward) and "forward" not in decoder.__dict__)
    if swap_decoder and decoder is not None:
        set_kernels(decoder, kernels)
        decoder.forward = types.MethodType(_fused_decoder, decoder)
    return {"layers": len(fused), "merged": merged, "head": int(swap_head), "stack": int(swap_decoder)}


def disable(model: nn.Module) -> None:
    """Undo ``enable``'s forwards and handovers (merged weights stay merged: the modules read them as views)."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if getattr(forward, "__func__", None) in (_fused_layer, _one_row_head, _fused_decoder):
            del module.forward
        for name in (_NEXT_NORM, _HANDOFF, _FUSED_ROTARY, _KERNELS, _PLAN, _STACK):
            module.__dict__.pop(name, None)
