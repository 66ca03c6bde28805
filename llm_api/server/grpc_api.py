"""TorchServe's gRPC inference service (``proto/inference.proto``) on ``grpc.aio``, over the same service.

Existing clients (``llm_api.client.GRPCClient``, stubs generated from TorchServe's proto) work unchanged:

* ``Predictions`` (unary): the whole answer and the marker in one message, whatever the input asks;
* ``StreamPredictions``: token by token when the input map has ``"stream": "true"``, else one message.
  Unlike under TorchServe, whose backend cannot tell the two calls apart (docs/torchserve.md), this is
  always safe: the servicer knows which call it serves;
* a refused request gets one message holding the native error object (status OK), as from TorchServe;
  an unknown ``model_name`` is NOT_FOUND; ``StreamPredictions2`` is UNIMPLEMENTED; ``Ping`` answers
  ``{"status": "Healthy"}`` while the server accepts requests.

The input map is handed to ``llm_api.api.native.parse_request`` as form fields (or a JSON ``body``/
``data`` field), exactly as TorchServe hands it to the handler. Metadata ``authorization: Bearer <key>``
is required (UNAUTHENTICATED otherwise); while the model loads or the server drains, calls get
UNAVAILABLE. The request id issued for a call comes back in the initial metadata (``x-request-id``), so
a gRPC request can be cancelled with ``{"cancel": id}`` too.

A client that cancels its call or goes away: grpc.aio cancels the servicer's task, and the cancellation
closes ``service.generate`` (abort, KV blocks freed at the engine's next step).
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import AsyncGenerator

import grpc

from llm_api.api.errors import ApiError, internal_error
from llm_api.api.native_stream import GRPC_MAX_MESSAGE_BYTES
from llm_api.api.request import CancelRequest
from llm_api.proto import inference_pb2, inference_pb2_grpc
from llm_api.server.http_api import ServerState, new_request_id
from llm_api.service.answer import Chunk, Refusal, encoded_parts, native_encoder, parse_native

logger = logging.getLogger(__name__)


class InferenceServicer(inference_pb2_grpc.InferenceAPIsServiceServicer):
    def __init__(self, state: ServerState):
        self.state = state

    async def Ping(self, request, context):  # noqa: N802 (the proto's names)
        status = "Healthy" if self.state.lifecycle.accepting else "Unhealthy"
        return inference_pb2.TorchServeHealthResponse(health=json.dumps({"status": status}))

    async def Predictions(self, request, context):  # noqa: N802
        async with aclosing(self._answer(request, context, streaming_call=False)) as answer:
            payloads = [p async for p in answer]
        return inference_pb2.PredictionResponse(prediction="".join(payloads).encode("utf-8"))

    async def StreamPredictions(self, request, context):  # noqa: N802
        # aclosing: a cancelled call closes the answer (and so the request) at once, not when collected.
        async with aclosing(self._answer(request, context, streaming_call=True)) as answer:
            async for payload in answer:
                yield inference_pb2.PredictionResponse(prediction=payload.encode("utf-8"))

    async def StreamPredictions2(self, request_iterator, context):  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "StreamPredictions2 is not served; use StreamPredictions")

    async def _answer(self, request, context, streaming_call: bool) -> AsyncGenerator[str, None]:
        state = self.state
        metadata = dict(context.invocation_metadata() or ())
        if not state.auth.allows(metadata.get("authorization")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer key (metadata "
                                                                 "'authorization: Bearer <key>')")
        service = state.service
        if service is None or state.lifecycle.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is loading" if service is None else
                                "the server is shutting down; retry on another replica")
        assert service is not None  # (context.abort raised above)
        if request.model_name != service.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no model {request.model_name[:64]!r}; this server serves "
                                                           f"{service.model_name!r}")
        request_id = new_request_id()
        await context.send_initial_metadata((("x-request-id", request_id),))
        started = False  # a chunk went out: a later error follows on its own line
        with state.lifecycle.track(request_id):
            try:
                parsed = await parse_native(service, dict(request.input), default_stream=False)
                if isinstance(parsed, CancelRequest):
                    yield json.dumps({"cancelled": service.cancel(parsed.target_id)})
                    return
                if not streaming_call:
                    parsed.stream = False
                # A unary answer is one message, which gRPC clients refuse above 4 MiB by default.
                max_unary_bytes = None if parsed.stream else GRPC_MAX_MESSAGE_BYTES
                encoder = native_encoder(parsed, state.marker, max_unary_bytes)
                async with aclosing(encoded_parts(service, parsed, encoder, request_id, state.marker)) as parts:
                    async for part in parts:
                        if isinstance(part, Refusal):
                            yield part.body
                            return
                        yield part.payload
                        started = True
                        if not isinstance(part, Chunk):
                            return
            except ApiError as error:  # a refusal: one message with the error object, as from TorchServe
                logger.info("request %s refused: %s", request_id, error.code)
                yield error.native_text(state.marker)
            except asyncio.CancelledError:
                logger.info("request %s: the gRPC client went away; aborted", request_id)
                raise
            except Exception:
                logger.exception("request %s failed", request_id)
                text = internal_error("the server failed to handle this request").native_text(state.marker)
                yield "\n" + text if started else text


def build_grpc_server(state: ServerState, address: str) -> grpc.aio.Server:
    options = [("grpc.max_receive_message_length", state.max_request_bytes),
               ("grpc.max_send_message_length", state.max_request_bytes),
               ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options)
    inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(InferenceServicer(state), server)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"cannot listen for gRPC on {address}")
    return server
