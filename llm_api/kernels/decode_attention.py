"""Paged attention for one query token per sequence (decode), split over the context (flash-decoding).

``paged_decode_attention(query[B, Hq, D], key_cache, value_cache, block_tables[B, M], context_lens[B],
scaling, sliding_window=None, softcap=None, out=None, num_partitions=None) -> out[B, Hq, D]``:
sequence ``b``'s query sits at position ``q = context_lens[b] - 1`` and attends to its keys at
positions ``p`` with ``q - sliding_window < p <= q``, read in place through its block table (only its
real length). Query head ``h`` uses KV head ``h // (Hq // Hkv)`` (transformers' repeat_kv order).
Scores are ``q.k * scaling`` (soft-capped ``tanh(s / softcap) * softcap`` if given), softmax in fp32,
output in the query dtype. A row with ``context_lens == 0`` (CUDA-graph padding) gets zeros.

No host synchronization: the grid and every constexpr come from shapes and Python arguments, so the
call can be captured in a CUDA graph (compile it once before capturing).

How it runs:
- grid (B, Hkv, P): one program per (sequence, KV head, partition). It holds the query heads of its
  KV head as rows of one tile, so each K/V tile is read once per KV head, not once per query head.
- P (the number of partitions) comes from the shapes (or ``num_partitions``): enough programs to fill a
  GPU at batch 1, but at most one per ``PARTITION_MIN_TOKENS`` of the longest context the block table
  allows (M * block_size). The partition *length* is derived in the kernel from each sequence's real
  key range (whole ``BLOCK_N`` tiles), so a short context still spreads over up to P partitions;
  partitions past its end exit at once.
- each iteration gathers ``BLOCK_N`` tokens (several pages) of K and V: more bytes in flight per
  program, which is what a memory-bound kernel needs.
- a second small kernel merges the partitions' (max, sum, unnormalized output); with P == 1 the first
  kernel writes the output itself.

``paged_decode_attention_reference`` is the torch oracle (the engine's per-sequence reference, in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_api.kernels.common import (check_index_vector, check_out, check_paged_inputs, device_guard, dot,
                                    dot_options, load_kv_tile, scores_log2)

BLOCK_N = 64  # tokens per iteration: 4 pages of 16; a 16 KiB K tile at D=128 in bf16
# Launch-shape knobs (tune on the GPU): ~3-4 resident programs (~156 registers at 4 warps, compiled for
# sm_90) on each of an H100's 132 SMs.
TARGET_PROGRAMS = 512
PARTITION_MIN_TOKENS = 128  # shorter partitions cost more in partial outputs than they win in parallelism
MAX_PARTITIONS = 64
REDUCE_CHUNK = 16  # partitions merged per step of the reduce loop (bounds its registers)
# GQA: tl.dot needs >= 16 rows, so a group of G query heads is padded to 16 (or the next power of two).
# The padding rows load nothing (masked) and the MMA they waste is free next to the memory traffic.
# With G == 1 (MHA) a broadcast multiply + sum on CUDA cores is used instead: it keeps one [BLOCK_N, D]
# tile in registers and skips 15 empty MMA rows (larger groups would need [G, BLOCK_N, D] registers).
# Compiled for sm_90, the dot path pipelines its K/V loads (cp.async), the broadcast path does not:
# measure both for MHA on the GPU (DOT_MIN_GROUP = 1 sends MHA through tl.dot too).
MIN_DOT_ROWS = 16
DOT_MIN_GROUP = 2


def choose_num_partitions(num_seqs: int, num_kv_heads: int, max_context_len: int) -> int:
    """P from shapes only (so a captured graph stays valid for any lengths)."""
    wanted = triton.cdiv(TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads))
    useful = triton.cdiv(max_context_len, PARTITION_MIN_TOKENS)
    return max(1, min(wanted, useful, MAX_PARTITIONS))


@triton.jit
def _partition_bounds(context_len, sliding_window, HAS_WINDOW: tl.constexpr,
                      NUM_PARTITIONS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first key, partition length, partitions in use) of a sequence; both kernels must agree."""
    first_key = context_len * 0
    if HAS_WINDOW:
        first_key = tl.maximum(context_len - sliding_window, 0)
    num_keys = context_len - first_key
    tiles_per_partition = tl.maximum(tl.cdiv(tl.cdiv(num_keys, BLOCK_N), NUM_PARTITIONS), 1)
    partition_len = tiles_per_partition * BLOCK_N
    return first_key, partition_len, tl.cdiv(num_keys, partition_len)


