"""paged_prefill_attention (Triton; the CPU interpreter without a GPU) against the per-sequence reference.

Every case packs several sequences; query tokens are the last q_len positions of each context, whose
keys (cached prefix + this chunk) are all in the cache already."""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from kernel_cases import DEVICE, DTYPES, assert_close, paged_cache, random_query  # noqa: E402

from llm_api.kernels.prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_reference,
)

# (id, context_lens, query_lens, Hq, Hkv, head_dim, block_size, sliding_window, softcap)
CASES = [
    ("mha-full-prompts", [33, 1, 16, 17], [33, 1, 16, 17], 4, 4, 64, 16, None, None),
    ("mha-two-query-tiles", [130], [100], 2, 2, 64, 16, None, None),
    ("gqa2-cached-prefix-bs8", [40, 17, 15], [9, 17, 1], 4, 2, 128, 8, None, None),
    ("qwen-gqa7-mixed-decode-rows", [17, 1, 15, 50, 16, 0], [1, 1, 15, 17, 1, 0], 14, 2, 64, 16, None, None),
    ("mqa-many-query-tiles", [80, 33], [70, 33], 8, 1, 64, 16, None, None),
    ("hd80-window-prefix", [40, 70, 5], [9, 70, 1], 4, 2, 80, 16, 7, None),
    ("window-gqa4-bs32", [100, 31], [64, 31], 8, 2, 64, 32, 24, None),
    ("softcap-prefix", [48, 20], [17, 1], 4, 2, 64, 16, None, 2.0),
    ("softcap-window-hd96", [45], [30], 2, 1, 96, 8, 16, 2.0),
    ("tiny-hd8-bs4", [9, 4, 23], [9, 1, 5], 4, 2, 8, 4, None, None),  # the engine tests' tiny models
    ("bs12-hd32-window-softcap", [30, 13], [11, 13], 6, 3, 32, 12, 5, 3.0),
]


def _inputs(case, dtype, index_dtype=torch.int32):
    name, context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, window, softcap = case
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{dtype}".encode()))
    cache = paged_cache(generator, context_lens, num_kv_heads, head_dim, block_size, dtype, index_dtype)
    query = random_query(generator, sum(query_lens), num_heads, head_dim, dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=index_dtype,
                                   device=DEVICE)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, query_start_loc, cache.context_lens)
    return args, max(query_lens), head_dim ** -0.5, window, softcap


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, dtype):
    index_dtype = torch.int64 if CASES.index(case) % 2 else torch.int32
    args, max_query_len, scaling, window, softcap = _inputs(case, dtype, index_dtype)
    out = paged_prefill_attention(*args, max_query_len, scaling, sliding_window=window, softcap=softcap)
    expected = paged_prefill_attention_reference(*args, scaling, sliding_window=window, softcap=softcap)
    assert_close(out, expected, dtype)


def test_single_token_rows_match_decode_kernel():
    """A mixed step can go through either kernel: one-token rows agree with paged_decode_attention."""
    from llm_api.kernels.decode_attention import paged_decode_attention

    args, _, scaling, _, _ = _inputs(("decode-rows", [1, 17, 64, 90], [1, 1, 1, 1], 14, 2, 64, 16, None, None),
                                     torch.float32)
    query, key_cache, value_cache, block_tables, _, context_lens = args
    prefill = paged_prefill_attention(*args, 1, scaling, sliding_window=20)
    decode = paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scaling,
                                    sliding_window=20)
    torch.testing.assert_close(prefill, decode, atol=2e-5, rtol=2e-5)


def test_out_buffer_and_causality_is_checked():
    """Writes into ``out``; and the comparison can fail: a query that saw its future keys (a context
    one longer than its chunk ends) no longer matches."""
    args, max_query_len, scaling, _, _ = _inputs(CASES[2], torch.float32)
    out = torch.full(args[0].shape, float("nan"), device=DEVICE)
    assert paged_prefill_attention(*args, max_query_len, scaling, out=out) is out
    expected = paged_prefill_attention_reference(*args, scaling)
    assert_close(out, expected, torch.float32)
    query, key_cache, value_cache, block_tables, query_start_loc, context_lens = args
    shifted = context_lens.clone()
    shifted[0] -= 1  # sequence 0's 9 queries now sit one position earlier: each loses its last key
    out = paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc, shifted,
                                  max_query_len, scaling)
    assert not torch.allclose(out[:9], expected[:9], atol=1e-3)
    torch.testing.assert_close(out[9:], expected[9:], atol=2e-5, rtol=2e-5)


def test_bad_metadata_raises():
    args, max_query_len, scaling, _, _ = _inputs(CASES[0], torch.float32)
    query, key_cache, value_cache, block_tables, query_start_loc, context_lens = args
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc[:-1], context_lens,
                                max_query_len, scaling)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_prefill_attention(*args, max_query_len, scaling, sliding_window=0)
