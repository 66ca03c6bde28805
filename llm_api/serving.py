"""ModelService: everything the handler does that is not TorchServe I/O.

It owns the loaded model, the generation path (the paged engine, or ``generate()`` when ENGINE=generate
or the engine cannot drive the model), the engine thread for async mode, and the table of live
requests that cancel calls and deadlines act on. The handler asks it to ``prepare`` a row (validate,
tokenize, build the job and the response stream), then either runs a batch through ``path`` (classic
mode) or iterates ``stream(job)`` (async mode).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

import torch

from llm_api import model_loader
from llm_api.config import Settings
from llm_api.detokenizer import TextStream
from llm_api.engine.async_engine import AsyncLLMEngine
from llm_api.engine.engine import EngineConfig, LLMEngine, PromptTooLongError
from llm_api.engine.support import unsupported_reason
from llm_api.generation import EnginePath, GenerationJob, GenerationPath, RequestOutput, stream_async
from llm_api.protocol import GenerateRequest, Limits, RequestError
from llm_api.reference import ReferenceGenerator
from llm_api.response import ResponseStream

logger = logging.getLogger(__name__)


@dataclass
class StreamEnd:
    """How an admitted request ended: complete with a finish reason ("stop" | "length"), or an error."""

    reason: str | None = None
    error: RequestError | None = None


@dataclass
class Prepared:
    job: GenerationJob
    stream: ResponseStream
    deadline: float  # time.monotonic() after which the request is ended with a timeout error
    aliases: tuple[str, ...]  # ids a cancel call may use: TorchServe's and the client's


class ModelService:
    def __init__(self, settings: Settings, lm: model_loader.LoadedModel):
        self.settings = settings
        self.lm = lm
        self.limits = Limits(settings.max_input_tokens, settings.max_new_tokens, lm.hidden_size)
        self.engine: LLMEngine | None = self._build_engine() if settings.engine == "paged" else None
        self.path: GenerationPath = (
            EnginePath(self.engine)
            if self.engine is not None
            else ReferenceGenerator(lm.model, lm.eos_token_ids, lm.tokenizer.pad_token_id)
        )
        self._async_engine: AsyncLLMEngine | None = None
        self._reference_lock = threading.Lock()
        self._live: dict[str, str] = {}  # alias -> request id of a running request
        self._requests: dict[str, int] = {}  # request id -> tokens it may hold (async mode)
        self._tokens_in_flight = 0

    @classmethod
    def load(cls, settings: Settings) -> "ModelService":
        return cls(settings, model_loader.load(settings))

    @property
    def path_name(self) -> str:
        return "paged engine" if self.engine is not None else "generate() reference"

    def _build_engine(self) -> LLMEngine | None:
        # Decided from the model before building (llm_api.engine.support); any other error building the
        # engine for a model it supports is a bug to surface, not a reason to serve silently slower.
        reason = unsupported_reason(self.lm.model)
        if reason is not None:
            logger.warning("the paged engine cannot drive this model: %s; using the generate() reference path", reason)
            return None
        engine = LLMEngine(self.lm.model, EngineConfig.from_settings(self.settings), set(self.lm.eos_token_ids))
        stats = engine.stats()
        logger.info(
            "paged engine: %d KV blocks of %d tokens, max concurrent tokens %d, max_model_len %d, attention %s, "
            "CUDA graphs for batch sizes %s", stats.num_total_blocks, stats.block_size,
            stats.num_total_blocks * stats.block_size, stats.max_model_len, engine.attention_backend,
            engine.cuda_graph_batch_sizes or "none",
        )
        return engine

    # ------------------------------------------------------------------------------------------

    def prepare(self, request: GenerateRequest, request_id: str) -> Prepared:
        """A validated request -> its job and response stream; RequestError for this request only."""
        job = GenerationJob(request_id=request_id, params=request.params)
        if request.inputs_embeds is not None:
            job.prompt_embeds = torch.tensor(request.inputs_embeds, dtype=self.lm.model.dtype, device=self.lm.device)
        else:
            job.prompt_token_ids = self._tokenize(request)
        self._check_fits(job)
        stream = ResponseStream(
            request_id=request_id,
            text_stream=TextStream(self.lm.tokenizer, request.params.stop, self.settings.end_of_stream_token),
            marker=self.settings.end_of_stream_token,
            streaming=request.stream,
        )
        timeout = min(request.timeout_s or self.settings.request_timeout_s, self.settings.request_timeout_s)
        aliases = (request_id,) + ((request.client_request_id,) if request.client_request_id else ())
        return Prepared(job, stream, time.monotonic() + timeout, aliases)

    def _tokenize(self, request: GenerateRequest) -> list[int]:
        tokenizer = self.lm.tokenizer
        if request.messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise RequestError("this model has no chat template; send 'text' instead", "unsupported_input")
            try:
                ids = tokenizer.apply_chat_template(
                    request.messages, add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            except Exception as exc:  # templates raise on role orders they do not support
                raise RequestError(f"the chat template rejected these messages: {exc}", "invalid_input") from None
        else:
            ids = tokenizer(request.text)["input_ids"]
        if len(ids) > self.settings.max_input_tokens:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; the limit is MAX_INPUT_TOKENS={self.settings.max_input_tokens}",
                "prompt_too_long",
            )
        return list(ids)

    def _check_fits(self, job: GenerationJob) -> None:
        if self.engine is None:
            return
        limit = self.engine.max_model_len
        if job.prompt_len + job.params.max_new_tokens > limit:
            raise RequestError(
                f"prompt ({job.prompt_len} tokens) + max_new_tokens ({job.params.max_new_tokens}) exceed the "
                f"{limit} tokens the KV cache can hold for one request (KV_CACHE_MEMORY_MIB, MAX_INPUT_TOKENS, "
                f"MAX_NEW_TOKENS)",
                "prompt_too_long",
            )

    # ------------------------------------------------------------------------------------------
    # live requests: cancel calls by id

    def register(self, prepared: Prepared) -> None:
        """Admit a request (async mode), or refuse it with 503 when the server is full."""
        cost = prepared.job.prompt_len + prepared.job.params.max_new_tokens
        max_live = self.settings.max_num_seqs + self.settings.max_waiting_requests
        if len(self._requests) >= max_live:
            raise RequestError(
                f"the server is busy: {len(self._requests)} requests in flight (MAX_NUM_SEQS + MAX_WAITING_REQUESTS = "
                f"{max_live}); retry later", "overloaded", 503,
            )
        if self._tokens_in_flight + cost > self.settings.max_tokens_in_flight:
            raise RequestError(
                f"the server is busy: {self._tokens_in_flight} tokens in flight, this request needs {cost} more "
                f"(MAX_TOKENS_IN_FLIGHT={self.settings.max_tokens_in_flight}); retry later", "overloaded", 503,
            )
        self._requests[prepared.job.request_id] = cost
        self._tokens_in_flight += cost
        for alias in prepared.aliases:
            self._live[alias] = prepared.job.request_id

    def unregister(self, prepared: Prepared) -> None:
        cost = self._requests.pop(prepared.job.request_id, None)
        if cost is not None:
            self._tokens_in_flight -= cost
        for alias in prepared.aliases:
            if self._live.get(alias) == prepared.job.request_id:
                del self._live[alias]

    @property
    def num_live_requests(self) -> int:
        return len(self._requests)

    def cancel(self, alias: str) -> bool:
        request_id = self._live.get(alias)
        if request_id is None:
            return False
        self.abort(request_id)
        return True

    # ------------------------------------------------------------------------------------------
    # async mode

    async def stream(self, job: GenerationJob) -> AsyncIterator[RequestOutput]:
        """One request's outputs while other requests run: the engine thread, or generate() on a thread."""
        if self.engine is None:
            outputs = stream_async(self.path, job, self._reference_lock)
        else:
            if self._async_engine is None:
                self._async_engine = AsyncLLMEngine(self.engine)
            outputs = self._async_engine.generate(job.request_id, job.prompt_token_ids, job.params, job.prompt_embeds)
        try:
            # aclosing: when our consumer stops early, the inner stream's finally (the abort) runs now.
            async with aclosing(outputs):
                async for out in outputs:
                    yield out
        except PromptTooLongError as exc:
            raise RequestError(str(exc), "prompt_too_long") from None

    def kv_usage(self) -> str:
        if self.engine is None:
            return "no paged KV cache"
        stats = self.engine.stats()
        return (f"KV blocks free {stats.num_free_blocks}/{stats.num_total_blocks}; "
                f"live requests {self.num_live_requests}")

    def abort(self, request_id: str) -> None:
        if self._async_engine is not None:
            self._async_engine.abort(request_id)
        else:
            self.path.abort(request_id)
