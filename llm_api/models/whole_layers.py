"""A decoder layer of few rows as two calls of a kernel set that runs whole layers (the C set), and a step's every
layer as one (issue 37): what the owned model (``llm_api.models.llama``) hands such a set.

Per layer: the set's ``layer_in`` (q/k/v product of the handed-over input norm, rotary), the attention, and
``layer_out`` (o_proj, sum + norm, gate/up, SiLU x up, down, sum + next norm), two calls where the layer op by op
makes ~20 Python-level calls, each ~10-25 us on a CPU (a decode step of the embedded model made ~600 of them).
The attention on the engine's torch backend is one more call of the set (``paged_decode``: every row's K/V
stored, then each row attends its sequence's blocks up to its own position, ``row_tables``: decode rows, drafted
rows and prompt chunks alike); on another backend, the backend's ``forward``. A step whose every layer runs whole
and whose ids come in (not embeddings) goes further: the decoder embeds them, computes the rotary tables and
hands every layer to the set's ``decode_layers`` in one call (the same calls in the same order: the same
numbers; tests/engine/test_cpu_layers.py).

What a layer's calls read is planned once (the set's ``LayerWeights``: norms, ``Product``s of the merged and
plain projections, biases, LoRA slots) and kept on the layer while it holds the same modules and merged weights
(``_plan_key``; a projection wrapped or replaced later makes a new plan, or none: the layer runs op by op). A
layer runs whole when its q/k/v and gate/up are merged and holding (through LoRA wrappers: the set adds each
row's adapter delta after the base product, ``lora_arguments``), o_proj and down are plain or quantized linears,
its weights are of one dtype the set takes (Qwen3's q/k norms and Mistral's and Qwen2's sliding windows are the
set's too). The rounding is the same as op by op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llm_api.kernels.cpu.layers import check_step_tables
from llm_api.kernels.kernel_set import WholeLayerKernels
from llm_api.layers.quantized import QuantizedLinear, embedding_dtype
from llm_api.lora.context import current_step
from llm_api.lora.layer import LoraLinear
from llm_api.models.linear import GATE_UP, QKV, base_linear, lora_slots

# The engine's ``llm_api.engine.attention.PagedAttentionMetadata`` of the step (the engine is a layer above: the
# model reads its fields and calls its backend, never imports it).
StepMetadata = Any


def _plan_key(layer: Any, next_norm: nn.Module | None) -> tuple:
    """The modules a plan was made from: a plan holds while the layer still has these. (Read from the modules'
    own dicts: this runs for every layer at every decode step, and ``nn.Module.__getattr__`` cost ~1 us a read,
    most of a 30-layer model's 0.95 ms a step of plan checks.)"""
    modules = layer._modules
    self_attn, mlp = modules["self_attn"], modules["mlp"]
    attention, mlp_modules = self_attn._modules, mlp._modules
    return (self_attn, mlp, attention.get("q_proj"), attention.get("k_proj"), attention.get("v_proj"),
            attention.get("o_proj"), mlp_modules.get("gate_proj"), mlp_modules.get("up_proj"),
            mlp_modules.get("down_proj"), modules["input_layernorm"], modules["post_attention_layernorm"], next_norm,
            attention.get("q_norm"), attention.get("k_norm"))


def _weight_pointer(module: Any) -> int:
    """Where a projection's weights (through a LoRA wrapper) are now, read from the modules' own dicts."""
    if type(module) is LoraLinear:
        module = module._modules["base"]
    tensor = (module._buffers["blocks"] if type(module) is QuantizedLinear
              else module._parameters["weight"] if type(module) is nn.Linear else None)
    return 0 if tensor is None else tensor.data_ptr()


def _first_pointers(key: tuple) -> tuple[int, int]:
    """Where the q and gate projections' weights (the merged tensors' first rows, or their blocks) are now."""
    return _weight_pointer(key[2]), _weight_pointer(key[6])


def _make_plan(layer: Any, kernels: WholeLayerKernels, next_norm: Any) -> Any:
    """The set's ``LayerWeights`` for ``layer``, or None where it cannot run whole (the module docstring)."""
    attn, mlp, qkv, gate_up = layer.self_attn, layer.mlp, layer.qkv, layer.gate_up
    if (qkv is None or gate_up is None or not qkv.holds_bases(attn) or not gate_up.holds_bases(mlp)
            or len(qkv.sizes) != 3):
        return None
    head_norms = (attn.q_norm, attn.k_norm) if layer.flags.qk_norm else (None, None)
    o_proj, down = base_linear(attn.o_proj), base_linear(mlp.down_proj)
    norms = [layer.input_layernorm, layer.post_attention_layernorm, *([] if next_norm is None else [next_norm])]
    if o_proj is None or down is None or qkv.sizes[1] != qkv.sizes[2]:
        return None
    dtype = layer.input_layernorm.weight.dtype
    floats = [qkv.weight, qkv.bias, o_proj.bias, gate_up.weight, gate_up.bias, down.bias,
              *(norm.weight for norm in (*norms, *head_norms) if norm is not None),
              *(m.weight for m in (o_proj, down) if type(m) is nn.Linear)]
    if kernels.max_rows(dtype) < 1 or not all(t is None or (t.dtype == dtype and t.is_contiguous()
                                                            and kernels.takes(t)) for t in floats):
        return None
    adapted = tuple(lora_slots(getattr(attn, name)) for name in (*QKV, "o_proj")) + tuple(
        lora_slots(getattr(mlp, name)) for name in (*GATE_UP, "down_proj"))
    return kernels.LayerWeights(layer.input_layernorm, layer.post_attention_layernorm, next_norm, qkv.product(kernels),
                                tuple(qkv.sizes), qkv.bias, layer.head_dim, _linear_product(o_proj, kernels),
                                o_proj.bias, gate_up.product(kernels), gate_up.bias, _linear_product(down, kernels),
                                down.bias, adapted, *head_norms)


def _linear_product(linear: nn.Linear | QuantizedLinear, kernels: WholeLayerKernels) -> Any:
    """The set's ``Product`` of one linear (its float weight or its blocks)."""
    if type(linear) is QuantizedLinear:
        return linear.product
    return kernels.Product([linear.weight], linear.in_features)


def layer_plan(layer: Any, kernels: WholeLayerKernels, next_norm: nn.Module | None) -> Any:
    """The layer's ``LayerWeights`` (``_make_plan``), made once and kept while the layer has the same modules
    (``_plan_key``) and its merged weights where they were: a plan costs ~70 attribute reads and checks, its
    check ~15. None where the layer cannot run whole."""
    key = _plan_key(layer, next_norm)
    cached = layer.plan
    if (cached is None or cached[0] != key or cached[3] is not kernels
            or (cached[1] is not None and _first_pointers(key) != cached[2])):
        weights = _make_plan(layer, kernels, next_norm)
        pointers = None if weights is None else _first_pointers(key)
        cached = layer.plan = (key, weights, pointers, kernels)
    return cached[1]


def _takes_rotary(weights: Any, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The rotary's cos/sin [1, T, head_dim] are what the set's ``layer_in`` reads."""
    return (cos.dtype == weights.dtype and sin.dtype == weights.dtype and cos.dim() == 3 and cos.shape[0] == 1
            and cos.stride() == sin.stride() and cos.stride(-1) == 1)


def layer_weights(layer: Any, kernels: WholeLayerKernels, next_norm: nn.Module | None, hidden: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> Any:
    """The layer's ``LayerWeights`` when the set can run it whole for this input (no more rows than its
    products take, in the plan's dtype), else None."""
    if (hidden.dim() != 3 or hidden.shape[0] != 1 or not hidden.is_contiguous()
            or hidden.shape[1] > kernels.max_rows(hidden.dtype)):  # (a prefill's rows: no plan check)
        return None
    weights = layer_plan(layer, kernels, next_norm)
    if (weights is None or hidden.dtype != weights.dtype or hidden.shape[1] > kernels.max_rows(weights.dtype)
            or not _takes_rotary(weights, cos, sin)):
        return None
    return weights


def _paged_step(kernels: WholeLayerKernels, metadata: StepMetadata, rows: int) -> bool:
    """Whether the set's ``paged_decode`` may attend this step of ``rows`` tokens (the engine's torch backend,
    whose math it is, over a CPU pool of the step's dtype)."""
    return (metadata.backend.kernel_set_may_attend and metadata.query_start_loc[-1] == rows
            and len(metadata.query_start_loc) == len(metadata.context_lens_list) + 1)


def row_tables(metadata: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


def _paged_decode(layer: Any, kernels: WholeLayerKernels, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  metadata: StepMetadata) -> torch.Tensor | None:
    """The attention of a step as the set's one call (the K/V store and every row's attention, ``row_tables``)
    where the engine's torch backend would run it (a gather and SDPA, ~13 tensor ops a layer); else None."""
    if not _paged_step(kernels, metadata, query.shape[0]):
        return None
    key_cache, value_cache = metadata.key_caches[layer.layer_idx], metadata.value_caches[layer.layer_idx]
    if (key_cache.dtype != query.dtype or value_cache.dtype != query.dtype or not key_cache.is_contiguous()
            or not value_cache.is_contiguous() or key_cache.device.type != "cpu"):
        return None
    slots, tables, lengths = row_tables(metadata)
    return kernels.paged_decode(query, key, value, key_cache, value_cache, slots, tables, lengths, layer.scaling,
                                layer.flags.sliding_window)


def lora_arguments(decoder: Any, kernels: WholeLayerKernels, holder: Any, plans: list, rows: int) -> tuple | None:
    """The set's LoRA arguments (its ``LoraRows`` and ``LoraProducts``) for the products of ``plans`` (one
    layer's, or every layer's) in this step of ``rows`` rows: each row's adapter, from the step the engine
    entered (``llm_api.lora.context``), made once a step and kept on the decoder. The products are kept on
    ``holder`` (the layer's plan, or the stack's) and remade only when an adapter's concatenated tensors change
    (a slot refilled). None where no row runs an adapter."""
    step = current_step()
    if step is None:
        return None
    if decoder.lora_rows is None or decoder.lora_rows[0] is not step:
        slots = step.token_slots.tolist()
        offsets = [step.columns[slot][0] for slot in slots]
        widths = [step.columns[slot][1] if slot else 0 for slot in slots]
        columns = sum(width for _, width in step.columns)
        decoder.lora_rows = (step, kernels.LoraRows(offsets, widths, step.row_scaling, columns))
    lora_rows = decoder.lora_rows[1]
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


def run_layer(decoder: Any, layer: Any, kernels: WholeLayerKernels, weights: Any, hidden: torch.Tensor,
              normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata: StepMetadata
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decoder layer as two calls of the set around the attention (``layer_weights``): (its output, the next
    norm's output of it, or None where the plan has no next norm)."""
    tokens, width = hidden.shape[1], hidden.shape[2]
    rows = hidden.view(tokens, width)
    lora = lora_arguments(decoder, kernels, weights, [weights], tokens)
    query, key, value = kernels.layer_in(weights, rows, normed.reshape(tokens, width), cos[0], sin[0], lora)
    output = _paged_decode(layer, kernels, query, key, value, metadata)
    if output is None:
        heads = (tokens, -1, layer.head_dim)
        output = metadata.backend.forward(metadata, layer.layer_idx, query.view(heads), key.view(heads),
                                          value.view(heads), layer.scaling, layer.flags.sliding_window,
                                          None).reshape(tokens, -1)
        if not output.is_contiguous():
            output = output.contiguous()
    hidden_out, normed_out = kernels.layer_out(weights, output, rows, lora)
    return hidden_out.view(hidden.shape), None if normed_out is None else normed_out.view(hidden.shape)


def _stack_plan(decoder: Any, kernels: WholeLayerKernels, layers: list) -> Any:
    """The set's ``DecodeStack`` of the decoder's layers, where every one runs whole (each plan hands its
    output's norm to the next): the chain ``decode_layers`` runs in C. Kept while the layers' plans are the
    same objects; None where any layer cannot run whole."""
    plans = []
    for layer, next_norm in zip(layers, decoder.following_norms()):
        weights = layer_plan(layer, kernels, next_norm)
        if weights is None:
            return None
        plans.append(weights)
    cached = decoder.stack
    if cached is None or len(cached[0]) != len(plans) or any(a is not b for a, b in zip(cached[0], plans)):
        cached = decoder.stack = (plans, kernels.DecodeStack(plans, [layer.scaling for layer in layers],
                                                             [layer.flags.sliding_window for layer in layers]))
    return cached[1]


def decoder_stack(decoder: Any, kernels: WholeLayerKernels, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  metadata: StepMetadata) -> torch.Tensor | None:
    """The decoder's last hidden state (the final norm's output) of a step of few rows computed by the set's
    ``decode_layers`` in one call, where it can run: ids in, the engine's torch backend, every layer whole, rows
    the set's products take. Else None (the layers run one by one)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        return None
    rows = input_ids.shape[1]
    if rows > kernels.max_rows(embedding_dtype(decoder.embed_tokens)) or not _paged_step(kernels, metadata, rows):
        return None  # (a prefill: no plan checks a step)
    layers = list(decoder.layers)
    stack = _stack_plan(decoder, kernels, layers)
    if stack is None or rows > kernels.max_rows(stack.dtype):
        return None
    hidden = decoder.embed_tokens(input_ids)
    if hidden.dtype != stack.dtype or not hidden.is_contiguous():
        return None
    cos, sin = decoder.rotary_emb(hidden, position_ids=position_ids)
    if not _takes_rotary(stack, cos, sin):
        return None
    slots, tables, lengths = row_tables(metadata)
    out = kernels.decode_layers(stack, hidden.view(rows, -1), cos[0], sin[0], metadata.key_caches,
                                metadata.value_caches, slots, tables, lengths,
                                lora_arguments(decoder, kernels, stack, stack.layers, rows))
    if out is None:
        return None
    hidden_out, normed_out = out
    if normed_out is None:  # (a plan chain without the final norm)
        norm = decoder.norm
        return kernels.rms_norm(hidden_out.view(hidden.shape), norm.weight, norm.variance_epsilon)
    return normed_out.view(hidden.shape)
