"""How the KV pool is sized on CUDA, from measured device memory (the measuring itself runs on a GPU:
tests/engine/test_gpu_fast_path.py), the shape of the profiled worst-case step, and a CPU pool's residency
(its pages in memory only where written, its mappings gone with the cache)."""

from __future__ import annotations

import gc
import os
import re

import pytest
import torch

from llm_api.engine.kv_cache import KV_MAPPING_NAME, DeviceMemory, KVCacheLayout, PagedKVCache, choose_num_blocks
from llm_api.engine.memory_profile import profile_sequence_lengths

GIB = 1 << 30


def _layout(devices):
    return KVCacheLayout(num_layers=len(devices), num_kv_heads=8, head_dim=128, layer_devices=tuple(devices),
                         layer_dtypes=(torch.bfloat16,) * len(devices))


def _blocks(layout, memory, utilization=0.9, **overrides):
    options = dict(num_blocks=None, memory_mib=0, gpu_memory_utilization=utilization, max_num_seqs=8,
                   max_model_len=1024, device_memory=memory)
    options.update(overrides)
    return choose_num_blocks(layout, 16, **options)


def test_budget_is_total_times_utilization_minus_weights_activations_and_non_torch():
    memory = DeviceMemory(total=80 * GIB, torch_peak=17 * GIB, non_torch=GIB)
    assert memory.kv_budget(0.9) == int(80 * GIB * 0.9) - 18 * GIB
    cuda0 = torch.device("cuda:0")
    layout = _layout([cuda0] * 32)  # Llama-3.1-8B shape: 128 KiB of K/V per token, 2 MiB per block
    bytes_per_block = layout.bytes_per_token() * 16
    assert bytes_per_block == 2 * 8 * 128 * 2 * 32 * 16
    assert _blocks(layout, {cuda0: memory}) == memory.kv_budget(0.9) // bytes_per_block
    # A lower utilization leaves more headroom (CUDA graphs, other processes) and fewer blocks.
    assert _blocks(layout, {cuda0: memory}, utilization=0.5) < _blocks(layout, {cuda0: memory})


def test_tightest_device_decides_a_split_model():
    cuda0, cuda1 = torch.device("cuda:0"), torch.device("cuda:1")
    layout = _layout([cuda0] * 16 + [cuda1] * 16)
    roomy = DeviceMemory(total=80 * GIB, torch_peak=10 * GIB, non_torch=GIB)
    tight = DeviceMemory(total=80 * GIB, torch_peak=60 * GIB, non_torch=GIB)
    half_block = layout.bytes_per_token() * 16 / 2  # each device holds half of every block's layers
    assert _blocks(layout, {cuda0: roomy, cuda1: tight}) == int(tight.kv_budget(0.9) / half_block)


def test_explicit_sizes_win_and_missing_measurements_are_refused():
    cuda0 = torch.device("cuda:0")
    layout = _layout([cuda0] * 4)
    assert _blocks(layout, None, num_blocks=7) == 7
    assert _blocks(layout, None, memory_mib=64) == (64 << 20) // (layout.bytes_per_token() * 16)
    with pytest.raises(ValueError, match="profiled"):
        _blocks(layout, None)
    full = DeviceMemory(total=80 * GIB, torch_peak=75 * GIB, non_torch=GIB)
    with pytest.raises(RuntimeError, match="GPU_MEMORY_UTILIZATION"):
        _blocks(layout, {cuda0: full})


def test_cpu_pool_is_sized_from_the_configuration():
    layout = _layout([torch.device("cpu")] * 2)
    assert _blocks(layout, None, max_num_seqs=4, max_model_len=99) == -(-4 * 99 // 16)


@pytest.mark.parametrize("tokens, seqs, max_len, expected", [
    (2048, 64, 4096, [32] * 64),
    (10, 4, 100, [3, 3, 2, 2]),
    (3, 64, 100, [1, 1, 1]),  # never more sequences than tokens
    (8192, 1, 4096, [4096]),  # one sequence is capped at the model's length
])
def test_profiled_step_spreads_the_token_budget(tokens, seqs, max_len, expected):
    assert profile_sequence_lengths(tokens, seqs, max_len) == expected


def _kv_mappings() -> dict[int, int]:
    """Start address -> resident bytes of each of this process's KV mappings, from smaps."""
    found, start, is_kv = {}, 0, False
    for line in open(f"/proc/{os.getpid()}/smaps"):
        head = re.match(r"^([0-9a-f]+)-[0-9a-f]+ ", line)
        if head:
            start, is_kv = int(head.group(1), 16), f"/memfd:{KV_MAPPING_NAME}" in line
        elif line.startswith("Rss:") and is_kv:
            found[start] = int(line.split()[1]) * 1024
    return found


def test_cpu_pool_is_resident_only_where_written_and_freed_with_the_cache():
    layout = KVCacheLayout(num_layers=3, num_kv_heads=2, head_dim=64, layer_devices=(torch.device("cpu"),) * 3,
                           layer_dtypes=(torch.float32,) * 3)
    cache = PagedKVCache(layout, num_blocks=512, block_size=16)  # 6 tensors of 4 MiB each
    tensors = cache.key_caches + cache.value_caches
    starts = [t.data_ptr() for t in tensors]  # each tensor begins its own mapping
    block_bytes = 16 * 2 * 64 * 4
    mappings = _kv_mappings()
    assert all(mappings.get(start) == 0 for start in starts), mappings
    for t in tensors:
        assert float(t[:2].abs().sum()) == 0.0  # zeros until written
        t[:2] = 1.0  # two blocks touched in every tensor
    resident = [_kv_mappings()[start] for start in starts]
    assert all(2 * block_bytes <= r <= 2 * block_bytes + 4096 for r in resident), resident
    assert float(cache.key_caches[0][2:4].abs().sum()) == 0.0
    del cache, tensors, t
    gc.collect()
    assert not set(starts) & set(_kv_mappings())
