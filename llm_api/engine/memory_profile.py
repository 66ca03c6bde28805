"""Measure what a model needs on each CUDA device besides its KV cache, before the cache is sized.

``profile_device_memory`` runs the largest step the scheduler can build (``max_num_batched_tokens``
prompt tokens spread over up to ``max_num_seqs`` sequences, every one of them sampling) through the real
model runner on a throwaway cache just large enough for it, then the sampler's float32 copy of the
logits, and reads per device: the total memory, torch's peak allocation (weights + activations; the
throwaway cache is taken off, since the real pool replaces it) and what is used outside torch's
allocator. ``kv_cache.choose_num_blocks`` turns that into a block count.

CUDA only (the CPU path sizes its pool from the configuration); it also warms the attention kernels
for the prefill shape.
"""

from __future__ import annotations

import torch
from torch import nn

from llm_api.engine.attention import AttentionBackend
from llm_api.engine.kv_cache import DeviceMemory, KVCacheLayout, PagedKVCache, cuda_layer_devices
from llm_api.engine.model_runner import ModelRunner
from llm_api.engine.request import Request
from llm_api.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from llm_api.engine.sampling_params import SamplingParams


def profile_sequence_lengths(num_tokens: int, num_seqs: int, max_model_len: int) -> list[int]:
    """The profiled step's sequences: ``num_tokens`` split as evenly as possible over at most ``num_seqs``
    sequences of at most ``max_model_len`` tokens (the scheduler's worst case for activations and logits)."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    base, extra = divmod(num_tokens, num_seqs)
    return [min(base + (i < extra), max_model_len) for i in range(num_seqs)]


@torch.inference_mode()
def profile_device_memory(model: nn.Module, layout: KVCacheLayout, block_size: int, backend: AttentionBackend,
                          lengths: list[int]) -> dict[torch.device, DeviceMemory]:
    devices = cuda_layer_devices(layout)
    for device in devices:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    num_blocks = sum(-(-n // block_size) for n in lengths)
    scratch = PagedKVCache(layout, num_blocks, block_size)
    runner = ModelRunner(model, scratch, backend)
    scheduled, next_block = [], 0
    for i, length in enumerate(lengths):
        request = Request(request_id=f"profile-{i}", prompt_token_ids=[0] * length, params=SamplingParams())
        used = -(-length // block_size)
        block_ids = list(range(next_block, next_block + used))
        next_block += used
        scheduled.append(ScheduledRequest(request, length, samples=True, new_block_ids=block_ids, is_new=True))
    logits, _ = runner.execute(SchedulerOutput(scheduled, sum(lengths)))
    logits.float().softmax(dim=-1)  # the sampler's float32 working copy
    memory = {}
    for device in devices:
        torch.cuda.synchronize(device)
        scratch_bytes = sum(t.numel() * t.element_size() for t in scratch.key_caches + scratch.value_caches
                            if t.device == device)
        free, total = torch.cuda.mem_get_info(device)
        memory[device] = DeviceMemory(
            total=total,
            torch_peak=torch.cuda.max_memory_allocated(device) - scratch_bytes,
            non_torch=max(0, total - free - torch.cuda.memory_reserved(device)),
        )
    del logits, runner, scratch
    torch.cuda.empty_cache()
    return memory
