"""The attention backend interface, the per-forward metadata, and the function transformers calls.

The model runs on a packed batch ``[1, num_tokens]`` with ``use_cache=False``; each attention layer calls
``paged_attention_forward(module, query[1,Hq,T,D], key[1,Hkv,T,D], value[1,Hkv,T,D], mask=None, ...)``
(RoPE already applied) with this forward's ``PagedAttentionMetadata`` in the keyword argument
``paged_attention_metadata`` (transformers passes unknown model kwargs down to the attention function).
The function hands the layer to ``metadata.backend``, which writes the new K/V into the layer's pool rows
``slot_mapping`` and attends each sequence's query tokens to its cached context (causal, offset by the
tokens cached before this step, optionally within a sliding window, with ``scaling`` and an optional
logit softcap), returning ``out[1,T,Hq,D]``.

Packing contract (the model runner builds it): the first ``num_decode_seqs`` sequences have exactly one
query token each (decode rows), the rest several (prefill chunks). A slot below 0 marks a padding row
(CUDA graphs): backends that declare ``supports_cuda_graphs`` store nothing for it and read nothing for a
sequence of context length 0.

A backend (``AttentionBackend``) owns what differs between implementations: its per-runner scratch, how
it turns the runner's packed step into metadata (``metadata``), the layer call (``forward``) and what it
supports (``supports_cuda_graphs``). ``select_backend`` picks one from the ATTENTION_BACKEND setting.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

ATTENTION_NAME = "llm_api_paged"
METADATA_KWARG = "paged_attention_metadata"


@dataclass
class PagedAttentionMetadata:
    backend: "AttentionBackend"
    key_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, Hkv, D]
    value_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] int64: flat pool row of each packed token (< 0: padding, store nothing)
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0 (a valid block: masked out)
    context_lens: torch.Tensor  # [B] int64: cached + new tokens of each sequence after this step
    query_start_loc: list[int]  # [B + 1] offsets of each sequence's tokens in the packed batch
    context_lens_list: list[int]  # context_lens as Python ints (per-sequence loops)
    num_decode_seqs: int  # leading sequences with exactly one query token
    max_query_len: int = 1  # longest query of this step (the prefill kernel's grid)
    query_start_loc_tensor: torch.Tensor | None = None  # query_start_loc, already on the device (graphs)
    _per_device: dict = field(default_factory=dict)  # backend-derived tensors, computed once per forward

    def cached(self, key, build):
        """``build()`` once per forward and key (a device, a window): shared by every layer of the step."""
        value = self._per_device.get(key)
        if value is None:
            value = self._per_device[key] = build()
        return value

    def slot_mapping_on(self, device: torch.device) -> torch.Tensor:
        return self.cached((device, "slots"), lambda: self.slot_mapping.to(device))


class AttentionBackend(ABC):
    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    # What a fused forward may ask of the backend, declared (never probed for): ``attend`` (the layer call
    # after a store the caller made itself, in its rotary kernel), and whether a kernel set's own paged
    # attention (``llm_api.kernels.kernel_set.WholeLayerKernels.paged_decode``: the same math over the same pool)
    # may stand in for this backend's.
    attends_stored_rows: ClassVar[bool] = False
    kernel_set_may_attend: ClassVar[bool] = False

    def metadata(self, **fields) -> PagedAttentionMetadata:
        """This step's metadata for this backend (the runner passes the packed step's fields)."""
        return PagedAttentionMetadata(backend=self, **fields)

    @abstractmethod
    def forward(self, metadata: PagedAttentionMetadata, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, scaling: float, sliding_window: int | None,
                softcap: float | None) -> torch.Tensor:
        """query [T, Hq, D], key/value [T, Hkv, D] of this step -> out [T, Hq, D]; stores key/value first."""

    def attend(self, metadata: PagedAttentionMetadata, layer_idx: int, query: torch.Tensor, scaling: float,
               sliding_window: int | None, softcap: float | None) -> torch.Tensor:
        """``forward`` without its store (the step's K/V rows already in the cache), where
        ``attends_stored_rows``."""
        raise NotImplementedError(f"the {self.name} attention backend does not attend stored rows")


def paged_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, **kwargs) -> tuple[torch.Tensor, None]:
    metadata: PagedAttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if metadata is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs `{METADATA_KWARG}=` in the model call")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME} expects a packed batch of 1 row, got {query.shape[0]}")
    if kwargs.get("s_aux") is not None:  # engine.support refuses such models; never ignore sinks silently
        raise NotImplementedError(f"{ATTENTION_NAME} attention has no attention sinks (s_aux)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = metadata.backend.forward(metadata, module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                                   value[0].transpose(0, 1), scaling, sliding_window, softcap)
    return out[None], None


def register_paged_attention() -> str:
    """Register the function with transformers (idempotent) and return the name to select it by."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
