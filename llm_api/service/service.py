"""ModelService: one loaded model served to every front end, and the one driver of a request's life.

The service owns the loaded model, the generation core (the paged engine, or ``generate()`` when
ENGINE=generate or the engine cannot drive the model), the ``EngineLoop`` thread that alone steps it,
the table of live requests, and the serving metrics. Front ends (the TorchServe handler, the standalone
server) parse a body into a ``GenerateRequest`` with the request formats of ``llm_api.api``, then:

``async for event in service.generate(request, request_id)``:

1. before the first event, the request is admitted or ``ApiError`` is raised (nothing was sent yet, so
   the edge answers with the error's status): a duplicate live ``request_id`` label (409), work over
   MAX_REQUEST_WORK (``llm_api.api.request.request_work``: checked before the prompt is tokenized, and
   again with its tokens; 400 ``work_limit_exceeded``), a prompt that tokenizes to nothing (400
   ``empty_prompt``: control characters the tokenizer drops), a prompt over MAX_INPUT_TOKENS (refused by its
   length before tokenizing when it cannot fit), one that cannot fit the KV cache, a grammar (structured
   output, tool calls) the library rejects (400 naming the field), a full server (503). Large prompts are
   tokenized, and embeddings converted, on a small thread pool, off the event loop; grammars are compiled
   on a pool of their own (``service.grammars``) and reach the engine compiled, in
   ``SamplingParams.grammar`` (each of a request's n sequences gets its own matcher);
2. then ``TextDelta``s, one ``ChoiceFinished`` per choice as it ends, then exactly one ``Finished`` (a
   finish reason, or an error). This is the only place that decides how a request ends: its EOS or
   length (engine), a stop string (detokenizer), a cancel (``service.cancel``), its deadline, an engine
   failure. Leaving the iteration early (a client that went away) aborts the request and frees its
   blocks; the request leaves the service's tables in a ``finally``.

A request with ``params.n`` > 1 is one engine request of n sequences: every ``TextDelta`` and
``ChoiceFinished`` names its choice (``index``), each choice has its own detokenizer and stop strings (a
choice that meets one is ended alone, in the engine too), and ``Finished`` comes once every choice
ended; an error (cancel, deadline, engine failure) ends them all at once. Admission counts prompt + n x
``max_new_tokens`` against MAX_TOKENS_IN_FLIGHT, the budget all live requests share (503 when it is
spent: a busy server, retry later); MAX_REQUEST_WORK is one request's own bound (400: the request as asked
can never be served), and counts logprob entries too, which hold no KV blocks.

With ``params.logprobs`` set, each ``TextDelta`` carries the ``LogprobItem`` of the tokens whose text it
releases (text the detokenizer held back keeps its tokens' logprobs for the delta that releases it): in
order, every generated token up to and including the one that completed a stop string, but not the
end-of-sequence token that ended a choice (it is not part of the answer, as in OpenAI's answers).

``request_id`` is the id the edge issued for the request (TorchServe's ``x-request-id``, a random UUID;
the standalone server's own): unguessable, returned to the client with the response, and the only handle
``cancel`` accepts, so no client can end another's request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import gc
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable, cast

import torch

from llm_api.api.detokenizer import TextDelta as StreamDelta, TextStream
from llm_api.api.errors import ApiError, echo, internal_error, model_not_found
from llm_api.api.logprobs import LogprobItem, TokenTexts
from llm_api.api.prompt import PromptBuilder
from llm_api.api.reasoning import reasoning_format
from llm_api.api.request import GenerateRequest, Limits, work_refusal
from llm_api.api.request import TokenizeRequest
from llm_api.api.tools import detect_tool_format
from llm_api.engine.engine import EngineConfig, LLMEngine
from llm_api.engine.reference import ReferenceCore
from llm_api.engine.request import FinishReason, RequestOutput
from llm_api.engine.scheduler import PromptTooLongError
from llm_api.engine.support import unsupported_reason
from llm_api.model.host_memory import release_freed_heap
from llm_api.model.loader import LoadedModel, load
from llm_api.lora.config import AdapterError
from llm_api.lora.registry import AdapterInUseError, AdapterPathError, LoraRegistry
from llm_api.model.settings import ConfigError, Settings
from llm_api.service.engine_loop import EngineLoop
from llm_api.service.grammars import GrammarCompilation
from llm_api.service.live_responses import Responses
from llm_api.service.metrics import ServingMetrics, Sink
from llm_api.service.response_store import open_response_store

logger = logging.getLogger(__name__)

# Prompts longer than this (characters, or embedding values) are prepared on the thread pool: below it
# the work (well under a millisecond) costs less than the hand-off.
OFF_LOOP_MIN_SIZE = 4096


@dataclass(frozen=True)
class TextDelta:
    text: str  # may be empty when only logprobs are released (the end of a choice)
    index: int = 0  # the choice (0 .. n-1)
    logprobs: tuple[LogprobItem, ...] = ()  # of the tokens this text came from, when asked for
    num_tokens: int = 0  # generated tokens whose text this delta completes (held-back text: a later delta's)


@dataclass(frozen=True)
class ChoiceFinished:
    """One choice ended (sent for n = 1 too, before ``Finished``)."""

    index: int
    reason: FinishReason
    num_generated_tokens: int


@dataclass(frozen=True)
class Finished:
    """How a request ended: complete (``reason``: choice 0's), or ``error``. Token counts (all choices)
    for usage reports; ``num_cached_tokens``: the prompt tokens the engine found in its prefix cache."""

    reason: FinishReason | None
    error: ApiError | None
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int = 0


Event = TextDelta | ChoiceFinished | Finished


class ModelService:
    def __init__(self, settings: Settings, lm: LoadedModel, metrics_sink: Sink | None = None):
        self.settings = settings
        self.lm = lm
        self.model_name = settings.model_name
        self.created = int(time.time())
        self.limits = Limits(settings.max_input_tokens, settings.max_new_tokens, lm.hidden_size,
                             _vocab_size(lm.model), settings.max_num_seqs, detect_tool_format(lm.tokenizer),
                             settings.max_request_work,
                             reasoning_format(settings.reasoning_parser, lm.tokenizer),
                             generic_tool_choice_auto=settings.generic_tool_choice_auto,
                             priority_scheduling=settings.scheduling_policy == "priority")
        self.lora: LoraRegistry | None = self._build_lora() if settings.lora_enabled else None
        self.engine: LLMEngine | None = self._build_engine() if settings.engine == "paged" else None
        core = self.engine if self.engine is not None else ReferenceCore(lm.model, lm.eos_token_ids,
                                                                         lm.tokenizer.pad_token_id)
        self.loop = EngineLoop(core)
        self.metrics = ServingMetrics(metrics_sink or (lambda *args: None), lambda: self.loop.stats,
                                      engine_alive=lambda: self.loop.alive)
        self._prepare_pool = ThreadPoolExecutor(2, thread_name_prefix="llm-prepare")
        self.grammars = GrammarCompilation(lm.tokenizer, _logits_width(lm.model), lm.eos_token_ids)
        # The Responses API's stored and in-flight responses (an unusable RESPONSES_STORE_PATH fails here).
        self.responses = Responses(open_response_store(settings))
        self._live: dict[str, Generation] = {}  # request id -> admitted request
        self._labels: set[str] = set()  # client request_id labels of live requests
        self._tokens_in_flight = 0
        self.lora_requests: Counter[str] = Counter()  # adapter name -> requests admitted since start
        self._lora_live: Counter[str] = Counter()  # adapter name -> live requests (an unload waits for 0)

    @classmethod
    def load(cls, settings: Settings, metrics_sink: Sink | None = None) -> "ModelService":
        service = cls(settings, load(settings), metrics_sink)
        _ = service.prompts  # (built now, not by the first request: 0.3 s of held GIL copying the tokenizer)
        # The model, tokenizer and libraries loaded by now are some 390,000 Python objects that live as long
        # as the process. Frozen, the cyclic GC no longer scans them: a full collection, which a request
        # that allocates many objects sets off (a 6 MB JSON body of 66,000 objects, about once per such
        # body), took 0.2-0.26 s of held GIL with them and takes 0.01-0.08 s without (2-core Xeon), time
        # the engine thread and every stream would wait (docs/reliability.md, "Hostile input, by class").
        gc.collect()
        gc.freeze()
        release_freed_heap()  # what loading and the engine's start-up freed (llm_api.model.host_memory)
        return service

    @functools.cached_property
    def prompts(self) -> PromptBuilder:
        return PromptBuilder(self.lm.tokenizer, self.settings.max_input_tokens)

    @functools.cached_property
    def token_texts(self) -> TokenTexts:
        return TokenTexts(self.lm.tokenizer)

    @property
    def path_name(self) -> str:
        return "paged engine" if self.engine is not None else "generate() reference"

    def _build_engine(self) -> LLMEngine | None:
        # Decided from the model before building (llm_api.engine.support); any other error building the
        # engine for a model it supports is a bug to surface, not a reason to serve silently slower.
        reason = unsupported_reason(self.lm.model)
        if reason is not None and self.lora is not None:
            raise ConfigError(f"LoRA adapters need the paged engine, which cannot drive this model: {reason}")
        if reason is not None:
            logger.warning("the paged engine cannot drive this model: %s; using the generate() reference path", reason)
            return None
        engine = LLMEngine(self.lm.model, EngineConfig.from_settings(self.settings), set(self.lm.eos_token_ids),
                           lora=self.lora)
        stats = engine.stats()
        logger.info(
            "paged engine: %d KV blocks of %d tokens, max concurrent tokens %d, max_model_len %d, attention %s, "
            "CUDA graphs for batch sizes %s, max %d tokens per step", stats.num_total_blocks, stats.block_size,
            stats.num_total_blocks * stats.block_size, stats.max_model_len, engine.attention.name,
            engine.cuda_graph_batch_sizes or "none", engine.config.max_num_batched_tokens,
        )
        return engine

    def _build_lora(self) -> LoraRegistry:
        """Wrap the model's target linears and load LORA_ADAPTERS; an adapter that does not fit stops the start
        (ConfigError naming it and why)."""
        try:
            # (adapters are checked against the checkpoint's folder name: PEFT records the base's hub id or path)
            registry = LoraRegistry(self.lm.model, self.settings.max_loras, self.settings.max_lora_rank,
                                    self.settings.model_path or None)
            for name, path in self.settings.lora_adapters:
                if name == self.model_name:
                    raise AdapterError(f"LoRA adapter {name!r} refused: the name is the base model's (MODEL_NAME)")
                registry.load(name, path)
        except AdapterError as err:
            raise ConfigError(str(err)) from None
        return registry

    # ------------------------------------------------------------------------------------------
    # LoRA adapters

    def adapter_names(self) -> frozenset[str]:
        return frozenset(a.name for a in self.lora.adapters()) if self.lora is not None else frozenset()

    def _lora_id(self, request: GenerateRequest) -> int:
        """The load id of the request's adapter (0: the base model); 404 model_not_found for an unknown name."""
        name = request.adapter
        if name is None or name == self.model_name:
            return 0
        adapter = self.lora.get(name) if self.lora is not None else None
        if adapter is None:
            raise model_not_found(name, self.model_name, self.adapter_names(), request.adapter_param)
        return adapter.lora_id

    async def load_adapter(self, name: str, path: str) -> None:
        """Runtime load (LORA_RUNTIME_LOADING): read below LORA_ADAPTER_ROOT only; ApiError otherwise."""
        if self.lora is None or not self.settings.lora_runtime_loading:
            raise ApiError(403, "lora_runtime_loading_disabled", "loading LoRA adapters at run time is off "
                           "(LORA_RUNTIME_LOADING=true and LORA_ADAPTER_ROOT enable it)")
        if name == self.model_name:
            raise ApiError(400, "invalid_value", "lora_name is the base model's name", "lora_name")
        try:
            await self.offload(self.lora.load_under_root, name, path, self.settings.lora_adapter_root)
        except AdapterPathError as err:
            raise ApiError(400, "invalid_lora_path", str(err), "lora_path") from None
        except AdapterError as err:
            code = "adapter_exists" if self.lora.get(name) is not None else "invalid_adapter"
            raise ApiError(400, code, str(err), "lora_name" if code == "adapter_exists" else "lora_path") from None

    def unload_adapter(self, name: str) -> None:
        if self.lora is None or not self.settings.lora_runtime_loading:
            raise ApiError(403, "lora_runtime_loading_disabled", "unloading LoRA adapters at run time is off "
                           "(LORA_RUNTIME_LOADING=true enables it)")
        try:
            self.lora.unload(name, in_use=self._lora_live[name])
        except KeyError:
            raise ApiError(404, "model_not_found", f"no LoRA adapter {echo(name)} is loaded", "lora_name") from None
        except AdapterInUseError as err:
            raise ApiError(409, "adapter_in_use", str(err), "lora_name") from None

    def lora_info(self) -> tuple[list[str], list[str], int] | None:
        """(running adapter names, waiting adapter names, MAX_LORAS) for vllm:lora_requests_info; None
        without LoRA."""
        if self.lora is None:
            return None
        stats = self.loop.stats
        running = [n for i in getattr(stats, "running_lora_ids", ()) if (n := self.lora.name_of(i))]
        waiting = [n for i in getattr(stats, "waiting_lora_ids", ()) if (n := self.lora.name_of(i))]
        return running, waiting, self.lora.max_loras

    async def offload(self, fn, *args):
        """Run ``fn(*args)`` on the service's small worker pool (large prompts and bodies): the event loop
        keeps serving the other requests meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool,
                                                                functools.partial(_refusal_let_go, fn, *args))

    def shutdown(self) -> None:
        self.loop.shutdown()
        self.responses.store.close()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        self.grammars.shutdown()

    # ------------------------------------------------------------------------------------------
    # admission

    async def generate(self, request: GenerateRequest, request_id: str, marker: str = "",
                       owner: str = "") -> AsyncGenerator[Event, None]:
        """Admit the request (or raise ApiError), then its events. ``marker``: text the detokenizer keeps
        out of the answer (the native format's end-of-stream marker); ``owner``: who sent it (its edge's
        ``Call.owner``: grammar compiles are shared out by it)."""
        generation = await self._admit_request(request, request_id, marker, owner)
        try:
            logger.info("request %s: %s, %d prompt tokens", request_id, request.input_kind,
                        generation.num_prompt_tokens)
            async with aclosing(generation.events()) as events:
                async for event in events:
                    yield event
        finally:
            self._release(generation)  # (events() releases too; this covers a consumer that left before it ran)

    async def _admit_request(self, request: GenerateRequest, request_id: str, marker: str, owner: str) -> "Generation":
        arrival = time.monotonic()
        label = request.client_request_id
        if label is not None and label in self._labels:
            raise ApiError(409, "duplicate_request_id", f"a request with request_id {echo(label)} is still running; "
                           f"request ids must be unique among live requests")
        # Work over MAX_REQUEST_WORK whatever the prompt is refused before the prompt is tokenized.
        refusal = work_refusal(request, 0, self.limits.max_request_work) or self.prompts.too_long(request)
        if refusal is not None:
            raise refusal
        if request.params.prompt_logprobs is not None and self.engine is None:
            raise ApiError(400, "unsupported_parameter", "'echo' with 'logprobs' (the prompt's logprobs) needs the "
                           f"paged engine; this model runs on the {self.path_name}", "echo")
        self._lora_id(request)  # an unknown adapter is refused before the prompt is tokenized
        prompt_ids, prompt_embeds = await self._prepare(request)
        if prompt_ids is not None:
            num_prompt_tokens = len(prompt_ids)
        else:
            assert prompt_embeds is not None  # _prepare gives ids or embeddings
            num_prompt_tokens = int(prompt_embeds.shape[0])
        if num_prompt_tokens == 0:  # (the engine has nothing to prefill: an answer needs one token to follow)
            raise ApiError(400, "empty_prompt", "the prompt becomes no tokens (it holds only characters the "
                           "tokenizer drops); send text the model can read")
        refusal = work_refusal(request, num_prompt_tokens, self.limits.max_request_work)
        if refusal is not None:
            raise refusal
        self._check_fits(num_prompt_tokens, request.params.max_new_tokens)
        if request.constraint is not None:
            timeout = min(request.timeout_s or self.settings.request_timeout_s, self.settings.request_timeout_s)
            grammar = await self.grammars.compile(request.constraint, arrival + timeout, owner)
            request.params = dataclasses.replace(request.params, grammar=grammar)
        if label is not None and label in self._labels:  # (another request took it while we tokenized)
            raise ApiError(409, "duplicate_request_id", f"a request with request_id {echo(label)} is still running")
        cost = num_prompt_tokens + request.params.n * request.params.max_new_tokens
        lora_id = self._lora_id(request)  # (again: it may have been unloaded while the prompt was tokenized)
        self._admit(cost)
        timeout = min(request.timeout_s or self.settings.request_timeout_s, self.settings.request_timeout_s)
        generation = Generation(self, request_id, request, prompt_ids, prompt_embeds, num_prompt_tokens,
                                cost, marker, arrival, arrival + timeout)
        generation.lora_id = lora_id
        if lora_id and request.adapter is not None:
            generation.adapter = request.adapter
            self.lora_requests[request.adapter] += 1
            self._lora_live[request.adapter] += 1
        self._live[request_id] = generation
        if label is not None:
            self._labels.add(label)
        self._tokens_in_flight += cost
        return generation

    async def _prepare(self, request: GenerateRequest) -> tuple[list[int] | None, torch.Tensor | None]:
        # (a tensor of embeddings, or token ids)
        work: Callable[[GenerateRequest], Any]
        result: Any
        if request.inputs_embeds is not None:
            work, size = self._embeds_tensor, len(request.inputs_embeds) * (self.limits.hidden_size or 1)
        else:
            work, size = self.prompts.token_ids, request.num_input_chars()
        if size < OFF_LOOP_MIN_SIZE:
            result = work(request)
        else:
            result = await asyncio.get_running_loop().run_in_executor(self._prepare_pool, work, request)
        return (None, result) if request.inputs_embeds is not None else (result, None)

    def _embeds_tensor(self, request: GenerateRequest) -> torch.Tensor:
        return torch.tensor(request.inputs_embeds, dtype=cast(torch.dtype, self.lm.model.dtype), device=self.lm.device)

    def _check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        if self.engine is None:
            return
        limit = self.engine.max_model_len
        if num_prompt_tokens + max_new_tokens > limit:
            raise ApiError(400, "prompt_too_long",
                           f"prompt ({num_prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceed the "
                           f"{limit} tokens the KV cache can hold for one request (KV_CACHE_MEMORY_MIB, "
                           f"MAX_INPUT_TOKENS, MAX_NEW_TOKENS)")

    def _admit(self, cost: int) -> None:
        max_live = self.settings.max_num_seqs + self.settings.max_waiting_requests
        if len(self._live) >= max_live:
            raise ApiError(503, "overloaded", f"the server is busy: {len(self._live)} requests in flight "
                           f"(MAX_NUM_SEQS + MAX_WAITING_REQUESTS = {max_live}); retry later")
        if self._tokens_in_flight + cost > self.settings.max_tokens_in_flight:
            raise ApiError(503, "overloaded", f"the server is busy: {self._tokens_in_flight} tokens in flight, this "
                           f"request needs {cost} more (MAX_TOKENS_IN_FLIGHT={self.settings.max_tokens_in_flight}); "
                           f"retry later")

    def _release(self, generation: "Generation") -> None:
        if self._live.get(generation.request_id) is generation:
            del self._live[generation.request_id]
            self._tokens_in_flight -= generation.cost
            if generation.adapter is not None:
                self._lora_live[generation.adapter] -= 1
            if generation.label is not None:
                self._labels.discard(generation.label)

    # ------------------------------------------------------------------------------------------
    # the tokenizer routes (vLLM's /tokenize and /detokenize)

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens one request may reach (the KV cache's limit with the paged engine)."""
        if self.engine is not None:
            return self.engine.max_model_len
        return self.settings.max_input_tokens + self.settings.max_new_tokens

    @property
    def vocab_size(self) -> int:
        return len(self.lm.tokenizer)

    async def tokenize(self, request: TokenizeRequest) -> list[int]:
        """The ids a prompt or chat becomes, exactly as ``generate`` would tokenize it (ApiError when it
        cannot be served: over MAX_INPUT_TOKENS, no chat template)."""
        as_generate = GenerateRequest(text=request.text, messages=request.messages)
        refusal = self.prompts.too_long(as_generate)
        if refusal is not None:
            raise refusal
        work = functools.partial(self.prompts.ids_of, request.text, request.messages, request.add_special_tokens)
        if as_generate.num_input_chars() < OFF_LOOP_MIN_SIZE:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, work)

    async def detokenize(self, token_ids: list[int]) -> str:
        work = functools.partial(self.lm.tokenizer.decode, token_ids)
        if len(token_ids) < OFF_LOOP_MIN_SIZE // 4:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, work)

    # ------------------------------------------------------------------------------------------

    def cancel(self, request_id: str) -> bool:
        """End a live request by its server-issued id; False for any other id (unknown or finished)."""
        generation = self._live.get(request_id)
        if generation is None:
            return False
        self.loop.abort(request_id)
        return True

    @property
    def num_live_requests(self) -> int:
        return len(self._live)

    def kv_usage(self) -> str:
        stats = self.loop.stats
        if stats is None:
            return f"no paged KV cache; live requests {self.num_live_requests}"
        return f"KV blocks free {stats.num_free_blocks}/{stats.num_total_blocks}; live requests {self.num_live_requests}"


