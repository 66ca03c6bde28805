"""The torch kernel set (``llm_api.kernels.kernel_set.KernelSet``): transformers' own arithmetic, op by op.

The owned model (``llm_api.models``) always holds a kernel set; where no compiled set runs (no C compiler, no
CUDA, ``FUSED_KERNELS=0``, or a tensor the compiled set does not take) it is this one. Each function is the
code of transformers' Llama modules written out (``LlamaRMSNorm.forward``, ``apply_rotary_pos_emb``,
``LlamaMLP``'s SiLU x up), in the same order of operations and roundings, so a model run on this set gives
transformers' logits bit for bit (tests/models/test_owned_model.py). Its products are ``F.linear``: it takes
no few-row product of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llm_api.kernels.kernel_set import KernelSet


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchKernels:
    """The reference set (``KernelSet``): plain torch, any device."""

    name = "torch"
    rotary_stores_kv = False

    @staticmethod
    def takes(tensor: torch.Tensor) -> bool:
        return True

    @staticmethod
    def takes_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        return False

    @staticmethod
    def row_product(x, weight, bias=None, silu_mul=False):
        return F.linear(TorchKernels.silu_and_mul(x) if silu_mul else x, weight, bias)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y = x.to(torch.float32)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        return weight * y.to(x.dtype)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + x
        return total, TorchKernels.rms_norm(total, weight, eps)

    @staticmethod
    def rotary_supported(q, k, cos, sin) -> bool:
        return True

    @staticmethod
    def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Hq, T, D], k [B, Hk, T, D], cos and sin [B or 1, T, D]."""
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


TORCH_KERNELS: KernelSet = TorchKernels()
