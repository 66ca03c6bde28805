"""``QUANTIZATION=q8_0|q4_0|q4_k``: a Hugging Face checkpoint's linear layers quantized at load into GGUF's block
formats (``llm_api.kernels.cpu.quant``), for the CPU kernels' products, as ``llama-quantize`` would make the file.

Which tensor gets which format follows ``llama-quantize``'s rules for the matching file types (Q8_0, Q4_0,
Q4_K_S-like), so a checkpoint quantized here and the GGUF file made from it hold the same kinds of blocks:

* every linear of the decoder layers: the scheme's format; where a layer's input width is not a multiple of the
  format's block (256 values for Q4_K), ``llama-quantize``'s fallback: Q5_0 for Q4_K; a width that is not a
  multiple of 32 stays in float (no GGUF format holds it);
* the output head (or the input embedding it is tied to): Q8_0 for ``q8_0``, else Q6_K, or Q8_0 where its width
  is not a multiple of 256 (``llama-quantize`` keeps the head at 6 bits or more: it sets every token's logit);
* an input embedding with a head of its own: the scheme's format (with the same fallback); a tied one shares the
  head's blocks (one copy in memory).

Q8_0, Q4_0 and Q5_0 are quantized exactly as the gguf package (and llama.cpp's reference) does; Q4_K and Q6_K by
a simpler rule (``quant.c``), so their error is a little above ``llama-quantize``'s. Each layer's float weight is
freed as soon as its blocks exist, so the load peaks at the float model and one layer's blocks.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from torch import nn

from llm_api.kernels.cpu import quant
from llm_api.layers.quantized import QuantizedEmbedding, QuantizedLinear

logger = logging.getLogger(__name__)

# QUANTIZATION -> (the layers' format, its fallback where the width is not a multiple of its block, the head's)
SCHEMES = {"q8_0": ("Q8_0", None, "Q8_0"), "q4_0": ("Q4_0", None, "Q6_K"), "q4_k": ("Q4_K", "Q5_0", "Q6_K")}


def _format_for(name: str, fallback: str | None, width: int) -> quant.BlockFormat | None:
    """The format a tensor of rows of ``width`` values gets (None: it stays in float)."""
    for candidate in (name, fallback, "Q8_0" if name == "Q6_K" else None):
        if candidate is not None and quant.FORMATS[candidate].fits(width):
            return quant.FORMATS[candidate]
    return None


def _blocks(weight: torch.Tensor, fmt: quant.BlockFormat) -> quant.QuantizedWeight:
    blocks = quant.quantize(weight, fmt)
    return quant.repack(blocks) if fmt.name in quant.REPACKABLE else blocks


def quantize_model(model: nn.Module, scheme: str, dtype: torch.dtype) -> dict[str, int]:
    """Replace ``model``'s linear layers (and its embedding) by quantized ones of ``scheme``; returns how many
    tensors got each format. ``dtype``: the model's compute dtype (the embedding's output)."""
    layer_format, fallback, head_format = SCHEMES[scheme]
    counts: Counter[str] = Counter()
    get_head = getattr(model, "get_output_embeddings", None)
    head: Any = get_head() if callable(get_head) else None
    embedding: Any = model.get_input_embeddings()  # type: ignore[operator]
    tied = head is not None and type(head) is nn.Linear and type(embedding) is nn.Embedding and head.weight is embedding.weight
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child is head:
                continue
            fmt = _format_for(layer_format, fallback, child.in_features)
            if fmt is None:
                counts["float"] += 1
                continue
            bias = None if child.bias is None else child.bias.detach().to(dtype)
            setattr(parent, name, QuantizedLinear(_blocks(child.weight.detach(), fmt), bias))
            counts[fmt.name] += 1
    if type(head) is nn.Linear:
        fmt = _format_for(head_format, None, head.in_features)
        if fmt is not None:
            table = _blocks(head.weight.detach(), fmt)
            model.set_output_embeddings(QuantizedLinear(table, None if head.bias is None else head.bias.detach()))  # type: ignore[operator]
            counts[fmt.name] += 1
            if tied:
                model.set_input_embeddings(QuantizedEmbedding(table, dtype))  # type: ignore[operator]
                counts[fmt.name] += 1
    if not tied and type(embedding) is nn.Embedding:
        fmt = _format_for(layer_format, fallback, embedding.embedding_dim)
        if fmt is not None:
            model.set_input_embeddings(QuantizedEmbedding(_blocks(embedding.weight.detach(), fmt), dtype))  # type: ignore[operator]
            counts[fmt.name] += 1
    return dict(counts)
