"""The torch attention backend: gather + SDPA over the paged cache (CPU, and the reference anywhere).

Decode rows are attended in a few batches of similar context length (``decode_groups``): per group, one
gather of the sequences' blocks into a padded ``[B, L, Hkv, D]`` (into a ``GatherWorkspace`` reused
across layers and steps) and one masked SDPA. One padded batch for all would copy and attend every
sequence at the longest one's length: with contexts drawn from 32-512 tokens, 1.65 times the blocks.
A row joins a group while the group's longest context is less than ``PAD_RATIO`` times its own, so no
row does more than that much padded work; the groups are formed once per step and shared by the layers.
Prefill chunks are attended one sequence at a time with ``llm_api.kernels.reference.attend_one_sequence``.
The gather copies each sequence's context once per layer; the Triton backend reads the blocks in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llm_api.engine.attention.base import AttentionBackend, PagedAttentionMetadata
from llm_api.kernels.reference import attend, attend_one_sequence


class GatherWorkspace:
    """Reusable scratch for the decode gather, one pair of flat buffers per (device, dtype), grown on
    demand. Why: on CPU a fresh ~50 MiB tensor per layer costs more in page faults than the copy itself
    (measured: index_select into a new tensor 34 ms, into a reused one 5 ms, at 64 x 1k tokens)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, like: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [num_blocks, block_size, Hkv, D] views shaped like the cache ``like``."""
        key = (like.device, like.dtype)
        block_numel = like[0].numel()
        buffers = self._buffers.get(key)
        if buffers is None or buffers[0].numel() < num_blocks * block_numel:
            numel = int(num_blocks * 1.25 + 1) * block_numel  # headroom: contexts grow a block at a time
            buffers = (torch.empty(numel, dtype=like.dtype, device=like.device),
                       torch.empty(numel, dtype=like.dtype, device=like.device))
            self._buffers[key] = buffers
        shape = (num_blocks, *like.shape[1:])
        return (buffers[0][: num_blocks * block_numel].view(shape),
                buffers[1][: num_blocks * block_numel].view(shape))


def decode_key_mask(metadata: PagedAttentionMetadata, device: torch.device, sliding_window: int | None):
    """Block table [Bd, M] and key mask [Bd, 1, 1, L] (True = attend) of the decode sequences on ``device``."""

    def build():
        num_decode = metadata.num_decode_seqs
        block_tables = metadata.block_tables[:num_decode].to(device)
        context_lens = metadata.context_lens[:num_decode].to(device)
        block_size = metadata.key_caches[0].shape[1]
        positions = torch.arange(block_tables.shape[1] * block_size, device=device)
        mask = positions[None, :] < context_lens[:, None]  # [Bd, L]
        if sliding_window is not None:
            mask &= positions[None, :] > (context_lens[:, None] - 1 - sliding_window)
        return block_tables, mask[:, None, None, :]

    return metadata.cached((device, sliding_window), build)


PAD_RATIO = 2.0  # measured: docs/benchmarks.md, "Decode attention on CPU"


@dataclass(frozen=True)
class DecodeGroup:
    rows: torch.Tensor | None  # the group's decode rows (None: all of them, in order)
    block_tables: torch.Tensor  # [n, m]: m = the group's longest context, in blocks
    key_mask: torch.Tensor  # [n, 1, 1, m * block_size]


def group_by_length(num_blocks: list[int], pad_ratio: float = PAD_RATIO) -> list[list[int]]:
    """Row indices in groups, longest first: a row joins the current group while the group's longest row
    has fewer than ``pad_ratio`` times its blocks."""
    order = sorted(range(len(num_blocks)), key=lambda i: -num_blocks[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and num_blocks[groups[-1][0]] < pad_ratio * num_blocks[i]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def decode_groups(metadata: PagedAttentionMetadata, device: torch.device, sliding_window: int | None,
                  pad_ratio: float = PAD_RATIO) -> list[DecodeGroup]:
    """The decode rows' groups (``group_by_length``), built once per step and device."""

    def build():
        block_tables, key_mask = decode_key_mask(metadata, device, sliding_window)
        block_size = metadata.key_caches[0].shape[1]
        num_blocks = [-(-n // block_size) for n in metadata.context_lens_list[: metadata.num_decode_seqs]]
        groups = group_by_length(num_blocks, pad_ratio)
        if len(groups) == 1:
            return [DecodeGroup(None, block_tables, key_mask)]
        out = []
        for rows in groups:
            width = num_blocks[rows[0]]
            index = torch.tensor(rows, device=device)
            out.append(DecodeGroup(index, block_tables[index, :width],
                                   key_mask[index][..., : width * block_size]))
        return out

    return metadata.cached((device, sliding_window, "groups"), build)


def decode_attention(query, key_cache, value_cache, block_tables, key_mask, scaling, softcap=None,
                     workspace: GatherWorkspace | None = None):
    """All single-query sequences at once. query [B, Hq, D], block_tables [B, M] -> out [B, Hq, D]."""
    num_seqs, num_heads, _ = query.shape
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    max_len = block_tables.shape[1] * block_size
    # One gather per tensor into a padded [B, L, Hkv, D] (padding keys are masked out), then viewed as
    # [B, Hkv, L, D] for SDPA.
    block_ids = block_tables.reshape(-1)
    if workspace is None:
        key, value = key_cache.index_select(0, block_ids), value_cache.index_select(0, block_ids)
    else:
        key, value = workspace.get(key_cache, block_ids.numel())
        torch.index_select(key_cache, 0, block_ids, out=key)
        torch.index_select(value_cache, 0, block_ids, out=value)
    key = key.view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    value = value.view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    if softcap is None:
        # Grouped-query heads without repeating K/V: the query heads sharing KV head h (h*G .. h*G+G-1,
        # as transformers' repeat_kv orders them) become G "query positions" of head h. With one query
        # token per sequence there is no causal order among them, so this is exact.
        groups = num_heads // num_kv_heads
        grouped = query.view(num_seqs, num_kv_heads, groups, head_dim)
        out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=key_mask, scale=scaling)
        return out.reshape(num_seqs, num_heads, head_dim)
    out = attend(query[:, :, None, :], key, value, key_mask, scaling, softcap)  # [B, Hq, 1, D]
    return out[:, :, 0, :]


class TorchBackend(AttentionBackend):
    name = "torch"
    supports_cuda_graphs = False  # padding rows (slot -1) would be stored by index_copy_
    kernel_set_may_attend = True  # (a gather and SDPA per layer: the C set's paged_decode is the same math)

    def __init__(self, pad_ratio: float = PAD_RATIO):
        self.workspace = GatherWorkspace()
        self.pad_ratio = pad_ratio  # float("inf"): all decode rows in one padded batch

    def forward(self, metadata, layer_idx, query, key, value, scaling, sliding_window, softcap):
        key_cache, value_cache = metadata.key_caches[layer_idx], metadata.value_caches[layer_idx]
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        # Store this step's K/V: [T, Hkv, D] rows of the flat pool.
        slots = metadata.slot_mapping_on(key_cache.device)
        key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(key_cache.dtype))
        value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(value_cache.dtype))

        num_tokens, num_decode = query.shape[0], metadata.num_decode_seqs
        if num_decode == num_tokens:  # a pure decode step: no prefill loop
            return self._decode(metadata, query, key_cache, value_cache, scaling, sliding_window, softcap)
        out = torch.empty_like(query)
        if num_decode:
            out[:num_decode] = self._decode(metadata, query[:num_decode], key_cache, value_cache, scaling,
                                            sliding_window, softcap)
        block_size = key_cache.shape[1]
        block_tables = metadata.cached((query.device, "tables"), lambda: metadata.block_tables.to(query.device))
        for i in range(num_decode, len(metadata.context_lens_list)):
            start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
            context_len = metadata.context_lens_list[i]
            block_ids = block_tables[i, : -(-context_len // block_size)]
            out[start:end] = attend_one_sequence(query[start:end], key_cache, value_cache, block_ids, context_len,
                                                 scaling, sliding_window, softcap)
        return out

    def _decode(self, metadata, query, key_cache, value_cache, scaling, sliding_window, softcap):
        """The decode rows ``query[:num_decode_seqs]``, a batch per length group (module docstring)."""
        groups = decode_groups(metadata, query.device, sliding_window, self.pad_ratio)
        if groups[0].rows is None:  # one group: every row, in order
            return decode_attention(query, key_cache, value_cache, groups[0].block_tables, groups[0].key_mask,
                                    scaling, softcap, self.workspace)
        out = torch.empty_like(query)
        for group in groups:
            assert group.rows is not None  # several groups: each names its rows
            out.index_copy_(0, group.rows, decode_attention(
                query.index_select(0, group.rows), key_cache, value_cache, group.block_tables, group.key_mask,
                scaling, softcap, self.workspace))
        return out
