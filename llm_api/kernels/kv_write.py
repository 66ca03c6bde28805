"""Write a step's new keys and values into the paged cache: ``store_kv`` (Triton) and its reference.

``store_kv(key[T, Hkv, D], value[T, Hkv, D], key_cache, value_cache, slot_mapping[T])`` copies token
``t``'s rows to the flat cache row ``slot_mapping[t]`` (block ``slot // block_size``, offset
``slot % block_size`` of ``[num_blocks, block_size, Hkv, D]``), in place, cast to the cache dtype.
A negative slot skips the token: the padding rows of a CUDA-graph batch write nothing. ``key`` and
``value`` may be strided views (the attention function hands ``key[0].transpose(0, 1)``); the slot
mapping is int32 or int64. No host synchronization (safe inside graph capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_api.kernels.common import SUPPORTED_DTYPES, device_guard


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    # One program per token: its Hkv x D rows are contiguous in the cache, one coalesced write each.
    token = tl.program_id(0)
    # int64: slot * row stride passes 2**31 elements in a large pool.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    # A mask rather than an early return: a skipped slot (< 0) masks every head, so it reads and writes
    # nothing. (Folded into the head bound: Triton 3.9's interpreter rejects a mask ANDed with a scalar.)
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)
    token64 = token.to(tl.int64)
    key = tl.load(key_ptr + token64 * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token64 * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(key_cache_ptr + slot * stride_kc_slot + heads[:, None] * stride_kc_head + dims[None, :],
             key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + slot * stride_vc_slot + heads[:, None] * stride_vc_head + dims[None, :],
             value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def _check(key, value, key_cache, value_cache, slot_mapping):
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"caches must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    row_shape = key_cache.shape[2:]
    if key.dim() != 3 or key.shape[1:] != row_shape or value.shape != key.shape:
        raise ValueError(f"key/value must be [T, {row_shape[0]}, {row_shape[1]}], got {tuple(key.shape)} "
                         f"and {tuple(value.shape)}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{key.shape[0]}], got {tuple(slot_mapping.shape)} "
                         f"{slot_mapping.dtype}")
    if key_cache.dtype not in SUPPORTED_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"caches must share one of {SUPPORTED_DTYPES}, got {key_cache.dtype}/{value_cache.dtype}")
    # The kernel addresses a slot as block * stride(0) + offset * stride(1): that needs
    # stride(0) == block_size * stride(1), true of a contiguous cache.
    for name, tensor in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last (head_dim) dimension")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.stride(0) != cache.shape[1] * cache.stride(1):
            raise ValueError(f"{name} blocks must be laid out back to back (a contiguous cache)")


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into the caches at flat rows ``slot_mapping`` [T] (< 0: skip)."""
    _check(key, value, key_cache, value_cache, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, num_kv_heads, head_dim = key_cache.shape
    with device_guard(key_cache):
        _store_kv_kernel[(num_tokens,)](
            key, value, key_cache, value_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(1), key_cache.stride(2), value_cache.stride(1), value_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        )


def store_kv_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The same write in torch (the engine's ``index_copy_``), skipping slots < 0."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[keep].to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[keep].to(value_cache.dtype))
