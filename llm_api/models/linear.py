"""Linear kinds of the owned model (``llm_api.models``): what a projection may be, and several as one product.

A projection is a plain ``nn.Linear``, a ``QuantizedLinear`` (GGUF blocks, ``llm_api.layers.quantized``), a LoRA
wrapper around either (``llm_api.lora.layer.LoraLinear``), or any other module that maps rows to rows (the
oneDNN-packed and split linears of ``llm_api.model``); the model calls the module unless the kernel set takes
the product itself (``project``: a plain linear's few rows).

Merged products (vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear``): ``merge`` concatenates q/k/v's
(gate/up's) weights into one tensor and makes the modules' own parameters views of it, so the model holds no
more memory and every other reader (LoRA wrappers, a state dict, ``generate()`` on the same modules) sees the
modules as before. A ``MergedProjection`` runs only while it still ``holds``, checked at each call: the
projections are still the plain linears whose weights point into the merged tensor (a projection wrapped or
replaced later, or a model moved since, takes the modules' own products). ``QuantizedLinear`` parts merge
without a copy: the C set's product runs over their blocks side by side, each part in its own format.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llm_api.kernels.kernel_set import KernelSet, WholeLayerKernels, runs_whole_layers
from llm_api.layers.quantized import QuantizedLinear
from llm_api.lora.layer import LoraLinear

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


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


def project(projection: nn.Module, x: torch.Tensor, kernels: KernelSet, silu_mul: bool = False) -> torch.Tensor:
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
