"""LLMHandler: the TorchServe entry point (the only module that imports ``ts``).

TorchServe calls ``initialize`` once per worker and ``handle`` with the requests it collected. The
handler turns each row into a ``GenerationJob`` (or a 4xx JSON error for that row alone), runs the
valid ones through the configured generation path and streams each client its own text with
``send_intermediate_predict_response``; the final return closes every stream.

Two worker modes, chosen in the archive's model-config.yaml:
* classic (default aggregator): TorchServe hands over up to ``batchSize`` requests collected within
  ``maxBatchDelay``; they run as one batch and every stream stays open until ``handle`` returns;
* ``asyncCommunication: true``: ``handle`` is awaited once per request and requests join the running
  engine at its next step (see ``_handle_async``).

TorchServe facts this relies on are listed in the project's torchserve-facts notes: the backend
cannot tell unary gRPC from streaming gRPC (so gRPC streams only with ``stream=true``), a non-200
status must be set per request with ``context.set_response_status``, and the module may define only
one class.
"""

from __future__ import annotations

import logging
import os
import time
import uuid

import torch
from ts.handler_utils.utils import send_intermediate_predict_response
from ts.torch_handler.base_handler import BaseHandler

from llm_api import model_loader
from llm_api.config import Settings
from llm_api.detokenizer import TextStream
from llm_api.generation import GenerationJob, StepOutput
from llm_api.protocol import GenerateRequest, Limits, RequestError, parse_request
from llm_api.reference import ReferenceGenerator
from llm_api.response import ResponseStream

logger = logging.getLogger(__name__)

STREAM_CONTENT_TYPE = "text/plain; charset=utf-8"
ERROR_CONTENT_TYPE = "application/json"