def _logits_width(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(config.vocab_size)


class Generation:
    """One admitted request (in the live table from admission until ``events()`` ends)."""

    def __init__(self, service: ModelService, request_id: str, request: GenerateRequest,
                 prompt_ids: list[int] | None, prompt_embeds: torch.Tensor | None, num_prompt_tokens: int,
                 cost: int, marker: str, arrival: float, deadline: float):
        self.service = service
        self.request_id = request_id
        self.label = request.client_request_id
        self.params = request.params
        self.num_prompt_tokens = num_prompt_tokens
        self.num_generated_tokens = 0
        self.num_cached_tokens = 0  # of the prompt, found in the prefix cache (the engine's outputs say)
        self.cost = cost
        self._prompt_ids = prompt_ids
        self._prompt_embeds = prompt_embeds
        self._marker = marker
        self._arrival = arrival
        self._deadline = deadline
        self.lora_id = 0  # the LoRA adapter's load id (0: the base model) and its name
        self.adapter: str | None = None
        self._priority = request.priority
        self._echo = request.echo
        self._echo_text = request.text  # (None: a prompt of ids or a chat, decoded when echoed)
        self._echo_only = request.echo_only

    def _log_end(self, end: Finished) -> None:
        if end.error is None:
            assert end.reason is not None  # a Finished without an error has its reason (_finished)
            how = end.reason.value
        else:
            how = end.error.code
        logger.info("request %s ended: %s after %d tokens; %s", self.request_id, how, self.num_generated_tokens,
                    self.service.kv_usage())

    async def events(self) -> AsyncGenerator[Event, None]:
        service = self.service
        choices = [_Choice(TextStream(service.lm.tokenizer, self.params.stop, self._marker))
                   for _ in range(self.params.n)]
        token_texts = service.token_texts if self.params.logprobs is not None else None
        echoed: set[int] = set()  # choices whose answer began with the prompt
        timer = service.metrics.start(self.num_prompt_tokens, self._arrival)
        end: Finished | None = None
        try:
            outputs = service.loop.generate(self.request_id, self._prompt_ids, self.params, self._prompt_embeds,
                                            self.lora_id, self._priority)
            async with aclosing(outputs):
                while end is None:
                    # The deadline bounds each wait on the engine, never the consumer's own awaits.
                    remaining = self._deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError
                    async with asyncio.timeout(remaining):
                        out = await anext(outputs)
                    choice = choices[out.index]
                    if choice.reason is not None:
                        continue  # a choice that met a stop string: the rest of its tokens are not the answer
                    if out.finished and out.finish_reason is FinishReason.ABORT:
                        end = self._failed(ApiError(499, "cancelled", "the request was cancelled"))
                        break
                    if out.finished and out.finish_reason is FinishReason.NON_FINITE:
                        end = self._failed(ApiError(
                            500, "non_finite_output", "the model's output for this request was not finite (NaN or "
                            "infinity); with a LoRA adapter, its weights are the likely cause" if self.adapter else
                            "the model's output for this request was not finite (NaN or infinity)"))
                        break
                    if self._echo and out.index not in echoed:
                        echoed.add(out.index)
                        yield self._echo_delta(out)
                    if self._echo_only:  # (max_tokens 0: the token sampled after the prompt is not the answer)
                        choice.reason = FinishReason.LENGTH
                        yield ChoiceFinished(out.index, choice.reason, 0)
                        if all(c.reason is not None for c in choices):
                            end = self._finished(FinishReason.LENGTH)
                        continue
                    delta, num_used = _push_tokens(choice.text, out.new_token_ids)
                    if choice.text.marker_removed and self.params.grammar is not None:
                        # (never silently: without the marker text the answer would no longer follow its grammar)
                        end = self._failed(ApiError(422, "marker_in_answer", "the answer this request's grammar "
                                                    "allows spelled out the end-of-stream marker, which this route "
                                                    "reserves for the end of a stream; use an OpenAI route, or "
                                                    "a grammar that cannot produce the marker's text"))
                        break
                    timer.tokens(num_used)
                    choice.num_tokens += num_used
                    choice.num_unreleased_tokens += num_used
                    self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
                    self.num_generated_tokens += num_used
                    if token_texts is not None and out.logprobs:
                        # The end-of-sequence token that ended the choice is not part of the answer.
                        # (Echo keeps it: evaluation harnesses count on one entry per prompt and sampled token.)
                        kept = (out.logprobs[:num_used] if num_used < len(out.new_token_ids)
                                else out.logprobs[:-1] if out.finish_reason is FinishReason.STOP and not self._echo
                                else out.logprobs)
                        choice.logprobs.extend(token_texts.item(lp) for lp in kept)
                    if delta.text:
                        yield choice.delta(delta.text, out.index)
                    if delta.stopped or out.finished:
                        if not delta.stopped:
                            tail = choice.text.finish()
                            if tail or choice.logprobs:
                                yield choice.delta(tail, out.index)
                        elif choice.logprobs:
                            yield choice.delta("", out.index)
                        reason = FinishReason.STOP if delta.stopped else out.finish_reason
                        assert reason is not None  # a finished output carries its reason
                        choice.reason = reason
                        if delta.stopped and not out.finished and len(choices) > 1:
                            service.loop.abort(self.request_id, out.index)  # the other choices go on
                        yield ChoiceFinished(out.index, choice.reason, choice.num_tokens)
                        if all(c.reason is not None for c in choices):
                            first_reason = choices[0].reason
                            assert first_reason is not None  # (every choice has one)
                            end = self._finished(first_reason)
        except TimeoutError:
            end = self._failed(ApiError(408, "timeout", "the request exceeded its deadline"))
        except PromptTooLongError as exc:
            end = self._failed(ApiError(400, "prompt_too_long", str(exc)))
        except Exception:  # an engine failure ends this stream with an error, never a hang
            logger.exception("request %s failed", self.request_id)
            end = self._failed(internal_error())
        finally:
            service._release(self)
            timer.finish()
        self._log_end(end)
        yield end

    def _echo_delta(self, out: RequestOutput) -> TextDelta:
        """The prompt, as the first text of choice ``out.index`` (echo), with its tokens' logprobs when asked
        for: the first token has none (nothing before it scores it), the others come with the first output."""
        tokenizer = self.service.lm.tokenizer
        prompt_ids = self._prompt_ids or []
        text = self._echo_text if self._echo_text is not None else tokenizer.decode(prompt_ids)
        if self.params.prompt_logprobs is None or not prompt_ids:
            return TextDelta(text, out.index, ())
        token_texts = self.service.token_texts
        items = [LogprobItem(token_texts(prompt_ids[0]), None)]
        items += [token_texts.item(lp) for lp in out.prompt_logprobs or ()]
        return TextDelta(text, out.index, tuple(items))

    def _finished(self, reason: FinishReason) -> Finished:
        return Finished(reason, None, self.num_prompt_tokens, self.num_generated_tokens, self.num_cached_tokens)

    def _failed(self, error: ApiError) -> Finished:
        return Finished(None, error, self.num_prompt_tokens, self.num_generated_tokens, self.num_cached_tokens)


@dataclass
class _Choice:
    """One choice's progress inside ``Generation.events``."""

    text: TextStream
    logprobs: list[LogprobItem] = field(default_factory=list)  # not yet sent with a delta
    num_tokens: int = 0
    num_unreleased_tokens: int = 0  # counted in num_tokens, not yet sent with a delta
    reason: FinishReason | None = None  # set once the choice ended

    def delta(self, text: str, index: int) -> TextDelta:
        released, self.logprobs = tuple(self.logprobs), []
        num_tokens, self.num_unreleased_tokens = self.num_unreleased_tokens, 0
        return TextDelta(text, index, released, num_tokens)


def _push_tokens(text: TextStream, token_ids: list[int]) -> tuple[StreamDelta, int]:
    """One output's tokens into the choice's text -> (the delta, how many tokens the answer keeps). An output
    of several tokens (speculative decoding) is pushed one token at a time, so a stop string ends the answer,
    its usage and its logprobs at the token that completed it, as it does when tokens come one by one."""
    if len(token_ids) == 1:
        return text.push(token_ids), 1
    parts = []
    for used, token_id in enumerate(token_ids, 1):
        delta = text.push([token_id])
        parts.append(delta.text)
        if delta.stopped:
            return StreamDelta("".join(parts), True), used
    return StreamDelta("".join(parts), False), len(token_ids)


def _refusal_let_go(fn, *args):
    """``fn(*args)``; an ``ApiError`` it raises leaves without its traceback and the exceptions it came from,
    whose frames hold what the parse made (a decoded 6 MB body: 66,000 objects), so they are freed here on
    the worker thread and not on the event loop that receives the error, where freeing them took 0.07-0.2 s
    with the GIL held (docs/reliability.md, "Hostile input, by class"). The edges render an error from its
    own fields, never from its traceback."""
    try:
        return fn(*args)
    except ApiError as error:
        error.__context__ = error.__cause__ = None
        raise error.with_traceback(None) from None


def _vocab_size(model) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "vocab_size", None)
