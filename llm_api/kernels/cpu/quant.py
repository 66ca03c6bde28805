"""Weights kept in GGUF's block formats on the CPU (``quant.c``): their products, de-quantization and quantization.

A quantized weight is a uint8 tensor ``[rows, K / block size x block bytes]``: each row is a run of blocks of one
format exactly as a GGUF file stores it (``BlockFormat``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 of 32 values a block; Q4_K,
Q5_K, Q6_K of 256), never de-quantized to float as a whole. ``Product`` is one input's product over 1-3 such
weights (or plain float ones) side by side: a merged q/k/v whose parts differ in format, as Q4_K_M files' do.
``product(x, ...)`` computes it for any number of rows of x (float32 or bfloat16): every row quantized to one or
two 8-bit digits a value per block of 32 (``INPUT_DIGITS``) and multiplied with the weights' blocks in integers
(``quant.c`` says how), the same instructions for a row whatever its batch, so prefill chunks, decode batches and
``generate()`` give one row the same numbers. ``dequantize`` turns rows back into float (embedding lookups; the
tests compare it with the ``gguf`` package's reference bit for bit); ``quantize`` makes blocks from float32 weights
(``QUANTIZATION`` at load: ``QUANTIZABLE``).

Why hand-written: batch-1 decode reads every weight once per token, so 4-bit weights are a quarter of
bfloat16's bytes to read; torch has no product over these formats on a CPU (bitsandbytes' CPU 4-bit ran
slower than bfloat16, docs/model-options.md). llama.cpp's own kernels are C++ in a library we would have to
build and bind whole. The C side trusts the pointers and sizes it is handed: the wrappers here check every
shape against the format before a call, and the C functions check what a call alone can (known format, whole
blocks, ids within the table).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

import torch

import llm_api.kernels.cpu.library as library
from llm_api.kernels.cpu.library import DTYPES

DENSE = -1  # a part of plain float rows in the activations' dtype (quant.h's LLM_DENSE)
MAX_PARTS = 3
# A quantized weight's layout (quant.h): GGUF's, row after row, or repacked at load in groups of 8 rows (the rows
# past the last whole group in GGUF's), which the products read several times faster (quant.c says why).
LAYOUTS = {"gguf": 0, "rows8": 1}
# How a product quantizes its input rows per block of 32 (quant.c): two signed 8-bit digits a value (~13 bits, the
# default) or one (llama.cpp's Q8 activations: half the integer work, 8 bits). QUANT_ACTIVATIONS names them.
INPUT_DIGITS = {"int8x2": 2, "int8": 1}


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block format: ``block`` values in ``bytes`` bytes; ``type_id`` its number in GGUF (ggml's enum)."""

    name: str
    type_id: int
    block: int
    bytes: int

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.bytes

    def fits(self, k: int) -> bool:
        """Rows of ``k`` values are whole blocks of this format."""
        return k > 0 and k % self.block == 0

    @property
    def bits(self) -> float:
        return self.bytes * 8 / self.block


FORMATS: dict[str, BlockFormat] = {f.name: f for f in (
    BlockFormat("Q4_0", 2, 32, 18), BlockFormat("Q4_1", 3, 32, 20), BlockFormat("Q5_0", 6, 32, 22),
    BlockFormat("Q5_1", 7, 32, 24), BlockFormat("Q8_0", 8, 32, 34), BlockFormat("Q4_K", 12, 256, 144),
    BlockFormat("Q5_K", 13, 256, 176), BlockFormat("Q6_K", 14, 256, 210))}
BY_TYPE: dict[int, BlockFormat] = {f.type_id: f for f in FORMATS.values()}
# What ``quantize`` makes (Q8_0, Q4_0, Q4_1, Q5_0 bit for bit as the gguf package's quantizers; Q4_K and Q6_K by
# a simpler rule than llama.cpp's, quant.c), and what ``repack`` groups by 8 rows (the others run in GGUF's layout).
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")
REPACKABLE = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


class _Weight(ctypes.Structure):
    """quant.h's ``llm_weight_t``: keep the two in step."""

    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_int64), ("rows", ctypes.c_int64), ("layout", ctypes.c_int64)]


