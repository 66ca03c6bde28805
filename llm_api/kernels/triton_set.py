"""The Triton kernel set (``llm_api.kernels.kernel_set.KernelSet``): CUDA, and a CPU under Triton's interpreter (the
tests). Each function imports its kernel module on first use, so this module loads without Triton. Its products
take one row (a batch-1 step's: ``kernels.gemv``); more rows are cuBLAS's. It is not a ``WholeLayerKernels``: on
a GPU a layer runs as these kernels, captured in a CUDA graph, not as one call.
"""

from __future__ import annotations

import torch

from llm_api.kernels.kernel_set import KernelSet


def one_row(x: torch.Tensor) -> bool:
    """``x`` holds one row (a batch-1 decode step): its products go to ``kernels.gemv``."""
    return x.numel() == x.shape[-1]


class TritonKernels:
    """The Triton kernel set (``KernelSet``), each kernel imported on first use."""

    name = "Triton"
    rotary_stores_kv = True

    @staticmethod
    def takes(tensor: torch.Tensor) -> bool:
        from llm_api.kernels import interpreter_enabled

        return tensor.is_cuda or interpreter_enabled()

    @staticmethod
    def takes_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
        return one_row(x)  # (a batch-1 step's products: more rows are cuBLAS's)

    @staticmethod
    def row_product(x, weight, bias=None, silu_mul=False):
        from llm_api.kernels.gemv import row_product

        return row_product(x, weight, bias, silu_mul=silu_mul)

    @staticmethod
    def silu_and_mul(gate_up):
        from llm_api.kernels.activation import silu_and_mul

        return silu_and_mul(gate_up)

    @staticmethod
    def rms_norm(x, weight, eps):
        from llm_api.kernels.rms_norm import rms_norm

        return rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x, residual, weight, eps):
        from llm_api.kernels.rms_norm import add_rms_norm

        return add_rms_norm(x, residual, weight, eps)

    @staticmethod
    def rotary_supported(q, k, cos, sin) -> bool:
        from llm_api.kernels.rotary import rotary_supported

        return rotary_supported(q, k, cos, sin)

    @staticmethod
    def apply_rotary(q, k, cos, sin):
        from llm_api.kernels.rotary import apply_rotary

        return apply_rotary(q, k, cos, sin)


TRITON_KERNELS: KernelSet = TritonKernels()
