"""Torch references for paged attention: the per-sequence oracle the kernels and the engine are tested against.

``attend_one_sequence`` attends one sequence's query tokens to its context read through its block list
(causal, offset by the tokens cached before them, optionally within a sliding window, with ``scaling`` and
an optional logit softcap); ``reference_paged_attention`` does it for every sequence of a packed batch.
Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer; query head ``h`` uses KV
head ``h // (Hq // Hkv)`` (transformers' ``repeat_kv`` order). Plain torch, no Triton: importing this
module never imports Triton, and the engine's torch attention backend runs prefill chunks with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(query, key, value, mask, scaling, softcap):
    """query [N, Hq, Lq, D], key/value [N, Hkv, Lk, D], mask [N or 1, 1, Lq, Lk] bool -> [N, Hq, Lq, D]."""
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=num_heads != num_kv_heads
        )
    # SDPA has no softcap: the plain math path (Gemma-2 style tanh capping of the scores).
    if num_heads != num_kv_heads:
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)


def causal_mask(num_query: int, context_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """[1, 1, Lq, Lk] bool. The query tokens are the last ``num_query`` of the context: query j sits at
    position context_len - num_query + j and sees keys at positions <= its own (and within the window)."""
    query_pos = torch.arange(context_len - num_query, context_len, device=device)[:, None]
    key_pos = torch.arange(context_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask[None, None]


def attend_one_sequence(query, key_cache, value_cache, block_ids, context_len, scaling, sliding_window, softcap):
    """query [Lq, Hq, D] of one sequence; block_ids [n] of its blocks -> out [Lq, Hq, D]."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key = key_cache[block_ids].view(-1, num_kv_heads, head_dim)[:context_len]  # [Lk, Hkv, D]
    value = value_cache[block_ids].view(-1, num_kv_heads, head_dim)[:context_len]
    mask = causal_mask(query.shape[0], context_len, sliding_window, query.device)
    out = attend(query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
                 mask, scaling, softcap)
    return out[0].transpose(0, 1)


def reference_paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                              scaling, sliding_window=None, softcap=None):
    """The oracle: every sequence on its own. query [T, Hq, D] -> out [T, Hq, D]."""
    out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    for i, context_len in enumerate(context_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        block_ids = block_tables[i, : -(-context_len // block_size)]
        out[start:end] = attend_one_sequence(query[start:end], key_cache, value_cache, block_ids, context_len,
                                             scaling, sliding_window, softcap)
    return out
