"""RMSNorm in one kernel, with the rounding of transformers' Llama norm; optionally with the residual sum before it.

``rms_norm(x[..., D], weight[D], eps) -> out[..., D]`` computes what ``LlamaRMSNorm.forward`` does
(and the owned decoder's norms, ``llm_api.models.llama``):

    y = x.float() * rsqrt(mean(x.float() ** 2) + eps)        (float32)
    out = weight * y.to(x.dtype)                               (rounded to x's dtype first, then the
                                                                product in the promoted dtype)

That code launches eight kernels per call (two casts, pow, mean, add, rsqrt, two products); a decode
step of a 32-layer model calls it 65 times, and at batch 1 each of those small launches costs a GPU
about as much as it costs to read a layer's smallest weight (issue 26's profile, docs/benchmarks.md).
Here: one program per row, the row in registers (``BLOCK`` = the next power of two of D).

Differences from the reference: the sum of squares is added in another order, and the GPU's rsqrt is
its own approximation; both move float32 results by an ulp or two, no more (tests/kernels/test_fused_kernels.py).

``add_rms_norm(x, residual, weight, eps) -> (residual + x, rms_norm(residual + x))``: a decoder layer's
residual sum and the RMSNorm that reads it, one kernel where the reference launches nine
(``llm_api.models.llama``); the sum is rounded to its dtype before the norm reads it, as there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_api.kernels.common import SUPPORTED_DTYPES, device_guard

MAX_HIDDEN = 65536  # one row in registers


@triton.jit
def _normalized(x, weight_ptr, offs, mask, D, eps):
    """One row's ``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)``, in float32 (inlined by both kernels)."""
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / D
    y = (xf * tl.rsqrt(variance + eps)).to(x.dtype)  # the reference's cast back to the input dtype
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    return w.to(tl.float32) * y.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, x_row_stride, out_row_stride, D, eps,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0)
    out = _normalized(x, weight_ptr, offs, mask, D, eps)
    tl.store(out_ptr + row * out_row_stride + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"rms_norm takes {SUPPORTED_DTYPES}, got {x.dtype} and {weight.dtype}")
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or hidden > MAX_HIDDEN or x.device != weight.device:
        raise ValueError(f"rms_norm needs weight [{hidden}] on {x.device} (D <= {MAX_HIDDEN}), "
                         f"got {tuple(weight.shape)} on {weight.device}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as rows [N, D] with a contiguous last dimension (a view for the usual contiguous rows)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)`` over the last dimension (see the module)."""
    _check_norm(x, weight)
    hidden = x.shape[-1]
    rows = _rows(x)
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


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, sum_ptr, out_ptr, x_row_stride, residual_row_stride,
                         sum_row_stride, out_row_stride, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * x_row_stride + offs, mask=mask, other=0.0)
    r = tl.load(residual_ptr + row * residual_row_stride + offs, mask=mask, other=0.0)
    # The reference's `residual + x` is its own kernel: the sum is rounded to its dtype before the norm reads it.
    total = (r.to(tl.float32) + x.to(tl.float32)).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * sum_row_stride + offs, total, mask=mask)
    out = _normalized(total, weight_ptr, offs, mask, D, eps)
    tl.store(out_ptr + row * out_row_stride + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``total = residual + x`` and ``rms_norm(total, weight, eps)`` in one kernel: what a decoder layer's
    residual sum followed by the next RMSNorm computes (vLLM's ``fused_add_rms_norm``), with the same
    rounding (the sum rounded to its dtype before the norm reads it). Returns ``(total, normed)``."""
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm needs x and residual of one shape, got {tuple(x.shape)} and "
                         f"{tuple(residual.shape)}")
    if residual.dtype not in SUPPORTED_DTYPES or x.device != residual.device:
        raise ValueError(f"add_rms_norm takes {SUPPORTED_DTYPES} on one device, got {residual.dtype} on "
                         f"{residual.device} and {x.device}")
    _check_norm(x, weight)
    hidden = x.shape[-1]
    rows, residual_rows = _rows(x), _rows(residual)
    total = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, total.dtype), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(hidden)
        with device_guard(x):
            _add_rms_norm_kernel[(rows.shape[0],)](
                rows, residual_rows, weight.contiguous(), total, out, rows.stride(0), residual_rows.stride(0),
                total.stride(0), out.stride(0), hidden, eps, BLOCK=block, num_warps=max(1, min(16, block // 256)))
    return total.view(x.shape), out.view(x.shape)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What a Llama decoder layer computes: ``residual + x``, then the next norm of that sum."""
    total = residual + x
    return total, rms_norm_reference(total, weight, eps)
