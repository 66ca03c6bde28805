"""LLMEngine: continuous batching over a paged KV cache, one ``step()`` at a time (token ids only).

``step()`` is the whole algorithm: the scheduler picks this step's tokens, the model runner computes
logits at the last token of each request that is due a new token, the sampler picks those tokens, and
the scheduler appends them, finishes requests (EOS, max_new_tokens, length limit) and frees their blocks.
A structured-output sequence has a grammar matcher (``llm_api.structured.matcher``): the step asks the
matchers for the token masks, the sampler applies them, and the step then advances the matchers with the
tokens it keeps (the sampler never touches a matcher).

A request with ``params.n`` > 1 is n sequences (``Request.index`` 0..n-1, one ``SamplingState`` each):
the prompt is prefilled once, by index 0; the step that completes it samples every sequence's first
token from that one logits row (the row is repeated in the sampler's batch) and the scheduler forks the
others onto the prompt's blocks. Outputs carry the sequence's ``index``; ``abort_request`` ends all n.
With ``params.logprobs`` set, each output carries the sampled token's ``TokenLogprob``.
On CUDA the KV pool is sized from a profiled worst-case step (``memory_profile``) and pure decode steps
replay CUDA graphs (``cuda_graphs``, Triton attention only; not while LoRA adapters are served: the
graphs would need the per-row adapter slots as a static input, so the decode step then runs eagerly).
With a ``LoraRegistry``, ``add_request(..., lora_id=)`` runs a request under an adapter: requests of
different adapters and of the base model share every step (``llm_api.lora``).

With ``speculative_tokens`` = k > 0 (``llm_api.engine.speculative``), decoding sequences draft up to k
tokens by n-gram prompt lookup; the runner returns a logits row per drafted position and
``speculative.verify`` turns them into the accepted tokens plus one, so a step may add several tokens to a
sequence (one ``RequestOutput`` with all of them). Speculative steps run eagerly (never a decode graph).

Not thread-safe, by design: one owner calls ``add_request``, ``abort_request`` and ``step`` (in the
server, ``llm_api.service.engine_loop.EngineLoop``'s thread, fed by messages), so an abort always lands
between two steps and frees the request's blocks at once. ``generate_batch_stream`` drives it
synchronously for tests and benchmarks.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn

from llm_api.engine.block_pool import BlockPool
from llm_api.engine.attention import select_backend
from llm_api.engine.cuda_graphs import capture_batch_sizes
from llm_api.engine.kv_cache import PagedKVCache, choose_num_blocks, cuda_layer_devices, layout_for_model
from llm_api.engine.memory_profile import profile_device_memory, profile_sequence_lengths
from llm_api.engine.model_runner import ModelRunner
from llm_api.engine.request import FinishReason, Request, RequestOutput
from llm_api.engine.scheduler import PromptTooLongError, Scheduler
from llm_api.engine.scheduler_config import SchedulerConfig
from llm_api.engine.speculative.drafter import Drafter, SpeculativeConfig
from llm_api.engine.speculative.verify import split_drafted_rows, verify
from llm_api.layers.quantized import embedding_dtype
from llm_api.engine.step_budget import CUDA_TOKEN_BUDGET, BudgetCache, CpuStepBudget
from llm_api.engine.support import check_supported
from llm_api.engine.sampler import Sampler, SamplerBatch, SamplingState, greedy_pick
from llm_api.engine.sampling_params import SamplingParams
from llm_api.model.settings import Settings
from llm_api.structured.bitmask import TokenMask
from llm_api.structured.matcher import GrammarMatcher, advance, step_mask

__all__ = ["LLMEngine", "EngineConfig", "EngineStats", "RequestOutput", "PromptTooLongError"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """What the engine runs with. A field that is also a setting takes its default from ``Settings`` (the one
    declaration of each default); ``from_settings`` maps a whole ``Settings`` onto these fields."""

    block_size: int = Settings.kv_block_size
    num_blocks: int | None = None  # None: sized from kv_cache_memory_mib / free memory / CPU default
    kv_cache_memory_mib: int = Settings.kv_cache_memory_mib
    gpu_memory_utilization: float = Settings.gpu_memory_utilization
    max_num_seqs: int = Settings.max_num_seqs
    # Tokens per step; None: sized to the device (step_budget), which MAX_NUM_BATCHED_TOKENS=0 asks for. Built
    # directly, an engine takes the fixed CUDA budget instead and measures nothing.
    max_num_batched_tokens: int | None = CUDA_TOKEN_BUDGET
    max_model_len: int | None = None  # prompt + output tokens; None: the model's position limit
    enable_prefix_caching: bool = True
    attention_backend: str = Settings.attention_backend  # auto | torch | triton (llm_api.kernels; auto: triton on CUDA)
    cuda_graphs: bool = Settings.cuda_graphs  # capture the decode step on CUDA (ignored elsewhere)
    cuda_graph_max_batch_size: int = Settings.cuda_graph_max_batch_size  # largest captured decode batch (<= max_num_seqs)
    # The owned model's kernel set (llm_api.models.kernel_choice): Triton's on CUDA, the C set on a CPU (with
    # cpu_kernels_cache, below); off: the torch set.
    fused_kernels: bool = Settings.fused_kernels
    # The owned model's q/k/v and gate/up as one product each (and the C set's whole layers, which need them). Not a
    # setting: bench/gpu_decode.py --no-fused-layers turns it off to compare.
    fused_layers: bool = True
    speculative_tokens: int = Settings.speculative_tokens  # k draft tokens per step (n-gram prompt lookup); 0: off
    ngram_min: int = Settings.ngram_min
    ngram_max: int = Settings.ngram_max
    speculative_max_batch: int = Settings.speculative_max_batch  # no drafts on steps with more decoding sequences
    step_budget_cache: str = ""  # where measured CPU step budgets are kept (step_budget.BudgetCache); "": nowhere
    # The cache folder where llm_api.kernels.cpu builds its library: with fused_kernels, a model on the CPU runs
    # the fused decoder layers with those C kernels. "": none (transformers' code), as an engine built directly.
    cpu_kernels_cache: str = ""
    # Owner -> how far its priorities count against other owners' requests (LLM_API_KEY's priority=N, by owner:
    # llm_api.service.owners.priority_grants; SchedulerConfig.priority_grants says how).
    priority_grants: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Settings) -> "EngineConfig":
        return cls(
            block_size=settings.kv_block_size,
            kv_cache_memory_mib=settings.kv_cache_memory_mib,
            gpu_memory_utilization=settings.gpu_memory_utilization,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens or None,
            max_model_len=settings.max_input_tokens + settings.max_new_tokens,
            attention_backend=settings.attention_backend,
            cuda_graphs=settings.cuda_graphs,
            cuda_graph_max_batch_size=settings.cuda_graph_max_batch_size,
            fused_kernels=settings.fused_kernels,
            speculative_tokens=settings.speculative_tokens,
            ngram_min=settings.ngram_min,
            ngram_max=settings.ngram_max,
            speculative_max_batch=settings.speculative_max_batch,
            step_budget_cache=str(Path(settings.cache_dir) / "step-budget"),
            cpu_kernels_cache=settings.cache_dir,
        )


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    max_model_len: int
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up at admission
    prefix_cache_hits: int  # of those, tokens reused from the cache
    num_prefill_tokens_computed: int
    num_decode_tokens_computed: int
    num_steps: int
    running_lora_ids: tuple[int, ...] = ()  # the LoRA adapters (load ids) of running / waiting requests
    waiting_lora_ids: tuple[int, ...] = ()
    # Speculative decoding (0 when off): drafted and accepted tokens, and accepted / drafted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_acceptance_rate: float = 0.0


class LLMEngine:
    def __init__(self, model: nn.Module, config: EngineConfig, eos_token_ids: set[int], lora: Any = None):
        """``lora``: the ``llm_api.lora.registry.LoraRegistry`` that wrapped ``model``'s linears, when
        adapters are served (requests then name one by ``lora_id``)."""
        check_supported(model)  # UnsupportedModelError before any memory is taken
        self.config = config
        self.model = model
        model_config: Any = model.config  # (nn.Module's __getattr__ is typed Tensor | Module)
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.vocab_size = text_config.vocab_size
        self.hidden_size = text_config.hidden_size
        model_max_len = getattr(text_config, "max_position_embeddings", None) or 1 << 30
        wanted_max_len = min(config.max_model_len or model_max_len, model_max_len)
        layout = layout_for_model(model)
        self.attention = select_backend(config.attention_backend, layout.layer_devices)
        device_memory = None
        on_cuda = bool(cuda_layer_devices(layout))
        if config.max_num_batched_tokens is None and on_cuda:
            config = dataclasses.replace(config, max_num_batched_tokens=CUDA_TOKEN_BUDGET)
            self.config = config
        if not config.num_blocks and not config.kv_cache_memory_mib and on_cuda:
            assert config.max_num_batched_tokens is not None  # set to CUDA_TOKEN_BUDGET above when on CUDA
            lengths = profile_sequence_lengths(config.max_num_batched_tokens, config.max_num_seqs, wanted_max_len)
            device_memory = profile_device_memory(model, layout, config.block_size, self.attention, lengths)
            for device, memory in device_memory.items():
                logger.info("%s: %.2f GiB total x %.2f utilization - %.2f GiB weights and activation peak "
                            "(%d-token step) - %.2f GiB outside torch = %.2f GiB for the KV cache", device,
                            memory.total / 2**30, config.gpu_memory_utilization, memory.torch_peak / 2**30,
                            sum(lengths), memory.non_torch / 2**30,
                            memory.kv_budget(config.gpu_memory_utilization) / 2**30)
        num_blocks = choose_num_blocks(
            layout, config.block_size, num_blocks=config.num_blocks, memory_mib=config.kv_cache_memory_mib,
            gpu_memory_utilization=config.gpu_memory_utilization, max_num_seqs=config.max_num_seqs,
            max_model_len=wanted_max_len, device_memory=device_memory,
        )
        self.kv_cache = PagedKVCache(layout, num_blocks, config.block_size)
        # One request never needs more than the whole pool, so it can always run alone.
        self.max_model_len = min(wanted_max_len, self.kv_cache.max_num_tokens)
        self.lora = lora
        self.runner = ModelRunner(model, self.kv_cache, self.attention, lora, fused_kernels=config.fused_kernels,
                                  fused_layers=config.fused_layers, cpu_kernels_cache=config.cpu_kernels_cache or None)
        self.step_budget: CpuStepBudget | None = None
        if config.max_num_batched_tokens is None:  # a CPU: size the step to it (chunked prefill)
            self.step_budget = CpuStepBudget(self.runner, model, BudgetCache(Path(config.step_budget_cache)
                                                                             if config.step_budget_cache else None),
                                             config.block_size, config.max_num_seqs, self.max_model_len)
            budget = self.step_budget.start(list(range(self.step_budget.probe_blocks_needed(num_blocks))))
            config = self.config = dataclasses.replace(config, max_num_batched_tokens=budget)
        self._enable_decode_graphs(config)
        assert config.max_num_batched_tokens is not None  # set above: CUDA_TOKEN_BUDGET, or the CPU's budget
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
                            lora.max_loras if lora is not None else 0, dict(config.priority_grants)),
            BlockPool(num_blocks, config.block_size, config.enable_prefix_caching),
            set(eos_token_ids),
            drafter=Drafter(SpeculativeConfig(config.speculative_tokens, config.ngram_min, config.ngram_max,
                                              config.speculative_max_batch)) if config.speculative_tokens else None,
        )
        self.sampler = Sampler()
        self._pending_outputs: list[RequestOutput] = []  # abort notices, reported by the next step()
        self._num_steps = 0
        logger.info("paged KV cache: %d blocks x %d tokens (%d tokens, %.1f MiB), max_model_len %d, attention %s",
                    num_blocks, config.block_size, self.kv_cache.max_num_tokens, self.kv_cache.num_bytes / 2**20,
                    self.max_model_len, self.attention.name)

    def _enable_decode_graphs(self, config: EngineConfig) -> None:
        """CUDA graphs for the decode step when asked for and possible; otherwise say why once and run eagerly."""
        if not config.cuda_graphs or self.runner.input_device.type != "cuda":
            return
        reason = None
        if self.lora is not None:  # (the slot tensor is no static input of the captured graphs)
            reason = "LoRA adapters are served"
        elif not self.attention.supports_cuda_graphs:
            reason = f"the {self.attention.name} attention backend does not support them"
        elif getattr(self.model.config, "quantization_config", None) is not None:
            reason = "quantized weights are not captured"
        elif any(hasattr(m, "_hf_hook") for m in self.model.modules()):
            reason = "accelerate hooks (device maps, offload) move tensors during the forward"
        if reason is None:
            sizes = capture_batch_sizes(min(config.cuda_graph_max_batch_size, config.max_num_seqs))
            try:
                self.runner.enable_decode_graphs(self.max_model_len, sizes, capture=True)
                return
            except Exception as err:  # a model whose forward cannot be captured still serves, eagerly
                self.runner.decode_graphs = None
                reason = f"capture failed: {type(err).__name__}: {err}"
        logger.warning("CUDA graphs off (%s); the decode step runs eagerly", reason)

    @property
    def cuda_graph_batch_sizes(self) -> list[int]:
        """The captured decode batch sizes (empty when the decode step runs eagerly)."""
        graphs = self.runner.decode_graphs
        return list(graphs.batch_sizes) if graphs is not None and graphs.capture_enabled else []

    # ----------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt_token_ids: list[int] | None, params: SamplingParams,
                    prompt_embeds: torch.Tensor | None = None, lora_id: int = 0, priority: int = 0,
                    owner: str = "") -> None:
        """Queue a request (its n sequences); ``priority``: lower is served first among ``owner``'s requests,
        and owners share the engine fairly (the scheduler, llm_api.engine.fair_share)."""
        if lora_id and self.lora is None:
            raise ValueError("this engine serves no LoRA adapters")
        request = self._build_request(request_id, prompt_token_ids, params, prompt_embeds)
        request.lora_id, request.priority, request.owner = lora_id, priority, owner
        if params.n < 1:
            raise ValueError(f"n must be >= 1, got {params.n}")
        siblings = [Request(request_id=request_id, prompt_token_ids=request.prompt_token_ids, params=params,
                            sampling_state=SamplingState.for_params(params, self.runner.logits_device, index),
                            # each choice follows the grammar on its own (a matcher holds one sequence's state)
                            grammar_matcher=GrammarMatcher(params.grammar) if params.grammar is not None else None,
                            prompt_embeds=request.prompt_embeds, index=index, lora_id=lora_id, priority=priority,
                            owner=owner)
                    for index in range(1, params.n)]
        self.scheduler.add(request, siblings)
        logger.debug("request %s added: %d prompt tokens, n=%d", request_id, request.num_prompt_tokens, params.n)

    def _build_request(self, request_id, prompt_token_ids, params, prompt_embeds) -> Request:
        if prompt_embeds is not None:
            if prompt_token_ids:
                raise ValueError("give prompt_token_ids or prompt_embeds, not both")
            if prompt_embeds.ndim == 3 and prompt_embeds.shape[0] == 1:
                prompt_embeds = prompt_embeds[0]
            if prompt_embeds.ndim != 2 or prompt_embeds.shape[1] != self.hidden_size:
                raise ValueError(f"prompt_embeds must be [num_tokens, {self.hidden_size}], "
                                 f"got {list(prompt_embeds.shape)}")
            dtype = embedding_dtype(self.runner.input_embeddings)  # (an offloaded weight on "meta" keeps its dtype)
            prompt_embeds = prompt_embeds.detach().to(self.runner.input_device, dtype)
            # Placeholder ids: only their count matters; such requests never use the prefix cache.
            prompt_token_ids = [0] * prompt_embeds.shape[0]
        elif prompt_token_ids is None:
            raise ValueError("give prompt_token_ids or prompt_embeds")
        else:
            prompt_token_ids = list(prompt_token_ids)
            if prompt_token_ids and not all(isinstance(t, int) and 0 <= t < self.vocab_size
                                            for t in prompt_token_ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if any(not 0 <= token_id < self.vocab_size for token_id, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {self.vocab_size})")
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            params=params,
            sampling_state=SamplingState.for_params(params, self.runner.logits_device),
            grammar_matcher=GrammarMatcher(params.grammar) if params.grammar is not None else None,
            prompt_embeds=prompt_embeds,
        )

    def abort_request(self, request_id: str, index: int | None = None) -> None:
        """End the request (every sequence, or only choice ``index``) and free its blocks; the next step
        reports each ended sequence as aborted."""
        for request in self.scheduler.abort(request_id, index):
            self._pending_outputs.append(RequestOutput(request_id, [], True, FinishReason.ABORT, request.index))

    def has_unfinished_requests(self) -> bool:
        """True while ``step()`` has work to do or outputs to report."""
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs)

    # ----------------------------------------------------------------- while idle

    def idle_work_delay(self) -> float | None:
        """Seconds of idleness after which ``idle_work()`` has something to do (re-measuring the CPU step
        budget: ``llm_api.engine.step_budget``); None when it has nothing."""
        return self.step_budget.idle_delay() if self.step_budget is not None else None

    def idle_work(self, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Re-measure the step budget into free blocks (only while no request runs); raise it if it grew.
        Stops early once ``interrupted()`` (work arrived: ``step_budget``'s module docstring)."""
        if self.step_budget is None or self.has_unfinished_requests():
            return
        pool = self.scheduler.block_pool
        needed = self.step_budget.probe_blocks_needed(pool.num_blocks)
        if pool.num_free_blocks < needed:
            return
        block_ids = pool.allocate(needed)
        try:
            raised = self.step_budget.refine(block_ids, interrupted)
        finally:
            pool.free(block_ids)
        if raised is not None:
            self.config = dataclasses.replace(self.config, max_num_batched_tokens=raised)
            self.scheduler.config = dataclasses.replace(self.scheduler.config, max_num_batched_tokens=raised)

    # ----------------------------------------------------------------- one step

    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            return outputs
        self._num_steps += 1
        self.kv_cache.zero_blocks(self.scheduler.block_pool.take_blocks_to_zero())  # (before any reads them)
        logits, sampled_requests = self.runner.execute(scheduler_output)  # [num_sampled, V]
        sampled_token_ids: dict = {}
        sampled_logprobs: dict | None = None
        drafts = {s.request.seq_id: s.draft_token_ids for s in scheduler_output.scheduled if s.draft_token_ids}
        picked = self._greedy_pick(scheduler_output, logits, sampled_requests) if not drafts else None
        if picked is not None:  # (the common greedy step: one pass over the logits, one copy to the host)
            outputs += self.scheduler.update(scheduler_output, picked, None)
            return outputs
        logits, sampled_requests = self._end_non_finite(logits, sampled_requests, drafts, outputs)
        if drafts:  # (a drafted sequence just ended has no rows left to verify)
            kept_ids = {r.seq_id for r in sampled_requests}
            drafts = {seq_id: draft for seq_id, draft in drafts.items() if seq_id in kept_ids}
        if drafts:  # drafted sequences are verified; the rest of the step samples as usual
            logits, sampled_requests, drafted_logits, drafted = split_drafted_rows(logits, sampled_requests, drafts)
            verified = verify(drafted_logits, drafted, [drafts[r.seq_id] for r in drafted],
                              self._sampler_batch(drafted), [r.grammar_matcher for r in drafted],
                              self.scheduler.eos_token_ids)
            sampled_token_ids = {r.seq_id: v.token_ids for r, v in zip(drafted, verified)}
            if any(v.logprobs is not None for v in verified):
                sampled_logprobs = {r.seq_id: tuple(v.logprobs) for r, v in zip(drafted, verified)
                                    if v.logprobs is not None}
        if sampled_requests:
            logits, sampled_requests = self._with_forks(scheduler_output, logits, sampled_requests)
            # The matchers give the masks, the sampler applies them, and the matchers then take the tokens
            # (each fork has its own matcher: its row of the repeated logits gets its own mask).
            matchers = [r.grammar_matcher for r in sampled_requests]
            token_mask = step_mask(matchers, logits.shape[-1])
            sampled = self.sampler(logits, self._sampler_batch(sampled_requests, token_mask))
            token_ids = sampled.token_ids.tolist()
            if token_mask is not None:
                advance(matchers, token_ids)
            sampled_token_ids.update(zip((r.seq_id for r in sampled_requests), token_ids))
            if sampled.logprobs is not None:
                sampled_logprobs = sampled_logprobs or {}
                sampled_logprobs.update((r.seq_id, lp) for r, lp in zip(sampled_requests, sampled.logprobs)
                                        if lp is not None)
        outputs += self.scheduler.update(scheduler_output, sampled_token_ids, sampled_logprobs)
        return outputs

    @staticmethod
    def _greedy_pick(scheduler_output, logits: torch.Tensor, requests: list[Request]) -> dict | None:
        """{seq id: token} when every sampled row takes the bare argmax (no bias, penalty, logprobs, grammar or
        fork) and every row's logits are finite, both learnt with one copy to the host (on CUDA from one pass
        of ``kernels.greedy``: ``sampler.greedy_pick``); None otherwise: the full path, which ends non-finite
        rows, runs."""
        if not requests or any(s.forks for s in scheduler_output.scheduled) or not all(
                r.params.argmax_only and r.grammar_matcher is None for r in requests):
            return None
        token_list, finite_list = greedy_pick(logits).tolist()
        if not all(finite_list):
            return None
        return dict(zip((r.seq_id for r in requests), token_list))

    def _end_non_finite(self, logits: torch.Tensor, requests: list[Request], drafts: dict,
                        outputs: list[RequestOutput]) -> tuple[torch.Tensor, list[Request]]:
        """Containment: a sequence whose logits hold a NaN or an infinity (a hostile LoRA adapter's weights:
        LoRA deltas reach only their own rows, ``llm_api.lora.ops``) ends alone with ``NON_FINITE``, its blocks
        leave the prefix cache and are zeroed before reuse; the other rows are sampled as if it were not there.
        (A prefill chunk that samples nothing is not checked; the request's sampling step finds it.)"""
        finite = torch.isfinite(logits).all(dim=-1)
        if bool(finite.all()):
            return logits, requests
        finite_rows = finite.tolist()
        keep_rows: list[int] = []
        kept: list[Request] = []
        row = 0
        for request in requests:
            num_rows = 1 + len(drafts.get(request.seq_id, ()))
            if all(finite_rows[row:row + num_rows]):
                keep_rows.extend(range(row, row + num_rows))
                kept.append(request)
            else:
                for sequence in self.scheduler.end_non_finite(request):
                    outputs.append(RequestOutput(sequence.request_id, [], True, FinishReason.NON_FINITE,
                                                 sequence.index))
                logger.warning("request %s (LoRA load id %d) ended: its logits were not finite", request.request_id,
                               request.lora_id)
            row += num_rows
        index = torch.tensor(keep_rows, dtype=torch.long, device=logits.device)
        return logits.index_select(0, index), kept

    @staticmethod
    def _with_forks(scheduler_output, logits: torch.Tensor, requests: list[Request]):
        """The sampler's rows: each sampled sequence's logits row, repeated for the siblings it forks."""
        forks = {s.request.seq_id: s.forks for s in scheduler_output.scheduled if s.forks}
        if not forks:
            return logits, requests
        rows, row_requests = [], []
        for row, request in enumerate(requests):
            for sequence in (request, *forks.get(request.seq_id, ())):
                rows.append(row)
                row_requests.append(sequence)
        return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device)), row_requests

    def run_step(self, on_outputs) -> None:
        """One step, its outputs handed to ``on_outputs`` (the engine loop's interface, shared with the
        ``generate()`` reference core)."""
        on_outputs(self.step())

    def _sampler_batch(self, requests: list[Request], token_mask: TokenMask | None = None) -> SamplerBatch:
        # Seen ids only for rows with repetition penalty: greedy rows stay a bare argmax.
        seen = [_seen_token_ids(r) if r.params.needs_penalty else None for r in requests]
        return SamplerBatch([r.params for r in requests], [r.sampling_state for r in requests], seen, token_mask)

    # ----------------------------------------------------------------- helpers

    def generate_batch_stream(
        self, requests: Iterable[tuple[str, list[int] | None, SamplingParams, torch.Tensor | None]]
    ) -> Iterator[list[RequestOutput]]:
        """Synchronous batch mode: add the requests, then step until all of them finish, yielding each
        step's outputs for them. If one add fails, the ones already added are aborted and the error is
        raised. Closing the iterator early aborts the unfinished ones."""
        unfinished: dict[str, int] = {}  # request id -> sequences not finished
        try:
            for request_id, prompt_token_ids, params, prompt_embeds in requests:
                self.add_request(request_id, prompt_token_ids, params, prompt_embeds)
                unfinished[request_id] = params.n
            while unfinished:
                outputs = [o for o in self.step() if o.request_id in unfinished]
                for output in outputs:
                    if output.finished:
                        unfinished[output.request_id] -= 1
                        if not unfinished[output.request_id]:
                            del unfinished[output.request_id]
                if outputs:
                    yield outputs
        finally:
            for request_id in unfinished:
                self.abort_request(request_id)
            # Nobody will read these requests' abort notices: the caller closed the stream.
            self._pending_outputs = [o for o in self._pending_outputs if o.request_id not in unfinished]

    def stats(self) -> EngineStats:
        counters = self.scheduler.counters
        pool = self.scheduler.block_pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_blocks,
            block_size=pool.block_size,
            max_model_len=self.max_model_len,
            num_preemptions=counters.num_preemptions,
            prefix_cache_queries=counters.prefix_cache_queries,
            prefix_cache_hits=counters.prefix_cache_hits,
            num_prefill_tokens_computed=counters.num_prefill_tokens_computed,
            num_decode_tokens_computed=counters.num_decode_tokens_computed,
            num_steps=self._num_steps,
            running_lora_ids=tuple(sorted({r.lora_id for r in self.scheduler.running if r.lora_id})),
            waiting_lora_ids=tuple(sorted({r.lora_id for r in self.scheduler.waiting if r.lora_id})),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        drafter = self.scheduler.drafter
        if drafter is None:
            return {}
        counters = drafter.counters
        return {"spec_decode_num_drafts": counters.num_drafts,
                "spec_decode_num_draft_tokens": counters.num_draft_tokens,
                "spec_decode_num_accepted_tokens": counters.num_accepted_tokens,
                "spec_decode_acceptance_rate": counters.acceptance_rate}


def _seen_token_ids(request: Request) -> list[int]:
    # An embeddings prompt has no ids (as in generate(inputs_embeds=...)): only the output counts.
    return request.output_token_ids if request.prompt_embeds is not None else request.all_token_ids()
