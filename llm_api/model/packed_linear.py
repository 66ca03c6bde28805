"""Linear layers whose weights are reordered once, at load, into oneDNN's blocked layout (CPU only).

Why: a decode step on a CPU is almost all matrix-vector products (one row per running sequence against
every weight matrix), and it can go no faster than the weights stream from memory. ``F.linear`` with a
plain row-major weight leaves a lot of that bandwidth unused for bfloat16: it re-blocks (or converts)
the weight inside every call. oneDNN's ``_reorder_linear_weight`` does that blocking once and
``mkldnn::_linear_pointwise`` then reads the blocked weight straight through, for any number of rows: the
same pair of operators that inductor's CPU "freezing" pass emits for bfloat16 linears, called here without
compiling the model. Measured on the hosts we have (docs/benchmarks.md, "Where a CPU decode step goes"):

* bfloat16 on a 2-core Intel Xeon with AMX and avx512_bf16: one SmolLM2-135M decode step's 211 products took
  23.7 ms as ``F.linear`` and 17.9 ms packed, the whole step 35.8 and 29.7 ms (2 threads, 2026-11-26);
* float32: torch's own products are MKL's, and MKL reads memory well on Intel CPUs only: on a 2-core AMD EPYC
  (avx2, no avx512) one row against the model's weight shapes read 9.6 GB/s through ``F.linear`` and 20.6 GB/s
  packed (2026-11-25), while on the Xeon above a packed float32 step took 47.6 ms against 32.6. On the same
  EPYC, measured again on 2026-11-27 beside the split product (``llm_api.model.split_linear``: a product of
  a few rows split across the cores), split beat packed at batch 1 and 4 and matched it at 16, so ``auto`` now splits
  float32 on AMD CPUs (``llm_api.model.cpu.cpu_vendor``) and leaves it to MKL elsewhere; ``true`` packs it
  everywhere, ``split`` splits it, ``false`` does neither.

``weight_layout(mode, dtype, on_cpu)`` applies that rule; ``pack_linear_weights(model)`` swaps every plain
``nn.Linear`` of a model on the CPU for a ``PackedLinear`` holding only the packed copy (the row-major weight
is dropped, so memory stays the same),
except where a weight is shared: a tied ``lm_head`` keeps the embedding's weight alive, and its packed copy
costs ``vocab x hidden`` elements more (113 MB for the embedded model in float32, 56 MB in bfloat16).
Quantized (bitsandbytes) layers are not ``nn.Linear`` and stay as they are; a model with offloaded weights is
not packed at all.

oneDNN packs bfloat16 only where the CPU has the instructions for it (avx512bw/vl/dq, avx_ne_convert or
AMX): elsewhere the first reorder raises, ``pack_linear_weights`` logs why and leaves the model unchanged.
The result of a packed product is checked against ``F.linear`` on the first layer before anything is
swapped; the two differ only in the order of the float32 sums (a few units in the last place).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llm_api.model import cpu

logger = logging.getLogger(__name__)

# One row: decode at batch 1, the case the layout is tuned for (it serves every other row count too).
_PACK_HINT_ROWS = 1


class PackedLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` held in oneDNN's blocked layout; any leading shape of ``x``.

    The packed weight is a non-persistent buffer (an opaque ``_mkldnn`` tensor: it has a dtype and a
    device, but no strides to read), so ``state_dict`` stays the model's own and the engine can still
    ask a layer for its dtype and device through its buffers."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), _PACK_HINT_ROWS)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def weight_layout(mode: str, dtype: torch.dtype, on_cpu: bool, vendor: str | None = None,
                  cpu_kernels: bool = False) -> str:
    """CPU_PACKED_WEIGHTS -> how the linear layers' products run: ``"packed"`` (``PackedLinear``), ``"split"``
    (``llm_api.model.split_linear``: a product of a few rows split across the cores) or ``"plain"``
    (``F.linear``). ``auto``: plain where ``cpu_kernels`` (the engine's fused decoder layers will run
    ``llm_api.kernels.cpu``'s products, whose products of up to 16 rows read the plain weights and beat both
    layouts below: docs/benchmarks.md, "CPU kernels"); else bfloat16 packed, float32 split on AMD CPUs (measured
    there: split beat packed at decode batch 1 and 4 and matched it at 16, module docstrings) and plain
    elsewhere (MKL's own products on an Intel Xeon). ``true``: packed, ``split``: split, ``false``: plain.
    Never off the CPU. ``vendor``: the CPU's ``vendor_id`` (default: this one's)."""
    if not on_cpu or mode == "false" or dtype not in (torch.float32, torch.bfloat16) or (mode == "auto" and cpu_kernels):
        return "plain"
    if mode == "split":
        return "split"
    if mode == "true" or dtype == torch.bfloat16:
        return "packed"
    return "split" if (cpu.cpu_vendor() if vendor is None else vendor) == "AuthenticAMD" else "plain"


def _check_packed_product(linear: nn.Linear) -> str | None:
    """None when a packed copy of ``linear`` computes what ``F.linear`` does, else why not."""
    try:
        packed = PackedLinear(linear)
        x = torch.randn(3, linear.in_features, dtype=linear.weight.dtype)
        with torch.no_grad():
            got, want = packed(x).float(), nn.functional.linear(x, linear.weight, linear.bias).float()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    # bfloat16 rounds each output to 8 significant bits; float32 sums in another order.
    tolerance = 2e-2 if linear.weight.dtype == torch.bfloat16 else 1e-4
    if not torch.allclose(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item()):
        return f"a packed product differs from F.linear by {(got - want).abs().max().item():.3g}"
    return None


def cpu_linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """Every plain ``nn.Linear`` of ``model`` with a CPU weight, as (parent, attribute name, layer): what
    ``CPU_PACKED_WEIGHTS`` may swap. None of a model with offloaded weights (logged)."""
    if any(p.device.type == "meta" for p in model.parameters()):
        # Offloaded (DEVICE_MAP "disk" entries): accelerate's hooks swap weights in per forward, and a
        # swapped-out module would lose its hook. Offloading is for memory, not speed: leave it alone.
        logger.info("CPU_PACKED_WEIGHTS: leaving the linear layers of a model with offloaded weights as they are")
        return []
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and child.weight.device.type == "cpu"]


def pack_linear_weights(model: nn.Module) -> int:
    """Swap every plain ``nn.Linear`` with a CPU weight in ``model`` for a ``PackedLinear``; return how many.
    Swaps nothing (and logs why) when this CPU or torch build cannot pack the model's dtype."""
    linears = cpu_linears(model)
    if not linears:
        return 0
    reason = _check_packed_product(linears[0][2])
    if reason is not None:
        logger.info("CPU_PACKED_WEIGHTS: not packing the %s weights on this CPU (%s); using F.linear",
                    linears[0][2].weight.dtype, reason)
        return 0
    with torch.no_grad():  # (not inference_mode: generate() uses these weights outside it)
        for parent, name, child in linears:
            setattr(parent, name, PackedLinear(child))
    return len(linears)
