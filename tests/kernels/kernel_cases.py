"""Builders for the kernel tests: random paged caches whose every unused row is NaN.

The poison is the point: a kernel that reads a key or value outside a sequence's real length (the tail
of its last page, a block-table padding entry, another sequence's block) turns its output into NaN
instead of passing by luck. The reference slices exactly the real keys, so it never sees the NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Kernel vs reference (the reference runs in fp32 on the same inputs, then casts to the output dtype).
# fp32: only summation order and exp2 differ; observed <= 1e-6, kept 20x above that for the GPU's
# approximate exp2 and another reduction order.
FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}
# bf16: both outputs are rounded to bf16 (the CPU interpreter truncates: up to 1 ulp, 2**-7 relative)
# and the kernel also rounds the probabilities to bf16 before P @ V (as flash attention does);
# observed <= 1 ulp (2**-8 absolute at |out| ~ 1-2), allowed ~2.5 ulps.
BF16_TOL = {"atol": 1e-2, "rtol": 2e-2}
# fp16: the same reasoning with 10 mantissa bits; observed <= 1 ulp (2**-10 at |out| ~ 1-2).
FP16_TOL = {"atol": 2e-3, "rtol": 4e-3}
TOLERANCES = {torch.float32: FP32_TOL, torch.bfloat16: BF16_TOL, torch.float16: FP16_TOL}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclass
class PagedCache:
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], NaN outside the sequences' tokens
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, M], shuffled blocks, padded with a NaN-only block
    context_lens: torch.Tensor  # [B]


def paged_cache(generator: torch.Generator, context_lens: list[int], num_kv_heads: int, head_dim: int,
                block_size: int, dtype: torch.dtype, index_dtype: torch.dtype = torch.int32,
                extra_blocks: int = 0) -> PagedCache:
    """Random K/V for each sequence in blocks drawn from a shuffled pool (so no sequence's blocks are
    contiguous or in order); block-table padding points at a block that holds only NaN."""
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 1 + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    pool = torch.randperm(num_blocks, generator=generator).tolist()
    nan_block = pool.pop()
    max_blocks = max([1, *blocks_per_seq])
    block_tables = torch.full((len(context_lens), max_blocks), nan_block, dtype=torch.int64)
    for i, (context_len, num) in enumerate(zip(context_lens, blocks_per_seq)):
        row = [pool.pop() for _ in range(num)]
        block_tables[i, :num] = torch.tensor(row, dtype=torch.int64)
        for position in range(context_len):
            block, offset = row[position // block_size], position % block_size
            key_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator).to(dtype)
            value_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator).to(dtype)
    return PagedCache(key_cache.to(DEVICE), value_cache.to(DEVICE), block_tables.to(index_dtype).to(DEVICE),
                      torch.tensor(context_lens, dtype=index_dtype, device=DEVICE))


def random_query(generator: torch.Generator, num_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """[T, Hq, D] as the model hands it: a transposed view of [Hq, T, D] (strided, not contiguous)."""
    query = torch.randn(num_heads, num_tokens, head_dim, generator=generator).to(dtype)
    return query.to(DEVICE).transpose(0, 1)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype == dtype
    assert torch.isfinite(actual).all(), "kernel output has NaN/inf: it read a masked-out row"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype])
