"""LLMHandler: the TorchServe entry point (the only module that imports ``ts``).

TorchServe calls ``initialize`` once per worker and ``handle`` with the requests it collected. Each
row becomes a job (or a 4xx JSON error for that row alone); ``ModelService`` runs the jobs and each
client gets its own text through ``send_intermediate_predict_response``, then a final message.

Two worker modes, chosen in the archive's model-config.yaml:
* classic (the default aggregator): up to ``batchSize`` requests collected within ``maxBatchDelay``
  arrive in one call and run as one batch; every stream stays open until ``handle`` returns;
* ``asyncCommunication: true`` (batchSize 1): ``handle`` returns a coroutine that TorchServe awaits
  once per request, many at a time, so requests join the running engine at its next step.

TorchServe 0.12 behaviours this is shaped by (see the project's torchserve-facts notes):
* the backend cannot tell unary gRPC from StreamPredictions: gRPC streams only with ``stream=true``,
  and a gRPC answer that was not streamed is one message marked ``ts_stream_next: false``
  (``_final_marking``);
* in async mode a final message without a preceding chunk is never removed from the frontend's
  table, so HTTP answers there go out as a chunk; a 4xx cannot (the frontend closes the
  connection after its head), so refused requests are the one exception;
* a non-200 code for the whole batch fails every request in flight: errors are set per request
  with ``context.set_response_status``, never raised;
* the module may define only one class;
* everything after ``/predictions/<model>/<version>/`` arrives in the ``url_path`` header: the
  OpenAI-compatible paths (``v1/...``, ``llm_api.openai_api``) are routed on it, async mode only.

Metrics (``llm_api.metrics``) are written as TorchServe ``[METRICS]`` lines through ``_metric_sink``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

from ts.handler_utils.utils import send_intermediate_predict_response
from ts.metrics.caching_metric import CachingMetric
from ts.metrics.metric_type_enum import MetricTypes
from ts.torch_handler.base_handler import BaseHandler

from llm_api import openai_api
from llm_api.config import Settings
from llm_api.metrics import ServingMetrics
from llm_api.openai_api import OpenAIError
from llm_api.protocol import CancelRequest, RequestError, parse_request
from llm_api.serving import ModelService, Prepared, StreamEnd

logger = logging.getLogger(__name__)

STREAM_CONTENT_TYPE = "text/plain; charset=utf-8"
JSON_CONTENT_TYPE = "application/json"


class LLMHandler(BaseHandler):
    def __init__(self):
        super().__init__()
        self.service: ModelService | None = None
        self.async_mode = False
        self.metrics: ServingMetrics | None = None
        self._ts_metrics: dict[str, CachingMetric] = {}
        self._model_name = ""
        self._created = int(time.time())

    def initialize(self, context):
        settings = Settings.from_env()  # a bad value raises here and the model does not load
        # Parse request bodies ourselves: TorchServe's own JSON decoding accepts NaN, duplicate keys
        # and invalid UTF-8 silently (it falls back to bytes), and we want one clear error per case.
        # The worker reads this variable for every incoming message.
        os.environ["TS_DECODE_INPUT_REQUEST"] = "false"
        yaml_config = getattr(context, "model_yaml_config", None) or {}
        self.async_mode = bool(yaml_config.get("asyncCommunication", False))
        self.service = ModelService.load(settings)
        self._model_name = settings.model_name
        engine = self.service.engine
        self.metrics = ServingMetrics(self._metric_sink, engine.stats if engine is not None else None)
        self.metrics.announce()
        self.initialized = True
        logger.info(
            "LLMHandler ready: model=%s path=%s mode=%s batch_size=%s",
            settings.model_name, self.service.path_name, "async" if self.async_mode else "classic",
            context.system_properties.get("batch_size"),
        )

    def handle(self, data, context):
        if self.async_mode:
            return self._handle_async(data, context)  # TorchServe awaits the coroutine
        return self._handle_batch(data, context)

    # -------------------------------------------------------------------------------------------
    # classic mode: one batch per call

    def _handle_batch(self, data, context):
        started = time.monotonic()
        results: dict[int, str | bytes] = {}
        live: dict[str, tuple[int, Prepared]] = {}
        timers = {}
        for idx, row in enumerate(data):
            if self._url_path(context, idx):
                err = OpenAIError("the OpenAI-compatible paths need the async worker mode (asyncCommunication: true)", 404, None, "not_found")
                results[idx] = self._openai_refuse(context, idx, err)
                continue
            try:
                prepared = self._prepare(idx, row, context)
            except RequestError as err:
                results[idx] = self._error(context, idx, err)
                continue
            if isinstance(prepared, str):  # a cancel call: it cannot reach a running batch here
                results[idx] = prepared
                continue
            live[prepared.job.request_id] = (idx, prepared)
            timers[prepared.job.request_id] = self.metrics.start(prepared.job.prompt_len, started)
            context.set_response_content_type(idx, STREAM_CONTENT_TYPE)
        jobs = [p.job for _, p in live.values()]
        logger.info("handle: batch of %d requests (%d valid), prompt tokens %s", len(data), len(jobs), [j.prompt_len for j in jobs])

        def on_step(outputs) -> None:
            chunks: dict[int, str] = {}
            now = time.monotonic()
            for out in outputs:
                idx, prepared = live[out.request_id]
                stream = prepared.stream
                if stream.finished:  # ended here already (stop string, deadline); its abort is under way
                    continue
                timers[out.request_id].tokens(len(out.new_token_ids))
                chunk, stopped = stream.push(out.new_token_ids)
                if chunk:
                    chunks[idx] = chunk
                if stopped:
                    results[idx] = stream.finish("stop")
                elif out.finished:
                    results[idx] = stream.finish(out.finish_reason)
                elif now > prepared.deadline:
                    results[idx] = self._fail(context, idx, prepared, 408, "timeout", "the request exceeded its deadline")
                if stream.finished and not out.finished:
                    self.service.path.abort(out.request_id)
            if chunks:
                send_intermediate_predict_response(
                    chunks, {i: context.get_request_id(i) for i in chunks}, "Intermediate", 200, context
                )

        try:
            self.service.path.run(jobs, on_step)
        except Exception:  # one failed batch must not take the worker down; every stream gets an end
            logger.exception("generation failed for a batch of %d", len(jobs))
            for idx, prepared in live.values():
                if not prepared.stream.finished:
                    results[idx] = self._fail(context, idx, prepared, 500, "internal_error", "generation failed")
        for idx, prepared in live.values():
            timers[prepared.job.request_id].finish()
            if idx not in results:
                results[idx] = prepared.stream.finish(prepared.stream.finish_reason or "length")
        for idx in range(len(data)):
            streamed = any(p.stream.started for i, p in live.values() if i == idx)
            self._final_marking(context, idx, streamed)
        logger.info("handle: batch of %d done in %.2fs", len(data), time.monotonic() - started)
        return [results[i] for i in range(len(data))]

    # -------------------------------------------------------------------------------------------
    # async mode: one request per call, many calls at once

    async def _handle_async(self, data, context):
        results = []
        for idx, row in enumerate(data):  # batchSize is 1 in this mode; a list still works
            results.append(await self._serve_one(idx, row, context))
        return results

    async def _serve_one(self, idx: int, row, context):
        arrival = time.monotonic()
        grpc = self._is_grpc(context, idx)
        if not grpc:
            try:
                api = openai_api.route(self._url_path(context, idx))
            except OpenAIError as err:
                return self._openai_refuse(context, idx, err)
            if api is not None:
                return await self._serve_openai(api, idx, row, context, arrival)
        try:
            prepared = self._prepare(idx, row, context)
            if not isinstance(prepared, str):
                self.service.register(prepared)  # 503 when the server is full
        except RequestError as err:
            return self._async_final(context, idx, self._error(context, idx, err), streamed=False, grpc=grpc)
        if isinstance(prepared, str):
            context.set_response_content_type(idx, JSON_CONTENT_TYPE)
            return self._async_final(context, idx, prepared, streamed=False, grpc=grpc)
        context.set_response_content_type(idx, STREAM_CONTENT_TYPE)
        stream = prepared.stream
        async for item in self._generate(prepared, arrival):
            if isinstance(item, str):
                send_intermediate_predict_response([item], {idx: context.get_request_id(idx)}, "Intermediate", 200, context)
            elif item.error is not None:
                final = self._fail(context, idx, prepared, item.error.code, item.error.type, item.error.message)
            else:
                final = stream.finish(item.reason)
        logger.info(
            "request %s ended: %s after %d tokens; %s",
            prepared.job.request_id, stream.finish_reason, stream.num_generated_tokens, self.service.kv_usage(),
        )
        return self._async_final(context, idx, final, streamed=stream.started, grpc=grpc)

    async def _generate(self, prepared: Prepared, arrival: float) -> AsyncIterator[str | StreamEnd]:
        """One admitted request's text chunks, then exactly one ``StreamEnd`` (native and OpenAI paths).

        Ends the request at its stop string, its end, a cancel call, its deadline or an engine error;
        leaving the engine's iterator (``aclosing``) aborts it there, and it leaves the service's tables."""
        stream = prepared.stream
        timer = self.metrics.start(prepared.job.prompt_len, arrival)
        end = None
        try:
            async with asyncio.timeout(max(0.0, prepared.deadline - time.monotonic())), aclosing(
                self.service.stream(prepared.job)
            ) as outputs:
                async for out in outputs:
                    timer.tokens(len(out.new_token_ids))
                    chunk, stopped = stream.push(out.new_token_ids)
                    if chunk:
                        yield chunk
                    if stopped:
                        end = StreamEnd("stop")
                    elif out.finished and out.finish_reason == "abort":
                        end = StreamEnd(error=RequestError("the request was cancelled", "cancelled", 499))
                    elif out.finished:
                        end = StreamEnd(out.finish_reason)
                    if end is not None:
                        break
        except TimeoutError:
            end = StreamEnd(error=RequestError("the request exceeded its deadline", "timeout", 408))
        except RequestError as err:
            end = StreamEnd(error=err)
        except Exception:  # an engine failure ends this stream with an error, never a hang
            logger.exception("request %s failed", prepared.job.request_id)
            end = StreamEnd(error=RequestError("generation failed", "internal_error", 500))
        finally:
            self.service.unregister(prepared)
            timer.finish()
        yield end or StreamEnd(error=RequestError("generation ended without a result", "internal_error", 500))

    def _async_final(self, context, idx: int, final, streamed: bool, grpc: bool):
        if grpc or streamed:
            self._final_marking(context, idx, streamed)
            return final
        status, _ = context.get_response_status(idx)
        if status is not None and status >= 400:
            # The frontend closes a connection right after the head of a 4xx, so an error cannot be
            # a chunk: it goes as a plain response (which TorchServe 0.12 then keeps in its table).
            return final
        # HTTP with nothing sent yet: the whole answer goes out as a chunk, and the final message
        # only closes the stream.
        send_intermediate_predict_response([final], {idx: context.get_request_id(idx)}, "Intermediate", 200, context)
        return ""

    # -------------------------------------------------------------------------------------------
    # OpenAI-compatible paths (async mode): same engine stream, OpenAI's encoding and errors

    async def _serve_openai(self, api: str, idx: int, row, context, arrival: float):
        if api == "models":
            return self._openai_answer(context, idx, openai_api.models_list(self._model_name, self._created), JSON_CONTENT_TYPE)
        if api == "health":
            health = self.metrics.health()
            if not health.ready:  # sent like a 4xx: a plain final response, for this request only
                context.set_response_status(503, "the engine is not making progress", idx)
                context.set_response_content_type(idx, JSON_CONTENT_TYPE)
                return json.dumps(health.to_json())
            return self._openai_answer(context, idx, json.dumps(health.to_json()), JSON_CONTENT_TYPE)
        body = row.get("body") if hasattr(row, "get") else None
        try:
            if body is None:
                raise OpenAIError("send a JSON body (Content-Type: application/json)", 400, None, "invalid_json")
            request, call = openai_api.parse_call(api, body, self._model_name, self.service.limits)
            prepared = self.service.prepare(request, context.get_request_id(idx) or uuid.uuid4().hex)
            self.service.register(prepared)  # 503 when the server is full
        except RequestError as err:
            return self._openai_refuse(context, idx, OpenAIError.from_request_error(err))
        except OpenAIError as err:
            return self._openai_refuse(context, idx, err)
        logger.info("request %s: openai %s, %d prompt tokens", prepared.job.request_id, api, prepared.job.prompt_len)
        prepared.stream.marker = ""  # SSE ends with [DONE], JSON with its closing brace
        context.set_response_content_type(idx, call.content_type)
        stream, reason, error, sent = prepared.stream, None, None, False

        def send(payload: str) -> None:
            nonlocal sent
            if payload:
                send_intermediate_predict_response([payload], {idx: context.get_request_id(idx)}, "Intermediate", 200, context)
                sent = True

        async for item in self._generate(prepared, arrival):
            if isinstance(item, str):
                send(call.delta(item))
            elif item.error is not None:
                error = OpenAIError.from_request_error(item.error)
            else:
                reason = item.reason
        logger.info("request %s ended: %s after %d tokens", prepared.job.request_id, reason or error.code, stream.num_generated_tokens)
        if error is not None:
            if not sent:
                return self._openai_refuse(context, idx, error)
            send(call.error_event(error))
            return ""
        send(call.finish(stream.finish(reason), reason, prepared.job.prompt_len, stream.num_generated_tokens))
        return ""

    def _openai_answer(self, context, idx: int, payload: str, content_type: str) -> str:
        # Async mode: a 200 answer goes out as a chunk; the final message only closes the stream.
        context.set_response_content_type(idx, content_type)
        send_intermediate_predict_response([payload], {idx: context.get_request_id(idx)}, "Intermediate", 200, context)
        return ""

    def _openai_refuse(self, context, idx: int, err: OpenAIError) -> bytes:
        logger.info("request %s refused: %s (%s)", context.get_request_id(idx), err.code, err.message)
        context.set_response_status(err.status, err.message[:200], idx)
        context.set_response_content_type(idx, JSON_CONTENT_TYPE)
        return err.to_bytes()

    def _metric_sink(self, name: str, value: float, unit: str, kind: str) -> None:
        """One observation -> a ``[METRICS]`` line on the worker's stdout, which the frontend parses."""
        metric = self._ts_metrics.get(name)
        if metric is None:
            metric = self._ts_metrics[name] = CachingMetric(name, unit, ["model_name"], MetricTypes[kind.upper()])
        metric.add_or_update(value, [self._model_name])

    # -------------------------------------------------------------------------------------------
    # shared

    def _prepare(self, idx: int, row, context) -> Prepared | str:
        """A row -> a prepared job, or the JSON answer of a cancel call; RequestError if refused."""
        # gRPC streams only when asked: a unary Predictions call looks the same as StreamPredictions here.
        request = parse_request(row, self.service.limits, default_stream=not self._is_grpc(context, idx))
        if isinstance(request, CancelRequest):
            found = self.service.cancel(request.target_id)
            logger.info("cancel %s: %s", request.target_id, "found" if found else "not running")
            return json.dumps({"request_id": request.target_id, "cancelled": found})
        prepared = self.service.prepare(request, context.get_request_id(idx) or uuid.uuid4().hex)
        logger.info("request %s: %s, %d prompt tokens", prepared.job.request_id, request.input_kind, prepared.job.prompt_len)
        return prepared

    def _error(self, context, idx: int, err: RequestError) -> bytes:
        logger.info("request %s refused: %s (%s)", context.get_request_id(idx), err.type, err.message)
        context.set_response_status(err.code, err.message[:200], idx)
        context.set_response_content_type(idx, JSON_CONTENT_TYPE)
        return err.to_bytes()

    def _fail(self, context, idx: int, prepared: Prepared, code: int, type_: str, message: str) -> str:
        """End an accepted request with an error: in-band if its stream began, else as its status."""
        if not prepared.stream.started:
            context.set_response_status(code, message, idx)
            context.set_response_content_type(idx, JSON_CONTENT_TYPE)
        return prepared.stream.fail(code, type_, message)

    def _final_marking(self, context, idx: int, streamed: bool) -> None:
        """Tell TorchServe's gRPC frontend that this message ends the call.

        A StreamPredictions call must end with ``ts_stream_next: false`` (without the header the
        frontend throws and the worker dies), and the backend cannot tell it from a unary call, so
        every gRPC answer that was not streamed carries it (a unary call ignores it). HTTP must not
        get it on a non-streamed answer: the frontend would then skip the response headers.
        """
        if not streamed and self._is_grpc(context, idx):
            context.set_response_header(idx, "ts_stream_next", "false")

    @staticmethod
    def _url_path(context, idx: int) -> str | None:
        """What followed ``/predictions/<model>/<version>/`` in an HTTP request's path (None over gRPC)."""
        headers = context.request_processor[idx].get_request_properties() if context.request_processor else {}
        value = headers.get("url_path")
        return value if isinstance(value, str) and value.strip("/") else None

    @staticmethod
    def _is_grpc(context, idx: int) -> bool:
        # HTTP requests carry their headers (url_path among them); gRPC requests carry none.
        headers = context.request_processor[idx].get_request_properties() if context.request_processor else {}
        return not any(isinstance(v, str) for v in headers.values())
