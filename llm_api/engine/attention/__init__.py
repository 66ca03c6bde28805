"""Paged attention plugged into stock transformers models: one registered function, two backends.

- ``base``: the ``AttentionBackend`` interface, ``PagedAttentionMetadata`` and the function transformers
  calls for every attention layer;
- ``torch_backend``: gather + SDPA (CPU, and the reference on any device);
- ``triton_backend``: the Triton kernels of ``llm_api.kernels`` (CUDA; CPU only under the interpreter),
  which read the blocks in place and can be captured in CUDA graphs.

``select_backend(requested, devices)`` turns the ATTENTION_BACKEND setting into a backend instance.
"""

from __future__ import annotations

import torch

from llm_api.engine.attention.base import (ATTENTION_NAME, METADATA_KWARG, AttentionBackend, PagedAttentionMetadata,
                                           paged_attention_forward, register_paged_attention)
from llm_api.engine.attention.torch_backend import TorchBackend

__all__ = ["ATTENTION_NAME", "METADATA_KWARG", "AttentionBackend", "PagedAttentionMetadata", "TorchBackend",
           "paged_attention_forward", "register_paged_attention", "select_backend"]

BACKEND_NAMES = ("torch", "triton")


def select_backend(requested: str, devices) -> AttentionBackend:
    """``auto`` | ``torch`` | ``triton`` -> the backend for layers on ``devices``. ``auto`` takes the Triton
    kernels when every layer is on CUDA and Triton imports; ``triton`` elsewhere needs ``TRITON_INTERPRET=1``
    (tests), and is refused with a reason otherwise."""
    devices = [torch.device(d) for d in devices]
    if requested not in ("auto", *BACKEND_NAMES):
        raise ValueError(f"unknown attention backend {requested!r}; allowed: auto, {', '.join(BACKEND_NAMES)}")
    if requested == "torch" or (requested == "auto" and any(d.type != "cuda" for d in devices)):
        return TorchBackend()  # (without importing triton: CPU servers never load it)
    from llm_api.kernels import triton_usable

    usable = all(triton_usable(d) for d in devices)
    if requested == "triton" and not usable:
        raise ValueError("ATTENTION_BACKEND=triton needs the triton package and CUDA devices (on CPU, only "
                         "under TRITON_INTERPRET=1); use auto or torch")
    if not usable:
        return TorchBackend()
    from llm_api.engine.attention.triton_backend import TritonBackend

    return TritonBackend()
