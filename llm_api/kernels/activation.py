"""SiLU of the gate times the up projection, in one kernel, with the rounding of transformers' Llama MLP.

``silu_and_mul(gate_up[..., 2I]) -> out[..., I]`` computes what ``LlamaMLP.forward`` does between its
products when the gate and up projections run as one product over their concatenated weights
(``llm_api.models.llama``): with ``gate, up = gate_up[..., :I], gate_up[..., I:]``,

    out = (silu(gate) rounded to the dtype) * up                 (the product rounded to the dtype)

where transformers launches two kernels (the activation, then the product), each writing a tensor of
the intermediate size. Here: a grid of (rows, column blocks). The sigmoid is the GPU's own ``exp``, so a
float32 result may differ from torch's by an ulp (tests/kernels/test_fused_kernels.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llm_api.kernels.common import SUPPORTED_DTYPES, device_guard

BLOCK = 1024  # columns per program


@triton.jit
def silu_mul_rounded(gate, up):
    """``silu(gate) * up`` with transformers' two roundings to the dtype (inlined here and by
    ``kernels.gemv``, which computes the down projection's input as it reads it)."""
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # (torch's SiLU writes its own tensor: rounded here)
    return (activated.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, in_row_stride, out_row_stride, INTERMEDIATE,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTERMEDIATE
    gate = tl.load(gate_up_ptr + row * in_row_stride + offs, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * in_row_stride + INTERMEDIATE + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_row_stride + offs, silu_mul_rounded(gate, up).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[..., :I]) * gate_up[..., I:]`` (see the module)."""
    if gate_up.dtype not in SUPPORTED_DTYPES or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul takes {SUPPORTED_DTYPES} with an even last dimension, got "
                         f"{gate_up.dtype} {tuple(gate_up.shape)}")
    intermediate = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and intermediate:
        with device_guard(gate_up):
            _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(intermediate, BLOCK))](
                rows, out, rows.stride(0), out.stride(0), intermediate, BLOCK=BLOCK, num_warps=4)
    return out.view(*gate_up.shape[:-1], intermediate)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
