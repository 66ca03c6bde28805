"""The paged attention functions against dense attention on the same keys and values.

The reference (per-sequence gather + SDPA) is the oracle for faster paths, so it is checked here
against plain dense causal attention computed with no paging at all; the batched decode path and the
full forward function are checked against the reference."""

from __future__ import annotations

import pytest
import torch

from llm_api.engine.attention import TorchBackend, paged_attention_forward
from llm_api.engine.attention.torch_backend import (GatherWorkspace, decode_attention, decode_groups, decode_key_mask,
                                                    group_by_length)
from llm_api.kernels.reference import reference_paged_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 64


def _dense(query, key, value, scaling, sliding_window=None, softcap=None):
    """query [Lq, Hq, D] = the last Lq positions; key/value [Lk, Hkv, D] -> [Lq, Hq, D], all in fp64."""
    q, k, v = (t.double().transpose(0, 1) for t in (query, key, value))
    groups = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    scores = q @ k.transpose(1, 2) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    num_q, num_k = q.shape[1], k.shape[1]
    query_pos = torch.arange(num_k - num_q, num_k)[:, None]
    key_pos = torch.arange(num_k)[None, :]
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).float()


def _paged_batch(generator, context_lens, query_lens):
    """Random K/V for each sequence, scattered into shuffled blocks of a pool."""
    key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    value_cache = torch.zeros_like(key_cache)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    block_rows, keys, values = [], [], []
    for context_len in context_lens:
        row = [free_blocks.pop() for _ in range(-(-context_len // BLOCK_SIZE))]
        key = torch.randn(context_len, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        value = torch.randn(context_len, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        slots = torch.tensor([row[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context_len)])
        key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = key
        value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = value
        block_rows.append(row)
        keys.append(key)
        values.append(value)
    max_blocks = max(len(r) for r in block_rows)
    block_tables = torch.tensor([r + [0] * (max_blocks - len(r)) for r in block_rows])
    query = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, generator=generator)
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    return key_cache, value_cache, block_tables, keys, values, query, query_start_loc


@pytest.mark.parametrize("sliding_window, softcap", [(None, None), (5, None), (None, 3.0), (7, 2.0)])
def test_reference_matches_dense_attention(sliding_window, softcap):
    generator = torch.Generator().manual_seed(0)
    context_lens, query_lens = [1, 9, 17, 30], [1, 9, 3, 1]
    key_cache, value_cache, block_tables, keys, values, query, starts = _paged_batch(generator, context_lens, query_lens)
    scaling = HEAD_DIM ** -0.5
    out = reference_paged_attention(query, key_cache, value_cache, block_tables, starts, context_lens, scaling,
                                    sliding_window, softcap)
    for i in range(len(context_lens)):
        expected = _dense(query[starts[i]:starts[i + 1]], keys[i], values[i], scaling, sliding_window, softcap)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sliding_window, softcap", [(None, None), (6, None), (None, 5.0)])
def test_batched_decode_matches_reference(sliding_window, softcap):
    generator = torch.Generator().manual_seed(1)
    context_lens = [1, 4, 5, 23, 40]
    key_cache, value_cache, block_tables, _, _, query, starts = _paged_batch(generator, context_lens, [1] * 5)
    metadata = TorchBackend().metadata(key_caches=[key_cache], value_caches=[value_cache],
                                       slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=block_tables,
                                       context_lens=torch.tensor(context_lens), query_start_loc=starts,
                                       context_lens_list=context_lens, num_decode_seqs=5)
    tables, key_mask = decode_key_mask(metadata, query.device, sliding_window)
    expected = reference_paged_attention(query, key_cache, value_cache, block_tables, starts, context_lens, 0.3,
                                         sliding_window, softcap)
    workspace = GatherWorkspace()
    for reused in (None, workspace, workspace):  # fresh tensors, then a workspace reused across calls
        out = decode_attention(query, key_cache, value_cache, tables, key_mask, 0.3, softcap, reused)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # A smaller batch later reuses the (larger) buffers.
    out = decode_attention(query[:2], key_cache, value_cache, tables[:2, :2], key_mask[:2, ..., :8], 0.3, softcap,
                           workspace)
    torch.testing.assert_close(out, expected[:2], atol=1e-5, rtol=1e-5)


def test_group_by_length_bounds_each_rows_padding():
    num_blocks = [1, 8, 2, 3, 16, 9, 4, 1]
    groups = group_by_length(num_blocks, 2.0)
    assert sorted(i for g in groups for i in g) == list(range(len(num_blocks)))  # every row once
    for group in groups:
        longest = num_blocks[group[0]]
        assert all(num_blocks[i] <= longest and longest < 2.0 * num_blocks[i] for i in group)
    assert groups == [[4, 5], [1], [6, 3], [2], [0, 7]]
    assert group_by_length(num_blocks, float("inf")) == [[4, 5, 1, 6, 3, 2, 0, 7]]


@pytest.mark.parametrize("sliding_window, softcap", [(None, None), (6, None), (None, 5.0)])
def test_decode_in_length_groups_matches_reference(sliding_window, softcap):
    """Rows of very different lengths, out of length order: grouped, they still land in their own rows."""
    generator = torch.Generator().manual_seed(3)
    context_lens = [40, 2, 23, 5, 1, 37, 9]
    key_cache, value_cache, block_tables, _, _, query, starts = _paged_batch(generator, context_lens, [1] * 7)
    expected = reference_paged_attention(query, key_cache, value_cache, block_tables, starts, context_lens, 0.3,
                                         sliding_window, softcap)
    for pad_ratio in (float("inf"), 2.0, 1.01):
        backend = TorchBackend(pad_ratio=pad_ratio)
        metadata = backend.metadata(key_caches=[key_cache], value_caches=[value_cache],
                                    slot_mapping=torch.zeros(0, dtype=torch.long), block_tables=block_tables,
                                    context_lens=torch.tensor(context_lens), query_start_loc=starts,
                                    context_lens_list=context_lens, num_decode_seqs=7)
        num_groups = len(decode_groups(metadata, query.device, sliding_window, pad_ratio))
        assert num_groups == {float("inf"): 1, 2.0: 3, 1.01: 5}[pad_ratio]
        out = backend._decode(metadata, query, key_cache, value_cache, 0.3, sliding_window, softcap)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_forward_writes_new_kv_and_mixes_decode_and_prefill():
    """paged_attention_forward on a packed step: 2 decode tokens then a 5-token prefill chunk."""
    generator = torch.Generator().manual_seed(2)
    context_lens, query_lens = [7, 13, 12], [1, 1, 5]
    key_cache, value_cache, block_tables, keys, values, query, starts = _paged_batch(generator, context_lens, query_lens)
    # The step's own K/V: the last query_len positions of each sequence, written by the function.
    new_keys = torch.cat([k[-n:] for k, n in zip(keys, query_lens)])  # [T, Hkv, D]
    new_values = torch.cat([v[-n:] for v, n in zip(values, query_lens)])
    slots = []
    for row, context_len, n in zip(block_tables.tolist(), context_lens, query_lens):
        slots += [row[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context_len - n, context_len)]
    slot_mapping = torch.tensor(slots)
    key_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot_mapping] = 0.0  # forget them: the forward must store them
    value_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot_mapping] = 0.0
    metadata = TorchBackend().metadata(key_caches=[key_cache], value_caches=[value_cache], slot_mapping=slot_mapping,
                                       block_tables=block_tables, context_lens=torch.tensor(context_lens),
                                       query_start_loc=starts, context_lens_list=context_lens, num_decode_seqs=2)

    class Layer(torch.nn.Module):
        layer_idx = 0

    out, weights = paged_attention_forward(
        Layer(), query.transpose(0, 1)[None], new_keys.transpose(0, 1)[None], new_values.transpose(0, 1)[None],
        None, scaling=0.25, paged_attention_metadata=metadata,
    )
    assert weights is None and out.shape == (1, sum(query_lens), NUM_HEADS, HEAD_DIM)
    for i in range(3):
        expected = _dense(query[starts[i]:starts[i + 1]], keys[i], values[i], 0.25)
        torch.testing.assert_close(out[0, starts[i]:starts[i + 1]], expected, atol=1e-5, rtol=1e-5)
