"""What the Triton attention kernels share: input checks, launch options and two device helpers.

``check_paged_inputs`` validates the paged cache against the queries (shapes only: it never reads a
tensor's values, so it is safe inside CUDA-graph capture) and returns a ``PagedShape``;
``check_index_vector`` and ``check_out`` do the same for the metadata vectors and the output.
``dot_options`` picks how ``tl.dot`` multiplies for a cache dtype, ``device_guard`` makes the
tensors' GPU the current one for the launch. The ``@triton.jit`` helpers (``load_kv_tile``, ``dot``,
``tanh``, ``scores_log2``) are inlined into the kernels that call them.

Only long-stable Triton APIs are used (the GPU machine runs Triton 3.6, this one 3.9).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llm_api.kernels import interpreter_enabled

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class PagedShape:
    num_kv_heads: int
    head_dim: int
    head_dim_pad: int  # power of two >= head_dim: tl.arange needs one; the extra lanes are masked
    block_size: int
    group: int  # query heads per KV head


def check_paged_inputs(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, num_seqs: int) -> PagedShape:
    """Raise ValueError (naming the problem) unless query [N, Hq, D] fits the cache [blocks, bs, Hkv, D]."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key/value caches must both be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.dtype != value_cache.dtype or key_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"caches must share one of {SUPPORTED_DTYPES}, got {key_cache.dtype}/{value_cache.dtype}")
    if query.dim() != 3 or query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query must be [tokens, num_heads, head_dim] float, got {tuple(query.shape)} {query.dtype}")
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    if query.shape[2] != head_dim:
        raise ValueError(f"query head_dim {query.shape[2]} != cache head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {MAX_HEAD_DIM} is not supported (register tiles)")
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("query and caches need a contiguous last (head_dim) dimension")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 or int64 with contiguous rows, got {block_tables.dtype} "
                         f"strides {block_tables.stride()}")
    return PagedShape(num_kv_heads, head_dim, max(16, triton.next_power_of_2(head_dim)), block_size,
                      num_heads // num_kv_heads)


def check_index_vector(name: str, tensor: torch.Tensor, length: int) -> None:
    """A 1-D int32/int64 tensor of ``length`` with unit stride (the kernels index it as ptr + i)."""
    if (tensor.shape != (length,) or tensor.dtype not in (torch.int32, torch.int64)
            or (length > 1 and tensor.stride(0) != 1)):
        raise ValueError(f"{name} must be a contiguous int32/int64 [{length}], got {tuple(tensor.shape)} "
                         f"{tensor.dtype}")


def check_out(out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device or out.stride(2) != 1:
        raise ValueError(f"out must be like query {tuple(query.shape)} {query.dtype} with a contiguous last "
                         f"dimension, got {tuple(out.shape)} {out.dtype}")
    return out


def dot_options(dtype: torch.dtype) -> tuple[str, bool]:
    """(input_precision, upcast) for ``dot`` on operands of ``dtype``.

    fp32 caches ask for "ieee": the default tf32 would cost ~1e-3 relative error, more than the fp32
    tests (and users who chose fp32) accept. ``upcast`` is a workaround for Triton's CPU interpreter,
    whose tl.dot multiplies bf16 operands as their raw uint16 storage (3.9: ``create_dot`` calls
    np.matmul on the bits); compiled kernels never upcast."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return precision, interpreter_enabled() and dtype == torch.bfloat16


def device_guard(tensor: torch.Tensor):
    """Triton launches on the *current* CUDA device; a model split across GPUs keeps each layer's cache
    on its own device, so make that one current for the launch."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with an fp32 accumulator (see ``dot_options``)."""
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        result = tl.dot(a, b, input_precision=PRECISION)
    return result


@triton.jit
def load_kv_tile(key_cache_ptr, value_cache_ptr, block_table, positions, position_mask, kv_head, dims, dim_mask,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, BLOCK_SIZE: tl.constexpr):
    """K and V [len(positions), D] of one KV head at token ``positions`` of a sequence, read in place through
    its ``block_table`` row: a page id per token (the few distinct ones hit L1), so a tile may start
    mid-page and partitions and windows may start anywhere. Masked lanes load zeros."""
    block_ids = tl.load(block_table + positions // BLOCK_SIZE, mask=position_mask, other=0).to(tl.int64)
    offsets = (positions % BLOCK_SIZE).to(tl.int64)
    load_mask = position_mask[:, None] & dim_mask[None, :]
    key = tl.load(key_cache_ptr + (block_ids * stride_kb + offsets * stride_kt + kv_head * stride_kh)[:, None]
                  + dims[None, :], mask=load_mask, other=0.0)
    value = tl.load(value_cache_ptr + (block_ids * stride_vb + offsets * stride_vt + kv_head * stride_vh)[:, None]
                    + dims[None, :], mask=load_mask, other=0.0)
    return key, value


@triton.jit
def tanh(x):
    # tl has no portable tanh (tl.math/libdevice spellings differ across versions and backends);
    # this form uses exp2 of a non-positive number only, so it never overflows.
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def scores_log2(s, scaling, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k -> the softmax logits in base 2 (scaled, optionally Gemma-2 soft-capped). Base 2 because
    exp2 is the hardware instruction: exp(x) == exp2(x * log2(e)), 1.4426950408889634 below."""
    if HAS_SOFTCAP:
        s = tanh(s * (scaling / softcap)) * (softcap * 1.4426950408889634)
    else:
        s = s * (scaling * 1.4426950408889634)
    return s
