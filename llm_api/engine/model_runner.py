"""Runs one scheduled step of an already-loaded Hugging Face decoder on the paged KV cache.

``ModelRunner(model, kv_cache, backend)`` switches the model to the paged attention function (any decoder
whose attention goes through transformers' ``AttentionInterface``). ``execute(scheduler_output)`` packs
every scheduled request's new tokens into one ``[1, num_tokens]`` batch (single-token sequences first, as
the attention backends expect), with per-token positions, the slot mapping and the block tables, runs the
forward with ``use_cache=False``, and returns logits ``[num_sampled, vocab]`` only at the last token of
each request that samples this step (``logits_to_keep`` keeps ``lm_head`` off the other positions), with
those requests in the same order. A request scheduled with a draft (speculative decoding) feeds its
last token and the draft ids, and gets a logits row at each of those 1 + k positions (consecutive rows,
in its place in that order): the verification needs the target distribution after every draft prefix.
A request asking for prompt logprobs (``SamplingParams.prompt_logprobs``) also gets logits at each prompt
position of its chunk; the runner turns them into the prompt tokens' logprobs (``Request.prompt_logprobs``)
and returns only the sampled rows. A request that pools its prompt (``SamplingParams.pooling``: embeddings)
has the decoder's output (the last hidden state, after the final norm) at each prompt position of its chunk
summed (``mean``) or its last row kept (``last``) in ``Request.pooled``, read from a forward hook on the
model's decoder (``get_decoder()``) for that step only: every route a forward takes (the whole-decoder C
call included) returns that state, and no logits are computed for those positions.

Block tables come from the scheduler's deltas (``BlockTables``: new block ids per step, rebuilt when a
sequence is admitted, resumed, forked or copied on write), never from the scheduler's own lists; they
are kept per sequence (``Request.seq_id``: the n sequences of one request each have their own). The
step's ``block_copies`` (copy on write of a shared partial block) are applied before the forward.

Requests built from ``prompt_embeds`` feed their prompt positions from the embeddings (the rest, i.e.
generated tokens being recomputed after a preemption, from the embedding table).

With ``enable_decode_graphs`` (a backend that ``supports_cuda_graphs``), a step where every request
feeds one token id and samples, and which fits the largest captured size, goes through
``DecodeGraphRunner``.

The model runs as llm_api's own decoder where its family is one we own (``llm_api.models``: Llama, Mistral,
Qwen2, Qwen3 and what shares their shape), on the kernel set chosen for its device (``fused_kernels``: the C set
on a CPU given ``cpu_kernels_cache``, Triton's on CUDA; else torch's), with q/k/v and gate/up merged
(``fused_layers``); every other family runs transformers' classes with the paged attention function. ``path``
says which and why (logged at start).

With a LoRA registry, each request's packed tokens are tagged with its adapter (``Request.lora_id``) and
the forward runs inside ``llm_api.lora.context.lora_step``: the wrapped linears add each row's delta.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from array import array
from typing import Any, cast

import torch
from torch import nn

from llm_api.engine.attention import METADATA_KWARG, AttentionBackend, register_paged_attention
from llm_api.engine.cuda_graphs import DecodeGraphRunner, DecodeRow
from llm_api.engine.kv_cache import PagedKVCache
from llm_api.engine.request import Request
from llm_api.engine.sampler import prompt_logprobs
from llm_api.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from llm_api.lora.context import lora_step
from llm_api.model.placement import execution_device
from llm_api.models.families import own_model
from llm_api.models.kernel_choice import choose_kernel_set


class BlockTables:
    """The runner's copy of each running request's block table, kept from the scheduler's deltas.

    Between two rebuilds a table only grows, and ``version`` changes only on a rebuild (admission or
    resumption), so a consumer that wrote the first n entries of a request's table under one version can
    write just the rest later (the CUDA-graph runner does)."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}
        self._versions: dict[str, int] = {}
        self._counter = itertools.count()

    def update(self, output: SchedulerOutput) -> None:
        for request_id in output.ended_request_ids:  # (seq ids)
            self._tables.pop(request_id, None)
            self._versions.pop(request_id, None)
        for item in output.scheduled:
            request_id = item.request.seq_id
            if item.is_new:
                self._tables[request_id] = list(item.new_block_ids)
                self._versions[request_id] = next(self._counter)
            elif item.new_block_ids:
                self._tables[request_id].extend(item.new_block_ids)

    def __getitem__(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def version(self, request_id: str) -> int:
        return self._versions[request_id]

    def __len__(self) -> int:
        return len(self._tables)


class ModelRunner:
    def __init__(self, model: nn.Module, kv_cache: PagedKVCache, backend: AttentionBackend, lora: Any = None,
                 fused_kernels: bool = False, fused_layers: bool = True, cpu_kernels_cache: str | None = None):
        self.loaded = model  # the transformers model as loaded (its modules shared with the model the steps run)
        self.lora = lora  # llm_api.lora.registry.LoraRegistry, or None
        self.kv_cache = kv_cache
        self.backend = backend
        self.decode_graphs: DecodeGraphRunner | None = None
        self.block_size = kv_cache.block_size
        self.block_tables = BlockTables()
        hf_model: Any = model  # (nn.Module's __getattr__ is typed Tensor | Module)
        transformers_classes = callable(getattr(hf_model, "set_attn_implementation", None))
        if transformers_classes:  # (else our module tree, llm_api.model.decoder_weights: only our decoder runs it)
            name = register_paged_attention()
            hf_model.set_attn_implementation(name)
            if getattr(hf_model.config, "_attn_implementation", None) != name:
                raise NotImplementedError(
                    f"{type(model).__name__} does not take a pluggable attention function (AttentionInterface)"
                )
        self.input_embeddings = hf_model.get_input_embeddings()
        # Not the weight's device: an offloaded embedding's weight is on "meta" until its hook runs.
        self.input_device = execution_device(model, self.input_embeddings)
        output_embeddings = hf_model.get_output_embeddings()
        self.logits_device = (execution_device(model, output_embeddings) if output_embeddings is not None
                              else self.input_device)
        # The model the steps run: ours where its family is, else the loaded one (set to the paged attention above).
        kernels = choose_kernel_set(model, fused_kernels, cpu_kernels_cache)
        owned, self.path = own_model(model, kernels, merged=fused_layers)
        if owned is None and not transformers_classes:
            raise NotImplementedError(f"{type(model).__name__} has no forward of its own, and llm_api's decoder "
                                      f"refused it: {self.path.reason}")
        self.model: nn.Module = owned if owned is not None else model
        self.takes_logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters

    @torch.inference_mode()
    def enable_decode_graphs(self, max_model_len: int, batch_sizes: list[int], capture: bool) -> None:
        """Run pure decode steps of up to ``max(batch_sizes)`` sequences through a ``DecodeGraphRunner``
        (``capture=False``: its static-buffer path, eagerly). Needs a backend that supports CUDA graphs
        (padding rows rely on it) and the whole model on one device."""
        if not self.backend.supports_cuda_graphs:
            raise ValueError(f"decode graphs need an attention backend that supports them, not {self.backend.name}")
        devices = set(self.kv_cache.layout.layer_devices) | {self.input_device, self.logits_device}
        if len(devices) != 1:
            raise ValueError(f"decode graphs need the whole model on one device, found {sorted(map(str, devices))}")
        runner = DecodeGraphRunner(self.model, self.kv_cache, self.backend, self.input_device, max_model_len,
                                   batch_sizes, capture)
        runner.capture()
        self.decode_graphs = runner

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> tuple[torch.Tensor, list[Request]]:
        """-> (logits [num_sampled, V], the requests those rows belong to)."""
        self.block_tables.update(scheduler_output)
        if scheduler_output.block_copies:
            self.kv_cache.copy_blocks(scheduler_output.block_copies)
        scheduled = scheduler_output.scheduled
        graph_rows = self._graph_decode_rows(scheduled)
        if graph_rows is not None:
            assert self.decode_graphs is not None  # (rows come only from a graph runner)
            return self.decode_graphs.run(graph_rows), [s.request for s in scheduled]
        block_size = self.block_size
        ordered = [s for s in scheduled if s.num_new_tokens == 1] + [s for s in scheduled if s.num_new_tokens > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        context_lens: list[int] = []
        block_table_rows: list[list[int]] = []
        logit_indices: list[int] = []
        sampled_requests: list[Request] = []
        prompt_logit_indices: list[int] = []  # packed positions whose logits score the next prompt token
        prompt_logit_rows: list[tuple[Request, int, int]] = []  # (request, first position, count)
        embeds_segments = []  # (packed offset, request, first position, end position) fed from embeddings
        pooled_rows: list[tuple[Request, int, int]] = []  # (request, first packed position, count) to pool
        lora_ranges = []  # (lora id, first packed token, end) of each request
        for item in ordered:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            block_ids = self.block_tables[request.seq_id]
            if item.num_new_tokens == 1:  # the common decode case, without building lists
                input_ids.append(_token_id_at(request, start))
                positions.append(start)
                slot_mapping.append(_slot_of(block_ids, start, block_size))
            else:
                input_ids.extend(request.token_ids(start, end))  # (stops at the last token when drafted)
                input_ids.extend(item.draft_token_ids)
                positions.extend(range(start, end))
                slot_mapping.extend(_slot_of(block_ids, p, block_size) for p in range(start, end))
            if request.prompt_embeds is not None and start < request.num_prompt_tokens:
                embeds_segments.append((query_start_loc[-1], request, start, min(end, request.num_prompt_tokens)))
            if request.needs_prompt_logits:
                first = max(start, len(request.prompt_logprobs))
                last = min(end, request.num_prompt_tokens - 1)
                if first < last:
                    offset = query_start_loc[-1] - start
                    prompt_logit_indices.extend(range(offset + first, offset + last))
                    prompt_logit_rows.append((request, first, last - first))
            if request.needs_prompt_hidden:
                first = max(start, request.num_pooled)
                last = min(end, request.num_prompt_tokens)
                if first < last:
                    pooled_rows.append((request, query_start_loc[-1] - start + first, last - first))
            if self.lora is not None:
                lora_ranges.append((request.lora_id, query_start_loc[-1], query_start_loc[-1] + item.num_new_tokens))
            query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
            context_lens.append(end)
            block_table_rows.append(block_ids)
            if item.samples:
                end_loc = query_start_loc[-1]
                logit_indices.extend(range(end_loc - 1 - len(item.draft_token_ids), end_loc))
                sampled_requests.append(request)

        device = self.input_device
        metadata = self.backend.metadata(
            key_caches=self.kv_cache.key_caches,
            value_caches=self.kv_cache.value_caches,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
            block_tables=_padded_block_table(block_table_rows).to(device),
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
            query_start_loc=query_start_loc,
            context_lens_list=context_lens,
            num_decode_seqs=sum(1 for s in ordered if s.num_new_tokens == 1),
            max_query_len=max(s.num_new_tokens for s in ordered),
        )
        token_ids = torch.tensor([input_ids], dtype=torch.long, device=device)  # [1, T]
        model_inputs = {
            "position_ids": torch.tensor([positions], dtype=torch.long, device=device),  # [1, T]
            "use_cache": False,
            METADATA_KWARG: metadata,
        }
        if embeds_segments:
            model_inputs["inputs_embeds"] = self._embeddings_with_prompts(token_ids, embeds_segments)
        else:
            model_inputs["input_ids"] = token_ids
        lora = self.lora.step(lora_ranges, len(input_ids), device) if self.lora is not None else None
        kept = logit_indices + prompt_logit_indices
        with lora_step(lora), _decoder_output(self.model, bool(pooled_rows)) as hidden:
            if self.takes_logits_to_keep:
                model_inputs["logits_to_keep"] = torch.tensor(kept, dtype=torch.long, device=device)
                logits = self.model(**model_inputs).logits[0]  # [num_sampled + num prompt rows, V]
            else:
                logits = self.model(**model_inputs).logits[0, kept]
        if pooled_rows:
            _pool(hidden, pooled_rows)
        if prompt_logit_rows:
            _keep_prompt_logprobs(logits[len(logit_indices):], prompt_logit_rows)
            logits = logits[: len(logit_indices)]
        return logits, sampled_requests

    def _graph_decode_rows(self, scheduled: list[ScheduledRequest]) -> list[DecodeRow] | None:
        """The step as decode rows if the graph runner can take it, else None (run it eagerly)."""
        if self.decode_graphs is None or not self.decode_graphs.accepts(len(scheduled)):
            return None
        block_size = self.block_size
        rows = []
        for item in scheduled:
            request = item.request
            position = request.num_computed_tokens
            if item.num_new_tokens != 1 or not item.samples or request.needs_prompt_hidden:
                return None
            if request.prompt_embeds is not None and position < request.num_prompt_tokens:
                return None  # fed from embeddings, not an id
            block_ids = self.block_tables[request.seq_id]
            rows.append(DecodeRow(_token_id_at(request, position), position, _slot_of(block_ids, position, block_size),
                                  request.seq_id, self.block_tables.version(request.seq_id), block_ids))
        return rows

    def _embeddings_with_prompts(self, token_ids: torch.Tensor, segments) -> torch.Tensor:
        embeds = self.input_embeddings(token_ids)  # [1, T, H]
        for offset, request, first, end in segments:
            rows = request.prompt_embeds[first:end]  # [n, H]
            embeds[0, offset : offset + rows.shape[0]] = rows.to(embeds.device, embeds.dtype)
        return embeds


@contextlib.contextmanager
def _decoder_output(model: nn.Module, wanted: bool):
    """While a forward runs: a list that receives the decoder's last hidden state [1, T, H] (``wanted``)."""
    captured: list[torch.Tensor] = []
    if not wanted:
        yield captured
        return

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):  # (the owned decoder's output: the state itself)
            captured.append(output)
            return
        state = getattr(output, "last_hidden_state", None)
        captured.append(state if state is not None else output[0])

    handle = cast(Any, model).get_decoder().register_forward_hook(keep)
    try:
        yield captured
    finally:
        handle.remove()


def _pool(captured: list[torch.Tensor], rows: list[tuple[Request, int, int]]) -> None:
    """Each pooling request's rows of this step's last hidden state -> ``Request.pooled`` (float32, CPU)."""
    hidden = captured[-1][0]  # [T, H] (the decoder runs once per step)
    for request, first, count in rows:
        chunk = hidden[first : first + count].float()
        if request.params.pooling == "mean":
            total = chunk.sum(dim=0).cpu()
            request.pooled = total if request.pooled is None else request.pooled + total
        else:
            request.pooled = chunk[-1].cpu().clone()
        request.num_pooled += count


def _keep_prompt_logprobs(logits: torch.Tensor, rows: list[tuple[Request, int, int]]) -> None:
    """Each request's prompt logits of this step -> the logprobs of the prompt tokens they predict, appended
    to ``Request.prompt_logprobs`` (the positions follow on from those it holds)."""
    row = 0
    for request, first, count in rows:
        targets = request.prompt_token_ids[first + 1 : first + 1 + count]
        k = request.params.prompt_logprobs
        assert k is not None  # (rows come only from requests that asked)
        request.prompt_logprobs.extend(prompt_logprobs(logits[row : row + count], targets, k))
        row += count


def _token_id_at(request: Request, position: int) -> int:
    num_prompt = request.num_prompt_tokens
    return (request.prompt_token_ids[position] if position < num_prompt
            else request.output_token_ids[position - num_prompt])


def _slot_of(block_ids: list[int], position: int, block_size: int) -> int:
    """The flat pool row holding ``position`` of a sequence with these blocks."""
    return block_ids[position // block_size] * block_size + position % block_size


def _padded_block_table(rows: list[list[int]]) -> torch.Tensor:
    """[len(rows), longest] int64 CPU tensor of block ids, each row padded with block 0 (never read: the
    attention reads a row only up to its sequence's length). Built through one flat ``array`` because
    ``torch.tensor`` on nested lists costs ~1 ms at 128 rows of 64 blocks, on every step."""
    width = max(map(len, rows))
    flat = array("q")
    for row in rows:
        flat.extend(row)
        if len(row) < width:
            flat.extend([0] * (width - len(row)))
    return torch.frombuffer(flat, dtype=torch.long).view(len(rows), width)  # (keeps ``flat`` alive)
