"""TorchServe's gRPC inference service (``proto/inference.proto``) on ``grpc.aio``, over the same service.

Existing clients (``llm_api.client.GRPCClient``, stubs generated from TorchServe's proto) work unchanged:

* ``Predictions`` (unary): the whole answer and the marker in one message, whatever the input asks;
* ``StreamPredictions``: token by token when the input map has ``"stream": "true"``, else one message.
  Unlike under TorchServe, whose backend cannot tell the two calls apart (docs/torchserve.md), this is
  always safe: the servicer knows which call it serves;
* a refused request gets one message holding the native error object (status OK), as from TorchServe;
  an unknown ``model_name`` is NOT_FOUND; ``StreamPredictions2`` is UNIMPLEMENTED; ``Ping`` answers
  ``{"status": "Healthy"}`` while the server accepts requests.

The input map is handed to ``llm_api.protocols.native.translate.parse_request`` as form fields (or a JSON ``body``/
``data`` field), exactly as TorchServe hands it to the handler. Metadata ``authorization: Bearer <key>``
is required (UNAUTHENTICATED otherwise); while the model loads or the server drains, calls get
UNAVAILABLE. The request id issued for a call comes back in the initial metadata (``x-request-id``), so
a gRPC request can be cancelled with ``{"cancel": id}`` too.

A client that cancels its call or goes away: grpc.aio cancels the servicer's task, and the cancellation
closes the answer's parts (abort, KV blocks freed at the engine's next step).

With ``SSL_CERTFILE`` the port speaks TLS only (``grpc.ssl_server_credentials``; mutual with
``SSL_CA_CERTS``): a client connects with ``grpc.secure_channel`` (``llm_api.client.ClientTLS``); a
plaintext channel never gets past the handshake.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import AsyncGenerator

import grpc

from llm_api.errors import ApiError, internal_error
from llm_api.proto import inference_pb2, inference_pb2_grpc
from llm_api.protocols.route import Call, RouteContext, Whole
from llm_api.protocols.table import BY_NAME, answer
from llm_api.protocols.wire import wire
from llm_api.server.http_api import ServerState, new_request_id
from llm_api.service.owners import single_authorization

logger = logging.getLogger(__name__)
# The route's refusals that are a call's status rather than an answer (every other refusal is one message
# holding the native error object, as TorchServe sends it).
STATUS_OF_CODE = {"model_not_found": grpc.StatusCode.NOT_FOUND, "loading": grpc.StatusCode.UNAVAILABLE,
                  "shutting_down": grpc.StatusCode.UNAVAILABLE}


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
        try:  # (one identity per call: llm_api.service.owners)
            authorization = single_authorization([value for name, value in context.invocation_metadata() or ()
                                                  if name == "authorization"])
        except ApiError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)
        owner = state.auth.owner(authorization)
        if owner is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer key (metadata "
                                                                 "'authorization: Bearer <key>')")
        request_id = new_request_id()
        route = BY_NAME["generate"]  # every call is the native route (the input map is its form fields)
        call = Call(request_id, "POST", dict(request.input), grpc=True, grpc_stream=streaming_call, owner=owner or "",
                    tenant=(owner or "") if state.auth.enabled else "")
        ctx = RouteContext(state.marker, state.service, state.lifecycle.draining)
        await context.send_initial_metadata((("x-request-id", request_id),))
        try:
            result = await answer(route, {"model": request.model_name}, ctx, call)
        except ApiError as error:
            status = STATUS_OF_CODE.get(error.code)
            if status is None:  # a refusal: one message with the error object, as from TorchServe
                logger.info("request %s refused: %s", request_id, error.code)
                yield error.native_text(state.marker)
                return
            await context.abort(status, error.message)
        except Exception:  # a bug while parsing costs this call only
            logger.exception("request %s failed", request_id)
            yield internal_error("the server failed to handle this request").native_text(state.marker)
            return
        with state.lifecycle.track(request_id):
            try:  # (llm_api.protocols.wire: what goes out, and what a failure becomes)
                async with aclosing(wire(result, request_id)) as events:
                    async for event in events:
                        if isinstance(event, Whole):
                            yield event.body if isinstance(event.body, str) else event.body.decode("utf-8")
                        else:
                            yield event.payload
            except ApiError as error:  # a refusal: one message with the error object, as from TorchServe
                logger.info("request %s refused: %s", request_id, error.code)
                yield error.native_text(state.marker)
            except asyncio.CancelledError:
                logger.info("request %s: the gRPC client went away; aborted", request_id)
                raise


def build_grpc_server(state: ServerState, address: str,
                      credentials: grpc.ServerCredentials | None = None) -> grpc.aio.Server:
    """The server on ``address``; ``credentials``: TLS on it (``llm_api.server.tls``), else plaintext."""
    options = [("grpc.max_receive_message_length", state.max_request_bytes),
               ("grpc.max_send_message_length", state.max_request_bytes),
               ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options)
    inference_pb2_grpc.add_InferenceAPIsServiceServicer_to_server(InferenceServicer(state), server)
    bound = (server.add_insecure_port(address) if credentials is None
             else server.add_secure_port(address, credentials))
    if bound == 0:
        raise OSError(f"cannot listen for gRPC on {address}")
    return server
