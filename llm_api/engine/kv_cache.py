"""The paged K/V tensors: one preallocated pool per attention layer, and how many blocks to make.

Layer ``i`` owns ``key_caches[i]`` and ``value_caches[i]``, each ``[num_blocks, block_size,
num_kv_heads, head_dim]`` on the device and in the dtype of that layer's attention weights, so a model
split across devices keeps each layer's cache beside the layer. Block ``b``'s slot ``s`` is the flat
row ``b * block_size + s`` of ``key_caches[i].view(-1, num_kv_heads, head_dim)`` (the slot mapping).

A layer's device is where its attention *runs*: for a module that accelerate offloads (DEVICE_MAP "cpu"
entries on a GPU machine, or "disk" entries), whose weights sit on ``meta`` or in CPU memory and are
moved in by a hook for each forward, that is the hook's execution device (``llm_api.model.placement``),
not the weights' device.

Sizing (``choose_num_blocks``): an explicit block count wins; else ``kv_cache_memory_mib``; else on
CUDA what is left of each device's total memory times ``gpu_memory_utilization`` once the weights, the
activation peak of a profiled worst-case step (``DeviceMemory``, measured by the engine) and the memory
used outside torch are taken off; else (CPU) enough blocks for ``max_num_seqs`` sequences of
``max_model_len`` tokens, but no more than ``1 / CPU_HOST_MEMORY_SHARE`` of the host's memory
(``llm_api.model.host_memory``: 768 MiB on a 24 GiB host) and never less than one sequence of
``max_model_len`` tokens. CUDA graphs are captured after the pool is allocated, from the share the
utilization fraction leaves free.

Residency: on the CPU each layer's K and V pool is a memory mapping of its own (``_lazy_zeros``), whose pages
the kernel gives zero-filled on first touch. Blocks are handed out from the front of the block pool's free
queue, so a server holds in memory the blocks it has used, not the whole pool: an idle server of the
embedded model with the default pool takes tens of MB for it, not the pool's size, and a busy one grows
towards the pool as its prefix cache fills. The contents stay zero until written, as ``torch.zeros`` would
leave them (a gathered block's unused slots are masked, and a masked zero cannot turn the sum into NaN).
Each mapping is a named memory file (``memfd_create("llm_api-kv")``) rather than plain anonymous memory, so
``/proc/<pid>/smaps`` (and ``pmap``) shows them as ``/memfd:llm_api-kv``, one entry per tensor with its
resident size, where anonymous mappings merge with their neighbours and cannot be told apart
(bench/server_memory.py reads the pool's residency there). Its pages become resident when first touched,
read or written (an anonymous mapping would lend a read the shared zero page); the engine reads only blocks
it has handed out, whose first slots were written, so what differs is at most the unwritten tail of a
sequence's last block.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from llm_api.model.host_memory import host_memory_bytes
from llm_api.model.placement import execution_device

KV_MAPPING_NAME = "llm_api-kv"  # each CPU K/V tensor's mapping appears as /memfd:llm_api-kv in smaps
CPU_HOST_MEMORY_SHARE = 32  # the default CPU pool takes at most this fraction of the host's memory


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_devices: tuple[torch.device, ...]
    layer_dtypes: tuple[torch.dtype, ...]

    def bytes_per_token(self) -> int:
        # K and V, every layer.
        return sum(2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dt).element_size()
                   for dt in self.layer_dtypes)


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """layer_idx -> the self-attention module of that layer (the ones that call the attention interface)."""
    found: dict[int, nn.Module] = {}
    for module in model.modules():
        layer_idx = getattr(module, "layer_idx", None)
        if isinstance(layer_idx, int) and type(module).__name__.endswith("Attention") and layer_idx not in found:
            found[layer_idx] = module
    return found


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of one CUDA device, measured right after a profiling forward of the largest step."""

    total: int
    torch_peak: int  # the most torch held during the profile: weights + activations (+ logits, sampler)
    non_torch: int  # used outside torch's allocator: CUDA context, cuBLAS and NCCL workspaces

    def kv_budget(self, utilization: float) -> int:
        return int(self.total * utilization) - self.torch_peak - self.non_torch


def layout_for_model(model: nn.Module) -> KVCacheLayout:
    model_config: Any = model.config  # (nn.Module's __getattr__ is typed Tensor | Module)
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    modules = attention_modules(model)
    num_layers = config.num_hidden_layers
    if sorted(modules) != list(range(num_layers)):
        raise NotImplementedError(
            f"{type(model).__name__}: expected attention modules with layer_idx 0..{num_layers - 1}, "
            f"found {sorted(modules)}"
        )
    devices: list[torch.device] = []
    dtypes: list[torch.dtype] = []
    for i in range(num_layers):
        weight = next(itertools.chain(modules[i].parameters(), modules[i].buffers()))
        devices.append(execution_device(model, modules[i]))
        # Quantized weights are integers; the activations (and so K/V) are in the model's float dtype.
        # (An offloaded weight on "meta" keeps its dtype.)
        dtypes.append(weight.dtype if weight.dtype.is_floating_point else cast(torch.dtype, model.dtype))
    return KVCacheLayout(num_layers, num_kv_heads, head_dim, tuple(devices), tuple(dtypes))


