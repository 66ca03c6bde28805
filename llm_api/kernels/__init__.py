"""Triton kernels for the paged KV cache, each beside a torch reference the tests compare it with.

- ``store_kv`` (module ``kv_write``: a submodule named ``store_kv`` would replace the function on this
  package once imported): write a step's K/V rows into the cache by slot mapping (slot < 0: skip).
- ``paged_decode_attention``: one query token per sequence, split over the context (flash-decoding).
- ``paged_prefill_attention``: packed variable-length query chunks over cached + new keys.

Beside them, imported by module (the Triton kernel set, ``kernels.triton_set``, that the owned model runs on): ``rms_norm``
(``kernels.rms_norm``) and ``apply_rotary`` (``kernels.rotary``), one launch each where transformers'
code launches eight and ten; ``add_rms_norm``, ``silu_and_mul`` (``kernels.activation``) and
``rotary_store_kv`` for the owned decoder's layers (``llm_api.models.llama``); ``row_product``
(``kernels.gemv``) for a batch-1 step's products; ``greedy_pick`` (``kernels.greedy``) for a greedy step's
argmax and non-finite check; ``lora_bgmv`` (``kernels.lora``) for the LoRA deltas.

``triton_usable(device)`` says whether they can run for tensors on ``device``: Triton importable and
either a CUDA device or Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before the kernel modules
are imported). Importing this package needs no Triton: the kernel functions load on first access.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

_LAZY = {
    "store_kv": "llm_api.kernels.kv_write",
    "paged_decode_attention": "llm_api.kernels.decode_attention",
    "paged_prefill_attention": "llm_api.kernels.prefill_attention",
}

__all__ = ["triton_usable", *_LAZY]


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # ImportError, or a broken install failing at import: either way, unusable
        return False
    return True


def interpreter_enabled() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``). The engine's settings do not own this variable:
    Triton itself reads it when kernels are decorated, so this reads the same variable, at the same moment, to
    agree with Triton (a value fixed in ``Settings`` at start could disagree; the kernel tests set it). The one
    read of the environment outside llm_api.model.settings that tests/test_architecture.py allows here."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_usable(device: torch.device) -> bool:
    return _triton_importable() and (device.type == "cuda" or interpreter_enabled())


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
