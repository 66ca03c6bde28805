"""Paged attention for packed variable-length query chunks (prefill, chunked prefill, mixed steps).

``paged_prefill_attention(query[T, Hq, D], key_cache, value_cache, block_tables[B, M],
query_start_loc[B + 1], context_lens[B], max_query_len, scaling, sliding_window=None, softcap=None,
out=None) -> out[T, Hq, D]``: sequence ``i``'s query tokens are rows ``query_start_loc[i] :
query_start_loc[i + 1]`` and sit at positions ``context_lens[i] - q_len .. context_lens[i] - 1``. Their
keys and values are already in the cache (``store_kv`` runs first), so every key (a cached prefix,
earlier chunks, this chunk) is read through the block table, causally: a query at position ``q`` sees
keys ``q - sliding_window < p <= q``. Scores, softcap, GQA head mapping and dtypes as in
``decode_attention``. Sequences with one query token are fine, so one call can serve a mixed step.
``max_query_len`` (a Python int, >= every q_len) sizes the grid: no host synchronization.

How it runs: grid (cdiv(max_query_len, BLOCK_Q), B, Hkv). A program takes BLOCK_Q query tokens of one
sequence times the GROUP query heads of one KV head as the BLOCK_M = BLOCK_Q * GROUP_PAD rows of its
tile (row r: token r // GROUP_PAD, head r % GROUP_PAD), so K/V tiles are shared by the group's heads
and a single-token (decode) row still fills GROUP rows of the MMA. It walks BLOCK_N-key tiles with
``tl.dot`` and an online softmax, visiting only keys some row can see (up to the tile's last position,
from its first position's window start), so fully masked tiles are never loaded. Programs past their
sequence's query length exit at once.

``paged_prefill_attention_reference`` is the torch oracle (the engine's per-sequence reference, fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llm_api.kernels.reference import reference_paged_attention
from llm_api.kernels.common import (check_index_vector, check_out, check_paged_inputs, device_guard, dot,
                                    dot_options, load_kv_tile, scores_log2)

BLOCK_M = 64  # query rows (tokens x heads of a group) per program
BLOCK_N = 64  # keys per iteration; 32 for head_dim > 128 to keep the tiles in registers


@triton.jit
def _prefill_kernel(
        query_ptr, key_cache_ptr, value_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr,
        context_lens_ptr, scaling, softcap, sliding_window,
        stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        stride_bt, stride_ot, stride_oh,
        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    q_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    query_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - query_start
    if q_tile * BLOCK_Q >= query_len:
        return
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    num_cached = context_len - query_len  # keys before this chunk: the first query's position

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token_in_seq = q_tile * BLOCK_Q + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_mask = (token_in_seq < query_len) & (head_in_group < GROUP)
    positions = num_cached + token_in_seq  # [BLOCK_M]
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = dims < HEAD_DIM
    q_rows = (query_start + token_in_seq).to(tl.int64) * stride_qt + (kv_head * GROUP + head_in_group) * stride_qh
    query = tl.load(query_ptr + q_rows[:, None] + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :],
                    other=0.0).to(key_cache_ptr.dtype.element_ty)

    # Keys this tile can see: up to its last token's position; from its first token's window start.
    first_position = num_cached + q_tile * BLOCK_Q
    key_end = tl.minimum(first_position + BLOCK_Q, context_len)
    key_start = first_position * 0
    if HAS_WINDOW:
        key_start = tl.maximum(first_position - sliding_window + 1, 0)

    # A finite initial max: a row can see no key of a tile (the causal diagonal, the window), and
    # exp2(-inf - -inf) would be NaN; exp2(-inf - -1e30) is 0 and the rescale exp2(0) is 1.
    max_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)
    sum_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile_start in range(key_start, key_end, BLOCK_N):
        key_positions = tile_start + offs_n
        key_mask = key_positions < key_end
        key, value = load_kv_tile(key_cache_ptr, value_cache_ptr, block_table, key_positions, key_mask, kv_head,
                                  dims, dim_mask, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                  BLOCK_SIZE)
        scores = scores_log2(dot(query, tl.trans(key), DOT_PRECISION, DOT_UPCAST), scaling, softcap, HAS_SOFTCAP)
        visible = key_mask[None, :] & (key_positions[None, :] <= positions[:, None])
        if HAS_WINDOW:
            visible = visible & (key_positions[None, :] > positions[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(max_i, tl.max(scores, axis=1))
        alpha = tl.exp2(max_i - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        sum_i = sum_i * alpha + tl.sum(probs, axis=1)
        acc = acc * alpha[:, None] + dot(probs.to(value.dtype), value, DOT_PRECISION, DOT_UPCAST)
        max_i = new_max

    out = acc / tl.where(sum_i > 0, sum_i, 1.0)[:, None]
    o_rows = (query_start + token_in_seq).to(tl.int64) * stride_ot + (kv_head * GROUP + head_in_group) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                            max_query_len: int, scaling: float, sliding_window: int | None = None,
                            softcap: float | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D] packed by ``query_start_loc`` [B + 1] -> out [T, Hq, D]."""
    num_seqs = block_tables.shape[0] if block_tables.dim() == 2 else -1
    shape = check_paged_inputs(query, key_cache, value_cache, block_tables, num_seqs)
    check_index_vector("query_start_loc", query_start_loc, num_seqs + 1)
    check_index_vector("context_lens", context_lens, num_seqs)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    out = check_out(out, query)
    if num_seqs == 0 or max_query_len <= 0 or query.shape[0] == 0:
        return out
    group_pad = triton.next_power_of_2(shape.group)
    block_q = max(1, BLOCK_M // group_pad)
    block_n = BLOCK_N if shape.head_dim_pad <= 128 else BLOCK_N // 2
    precision, upcast = dot_options(key_cache.dtype)
    with device_guard(query):
        _prefill_kernel[(triton.cdiv(max_query_len, block_q), num_seqs, shape.num_kv_heads)](
            query, key_cache, value_cache, out, block_tables, query_start_loc, context_lens,
            float(scaling), float(softcap or 1.0), sliding_window or 0,
            query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            BLOCK_SIZE=shape.block_size, GROUP=shape.group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
            HEAD_DIM=shape.head_dim, HEAD_DIM_PAD=shape.head_dim_pad, BLOCK_N=block_n,
            HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None,
            DOT_PRECISION=precision, DOT_UPCAST=upcast,
        )
    return out


def paged_prefill_attention_reference(query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                                      scaling, sliding_window=None, softcap=None) -> torch.Tensor:
    """The oracle: ``reference_paged_attention`` (one sequence at a time) on fp32 copies, cast back, so it
    is exact up to the output rounding. Sequences with no query token are skipped and an empty context
    gives zeros. Reads the lengths on the host: tests only."""
    starts = [int(x) for x in query_start_loc.tolist()]
    lens = [int(x) for x in context_lens.tolist()]
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    key32, value32 = key_cache.float(), value_cache.float()
    live = [i for i, n in enumerate(lens) if n > 0 and starts[i + 1] > starts[i]]
    for i in live:
        rows = slice(starts[i], starts[i + 1])
        out[rows] = reference_paged_attention(query[rows].float(), key32, value32, block_tables[i:i + 1].long(),
                                              [0, starts[i + 1] - starts[i]], [lens[i]], scaling,
                                              sliding_window, softcap)
    return out.to(query.dtype)