def choose_num_blocks(
    layout: KVCacheLayout,
    block_size: int,
    *,
    num_blocks: int | None,
    memory_mib: int,
    gpu_memory_utilization: float,
    max_num_seqs: int,
    max_model_len: int,
    device_memory: dict[torch.device, DeviceMemory] | None = None,
) -> int:
    bytes_per_block = layout.bytes_per_token() * block_size
    if num_blocks:
        return num_blocks
    if memory_mib > 0:
        return max(1, (memory_mib << 20) // bytes_per_block)
    cuda_devices = cuda_layer_devices(layout)
    if cuda_devices:
        if device_memory is None or set(cuda_devices) - set(device_memory):
            raise ValueError("sizing the KV cache on CUDA needs the profiled DeviceMemory of every device")
        # Every device must hold its layers' share; the tightest device decides the count.
        counts = []
        for device in cuda_devices:
            share = sum(1 for d in layout.layer_devices if d == device) / layout.num_layers
            counts.append(int(device_memory[device].kv_budget(gpu_memory_utilization) / (bytes_per_block * share)))
        if min(counts) < 1:
            raise RuntimeError("no GPU memory left for the KV cache after the weights and the profiled activations; "
                               "raise GPU_MEMORY_UTILIZATION, lower MAX_NUM_BATCHED_TOKENS, or use a smaller model")
        return min(counts)
    return cpu_default_num_blocks(bytes_per_block, block_size, max_num_seqs, max_model_len, host_memory_bytes())


def cpu_default_num_blocks(bytes_per_block: int, block_size: int, max_num_seqs: int, max_model_len: int,
                           host_bytes: int) -> int:
    """The CPU pool when no setting sizes it (module docstring): ``max_num_seqs`` full sequences, within
    ``host_bytes / CPU_HOST_MEMORY_SHARE``, and at least one full sequence."""
    wanted = _cdiv(max_num_seqs * max_model_len, block_size)
    cap = host_bytes // CPU_HOST_MEMORY_SHARE // bytes_per_block
    return max(1, _cdiv(max_model_len, block_size), min(wanted, cap))


def cuda_layer_devices(layout: KVCacheLayout) -> list[torch.device]:
    return sorted({d for d in layout.layer_devices if d.type == "cuda"}, key=str)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _lazy_zeros(shape, dtype) if device.type == "cpu" else torch.zeros(shape, dtype=dtype, device=device)


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros backed by its own named memory file: pages become resident only when touched
    (module docstring, residency). The tensor keeps the mapping alive; the memory is freed with the tensor
    (the file has no name in any folder, and its descriptor is closed once mapped)."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    fd = os.memfd_create(KV_MAPPING_NAME, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(num_bytes, 1))  # a sparse file: zero-filled on first touch
        mapping = mmap.mmap(fd, max(num_bytes, 1))
    finally:
        os.close(fd)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes).view(dtype).view(shape)


class PagedKVCache:
    def __init__(self, layout: KVCacheLayout, num_blocks: int, block_size: int):
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, layout.num_kv_heads, layout.head_dim)
        self.key_caches = [_zeros(shape, dt, dev) for dev, dt in zip(layout.layer_devices, layout.layer_dtypes)]
        self.value_caches = [_zeros(shape, dt, dev) for dev, dt in zip(layout.layer_devices, layout.layer_dtypes)]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy every layer's K/V of block ``src`` into block ``dst`` for each (src, dst): one indexed copy
        per tensor, on the device (copy on write of a partial block shared by the n sequences of a request)."""
        if not copies:
            return
        indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for cache in self.key_caches + self.value_caches:
            if cache.device not in indices:
                indices[cache.device] = (torch.tensor([c[0] for c in copies], dtype=torch.long, device=cache.device),
                                         torch.tensor([c[1] for c in copies], dtype=torch.long, device=cache.device))
            src, dst = indices[cache.device]
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Zero every layer's K/V of these blocks (tainted blocks before reuse: ``BlockPool.taint``)."""
        if not block_ids:
            return
        indices: dict[torch.device, torch.Tensor] = {}
        for cache in self.key_caches + self.value_caches:
            if cache.device not in indices:
                indices[cache.device] = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
            cache.index_fill_(0, indices[cache.device], 0)

    @property
    def max_num_tokens(self) -> int:
        """Tokens the whole pool holds: the most concurrent context across all requests."""
        return self.num_blocks * self.block_size

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_caches + self.value_caches)

