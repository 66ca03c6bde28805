"""Rotary position embedding of queries and keys in one kernel, with transformers' rounding.

``apply_rotary(q[B, Hq, T, D], k[B, Hkv, T, D], cos[B, T, D], sin[B, T, D]) -> (q_out, k_out)`` computes
what Llama's ``apply_rotary_pos_emb(q, k, cos, sin)`` does (``unsqueeze_dim=1``, the whole head dim
rotated, ``rotate_half`` = ``cat(-x2, x1)``), for the owned decoder's layers
(``llm_api.models.llama``):

    out[:D/2] = q[:D/2] * cos[:D/2] - q[D/2:] * sin[:D/2]
    out[D/2:] = q[D/2:] * cos[D/2:] + q[:D/2] * sin[D/2:]

each product rounded to the tensors' dtype before the sum, as the reference's separate elementwise
kernels do. That reference launches ten kernels per layer (slices, negation, concatenation, four
products, two sums); this launches one for q and k together. q and k may be strided views (the
attention's ``transpose(1, 2)`` of the projections); the outputs keep their memory layout
(``empty_like``), as the reference's elementwise results do.

``rotary_store_kv(q, k, v, cos, sin, key_cache, value_cache, slot_mapping) -> q_out``: the same rotation
for a packed step, with k and v written straight into the paged cache (``kernels.kv_write``'s rows) instead
of returned, one launch where the two kernels take two (``llm_api.models.llama``).
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


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, cos_ptr,
                            sin_ptr, HQ, HKV, HALF, q_st, q_sh, k_st, k_sh, v_st, v_sh, qo_st, qo_sh, c_st,
                            kc_slot, kc_head, vc_slot, vc_head, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # query heads, then key heads, then value heads
    cos_offset = token * c_st
    if head < HQ:
        _rotate(q_ptr, q_out_ptr, cos_ptr, sin_ptr, token * q_st + head * q_sh, token * qo_st + head * qo_sh,
                cos_offset, HALF, BLOCK)
    else:
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:  # (< 0: a CUDA-graph padding row, stored nowhere)
            h = head - HQ
            if h < HKV:
                _rotate(k_ptr, key_cache_ptr, cos_ptr, sin_ptr, token * k_st + h * k_sh,
                        slot * kc_slot + h * kc_head, cos_offset, HALF, BLOCK)
            else:
                h = h - HKV
                offs = tl.arange(0, BLOCK)
                mask = offs < HALF
                source = v_ptr + token * v_st + h * v_sh
                target = value_cache_ptr + slot * vc_slot + h * vc_head
                element = value_cache_ptr.dtype.element_ty
                tl.store(target + offs, tl.load(source + offs, mask=mask).to(element), mask=mask)
                tl.store(target + HALF + offs, tl.load(source + HALF + offs, mask=mask).to(element), mask=mask)


def rotary_store_kv_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                              sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether ``rotary_store_kv`` takes these (else the caller rotates and stores apart)."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or cos.dim() != 3 or cos.shape != sin.shape:
        return False
    tokens, _, dim = q.shape
    return (k.shape[0] == tokens and k.shape[2] == dim and dim % 2 == 0 and cos.shape == (1, tokens, dim)
            and key_cache.dim() == 4 and key_cache.shape == value_cache.shape and key_cache.shape[2:] == k.shape[1:]
            and q.dtype in SUPPORTED_DTYPES
            and q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype == key_cache.dtype == value_cache.dtype
            and q.stride(2) == k.stride(2) == v.stride(2) == 1 and cos.stride() == sin.stride()
            and cos.stride(2) == 1 and key_cache.stride(3) == value_cache.stride(3) == 1
            and key_cache.stride(0) == key_cache.shape[1] * key_cache.stride(1)
            and value_cache.stride(0) == value_cache.shape[1] * value_cache.stride(1)
            and q.device == k.device == v.device == cos.device == key_cache.device == value_cache.device)


def rotary_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The packed step's rotary embedding and KV write in one kernel: q, k, v [T, H, D] (strided views of one
    q/k/v product are fine), cos/sin [1, T, D]. Rotates k and writes it and v into the caches at the flat
    rows ``slot_mapping`` [T] (< 0: skip), with the rounding of ``apply_rotary`` then ``store_kv``, and
    returns the rotated q [T, Hq, D] (contiguous). Replaces two launches a layer by one
    (``llm_api.models.llama``)."""
    if not rotary_store_kv_supported(q, k, v, cos, sin, key_cache, value_cache):
        raise ValueError(f"rotary_store_kv cannot take q {tuple(q.shape)} {q.dtype}, k {tuple(k.shape)}, "
                         f"cos {tuple(cos.shape)} {cos.dtype}, cache {tuple(key_cache.shape)} {key_cache.dtype}")
    if slot_mapping.shape != (q.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{q.shape[0]}], got {tuple(slot_mapping.shape)}")
    tokens, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty((tokens, num_q_heads, dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    half = dim // 2
    # A flat slot (block * block_size + offset) addresses as slot * stride(1): blocks lie back to back (checked).
    with device_guard(q):
        _rotary_store_kv_kernel[(tokens, num_q_heads + 2 * num_kv_heads)](
            q, k, v, q_out, key_cache, value_cache, slot_mapping, cos, sin, num_q_heads, num_kv_heads, half,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            q_out.stride(0), q_out.stride(1), cos.stride(1),
            key_cache.stride(1), key_cache.stride(2), value_cache.stride(1), value_cache.stride(2),
            BLOCK=triton.next_power_of_2(half), num_warps=1)
    return q_out
