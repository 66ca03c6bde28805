"""store_kv (Triton; the CPU interpreter without a GPU) against the torch write: bit-identical caches."""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (pip install triton)")

from kernel_cases import DEVICE  # noqa: E402

from llm_api.kernels.kv_write import store_kv, store_kv_reference  # noqa: E402

# (id, num_tokens, Hkv, head_dim, block_size, num_blocks, input dtype, cache dtype, slot dtype, skipped rows)
CASES = [
    ("fp32-int64-slots", 17, 2, 64, 16, 4, torch.float32, torch.float32, torch.int64, []),
    ("bf16-int32-slots-padding", 20, 2, 128, 16, 4, torch.bfloat16, torch.bfloat16, torch.int32, [3, 18, 19]),
    ("fp32-into-bf16-cast", 9, 1, 64, 8, 3, torch.float32, torch.bfloat16, torch.int32, [0]),
    ("odd-heads-hd80-bs32", 33, 3, 80, 32, 3, torch.float32, torch.float32, torch.int64, [32]),
    ("all-padding", 4, 2, 64, 16, 2, torch.float32, torch.float32, torch.int32, [0, 1, 2, 3]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case):
    name, num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, cache_dtype, slot_dtype, skipped = case
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    # The model hands K/V as a transposed view of [Hkv, T, D].
    key = torch.randn(num_kv_heads, num_tokens, head_dim, generator=generator).to(dtype).to(DEVICE).transpose(0, 1)
    value = torch.randn(num_kv_heads, num_tokens, head_dim, generator=generator).to(dtype).to(DEVICE).transpose(0, 1)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[skipped] = -1
    slot_mapping = slots.to(slot_dtype).to(DEVICE)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # Start from random (not zero) caches, so an untouched row is told apart from one written with zeros.
    key_cache = torch.randn(shape, generator=generator).to(cache_dtype).to(DEVICE)
    value_cache = torch.randn(shape, generator=generator).to(cache_dtype).to(DEVICE)
    expected_key, expected_value = key_cache.clone(), value_cache.clone()
    store_kv_reference(key, value, expected_key, expected_value, slot_mapping)
    store_kv(key, value, key_cache, value_cache, slot_mapping)
    if dtype == cache_dtype or DEVICE.type == "cuda":
        assert torch.equal(key_cache, expected_key)
        assert torch.equal(value_cache, expected_value)
    else:
        # Triton's CPU interpreter (3.9) casts fp32 -> bf16 by truncation, torch and the GPU round to
        # nearest even: under 1 bf16 ulp (2**-7 relative) apart.
        torch.testing.assert_close(key_cache, expected_key, atol=0, rtol=2 ** -7)
        torch.testing.assert_close(value_cache, expected_value, atol=0, rtol=2 ** -7)


def test_empty_batch_and_bad_inputs():
    cache = torch.zeros(2, 16, 2, 64, device=DEVICE)
    empty = torch.zeros(0, 2, 64, device=DEVICE)
    store_kv(empty, empty, cache, cache.clone(), torch.zeros(0, dtype=torch.int64, device=DEVICE))
    rows = torch.zeros(3, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(rows, rows, cache, cache.clone(), torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="key/value"):
        store_kv(torch.zeros(3, 4, 64, device=DEVICE), rows, cache, cache.clone(),
                 torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="back to back"):
        store_kv(rows, rows, cache[:, :8], cache.clone()[:, :8], torch.zeros(3, dtype=torch.int64, device=DEVICE))
