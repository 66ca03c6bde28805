"""LLMHandler: the TorchServe entry point (the archive's handler; the module defines this one class).

TorchServe calls ``initialize`` once per worker and ``handle`` with the requests it collected. Every row
runs through the same coroutine, ``_serve_row``, whatever the worker mode:

* ``asyncCommunication: true`` (the shipped model-config.yaml, batchSize 1): ``handle`` returns the
  coroutine and TorchServe awaits it once per request, many at a time, so requests join the running
  engine at its next step;
* classic batching (model-config.classic.yaml): up to ``batchSize`` requests arrive in one call;
  ``handle`` runs their coroutines together on the handler's own event loop and returns when all ended
  (every stream of the batch stays open until then, TorchServe's rule), while the engine batches them
  with whatever else is running.

A row is routed on what follows ``/predictions/<model>/<version>/`` (the ``url_path`` header): nothing
-> the native format (``llm_api.api.native``), ``v1/...`` -> the OpenAI-compatible routes
(``llm_api.api.openai``). Each becomes a ``GenerateRequest`` for ``ModelService.generate``, whose events
are encoded per format and written with ``llm_api.torchserve.reply.Reply``. Nothing a row does can
escape it: every exception while handling one request becomes that request's own error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from contextlib import aclosing
from typing import AsyncGenerator

from ts.torch_handler.base_handler import BaseHandler

from llm_api.api import openai
from llm_api.api.errors import DEFAULT_RETRY_AFTER_S, ApiError, internal_error
from llm_api.api.native_stream import GRPC_MAX_MESSAGE_BYTES
from llm_api.api.request import CancelRequest
from llm_api.api.tokenize import detokenize_answer, tokenize_answer
from llm_api.model.settings import ConfigError, Settings
from llm_api.service.answer import (Chunk, Part, Refusal, encoded_parts, native_encoder, parse_detokenize_call,
                                    parse_native, parse_openai, parse_tokenize_call)
from llm_api.service.service import ModelService
from llm_api.torchserve.metrics_sink import TorchServeMetricSink
from llm_api.torchserve.reply import JSON_CONTENT_TYPE, Reply

logger = logging.getLogger(__name__)


class LLMHandler(BaseHandler):
    def __init__(self) -> None:
        super().__init__()
        self.service: ModelService | None = None
        self.async_mode = False
        self.marker = ""
        self.grpc_streaming = False
        self._loop: asyncio.AbstractEventLoop | None = None  # classic mode's own event loop

    def initialize(self, context):
        settings = Settings.from_env()  # a bad value raises here and the model does not load
        # Parse request bodies ourselves: TorchServe's own JSON decoding accepts NaN, duplicate keys
        # and invalid UTF-8 silently (it falls back to bytes), and we want one clear error per case.
        # The worker reads this variable for every incoming message.
        os.environ["TS_DECODE_INPUT_REQUEST"] = "false"
        yaml_config = getattr(context, "model_yaml_config", None) or {}
        self.async_mode = bool(yaml_config.get("asyncCommunication", False))
        batch_size = int(context.system_properties.get("batch_size") or 1)
        if self.async_mode and batch_size != 1:
            # The frontend's async aggregator breaks on batches (ConcurrentModificationException: every
            # request in flight hangs); refuse to serve rather than take requests we would lose.
            raise ConfigError(f"asyncCommunication needs batchSize 1, got {batch_size}: set batchSize: 1 in the "
                              f"archive's model-config.yaml (it wins over config.properties' models= block)")
        if not self.async_mode:
            self._loop = asyncio.new_event_loop()
        self.marker = settings.end_of_stream_token
        self.grpc_streaming = settings.grpc_streaming
        self.service = ModelService.load(settings, TorchServeMetricSink(settings.model_name))
        self.service.metrics.announce()
        self.initialized = True
        logger.info("LLMHandler ready: model=%s path=%s mode=%s batch_size=%s", settings.model_name,
                    self.service.path_name, "async" if self.async_mode else "classic",
                    context.system_properties.get("batch_size"))

    @property
    def _service(self) -> ModelService:
        """The loaded service (``initialize`` sets it; TorchServe sends requests only after it returned)."""
        if self.service is None:  # (a request's failure: _serve_row answers it with a 500)
            raise RuntimeError("the model is not loaded")
        return self.service

    def handle(self, data, context):
        if self.async_mode:
            return self._serve_rows(data, context)  # TorchServe awaits the coroutine
        return self._loop.run_until_complete(self._serve_rows(data, context))

    async def _serve_rows(self, data, context) -> list:
        if len(data) > 1:
            logger.info("handle: %d requests in one call", len(data))
        return list(await asyncio.gather(*(self._serve_row(idx, row, context) for idx, row in enumerate(data))))

    async def _serve_row(self, idx: int, row, context):
        reply = Reply(context, idx, self.async_mode)
        api = None
        try:
            api = openai.route(reply.url_path) if not reply.is_grpc else None
            if api is not None:
                return await self._serve_openai(reply, api, row)
            return await self._serve_native(reply, row)
        except ApiError as err:  # a refusal before anything was sent
            logger.info("request %s refused: %s", reply.request_id, err.code)
            body = err.openai_text(self.marker) if api is not None or reply.url_path else err.native_text(self.marker)
            return reply.refuse(err.status, body, headers=err.headers())
        except Exception:  # a bug must cost this request only, never the worker or the other streams
            logger.exception("request %s failed", reply.request_id)
            error = internal_error("the server failed to handle this request")
            if reply.started:
                return reply.finish("\n" + error.native_text(self.marker))
            return reply.refuse(500, error.native_text(self.marker))

    # -------------------------------------------------------------------------------------------
    # native: /predictions/<model> and gRPC

    async def _serve_native(self, reply: Reply, row):
        service = self._service
        request = await parse_native(service, row, default_stream=not reply.is_grpc)
        if isinstance(request, CancelRequest):
            found = service.cancel(request.target_id)
            logger.info("cancel of request %s: %s", request.target_id[:64], "done" if found else "not running")
            return reply.finish(json.dumps({"cancelled": found}), JSON_CONTENT_TYPE)
        if reply.is_grpc and not self.grpc_streaming:
            # A unary Predictions call looks the same as StreamPredictions here, and a second message to a
            # unary call kills the worker: without GRPC_STREAMING every gRPC answer is one message.
            request.stream = False
        # A unary gRPC answer is one message, which gRPC clients refuse above 4 MiB by default.
        max_unary_bytes = GRPC_MAX_MESSAGE_BYTES if reply.is_grpc else None
        encoder = native_encoder(request, self.marker, max_unary_bytes)
        return await self._write_parts(reply, encoded_parts(service, request, encoder, reply.request_id, self.marker))

    # -------------------------------------------------------------------------------------------
    # OpenAI-compatible: /predictions/<model>/<version>/v1/...

    async def _serve_openai(self, reply: Reply, api: str, row):
        service = self._service
        if api == "models":
            return reply.finish(openai.models_list(service.model_name, service.created), JSON_CONTENT_TYPE)
        if api == "health":
            health = service.metrics.health()
            if not health.ready:
                return reply.refuse(503, json.dumps(health.to_json()),
                                    headers={"Retry-After": str(DEFAULT_RETRY_AFTER_S)})
            return reply.finish(json.dumps(health.to_json()), JSON_CONTENT_TYPE)
        body = row.get("body") if hasattr(row, "get") else None
        if body is None:
            raise ApiError(400, "invalid_json", "send a JSON body (Content-Type: application/json)")
        if api == "tokenize":
            token_ids = await service.tokenize(await parse_tokenize_call(service, body))
            return reply.finish(tokenize_answer(token_ids, service.max_model_len), JSON_CONTENT_TYPE)
        if api == "detokenize":
            token_ids = await parse_detokenize_call(service, body)
            return reply.finish(detokenize_answer(await service.detokenize(token_ids)), JSON_CONTENT_TYPE)
        request, call = await parse_openai(service, api, body)
        call.marker = self.marker
        return await self._write_parts(reply, encoded_parts(service, request, call, reply.request_id),
                                       final_as_chunk=True)

    # -------------------------------------------------------------------------------------------
    # writing an answer

    async def _write_parts(self, reply: Reply, parts: AsyncGenerator[Part, None], final_as_chunk: bool = False):
        """Write a request's parts (``llm_api.service.answer``): each chunk as it comes, then the final part
        as the final message, or the refusal.

        ``final_as_chunk`` (the OpenAI routes): the final part goes out as one more chunk and an empty final
        message closes the answer. That differs from ``reply.finish(payload)`` only in classic mode when
        nothing was sent before (a non-streamed answer): there the answer is then a chunked body instead
        of one plain message."""
        async with aclosing(parts):
            async for part in parts:
                if isinstance(part, Chunk):
                    reply.send(part.payload, part.content_type)
                elif isinstance(part, Refusal):
                    return reply.refuse(part.status, part.body, headers=part.headers)
                elif final_as_chunk:
                    reply.send(part.payload, part.content_type)
                    return reply.finish("", part.content_type)
                else:
                    return reply.finish(part.payload, part.content_type)
        raise RuntimeError("the request ended without a final part")