class LLMHandler(BaseHandler):
    def __init__(self):
        super().__init__()
        self.settings: Settings | None = None
        self.lm = None
        self.path = None
        self.limits: Limits | None = None
        self.async_mode = False

    # -------------------------------------------------------------------------------------------
    # lifecycle

    def initialize(self, context):
        self.settings = Settings.from_env()  # a bad value raises here and the model does not load
        # Parse request bodies ourselves: TorchServe's own JSON decoding accepts NaN, duplicate keys
        # and invalid UTF-8 silently (it falls back to bytes), and we want one clear error per case.
        # The worker reads this variable for every incoming message.
        os.environ["TS_DECODE_INPUT_REQUEST"] = "false"
        yaml_config = getattr(context, "model_yaml_config", None) or {}
        self.async_mode = bool(yaml_config.get("asyncCommunication", False))
        self.lm = model_loader.load(self.settings)
        self.limits = Limits(
            max_input_tokens=self.settings.max_input_tokens,
            max_new_tokens=self.settings.max_new_tokens,
            hidden_size=self.lm.hidden_size,
        )
        self.path = ReferenceGenerator(self.lm.model, self.lm.eos_token_ids, self.lm.tokenizer.pad_token_id)
        self.initialized = True
        logger.info(
            "LLMHandler ready: model=%s engine=%s async=%s batch_size=%s",
            self.settings.model_name,
            self.settings.engine,
            self.async_mode,
            getattr(context, "system_properties", {}).get("batch_size"),
        )

    def handle(self, data, context):
        return self._handle_batch(data, context)

    # -------------------------------------------------------------------------------------------
    # classic mode: one batch per call

    def _handle_batch(self, data, context):
        started = time.monotonic()
        results: dict[int, str | bytes] = {}
        jobs: list[GenerationJob] = []
        streams: dict[str, ResponseStream] = {}
        index_of: dict[str, int] = {}
        for idx, row in enumerate(data):
            try:
                job, stream = self._prepare(idx, row, context)
            except RequestError as err:
                logger.info("request %s refused: %s (%s)", context.get_request_id(idx), err.type, err.message)
                self._set_error(context, idx, err.code, err.message)
                results[idx] = err.to_bytes()
                continue
            jobs.append(job)
            streams[job.key] = stream
            index_of[job.key] = idx
            context.set_response_content_type(idx, STREAM_CONTENT_TYPE)
        logger.info(
            "handle: batch of %d requests (%d valid), prompt tokens %s",
            len(data), len(jobs), [j.prompt_len for j in jobs],
        )

        def on_step(outputs: list[StepOutput]) -> None:
            chunks: dict[int, str] = {}
            for out in outputs:
                stream = streams[out.key]
                chunk, stopped = stream.push(out.new_token_ids)
                if stopped and not out.finished:
                    self.path.abort(out.key)
                if chunk:
                    chunks[index_of[out.key]] = chunk
                if out.finished or stopped:
                    stream.finish_reason = "stop" if stopped else out.finish_reason
            if chunks:
                send_intermediate_predict_response(
                    chunks, {i: context.get_request_id(i) for i in chunks}, "Intermediate", 200, context
                )

        try:
            self.path.run(jobs, on_step)
        except Exception:  # one failed batch must not take the worker down; every stream gets an end
            logger.exception("generation failed for a batch of %d", len(jobs))
            for key, stream in streams.items():
                if not stream.finished:
                    results[index_of[key]] = stream.fail(500, "internal_error", "generation failed")
                    if not stream.started:
                        self._set_error(context, index_of[key], 500, "generation failed")
        for key, stream in streams.items():
            if index_of[key] not in results:
                results[index_of[key]] = stream.finish(stream.finish_reason)
        for idx in range(len(data)):
            self._mark_last_message(context, idx, streamed=any(s.started for k, s in streams.items() if index_of[k] == idx))
        logger.info("handle: batch of %d done in %.2fs", len(data), time.monotonic() - started)
        return [results[i] for i in range(len(data))]

    # -------------------------------------------------------------------------------------------
    # shared request preparation

    def _prepare(self, idx: int, row, context) -> tuple[GenerationJob, ResponseStream]:
        """Validate one row and turn it into a job; raises RequestError for this row only."""
        is_grpc = self._is_grpc(context, idx)
        fields = dict(row)
        if is_grpc and "stream" not in fields and "body" not in fields and "data" not in fields:
            fields["stream"] = "false"  # unary Predictions looks the same as StreamPredictions here
        request = parse_request(fields, self.limits)
        key = context.get_request_id(idx) or uuid.uuid4().hex
        job = GenerationJob(key=key, params=request.params)
        if request.inputs_embeds is not None:
            job.prompt_embeds = torch.tensor(request.inputs_embeds, dtype=self.lm.model.dtype, device=self.lm.device)
        else:
            job.prompt_token_ids = self._tokenize(request)
        stream = ResponseStream(
            key=key,
            text_stream=TextStream(self.lm.tokenizer, request.params.stop, self.settings.end_of_stream_token),
            marker=self.settings.end_of_stream_token,
            streaming=request.stream,
            num_prompt_tokens=job.prompt_len,
        )
        return job, stream

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

    @staticmethod
    def _is_grpc(context, idx: int) -> bool:
        # HTTP requests carry their headers (url_path among them); gRPC requests carry none.
        headers = context.request_processor[idx].get_request_properties() if context.request_processor else {}
        return not any(isinstance(v, str) for v in headers.values())

    def _mark_last_message(self, context, idx: int, streamed: bool) -> None:
        """Tell TorchServe's gRPC frontend that this message ends the call.

        A StreamPredictions call must end with ``ts_stream_next: false`` (without the header the
        frontend throws and the worker dies), and the backend cannot tell it from a unary call, so
        every gRPC answer that was not streamed carries it (a unary call ignores it). HTTP must not
        get it on a non-streamed answer: the frontend would then skip the response headers.
        """
        if not streamed and self._is_grpc(context, idx):
            context.set_response_header(idx, "ts_stream_next", "false")

    @staticmethod
    def _set_error(context, idx: int, code: int, message: str) -> None:
        context.set_response_status(code, message[:200], idx)
        context.set_response_content_type(idx, ERROR_CONTENT_TYPE)
