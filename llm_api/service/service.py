"""ModelService: one loaded model served to every front end, and the one driver of a request's life.

The service owns the loaded model, the generation core (the paged engine, or ``generate()`` when
ENGINE=generate or the engine cannot drive the model), the ``EngineLoop`` thread that alone steps it,
the LoRA adapters' lifecycle, the table of live requests with what they share (MAX_NUM_SEQS +
MAX_WAITING_REQUESTS, MAX_TOKENS_IN_FLIGHT, request_id labels, adapters in use), and the serving metrics.
What a request needs on its own is done in two rooms beside it, as vLLM splits it: ``inputs``
(``llm_api.service.input``: render, tokenize, the limits one request must meet, its grammar and deadline)
and, per request, ``llm_api.service.output.RequestState`` (detokenize, stop strings, logprobs, n choices,
echo). State of one API (the Responses API's stored responses) belongs to that API
(``llm_api.protocols.responses``). Routes (``llm_api.protocols``) parse a body into a ``GenerateRequest``,
then:

``generation = await service.admit(request, request_id)``, then ``async for event in generation.events()``
(``service.generate`` is both in one, for in-process callers):

1. at admission the request is admitted or ``ApiError`` is raised (a route admits before it answers, so
   nothing was sent yet and the edge answers with the error's status): a duplicate live ``request_id`` label (409), an unknown
   adapter (404, before the prompt is tokenized), every refusal of ``inputs`` (400: work over
   MAX_REQUEST_WORK, an empty prompt, over MAX_INPUT_TOKENS or the KV cache, a grammar the library
   rejects), a full server (503). Grammars reach the engine compiled, in ``SamplingParams.grammar`` (each
   of a request's n sequences gets its own matcher);
2. then ``TextDelta``s, one ``ChoiceFinished`` per choice as it ends, then exactly one ``Finished`` (a
   finish reason, or an error) (``llm_api.service.events``). How a request ends is decided in two places
   only: ``RequestState`` (its EOS or length from the engine, a stop string, a cancel, a non-finite output)
   and the driver here (its deadline, an engine failure). Leaving the iteration early (a client that went
   away) aborts the request and frees its blocks; the request leaves the service's tables in a
   ``finally``.

A request with ``params.n`` > 1 is one engine request of n sequences: every ``TextDelta`` and
``ChoiceFinished`` names its choice (``index``), each choice has its own detokenizer and stop strings (a
choice that meets one is ended alone, in the engine too), and ``Finished`` comes once every choice
ended; an error (cancel, deadline, engine failure) ends them all at once. Every limit a request must meet
is the ``Admission``'s (``llm_api.service.admission``): it counts prompt + n x ``max_new_tokens`` against
MAX_TOKENS_IN_FLIGHT, the budget all live requests share (503 when it is spent: a busy server, retry later);
MAX_REQUEST_WORK is one request's own bound (400: the request as asked can never be served), and counts logprob
entries too, which hold no KV blocks.

With ``params.logprobs`` set, each ``TextDelta`` carries the ``LogprobItem`` of the tokens whose text it
releases (text the detokenizer held back keeps its tokens' logprobs for the delta that releases it):
``llm_api.service.output`` says which.

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
from contextlib import aclosing
from typing import AsyncGenerator


from llm_api.engine.engine import EngineConfig, LLMEngine
from llm_api.engine.support import unsupported_reason
from llm_api.errors import ApiError, echo, internal_error, model_not_found
from llm_api.lora.config import AdapterError
from llm_api.lora.registry import AdapterInUseError, AdapterPathError, LoraRegistry
from llm_api.model.host_memory import release_freed_heap, release_unreferenced_file_pages
from llm_api.model.loader import LoadedModel, load
from llm_api.model.settings import ConfigError, Settings
from llm_api.service.admission import Admission, request_work
from llm_api.service.engine_loop import EngineLoop
from llm_api.service.events import Event, Finished
from llm_api.service.input import InputProcessor, Prepared
from llm_api.service.metrics import ServingMetrics, Sink
from llm_api.service.output import Echo, RequestState
from llm_api.service.owners import priority_grants
from llm_api.service.request import GenerateRequest, Limits
from llm_api.text.logprobs import TokenTexts
from llm_api.text.reasoning import reasoning_format
from llm_api.text.tools import detect_tool_format

logger = logging.getLogger(__name__)

class ModelService:
    def __init__(self, settings: Settings, lm: LoadedModel, metrics_sink: Sink | None = None):
        self.settings = settings
        self.lm = lm
        self.model_name = settings.model_name
        self.model_names = settings.model_names  # MODEL_NAME, then its SERVED_MODEL_NAME aliases
        self.created = int(time.time())
        self.limits = Limits(settings.max_input_tokens, settings.max_new_tokens, lm.hidden_size,
                             _vocab_size(lm.model), settings.max_num_seqs, detect_tool_format(lm.tokenizer),
                             settings.max_request_work,
                             reasoning_format(settings.reasoning_parser, lm.tokenizer),
                             generic_tool_choice_auto=settings.generic_tool_choice_auto,
                             priority_scheduling=settings.scheduling_policy == "priority")
        self.lora: LoraRegistry | None = self._build_lora() if settings.lora_enabled else None
        self.engine: LLMEngine | None = self._build_engine() if settings.engine == "paged" else None
        self.admission = Admission(self.limits, self.engine.max_model_len if self.engine is not None else None,
                                   self.path_name, callable(getattr(lm.model, "get_decoder", None)),
                                   settings.max_num_seqs + settings.max_waiting_requests, settings.max_tokens_in_flight)
        self.inputs = InputProcessor(settings, lm, self.limits, self.admission)
        core = self.engine if self.engine is not None else _reference_core(lm)
        self.loop = EngineLoop(core)
        self.metrics = ServingMetrics(metrics_sink or (lambda *args: None), lambda: self.loop.stats,
                                      engine_alive=lambda: self.loop.alive)
        self._live: dict[str, Generation] = {}  # request id -> admitted request
        self._labels: set[str] = set()  # client request_id labels of live requests
        self._tokens_in_flight = 0
        self.lora_requests: Counter[str] = Counter()  # adapter name -> requests admitted since start
        self._lora_live: Counter[str] = Counter()  # adapter name -> live requests (an unload waits for 0)

    @classmethod
    def load(cls, settings: Settings, metrics_sink: Sink | None = None) -> "ModelService":
        service = cls(settings, load(settings), metrics_sink)
        _ = service.inputs.prompts  # (built now, not by the first request: 0.3 s of held GIL copying the tokenizer)
        # The model, tokenizer and libraries loaded by now are some 390,000 Python objects that live as long
        # as the process. Frozen, the cyclic GC no longer scans them: a full collection, which a request
        # that allocates many objects sets off (a 6 MB JSON body of 66,000 objects, about once per such
        # body), took 0.2-0.26 s of held GIL with them and takes 0.01-0.08 s without (2-core Xeon), time
        # the engine thread and every stream would wait (docs/reliability.md, "Hostile input, by class").
        gc.collect()
        gc.freeze()
        release_freed_heap()  # what loading and the engine's start-up freed (llm_api.model.host_memory)
        release_unreferenced_file_pages(service.lm.model)  # the checkpoint's pages the merged copies replaced
        return service

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
        config = dataclasses.replace(EngineConfig.from_settings(self.settings),
                                     priority_grants=priority_grants(self.settings.api_key_priorities))
        engine = LLMEngine(self.lm.model, config, set(self.lm.eos_token_ids), lora=self.lora)
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
                if name in self.model_names:
                    raise AdapterError(f"LoRA adapter {name!r} refused: the name is the base model's (MODEL_NAME, "
                                       "SERVED_MODEL_NAME)")
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
        if name is None or name in self.model_names:
            return 0
        adapter = self.lora.get(name) if self.lora is not None else None
        if adapter is None:
            raise model_not_found(name, self.model_names, self.adapter_names(), request.adapter_param)
        return adapter.lora_id

    async def load_adapter(self, name: str, path: str) -> None:
        """Runtime load (LORA_RUNTIME_LOADING): read below LORA_ADAPTER_ROOT only; ApiError otherwise."""
        if self.lora is None or not self.settings.lora_runtime_loading:
            raise ApiError(403, "lora_runtime_loading_disabled", "loading LoRA adapters at run time is off "
                           "(LORA_RUNTIME_LOADING=true and LORA_ADAPTER_ROOT enable it)")
        if name in self.model_names:
            raise ApiError(400, "invalid_value", "lora_name is a name of the base model", "lora_name")
        try:
            await self.inputs.offload(self.lora.load_under_root, name, path, self.settings.lora_adapter_root)
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

    def shutdown(self) -> None:
        self.loop.shutdown()
        self.inputs.shutdown()

    # ------------------------------------------------------------------------------------------
    # admission

    async def generate(self, request: GenerateRequest, request_id: str, marker: str = "",
                       owner: str = "") -> AsyncGenerator[Event, None]:
        """Admit the request (or raise ApiError), then its events: ``admit`` and ``Generation.events`` in one
        (in-process callers; the routes admit first, so a refusal is raised before their answer begins)."""
        generation = await self.admit(request, request_id, marker, owner)
        try:
            async with aclosing(generation.events()) as events:
                async for event in events:
                    yield event
        finally:
            generation.release()  # (events() releases too; this covers a consumer that left before it ran)

    async def admit(self, request: GenerateRequest, request_id: str, marker: str = "", owner: str = "",
                    tenant: str = "") -> "Generation":
        """The request admitted (in the live table, holding its share of the capacity) or ApiError raised.
        ``marker``: text the detokenizer keeps out of the answer (the native format's end-of-stream marker);
        ``owner``: who sent it (its edge's ``Call.owner``: grammar compiles are shared out by it); ``tenant``:
        whose share of the engine it runs in (``Call.tenant``). The
        caller reads ``events()`` or calls ``release()``: an admitted request nobody reads holds its share."""
        arrival = time.monotonic()
        label = request.client_request_id
        if label is not None and label in self._labels:
            raise ApiError(409, "duplicate_request_id", f"a request with request_id {echo(label)} is still running; "
                           f"request ids must be unique among live requests")
        self.inputs.check(request)
        self._lora_id(request)  # an unknown adapter is refused before the prompt is tokenized
        prepared = await self.inputs.prepare(request, owner, arrival)
        if label is not None and label in self._labels:  # (another request took it while we tokenized)
            raise ApiError(409, "duplicate_request_id", f"a request with request_id {echo(label)} is still running")
        lora_id = self._lora_id(request)  # (again: it may have been unloaded while the prompt was tokenized)
        self.admission.capacity(len(self._live), self._tokens_in_flight, prepared.cost)
        generation = Generation(self, request_id, request, prepared, marker, arrival, lora_id, tenant)
        if lora_id and request.adapter is not None:
            self.lora_requests[request.adapter] += 1
            self._lora_live[request.adapter] += 1
        self._live[request_id] = generation
        if label is not None:
            self._labels.add(label)
        self._tokens_in_flight += prepared.cost
        logger.info("request %s: %s, %d prompt tokens", request_id, request.input_kind, prepared.num_prompt_tokens)
        return generation

    def _release(self, generation: "Generation") -> None:
        if self._live.get(generation.request_id) is generation:
            del self._live[generation.request_id]
            self._tokens_in_flight -= generation.cost
            if generation.adapter is not None:
                self._lora_live[generation.adapter] -= 1
            if generation.label is not None:
                self._labels.discard(generation.label)

    # ------------------------------------------------------------------------------------------
    # what the routes read

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens one request may reach (the KV cache's limit with the paged engine)."""
        if self.engine is not None:
            return self.engine.max_model_len
        return self.settings.max_input_tokens + self.settings.max_new_tokens

    @property
    def vocab_size(self) -> int:
        return len(self.lm.tokenizer)

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


class Generation:
    """One admitted request (in the live table from admission until ``events()`` ends) and the driver of its
    life: the engine's outputs through its ``RequestState``, within its deadline."""

    def __init__(self, service: ModelService, request_id: str, request: GenerateRequest, prepared: Prepared,
                 marker: str, arrival: float, lora_id: int, tenant: str = ""):
        self.service = service
        self.request_id = request_id
        self.label = request.client_request_id
        self.params = prepared.params
        self.num_prompt_tokens = prepared.num_prompt_tokens
        self.cost = prepared.cost
        self.lora_id = lora_id  # the LoRA adapter's load id (0: the base model) and its name
        self.adapter = request.adapter if lora_id else None
        self._prepared = prepared
        self._arrival = arrival
        self._priority = request.priority
        self._tenant = tenant
        self.work = request_work(prepared.num_prompt_tokens, prepared.params, request.echo)
        self.state = RequestState(service.lm.tokenizer, prepared.params, marker, prepared.num_prompt_tokens,
                                  prepared.prompt_ids, Echo(request.text, request.echo_only) if request.echo else None,
                                  lambda: service.token_texts, functools.partial(service.loop.abort, request_id),
                                  self.adapter)

    def release(self) -> None:
        """Leave the service's live table (idempotent): ``events()`` does at its end; a caller that admitted
        the request and will not read its events does it instead (its request never reached the engine)."""
        self.service._release(self)

    def _log_end(self, end: Finished) -> None:
        if end.error is None:
            assert end.reason is not None  # a Finished without an error has its reason
            how = end.reason.value
        else:
            how = end.error.code
        logger.info("request %s ended: %s after %d tokens; %s", self.request_id, how,
                    self.state.num_generated_tokens, self.service.kv_usage())

    async def events(self) -> AsyncGenerator[Event, None]:
        service, state, prepared = self.service, self.state, self._prepared
        timer = service.metrics.start(self.num_prompt_tokens, self._arrival)
        try:
            outputs = service.loop.generate(self.request_id, prepared.prompt_ids, self.params, prepared.prompt_embeds,
                                            self.lora_id, self._priority, self._tenant)
            async with aclosing(outputs):
                while state.end is None:
                    # The deadline bounds each wait on the engine, never the consumer's own awaits.
                    remaining = prepared.deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError
                    async with asyncio.timeout(remaining):
                        out = await anext(outputs)
                    num_before = state.num_generated_tokens
                    events = state.process(out)
                    timer.tokens(state.num_generated_tokens - num_before)
                    for event in events:
                        yield event
            end = state.end
        except TimeoutError:
            end = state.failed(ApiError(408, "timeout", "the request exceeded its deadline"))
        except Exception:  # an engine failure ends this stream with an error, never a hang
            logger.exception("request %s failed", self.request_id)
            end = state.failed(internal_error())
        finally:
            self.release()
            timer.finish()
        assert end is not None  # (the loop ran until the state decided, or an error decided)
        self._log_end(end)
        yield end


def _vocab_size(model) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "vocab_size", None)


def _reference_core(lm: LoadedModel):
    """The ``generate()`` reference core over ``lm`` (ENGINE=generate), imported only then: it imports
    transformers' generation, which a server of the paged engine never needs."""
    from llm_api.engine.reference import ReferenceCore

    return ReferenceCore(lm.model, lm.eos_token_ids, lm.tokenizer.pad_token_id)
