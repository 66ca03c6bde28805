"""Paged attention for stock transformers models, registered with ``AttentionInterface``.

The model runs on a packed batch ``[1, num_tokens]`` with ``use_cache=False``; each attention layer calls
``paged_attention_forward(module, query[1,Hq,T,D], key[1,Hkv,T,D], value[1,Hkv,T,D], mask=None, ...)``
(RoPE already applied) with this forward's ``PagedAttentionMetadata`` in the keyword argument
``paged_attention_metadata``. The function writes the new K/V into the layer's pool rows
``slot_mapping`` and attends each sequence's query tokens to its cached context (causal, offset by the
tokens cached before this step, optionally within a sliding window, with ``scaling`` and an optional
logit softcap). It returns ``(out[1,T,Hq,D], None)``.

Packing contract (the model runner builds it): the first ``num_decode_seqs`` sequences have exactly one
query token each (decode steps), the rest several (prefill chunks). Single-query sequences are attended
in one batched gather (into a ``GatherWorkspace`` reused across layers and steps) + one masked SDPA; the
others one by one (``attend_one_sequence``). ``reference_paged_attention`` is the plain per-sequence
oracle that tests (and the Triton kernels) compare against. The gather copies each sequence's context
once per layer; the ``"triton"`` backend (``metadata.backend``, chosen by ``resolve_attention_backend``)
instead stores K/V and attends with the kernels of ``llm_api.kernels``, which read the blocks in place:
one decode kernel for a pure decode step (no host synchronization, so it can be captured in a CUDA
graph), one prefill kernel for any other step. A slot below 0 (a padding row) stores nothing there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTENTION_NAME = "llm_api_paged"
METADATA_KWARG = "paged_attention_metadata"
BACKENDS = ("torch", "triton")


def resolve_attention_backend(requested: str, devices) -> str:
    """``auto`` | ``torch`` | ``triton`` -> the backend the layers on ``devices`` run. ``auto`` takes the
    Triton kernels when every layer is on CUDA and Triton imports; ``triton`` elsewhere needs
    ``TRITON_INTERPRET=1`` (tests), and is refused with a reason otherwise."""
    devices = [torch.device(d) for d in devices]
    if requested == "torch" or (requested == "auto" and any(d.type != "cuda" for d in devices)):
        return "torch"  # (without importing triton: CPU servers never load it)
    from llm_api.kernels import triton_usable

    usable = all(triton_usable(d) for d in devices)
    if requested == "triton":
        if not usable:
            raise ValueError("ATTENTION_BACKEND=triton needs the triton package and CUDA devices (on CPU, only "
                             "under TRITON_INTERPRET=1); use auto or torch")
        return "triton"
    if requested != "auto":
        raise ValueError(f"unknown attention backend {requested!r}; allowed: auto, {', '.join(BACKENDS)}")
    return "triton" if usable else "torch"


class GatherWorkspace:
    """Reusable scratch for the decode gather, one pair of flat buffers per (device, dtype), grown on
    demand. Why: on CPU a fresh ~50 MiB tensor per layer costs more in page faults than the copy itself
    (measured: index_select into a new tensor 34 ms, into a reused one 5 ms, at 64 x 1k tokens)."""

    def __init__(self):
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


@dataclass
class PagedAttentionMetadata:
    key_caches: list[torch.Tensor]  # per layer [num_blocks, block_size, Hkv, D]
    value_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] int64: flat pool row of each packed token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0 (a valid block: masked out)
    context_lens: torch.Tensor  # [B] int64: cached + new tokens of each sequence after this step
    query_start_loc: list[int]  # [B + 1] offsets of each sequence's tokens in the packed batch
    context_lens_list: list[int]  # context_lens as Python ints (for the per-sequence loop)
    num_decode_seqs: int  # leading sequences with exactly one query token
    workspace: GatherWorkspace | None = None  # decode gather scratch, kept by the caller across steps
    backend: str = "torch"  # "torch" (gather + SDPA) or "triton" (llm_api.kernels)
    max_query_len: int = 1  # longest query of this step (the prefill kernel's grid)
    query_start_loc_tensor: torch.Tensor | None = None  # query_start_loc, already on the device (graphs)
    _per_device: dict = field(default_factory=dict)  # (device, window) -> decode key mask, etc.

    def decode_inputs(self, device: torch.device, sliding_window: int | None):
        """Block table, and key mask [Bd, 1, 1, L] (True = attend), of the decode sequences on ``device``."""
        key = (device, sliding_window)
        if key not in self._per_device:
            num_decode = self.num_decode_seqs
            block_tables = self.block_tables[:num_decode].to(device)
            context_lens = self.context_lens[:num_decode].to(device)
            block_size = self.key_caches[0].shape[1]
            max_len = block_tables.shape[1] * block_size
            positions = torch.arange(max_len, device=device)
            mask = positions[None, :] < context_lens[:, None]  # [Bd, L]
            if sliding_window is not None:
                mask &= positions[None, :] > (context_lens[:, None] - 1 - sliding_window)
            self._per_device[key] = (block_tables, mask[:, None, None, :])
        return self._per_device[key]

    def kernel_inputs(self, device: torch.device):
        """(block_tables, context_lens, query_start_loc) tensors on ``device``, for the Triton kernels.
        Tensors already there are returned as they are (a captured graph's static buffers stay static)."""
        key = (device, "kernel")
        if key not in self._per_device:
            query_start_loc = self.query_start_loc_tensor
            if query_start_loc is None:
                query_start_loc = torch.tensor(self.query_start_loc, dtype=torch.int32)
            self._per_device[key] = (self.block_tables.to(device), self.context_lens.to(device),
                                     query_start_loc.to(device))
        return self._per_device[key]

    def slot_mapping_on(self, device: torch.device) -> torch.Tensor:
        key = (device, "slots")
        if key not in self._per_device:
            self._per_device[key] = self.slot_mapping.to(device)
        return self._per_device[key]


def _attend(query, key, value, mask, scaling, softcap):
    # query [N, Hq, Lq, D], key/value [N, Hkv, Lk, D], mask [N or 1, 1, Lq, Lk] bool -> [N, Hq, Lq, D]
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=num_heads != num_kv_heads
        )
    # SDPA has no softcap: the plain math path (Gemma-2 style tanh capping of the scores).
    if num_heads != num_kv_heads:
        key = key.repeat_interleave(num_heads // num_kv_heads, dim=1)
        value = value.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1).to(value.dtype), value)


