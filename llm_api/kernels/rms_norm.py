"""RMSNorm in one kernel, with the rounding of transformers' Llama norm.

``rms_norm(x[..., D], weight[D], eps) -> out[..., D]`` computes what ``LlamaRMSNorm.forward`` does
(and every norm whose forward is the same code, ``llm_api.engine.fused_ops``):

    y = x.float() * rsqrt(mean(x.float() ** 2) + eps)        (float32)
    out = weight * y.to(x.dtype)                               (rounded to x's dtype first, then the
                                                                product in the promoted dtype)

That code launches eight kernels per call (two casts, pow, mean, add, rsqrt, two products); a decode
step of a 32-layer model calls it 65 times, and at batch 1 each of those small launches costs a GPU
about as much as it costs to read a layer's smallest weight (issue 26's profile, docs/benchmarks.md).
Here: one program per row, the row in registers (``BLOCK`` = the next power of two of D).

Differences from the reference: the sum of squares is added in another order, and the GPU's rsqrt is
its own approximation; both move float32 results by an ulp or two, no more (tests/kernels/test_fused_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_api.kernels.common import SUPPORTED_DTYPES, device_guard

MAX_HIDDEN = 65536  # one row in registers


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, x_row_stride, out_row_stride, D, eps,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / D
    y = (xf * tl.rsqrt(variance + eps)).to(x.dtype)  # the reference's cast back to the input dtype
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * out_row_stride + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)`` over the last dimension (see the module)."""
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"rms_norm takes {SUPPORTED_DTYPES}, got {x.dtype} and {weight.dtype}")
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or hidden > MAX_HIDDEN or x.device != weight.device:
        raise ValueError(f"rms_norm needs weight [{hidden}] on {x.device} (D <= {MAX_HIDDEN}), "
                         f"got {tuple(weight.shape)} on {weight.device}")
    rows = x.reshape(-1, hidden)  # a view for the usual contiguous rows
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(hidden)
        with device_guard(x):
            _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), hidden, eps,
                                               BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return out.view(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm.forward``, written out."""
    y = x.to(torch.float32)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)
