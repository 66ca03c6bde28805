"""A linear layer and an embedding whose weights stay in a GGUF block format (``llm_api.kernels.cpu.quant``).

``QuantizedLinear`` replaces an ``nn.Linear`` of a model on the CPU: ``forward(x)`` is ``x @ W.T (+ bias)`` for any
number of rows, computed by the C product over the blocks (every row's input quantized per block of 32 to
``input_digits`` 8-bit digits a value, QUANT_ACTIVATIONS: ``set_input_digits``; integer dot products), in x's dtype
(float32 or bfloat16: the model's). It has ``in_features`` and ``out_features`` like the module it replaces, so
LoRA wraps it as it wraps any linear (the adapters' delta in float over the quantized base: QLoRA's serving shape),
and ``llm_api.models.whole_layers`` hands its blocks to the whole-layer C calls. ``QuantizedEmbedding`` looks rows
up by de-quantizing only those rows. A tied output head is a ``QuantizedLinear`` over the embedding's own blocks
(one copy in memory).

The blocks are a buffer (``blocks``: uint8 [rows, bytes a row], not saved in a state dict: the model's weights
come from its file), so a module moved or copied keeps them; the ``Product`` the C calls read is remade when
the blocks move. Both need the CPU kernels (``llm_api.kernels.cpu.library``): the loader checks they load
before it builds a quantized model.
"""

from __future__ import annotations

import torch
from torch import nn

from llm_api.kernels.cpu import quant
from llm_api.kernels.cpu.quant import BlockFormat, Product, QuantizedWeight


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` [out_features, in_features] in ``format``'s blocks (``weight``); ``bias``
    (or None) in the model's dtype."""

    blocks: torch.Tensor

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features = weight.in_features
        self.out_features = weight.rows
        self.format: BlockFormat = weight.format
        self.layout = weight.layout
        self.input_digits = weight.input_digits
        self.register_buffer("blocks", weight.blocks, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().contiguous(), requires_grad=False)
        self._product: Product | None = None

    @property
    def quantized(self) -> QuantizedWeight:
        """The weight as the kernels take it (the blocks where they are now)."""
        return QuantizedWeight(self.format, self.blocks, self.in_features, self.layout, self.input_digits)

    @property
    def product(self) -> Product:
        """This layer's product alone, remade where the blocks moved or the input digits changed since it was made."""
        product = self._product
        first = None if product is None else product.parts[0]
        if (product is None or not isinstance(first, QuantizedWeight) or first.blocks.data_ptr() != self.blocks.data_ptr()
                or product.input_digits != self.input_digits):
            product = self._product = Product([self.quantized], self.in_features)
        return product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias: torch.Tensor | None = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        return quant.product(x, self.product, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format.name}, "
                f"layout={self.layout}, input_digits={self.input_digits}, bias={self.bias is not None}")


class QuantizedEmbedding(nn.Module):
    """An embedding table [num_embeddings, embedding_dim] in ``format``'s blocks: ``forward(ids)`` de-quantizes the
    rows asked for into ``dtype`` (an id outside the table raises IndexError, as ``nn.Embedding`` does)."""

    blocks: torch.Tensor

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.num_embeddings = weight.rows
        self.embedding_dim = weight.in_features
        self.padding_idx = None
        self.format: BlockFormat = weight.format
        self.layout = weight.layout
        self.dtype = dtype
        self.register_buffer("blocks", weight.blocks, persistent=False)

    @property
    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.format, self.blocks, self.embedding_dim, self.layout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return quant.dequantize(self.quantized, ids, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.format.name}, dtype={self.dtype}"


def embedding_dtype(module: nn.Module) -> torch.dtype:
    """The dtype an input embedding module returns (a quantized table's, or its float weight's)."""
    if isinstance(module, QuantizedEmbedding):
        return module.dtype
    return module.weight.dtype  # type: ignore[union-attr, return-value]


# QUANT_ACTIVATIONS=auto: one digit (llama.cpp's precision) from this many parameters up, two below. Measured
# (docs/model-options.md, "The products"): the 135M embedded model's greedy answers change with one digit (6 of 8
# chats) and its batch-1 decode is at llama.cpp's with two; on a 1B model the products are the step's cost and two
# digits keep prefill at ~0.75x llama.cpp's, while one gives llama.cpp's own numerics at 1.0-1.3x.
AUTO_ONE_DIGIT_PARAMETERS = 1_000_000_000


def parameter_count(model: nn.Module) -> int:
    """Weights a model holds, float parameters and quantized tables alike (a table two modules share, a tied
    head's, counted once)."""
    count = sum(p.numel() for p in model.parameters())
    seen: set[int] = set()
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)) and module.blocks.data_ptr() not in seen:
            seen.add(module.blocks.data_ptr())
            weight = module.quantized
            count += weight.rows * weight.in_features
    return count


def input_digits_for(model: nn.Module, setting: str) -> int:
    """The input digits QUANT_ACTIVATIONS asks for (``auto``: by ``AUTO_ONE_DIGIT_PARAMETERS``)."""
    if setting != "auto":
        return quant.INPUT_DIGITS[setting]
    return 1 if parameter_count(model) >= AUTO_ONE_DIGIT_PARAMETERS else 2


def set_input_digits(model: nn.Module, digits: int) -> int:
    """Every ``QuantizedLinear`` of ``model`` quantizes its inputs to ``digits`` 8-bit digits a value (1 or 2:
    ``quant.INPUT_DIGITS``, QUANT_ACTIVATIONS); before the first product is made (a merged layer's product
    reads its parts' digits when it is made). The number of layers set."""
    if digits not in quant.INPUT_DIGITS.values():
        raise ValueError(f"a product's inputs have 1 or 2 digits, not {digits!r}")
    layers = [module for module in model.modules() if isinstance(module, QuantizedLinear)]
    for layer in layers:
        layer.input_digits = digits
    return len(layers)