def _causal_mask(num_query: int, context_len: int, sliding_window: int | None, device) -> torch.Tensor:
    # The query tokens are the last num_query of the context: query j sits at position
    # context_len - num_query + j and sees keys at positions <= its own (and within the window).
    query_pos = torch.arange(context_len - num_query, context_len, device=device)[:, None]
    key_pos = torch.arange(context_len, device=device)[None, :]
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask[None, None]  # [1, 1, Lq, Lk]


def attend_one_sequence(query, key_cache, value_cache, block_ids, context_len, scaling, sliding_window, softcap):
    """query [Lq, Hq, D] of one sequence; block_ids [n] of its blocks -> out [Lq, Hq, D]."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key = key_cache[block_ids].view(-1, num_kv_heads, head_dim)[:context_len]  # [Lk, Hkv, D]
    value = value_cache[block_ids].view(-1, num_kv_heads, head_dim)[:context_len]
    mask = _causal_mask(query.shape[0], context_len, sliding_window, query.device)
    out = _attend(query.transpose(0, 1)[None], key.transpose(0, 1)[None], value.transpose(0, 1)[None],
                  mask, scaling, softcap)
    return out[0].transpose(0, 1)


def reference_paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, context_lens,
                              scaling, sliding_window=None, softcap=None):
    """The oracle: every sequence on its own. query [T, Hq, D] -> out [T, Hq, D]."""
    out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    for i, context_len in enumerate(context_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        block_ids = block_tables[i, : -(-context_len // block_size)]
        out[start:end] = attend_one_sequence(query[start:end], key_cache, value_cache, block_ids, context_len,
                                             scaling, sliding_window, softcap)
    return out


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
    out = _attend(query[:, :, None, :], key, value, key_mask, scaling, softcap)  # [B, Hq, 1, D]
    return out[:, :, 0, :]


def paged_attention_forward(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, **kwargs):
    metadata: PagedAttentionMetadata | None = kwargs.get(METADATA_KWARG)
    if metadata is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs `{METADATA_KWARG}=` in the model call")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTENTION_NAME} expects a packed batch of 1 row, got {query.shape[0]}")
    if kwargs.get("s_aux") is not None:  # engine.support refuses such models; never ignore sinks silently
        raise NotImplementedError(f"{ATTENTION_NAME} attention has no attention sinks (s_aux)")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    key_cache = metadata.key_caches[module.layer_idx]
    value_cache = metadata.value_caches[module.layer_idx]
    if metadata.backend == "triton":
        return _triton_attention(metadata, query, key, value, key_cache, value_cache, scaling, sliding_window,
                                 softcap), None
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]

    # Store this step's K/V: [1, Hkv, T, D] -> [T, Hkv, D] rows of the flat pool.
    slots = metadata.slot_mapping_on(key_cache.device)
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[0].transpose(0, 1).to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[0].transpose(0, 1).to(value_cache.dtype))

    query = query[0].transpose(0, 1)  # [T, Hq, D]
    num_tokens = query.shape[0]
    num_decode = metadata.num_decode_seqs
    if num_decode == num_tokens:  # a pure decode step: no output buffer, no loop
        block_tables, key_mask = metadata.decode_inputs(query.device, sliding_window)
        out = decode_attention(query, key_cache, value_cache, block_tables, key_mask, scaling, softcap,
                               metadata.workspace)
        return out[None], None
    out = torch.empty_like(query)
    if num_decode:
        block_tables, key_mask = metadata.decode_inputs(query.device, sliding_window)
        out[:num_decode] = decode_attention(query[:num_decode], key_cache, value_cache, block_tables, key_mask,
                                            scaling, softcap, metadata.workspace)
    block_size = key_cache.shape[1]
    block_tables = metadata.block_tables.to(query.device)
    for i in range(num_decode, len(metadata.context_lens_list)):
        start, end = metadata.query_start_loc[i], metadata.query_start_loc[i + 1]
        context_len = metadata.context_lens_list[i]
        block_ids = block_tables[i, : -(-context_len // block_size)]
        out[start:end] = attend_one_sequence(query[start:end], key_cache, value_cache, block_ids, context_len,
                                             scaling, sliding_window, softcap)
    return out[None], None


def _triton_attention(metadata, query, key, value, key_cache, value_cache, scaling, sliding_window, softcap):
    from llm_api import kernels

    device = key_cache.device
    kernels.store_kv(key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache, value_cache,
                     metadata.slot_mapping_on(device))
    block_tables, context_lens, query_start_loc = metadata.kernel_inputs(device)
    query = query[0].transpose(0, 1)  # [T, Hq, D]
    if metadata.num_decode_seqs == query.shape[0]:
        out = kernels.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scaling,
                                             sliding_window=sliding_window, softcap=softcap)
    else:
        out = kernels.paged_prefill_attention(query, key_cache, value_cache, block_tables, query_start_loc,
                                              context_lens, metadata.max_query_len, scaling,
                                              sliding_window=sliding_window, softcap=softcap)
    return out[None]


def register_paged_attention() -> str:
    """Register the function with transformers (idempotent) and return the name to select it by."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
