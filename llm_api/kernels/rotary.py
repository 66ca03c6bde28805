"""Rotary position embedding of queries and keys in one kernel, with transformers' rounding.

``apply_rotary(q[B, Hq, T, D], k[B, Hkv, T, D], cos[B, T, D], sin[B, T, D]) -> (q_out, k_out)`` computes
what Llama's ``apply_rotary_pos_emb(q, k, cos, sin)`` does (``unsqueeze_dim=1``, the whole head dim
rotated, ``rotate_half`` = ``cat(-x2, x1)``) and every family whose function is the same code
(``llm_api.engine.fused_ops``):

    out[:D/2] = q[:D/2] * cos[:D/2] - q[D/2:] * sin[:D/2]
    out[D/2:] = q[D/2:] * cos[D/2:] + q[:D/2] * sin[D/2:]

each product rounded to the tensors' dtype before the sum, as the reference's separate elementwise
kernels do. That reference launches ten kernels per layer (slices, negation, concatenation, four
products, two sums); this launches one for q and k together. q and k may be strided views (the
attention's ``transpose(1, 2)`` of the projections); the outputs keep their memory layout
(``empty_like``), as the reference's elementwise results do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_api.kernels.common import SUPPORTED_DTYPES, device_guard


@triton.jit
def _rotate(x_ptr, out_ptr, cos_ptr, sin_ptr, x_offset, out_offset, cos_offset, HALF, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    x1 = tl.load(x_ptr + x_offset + offs, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + x_offset + HALF + offs, mask=mask, other=0.0)
    c1 = tl.load(cos_ptr + cos_offset + offs, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + cos_offset + HALF + offs, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + cos_offset + offs, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + cos_offset + HALF + offs, mask=mask, other=0.0)
    dtype = x1.dtype
    # (products rounded to the dtype one by one: the reference's kernels each write their result)
    a1 = (x1.to(tl.float32) * c1.to(tl.float32)).to(dtype)
    b1 = (-x2.to(tl.float32) * s1.to(tl.float32)).to(dtype)
    a2 = (x2.to(tl.float32) * c2.to(tl.float32)).to(dtype)
    b2 = (x1.to(tl.float32) * s2.to(tl.float32)).to(dtype)
    element = out_ptr.dtype.element_ty
    tl.store(out_ptr + out_offset + offs, (a1.to(tl.float32) + b1.to(tl.float32)).to(element), mask=mask)
    tl.store(out_ptr + out_offset + HALF + offs, (a2.to(tl.float32) + b2.to(tl.float32)).to(element), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, T, HQ, HALF,
                   q_sb, q_sh, q_st, k_sb, k_sh, k_st, qo_sb, qo_sh, qo_st, ko_sb, ko_sh, ko_st, c_sb, c_st,
                   BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # b * T + t
    head = tl.program_id(1)  # query heads first, then key heads
    b = token // T
    t = token % T
    cos_offset = b * c_sb + t * c_st
    if head < HQ:
        _rotate(q_ptr, q_out_ptr, cos_ptr, sin_ptr, b * q_sb + head * q_sh + t * q_st,
                b * qo_sb + head * qo_sh + t * qo_st, cos_offset, HALF, BLOCK)
    else:
        h = head - HQ
        _rotate(k_ptr, k_out_ptr, cos_ptr, sin_ptr, b * k_sb + h * k_sh + t * k_st,
                b * ko_sb + h * ko_sh + t * ko_st, cos_offset, HALF, BLOCK)


def rotary_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``apply_rotary`` takes these (else the caller runs the reference)."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    batch, _, tokens, dim = q.shape
    return (k.shape[0] == batch and k.shape[2] == tokens and k.shape[3] == dim and dim % 2 == 0
            and cos.shape[1:] == (tokens, dim) and cos.shape[0] in (1, batch)
            and q.dtype in SUPPORTED_DTYPES and q.dtype == k.dtype == cos.dtype == sin.dtype
            and q.stride(3) == 1 and k.stride(3) == 1 and cos.stride() == sin.stride() and cos.stride(2) == 1
            and q.device == k.device == cos.device == sin.device)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    if not rotary_supported(q, k, cos, sin):
        raise ValueError(f"apply_rotary cannot take q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)} {cos.dtype}")
    batch, num_q_heads, tokens, dim = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.numel() == 0:
        return q_out, k_out
    cos_batch_stride = cos.stride(0) if cos.shape[0] == batch else 0
    half = dim // 2
    with device_guard(q):
        _rotary_kernel[(batch * tokens, num_q_heads + k.shape[1])](
            q, k, q_out, k_out, cos, sin, tokens, num_q_heads, half,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
            cos_batch_stride, cos.stride(1), BLOCK=triton.next_power_of_2(half), num_warps=1)
    return q_out, k_out


def apply_rotary_reference(q, k, cos, sin):
    """Llama's ``apply_rotary_pos_emb`` (``unsqueeze_dim=1``), written out."""
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)
