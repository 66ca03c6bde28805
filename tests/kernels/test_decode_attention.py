"""paged_decode_attention (Triton; the CPU interpreter without a GPU) against the per-sequence reference."""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from kernel_cases import DEVICE, DTYPES, assert_close, paged_cache, random_query  # noqa: E402

from llm_api.kernels.decode_attention import (  # noqa: E402
    choose_num_partitions,
    paged_decode_attention,
    paged_decode_attention_reference,
)

# (id, context_lens, Hq, Hkv, head_dim, block_size, sliding_window, softcap, num_partitions or None = derived)
CASES = [
    ("mha-odd-lengths", [1, 15, 16, 17, 33], 4, 4, 64, 16, None, None, None),
    ("gqa2-bs8-two-partitions", [1, 8, 9, 200], 4, 2, 128, 8, None, None, None),
    ("gqa4-five-partitions", [33, 300, 64], 8, 2, 64, 16, None, None, 5),
    ("mqa-hq8", [17, 64, 65], 8, 1, 128, 16, None, None, None),
    ("qwen-gqa7-hd80-bs32", [1, 16, 130], 14, 2, 80, 32, None, None, 3),
    ("window-split", [5, 16, 40, 150], 4, 2, 64, 16, 24, None, 4),
    ("window-one-partition", [5, 16, 40, 150], 4, 4, 64, 16, 24, None, 1),
    ("softcap-mqa", [3, 47, 100], 4, 1, 64, 16, None, 2.0, 2),
    ("softcap-window-mha", [3, 47, 100], 2, 2, 96, 8, 33, 2.0, None),
    ("padding-rows-split", [0, 20, 0, 129], 4, 2, 64, 16, None, None, 3),
    ("padding-rows-one-partition", [0, 20, 0], 4, 4, 64, 16, None, None, 1),
    ("tiny-hd8-bs4", [1, 4, 5, 23], 4, 2, 8, 4, None, None, None),  # the engine tests' tiny models
    ("bs12-hd32-window", [1, 12, 13, 100], 6, 3, 32, 12, 30, None, 3),
]


def _run_case(case, dtype, index_dtype=torch.int32):
    name, context_lens, num_heads, num_kv_heads, head_dim, block_size, window, softcap, num_partitions = case
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{dtype}".encode()))
    cache = paged_cache(generator, context_lens, num_kv_heads, head_dim, block_size, dtype, index_dtype)
    query = random_query(generator, len(context_lens), num_heads, head_dim, dtype)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.context_lens, head_dim ** -0.5)
    out = paged_decode_attention(*args, sliding_window=window, softcap=softcap, num_partitions=num_partitions)
    expected = paged_decode_attention_reference(*args, sliding_window=window, softcap=softcap)
    return out, expected, cache, args


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case, dtype):
    # Alternate the index dtype so both int32 and int64 block tables / lengths are covered.
    index_dtype = torch.int64 if CASES.index(case) % 2 else torch.int32
    out, expected, cache, _ = _run_case(case, dtype, index_dtype)
    assert_close(out, expected, dtype)
    padding = cache.context_lens == 0
    assert (out[padding] == 0).all(), "an empty context (graph padding row) must give zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mha_through_the_dot_path(monkeypatch, dtype):
    """DOT_MIN_GROUP is a tuning knob: MHA through tl.dot (one real row of 16) must agree as well."""
    from llm_api.kernels import decode_attention

    monkeypatch.setattr(decode_attention, "DOT_MIN_GROUP", 1)
    out, expected, _, _ = _run_case(CASES[0], dtype)
    assert_close(out, expected, dtype)


def test_writes_into_out_and_checks_it():
    generator = torch.Generator().manual_seed(1)
    cache = paged_cache(generator, [7, 40], 2, 64, 16, torch.float32)
    query = random_query(generator, 2, 4, 64, torch.float32)
    out = torch.full((2, 4, 64), float("nan"), device=DEVICE)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.context_lens, 0.125)
    assert paged_decode_attention(*args, out=out) is out
    assert_close(out, paged_decode_attention_reference(*args), torch.float32)
    with pytest.raises(ValueError, match="out must be like query"):
        paged_decode_attention(*args, out=out.to(torch.bfloat16))


def test_corrupted_block_table_is_caught():
    """The comparison can fail: pointing a sequence's page at another sequence's block changes the
    kernel's answer. (Swapping two of its own pages would not: without positions in K, attention is
    blind to key order.)"""
    case = CASES[1]
    _, expected, cache, args = _run_case(case, torch.float32)
    corrupted = cache.block_tables.clone()
    corrupted[3, 0] = corrupted[2, 0]
    out = paged_decode_attention(args[0], args[1], args[2], corrupted, *args[4:])
    assert not torch.allclose(out[3], expected[3], atol=1e-3)
    torch.testing.assert_close(out[:3], expected[:3], atol=2e-5, rtol=2e-5)  # other sequences untouched


def test_unsupported_inputs_raise():
    generator = torch.Generator().manual_seed(2)
    cache = paged_cache(generator, [4], 3, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(random_query(generator, 1, 4, 64, torch.float32), cache.key_cache,
                               cache.value_cache, cache.block_tables, cache.context_lens, 0.125)
    wide = torch.zeros(2, 16, 1, 512, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 512"):
        paged_decode_attention(torch.zeros(1, 1, 512, device=DEVICE), wide, wide, cache.block_tables,
                               cache.context_lens, 0.125)
    with pytest.raises(ValueError, match="block_tables"):
        paged_decode_attention(random_query(generator, 1, 3, 64, torch.float32), cache.key_cache,
                               cache.value_cache, cache.block_tables.float(), cache.context_lens, 0.125)


def test_partitions_come_from_shapes():
    # Batch 1 is split to fill the GPU, a large batch is not, and no partition is shorter than the
    # minimum at the longest context the block table allows.
    assert choose_num_partitions(1, 8, 32 * 1024) > 8
    assert choose_num_partitions(256, 8, 32 * 1024) == 1
    assert choose_num_partitions(1, 8, 16) == 1
    assert choose_num_partitions(1, 1, 256) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_with_new_lengths():
    """Captured once, replayed after the lengths and block tables change on the device: no host sync
    and no value baked into the launch."""
    generator = torch.Generator().manual_seed(3)
    cache = paged_cache(generator, [200, 17, 0, 90], 2, 128, 16, torch.bfloat16, extra_blocks=8)
    query = random_query(generator, 4, 8, 128, torch.bfloat16).contiguous()
    out = torch.empty_like(query)
    args = (query, cache.key_cache, cache.value_cache, cache.block_tables, cache.context_lens, 128 ** -0.5)
    paged_decode_attention(*args, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out)
    # Shorter only: positions past the built lengths hold NaN.
    cache.context_lens.copy_(torch.tensor([150, 0, 0, 60], dtype=cache.context_lens.dtype))
    query.copy_(torch.randn(query.shape, generator=generator).to(query.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, paged_decode_attention_reference(*args), torch.bfloat16)