@triton.jit
def _decode_partition_kernel(
        query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, part_max_ptr, part_sum_ptr, part_out_ptr,
        scaling, softcap, sliding_window, num_heads,
        stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_bt, stride_ob, stride_oh,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_PARTITIONS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    first_key, partition_len, num_used = _partition_bounds(context_len, sliding_window, HAS_WINDOW,
                                                           NUM_PARTITIONS, BLOCK_N)
    if NUM_PARTITIONS > 1:
        # Nothing to do, and the reduce reads only the first num_used partitions. (With one partition
        # the program must run anyway: it writes the output, zeros for an empty context.)
        if partition >= num_used:
            return
    start = first_key + partition * partition_len
    end = tl.minimum(start + partition_len, context_len)

    heads = tl.arange(0, GROUP_PAD)
    head_mask = heads < GROUP
    q_heads = kv_head * GROUP + heads
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    query = tl.load(query_ptr + seq.to(tl.int64) * stride_qb + q_heads[:, None] * stride_qh + dims[None, :],
                    mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    query = query.to(key_cache_ptr.dtype.element_ty)

    # Every tile visited holds >= 1 valid key (the loop stays inside [start, end)), so the running max
    # is finite after the first tile and -inf needs no NaN guard here.
    max_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    sum_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + offs_n
        token_mask = tokens < end
        key, value = load_kv_tile(key_cache_ptr, value_cache_ptr, block_table, tokens, token_mask, kv_head, dims,
                                  dim_mask, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                  BLOCK_SIZE)  # [BLOCK_N, D] each
        if USE_DOT:
            scores = dot(query, tl.trans(key), DOT_PRECISION, DOT_UPCAST)  # [GROUP_PAD, BLOCK_N]
        else:
            scores = tl.sum(query.to(tl.float32)[:, None, :] * key.to(tl.float32)[None, :, :], axis=2)
        scores = scores_log2(scores, scaling, softcap, HAS_SOFTCAP)
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(max_i, tl.max(scores, axis=1))
        alpha = tl.exp2(max_i - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        sum_i = sum_i * alpha + tl.sum(probs, axis=1)
        if USE_DOT:
            pv = dot(probs.to(value.dtype), value, DOT_PRECISION, DOT_UPCAST)
        else:
            pv = tl.sum(probs[:, :, None] * value.to(tl.float32)[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        max_i = new_max

    out_mask = head_mask[:, None] & dim_mask[None, :]
    if NUM_PARTITIONS == 1:
        out = acc / tl.where(sum_i > 0, sum_i, 1.0)[:, None]  # empty context: 0 / 1, not NaN
        tl.store(out_ptr + seq.to(tl.int64) * stride_ob + q_heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials are [B, Hq, P] (max, sum) and [B, Hq, P, D] (unnormalized output), fp32, contiguous.
        row = (seq * num_heads + q_heads) * NUM_PARTITIONS + partition
        tl.store(part_max_ptr + row, max_i, mask=head_mask)
        tl.store(part_sum_ptr + row, sum_i, mask=head_mask)
        tl.store(part_out_ptr + row[:, None].to(tl.int64) * HEAD_DIM + dims[None, :], acc, mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
        context_lens_ptr, part_max_ptr, part_sum_ptr, part_out_ptr, out_ptr, sliding_window,
        stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_PARTITIONS: tl.constexpr, HAS_WINDOW: tl.constexpr, CHUNK: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    _, _, num_used = _partition_bounds(context_len, sliding_window, HAS_WINDOW, NUM_PARTITIONS, BLOCK_N)
    base = (seq * num_heads + head) * NUM_PARTITIONS
    parts = tl.arange(0, CHUNK)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM

    # Two passes over the (few) partition maxima: the global max first, then the weighted sums, so each
    # partition is rescaled once. Only the num_used partitions written by the first kernel are read.
    running_max = tl.full([CHUNK], float("-inf"), tl.float32)
    for chunk in range(0, num_used, CHUNK):
        mask = chunk + parts < num_used
        running_max = tl.maximum(running_max, tl.load(part_max_ptr + base + chunk + parts, mask=mask,
                                                      other=float("-inf")))
    global_max = tl.max(running_max, axis=0)
    total = tl.zeros([CHUNK], tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for chunk in range(0, num_used, CHUNK):
        mask = chunk + parts < num_used
        weight = tl.exp2(tl.load(part_max_ptr + base + chunk + parts, mask=mask, other=float("-inf")) - global_max)
        total += weight * tl.load(part_sum_ptr + base + chunk + parts, mask=mask, other=0.0)
        partial = tl.load(part_out_ptr + (base + chunk + parts)[:, None].to(tl.int64) * HEAD_DIM + dims[None, :],
                          mask=mask[:, None] & dim_mask[None, :], other=0.0)
        acc += tl.sum(weight[:, None] * partial, axis=0)
    total_sum = tl.sum(total, axis=0)
    out = acc / tl.where(total_sum > 0, total_sum, 1.0)  # empty context (num_used == 0): zeros
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scaling: float,
                           sliding_window: int | None = None, softcap: float | None = None,
                           out: torch.Tensor | None = None, num_partitions: int | None = None) -> torch.Tensor:
    """query [B, Hq, D] (one token per sequence) -> out [B, Hq, D]. ``num_partitions`` overrides the
    shape-derived split (tests, tuning); it must not depend on tensor values either."""
    num_seqs, num_heads, _ = query.shape
    shape = check_paged_inputs(query, key_cache, value_cache, block_tables, num_seqs)
    check_index_vector("context_lens", context_lens, num_seqs)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if num_partitions is not None and num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    out = check_out(out, query)
    if num_seqs == 0:
        return out
    if num_partitions is None:
        num_partitions = choose_num_partitions(num_seqs, shape.num_kv_heads,
                                               block_tables.shape[1] * shape.block_size)
    use_dot = shape.group >= DOT_MIN_GROUP
    group_pad = max(MIN_DOT_ROWS, triton.next_power_of_2(shape.group)) if use_dot else 1
    precision, upcast = dot_options(key_cache.dtype)
    if num_partitions > 1:
        part_max = torch.empty((num_seqs, num_heads, num_partitions), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_out = torch.empty((num_seqs, num_heads, num_partitions, shape.head_dim), dtype=torch.float32,
                               device=query.device)
    else:
        part_max = part_sum = part_out = out  # unused by the kernel (NUM_PARTITIONS == 1)
    window = sliding_window or 0
    with device_guard(query):
        _decode_partition_kernel[(num_seqs, shape.num_kv_heads, num_partitions)](
            query, key_cache, value_cache, block_tables, context_lens, out, part_max, part_sum, part_out,
            float(scaling), float(softcap or 1.0), window, num_heads,
            query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            BLOCK_SIZE=shape.block_size, GROUP=shape.group, GROUP_PAD=group_pad, HEAD_DIM=shape.head_dim,
            HEAD_DIM_PAD=shape.head_dim_pad, BLOCK_N=BLOCK_N, NUM_PARTITIONS=num_partitions,
            HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
            USE_DOT=use_dot, DOT_PRECISION=precision, DOT_UPCAST=upcast,
        )
        if num_partitions > 1:
            _decode_reduce_kernel[(num_seqs, num_heads)](
                context_lens, part_max, part_sum, part_out, out, window, out.stride(0), out.stride(1),
                HEAD_DIM=shape.head_dim, HEAD_DIM_PAD=shape.head_dim_pad, BLOCK_N=BLOCK_N,
                NUM_PARTITIONS=num_partitions, HAS_WINDOW=sliding_window is not None,
                CHUNK=min(REDUCE_CHUNK, triton.next_power_of_2(num_partitions)),
            )
    return out


def paged_decode_attention_reference(query, key_cache, value_cache, block_tables, context_lens, scaling,
                                     sliding_window=None, softcap=None) -> torch.Tensor:
    """The oracle: ``reference_paged_attention`` per sequence, in fp32 (so it is exact up to the output's
    rounding), zeros for an empty context. Reads ``context_lens`` on the host: tests only."""
    from llm_api.kernels.prefill_attention import paged_prefill_attention_reference

    num_seqs = query.shape[0]
    query_start_loc = torch.arange(num_seqs + 1, device=query.device)
    return paged_prefill_attention_reference(query, key_cache, value_cache, block_tables, query_start_loc,
                                             context_lens, scaling, sliding_window, softcap)
