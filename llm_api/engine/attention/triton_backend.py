"""The Triton attention backend: the kernels of ``llm_api.kernels`` read the paged cache in place.

A pure decode step is one decode kernel per layer (no host synchronization, so the step can be captured
in a CUDA graph); any other step is one prefill kernel over the packed chunks (decode rows included).
``store_kv`` skips slots below 0 and the decode kernel outputs zeros for a context of length 0, which is
what CUDA-graph padding rows rely on (``supports_cuda_graphs``). ``attend`` is the layer call without its
store, for a caller that wrote the rows itself (``llm_api.kernels.rotary.rotary_store_kv``).
"""

from __future__ import annotations

import torch

from llm_api import kernels
from llm_api.engine.attention.base import AttentionBackend, PagedAttentionMetadata


def kernel_inputs(metadata: PagedAttentionMetadata, device: torch.device):
    """(block_tables, context_lens, query_start_loc) on ``device``. Tensors already there are returned as
    they are (a captured graph's static buffers stay static)."""

    def build():
        query_start_loc = metadata.query_start_loc_tensor
        if query_start_loc is None:
            query_start_loc = torch.tensor(metadata.query_start_loc, dtype=torch.int32)
        return metadata.block_tables.to(device), metadata.context_lens.to(device), query_start_loc.to(device)

    return metadata.cached((device, "kernel"), build)


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    attends_stored_rows = True

    def forward(self, metadata, layer_idx, query, key, value, scaling, sliding_window, softcap):
        key_cache, value_cache = metadata.key_caches[layer_idx], metadata.value_caches[layer_idx]
        kernels.store_kv(key, value, key_cache, value_cache, metadata.slot_mapping_on(key_cache.device))
        return self.attend(metadata, layer_idx, query, scaling, sliding_window, softcap)

    def attend(self, metadata: PagedAttentionMetadata, layer_idx: int, query: torch.Tensor, scaling: float,
               sliding_window: int | None, softcap: float | None) -> torch.Tensor:
        """``forward`` after its store: the step's K/V rows are already in the cache (``llm_api.models.
        llama`` writes them in its rotary kernel)."""
        key_cache, value_cache = metadata.key_caches[layer_idx], metadata.value_caches[layer_idx]
        device = key_cache.device
        block_tables, context_lens, query_start_loc = kernel_inputs(metadata, device)
        if metadata.num_decode_seqs == query.shape[0]:
            return kernels.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scaling,
                                                  sliding_window=sliding_window, softcap=softcap)
        return kernels.paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                                               context_lens, metadata.max_query_len, scaling,
                                               sliding_window=sliding_window, softcap=softcap)