class _Product(ctypes.Structure):
    """quant.h's ``llm_product_t``: keep the two in step."""

    _fields_ = [("part", _Weight * MAX_PARTS), ("parts", ctypes.c_int64), ("digits", ctypes.c_int64)]


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight of ``rows`` x ``in_features`` values kept as ``blocks`` (uint8 [rows, format.row_bytes(in_features)],
    contiguous, on the CPU) in ``layout`` (``LAYOUTS``); its products quantize their inputs to ``input_digits``
    8-bit digits a value (``INPUT_DIGITS``)."""

    format: BlockFormat
    blocks: torch.Tensor
    in_features: int
    layout: str = "gguf"
    input_digits: int = 2

    def __post_init__(self):
        expected = (self.blocks.shape[0] if self.blocks.dim() == 2 else -1, self.format.row_bytes(self.in_features))
        if not self.format.fits(self.in_features):
            raise ValueError(f"{self.format.name} rows hold whole blocks of {self.format.block} values, "
                             f"not {self.in_features}")
        if self.input_digits not in INPUT_DIGITS.values():
            raise ValueError(f"a product's inputs have 1 or 2 digits, not {self.input_digits!r}")
        if self.layout not in LAYOUTS or (self.layout == "rows8" and self.format.name not in REPACKABLE):
            raise ValueError(f"{self.format.name} weights have no layout {self.layout!r}")
        if (self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or tuple(self.blocks.shape) != expected
                or not self.blocks.is_contiguous() or self.blocks.device.type != "cpu"):
            raise ValueError(f"{self.format.name} blocks of {self.in_features} values a row must be a contiguous CPU "
                             f"uint8 tensor [rows, {expected[1]}], got {self.blocks.dtype} {tuple(self.blocks.shape)}")

    @property
    def rows(self) -> int:
        return int(self.blocks.shape[0])


class Product:
    """One input's product over ``parts`` (each a ``QuantizedWeight``, or a dense float tensor [rows, K] in the
    activations' dtype), their outputs side by side: the ``llm_product_t`` that ``product`` and the whole-layer
    calls hand to C, its tensors kept referenced while this lives. Its inputs are quantized to the quantized
    parts' ``input_digits`` (they must agree)."""

    def __init__(self, parts: Sequence[QuantizedWeight | torch.Tensor], in_features: int):
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"a product has 1 to {MAX_PARTS} parts, not {len(parts)}")
        self.parts = tuple(parts)
        self.in_features = in_features
        self.struct = _Product()
        self.struct.parts = len(parts)
        self.sizes: list[int] = []
        self.dense_dtype: torch.dtype | None = None
        for entry, part in zip(self.struct.part, parts):
            if isinstance(part, QuantizedWeight):
                if part.in_features != in_features:
                    raise ValueError(f"a part of {part.in_features} inputs in a product of {in_features}")
                entry.data, entry.type, entry.rows = part.blocks.data_ptr(), part.format.type_id, part.rows
                entry.layout = LAYOUTS[part.layout]
            else:
                if (part.dim() != 2 or part.shape[1] != in_features or not part.is_contiguous()
                        or part.device.type != "cpu" or part.dtype not in DTYPES
                        or self.dense_dtype not in (None, part.dtype)):
                    raise ValueError(f"a dense part must be a contiguous CPU float tensor [rows, {in_features}], "
                                     f"got {part.dtype} {tuple(part.shape)}")
                self.dense_dtype = part.dtype
                entry.data, entry.type, entry.rows = part.data_ptr(), DENSE, part.shape[0]
            self.sizes.append(int(entry.rows))
        self.out_features = sum(self.sizes)
        self.quantized = any(isinstance(part, QuantizedWeight) for part in parts)
        digits = {part.input_digits for part in parts if isinstance(part, QuantizedWeight)}
        if len(digits) > 1:
            raise ValueError(f"a product's quantized parts quantize their inputs alike, not to {sorted(digits)} digits")
        self.input_digits = digits.pop() if digits else 2
        self.struct.digits = self.input_digits

    def takes(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        """``product`` computes this for ``x`` (and ``bias``): a CPU float32/bfloat16 input of ``in_features``
        whose dense parts (if any) and bias are in its dtype."""
        return (library.loaded() and x.device.type == "cpu" and x.dtype in DTYPES and x.dim() >= 1
                and x.shape[-1] == self.in_features and self.dense_dtype in (None, x.dtype)
                and (bias is None or (bias.dtype == x.dtype and bias.shape == (self.out_features,)
                                      and bias.is_contiguous() and bias.device.type == "cpu")))

    def pointer(self):
        return ctypes.byref(self.struct)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def product(x: torch.Tensor, weights: Product, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for ``W`` the parts of ``weights`` stacked; x [..., K] float32 or bfloat16 on the CPU,
    the result in x's dtype (``Product.takes`` says whether it applies)."""
    if not weights.takes(x, bias):
        raise ValueError(f"a quantized product of {weights.in_features} inputs cannot take {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}" + ("" if library.loaded() else " (CPU kernels not loaded)"))
    rows = _rows(x)
    out = torch.empty((rows.shape[0], weights.out_features), dtype=x.dtype)
    failed = library.lib().llm_q_product(rows.data_ptr(), rows.stride(0), weights.pointer(),
                                         None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
                                         rows.shape[0], weights.in_features, DTYPES[x.dtype], library.threads())
    _raise_for(failed, "product")
    return out.view(*x.shape[:-1], weights.out_features)


def dequantize(weight: QuantizedWeight, ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` (int64, any shape; every row where None) of ``weight`` as float32, or bfloat16 rounded once:
    [*ids.shape, in_features]. An id outside the rows raises IndexError."""
    if dtype not in DTYPES:
        raise ValueError(f"dequantize to float32 or bfloat16, not {dtype}")
    flat = None if ids is None else ids.reshape(-1).to(torch.int64).contiguous()
    count = weight.rows if flat is None else flat.numel()
    out = torch.empty((count, weight.in_features), dtype=dtype)
    if count:
        failed = library.lib().llm_q_dequantize(weight.format.type_id, LAYOUTS[weight.layout], weight.blocks.data_ptr(),
                                                weight.rows,
                                                None if flat is None else flat.data_ptr(), count, weight.in_features,
                                                out.data_ptr(), out.stride(0), DTYPES[dtype], library.threads())
        if failed == 2:
            raise IndexError(f"a row id outside the table's {weight.rows} rows")
        _raise_for(failed, "dequantize")
    return out if ids is None else out.view(*ids.shape, weight.in_features)


def quantize(weight: torch.Tensor, format: BlockFormat) -> QuantizedWeight:
    """A float weight [rows, K] as ``format``'s blocks (``QUANTIZABLE`` formats; K whole blocks of it)."""
    if format.name not in QUANTIZABLE or not format.fits(weight.shape[-1]) or weight.dim() != 2:
        raise ValueError(f"cannot quantize {tuple(weight.shape)} to {format.name}")
    values = weight.detach().to("cpu", torch.float32).contiguous()
    rows, k = values.shape
    blocks = torch.empty((rows, format.row_bytes(k)), dtype=torch.uint8)
    if rows:
        _raise_for(library.lib().llm_q_quantize(format.type_id, values.data_ptr(), rows, k, blocks.data_ptr(),
                                                library.threads()), "quantize")
    return QuantizedWeight(format, blocks, k)


def repack(weight: QuantizedWeight, layout: str = "rows8") -> QuantizedWeight:
    """The same weight in ``layout`` (a copy; the same bytes reordered: ``REPACKABLE`` formats only)."""
    if layout == weight.layout:
        return weight
    if weight.format.name not in REPACKABLE or layout not in LAYOUTS:
        raise ValueError(f"{weight.format.name} weights have no layout {layout!r}")
    blocks = torch.empty_like(weight.blocks)
    _raise_for(library.lib().llm_q_repack(weight.format.type_id, weight.blocks.data_ptr(), weight.rows, weight.in_features,
                                          blocks.data_ptr(), int(layout == "rows8"), library.threads()), "repack")
    return QuantizedWeight(weight.format, blocks, weight.in_features, layout, weight.input_digits)


def _raise_for(failed: int, what: str) -> None:
    if failed == 1:
        raise MemoryError(f"quantized {what}: out of memory for its scratch")
    if failed:
        raise ValueError(f"quantized {what}: the library refused its arguments (code {failed})")
