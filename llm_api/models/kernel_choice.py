"""The kernel set a model runs on (``llm_api.kernels.kernel_set``), chosen once where the engine starts.

With ``fused_kernels`` (the FUSED_KERNELS setting, on by default): on CUDA where Triton imports, the Triton set;
on a CPU, given the cache folder where ``llm_api.kernels.cpu`` builds its library, the C set where it builds and
every weight is on the CPU. Otherwise, and with ``fused_kernels`` off, the torch set (transformers' arithmetic).
"""

from __future__ import annotations

import torch
from torch import nn

from llm_api.kernels.kernel_set import KernelSet
from llm_api.kernels.torch_set import TORCH_KERNELS


def choose_kernel_set(model: nn.Module, fused_kernels: bool, cpu_kernels_cache: str | None) -> KernelSet:
    if not fused_kernels:
        return TORCH_KERNELS
    from llm_api.kernels import triton_usable

    devices = {p.device.type for p in model.parameters() if p.device.type != "meta"}
    if devices == {"cuda"} and triton_usable(torch.device("cuda")):
        from llm_api.kernels.triton_set import TRITON_KERNELS

        return TRITON_KERNELS
    if devices == {"cpu"} and cpu_kernels_cache is not None:
        from llm_api.kernels import cpu as cpu_kernels

        if cpu_kernels.load(cpu_kernels_cache):
            return cpu_kernels  # (the module is the set: mypy checks it against the protocol here)
    return TORCH_KERNELS
