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

The handler moves bytes only: a row becomes a ``Call`` (``llm_api.protocols.route``), its route is found
in the one route table by what follows ``/predictions/<model>/<version>/`` (the ``url_path`` header;
nothing: the native route; gRPC: always the native route), and the route's answer is written with
``llm_api.torchserve.reply.Reply``: a whole answer as the final message, a streamed one chunk by chunk.
Nothing a row does can escape it: every exception while handling one request becomes that request's own
error, in its route's shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from contextlib import aclosing

from ts.torch_handler.base_handler import BaseHandler

from llm_api.errors import ApiError, internal_error
from llm_api.model.settings import ConfigError, Settings
from llm_api.protocols.route import Answer, ApiStates, Call, RouteContext, Whole, error_body
from llm_api.protocols.table import answer, error_shape, find, open_api_states
from llm_api.protocols.wire import wire
from llm_api.service.answer import Chunk
from llm_api.service.owners import request_credential, torchserve_owner
from llm_api.service.service import ModelService
from llm_api.torchserve.metrics_sink import TorchServeMetricSink
from llm_api.torchserve.reply import Reply

logger = logging.getLogger(__name__)


class LLMHandler(BaseHandler):
    def __init__(self) -> None:
        super().__init__()
        self.service: ModelService | None = None
        self.apis: ApiStates | None = None
        self.async_mode = False
        self.marker = ""
        self.grpc_streaming = False
        self._loop: asyncio.AbstractEventLoop | None = None  # classic mode's own event loop

    def initialize(self, context):
        settings = Settings.from_env()  # a bad value raises here and the model does not load
        model_dir = context.system_properties.get("model_dir")
        if model_dir:  # adapters packaged into the archive (--extra-files) are named relative to it
            settings = settings.with_lora_base(model_dir)
        # Parse request bodies ourselves: TorchServe's own JSON decoding accepts NaN, duplicate keys
        # and invalid UTF-8 silently (it falls back to bytes), and we want one clear error per case.
        # The worker reads this variable for every incoming message (so it is set here, not a setting:
        # tests/test_architecture.py allows this one use of the environment outside llm_api.model.settings).
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
        self.apis = open_api_states(settings)  # (what the APIs keep: an unusable RESPONSES_STORE_PATH stops here)
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
        path = "" if reply.is_grpc else (reply.url_path or "")
        shape = error_shape(path, "torchserve")
        try:
            route, params = find(None, path, "torchserve", reply.headers)
            shape = route.errors
            key = None if reply.is_grpc else _inference_key()
            credential = request_credential(_one(reply.headers.get("authorization")), _one(reply.headers.get("x-api-key")))
            owner = torchserve_owner(credential, key)
            # (a tenant only where the frontend checked the key: an unchecked header names no share of its own)
            call = Call(reply.request_id, None, row, reply.headers, grpc=reply.is_grpc,
                        grpc_stream=reply.is_grpc and self.grpc_streaming, owner=owner,
                        tenant=owner if key is not None else "")
            ctx = RouteContext(self.marker, self._service, management_key=_management_key, apis=self.apis)
            return await self._write(reply, await answer(route, params, ctx, call))
        except ApiError as err:  # a refusal before anything was sent
            logger.info("request %s refused: %s", reply.request_id, err.code)
            return reply.refuse(err.status, error_body(shape, err, self.marker), headers=err.headers())
        except Exception:  # a bug must cost this request only, never the worker or the other streams
            logger.exception("request %s failed", reply.request_id)
            if reply.started:
                # (only the reply itself fails here once a chunk went out: a failure of the answer after that
                # is its route's in-band ending, written by wire; the stream is ended without another word)
                return reply.finish("")
            return reply.refuse(500, error_body(shape, internal_error("the server failed to handle this request"),
                                                self.marker))

    @staticmethod
    async def _write(reply: Reply, result: Answer):
        """Write a route's answer (``llm_api.protocols.wire``): a whole answer as the final message (a refusal
        with its status), a streamed one chunk by chunk, its last payload as the final message."""
        async with aclosing(wire(result, reply.request_id)) as events:
            async for event in events:
                if isinstance(event, Whole):
                    if event.status == 200:
                        return reply.finish(event.body, event.content_type)
                    return reply.refuse(event.status, event.body, event.content_type, event.headers)
                if isinstance(event, Chunk):
                    reply.send(event.payload, event.content_type)
                else:
                    return reply.finish(event.payload, event.content_type)
        raise AssertionError("wire ends with a Whole, or with a Final after chunks")


def _management_key() -> str | None:
    """TorchServe's current management key (``_frontend_key``)."""
    return _frontend_key("management")


def _one(value: str | None) -> list[str]:
    """A header of TorchServe's table (one value per name) as the list of values the owner functions take."""
    return [] if value is None else [value]


def _inference_key() -> str | None:
    """TorchServe's current inference key (``_frontend_key``): the one header the frontend let through."""
    return _frontend_key("inference")


def _frontend_key(kind: str) -> str | None:
    """One of TorchServe's current keys, from the key_file.json in the frontend's working directory (the
    worker runs in the model's folder; its parent process is the frontend), read at each use (the frontend
    renews keys). None when there is no key file written since the frontend started: token authorization is
    off (a file left by an earlier run with it on is not this frontend's)."""
    started = _frontend_started_at()
    for folder in (f"/proc/{os.getppid()}/cwd", os.getcwd()):
        path = os.path.join(folder, "key_file.json")
        if not os.path.exists(path):
            continue
        if started is not None and os.path.getmtime(path) < started - 5:
            continue
        try:
            with open(path, encoding="utf-8") as file:
                return str(json.load(file)[kind]["key"])
        except (OSError, ValueError, KeyError, TypeError):
            return secrets.token_hex(32)  # a key file we cannot read: no key matches (fail closed)
    return None



def _frontend_started_at() -> float | None:
    """When the frontend (this worker's parent process) started, in Unix seconds; None where unknown."""
    try:
        with open(f"/proc/{os.getppid()}/stat", encoding="ascii", errors="replace") as file:
            start_ticks = int(file.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as file:
            boot = next(int(line.split()[1]) for line in file if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
