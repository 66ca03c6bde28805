"""The standalone server's HTTP edge on aiohttp's own server: bytes in, the route table's answers out.

Every path goes to one handler, which finds the route in ``llm_api.protocols.table`` (the same
table the TorchServe handler and the gRPC servicer use: native ``POST /predictions/<model>``, the OpenAI
routes below ``/v1/``, ``/tokenize``, ``/detokenize``, the probes ``/health`` and ``/ready`` and
``/metrics``), hands it a ``Call`` and writes the ``Whole`` or ``Streamed`` answer: chunks as a chunked
200, or one response when nothing streamed. A form body (native route) is read into the same fields
TorchServe hands its handler.

Every answer carries ``x-request-id``, a random id issued here (``secrets.token_urlsafe``). Every route
but the public ones (the probes and metrics) needs ``Authorization: Bearer <key>`` (401 otherwise, in
the route's error shape, and also for paths that do not exist, so a client without the key learns
nothing). While the model loads or the server drains, the generation routes answer 503.

A client that goes away: the server runs with ``handler_cancellation`` on, so aiohttp cancels the
handler's task as soon as the connection is lost, wherever it is waiting (admission, the first token,
between chunks); the cancellation closes the answer's parts, which abort the request in the engine
and frees its KV blocks at the engine's next step. A write to a connection already closed ends the same
way, and so does a client that stops reading (a write that does not finish within ``WRITE_TIMEOUT_S``);
the other transport limits (slow heads and bodies, sizes, the connection cap) are
``llm_api.server.transport``'s. Errors a request causes are its own: its status before the first chunk,
the format's in-band error (native line, SSE event) after.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Awaitable, Callable

from aiohttp import web

from llm_api.errors import ApiError
from llm_api.model.settings import Settings
from llm_api.protocols.route import Answer, ApiStates, Call, RouteContext, Whole, error_body
from llm_api.protocols.table import answer, error_shape, find, is_public
from llm_api.protocols.wire import wire
from llm_api.server.auth import BearerAuth
from llm_api.server.connections import ConnectionGuard
from llm_api.server.lifecycle import Lifecycle
from llm_api.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from llm_api.server.metrics import ServerMetrics
from llm_api.server.transport import (
    TransportLimits,
    WriteTimeout,
    bound_send_buffer,
    too_many_connections,
    read_body,
    write,
)
from llm_api.service.answer import Final
from llm_api.service.owners import MISSING_KEY, request_credential

if TYPE_CHECKING:  # (annotations only: the route table loads without the engine and torch)
    from llm_api.service.service import ModelService

logger = logging.getLogger(__name__)


JSON_CONTENT_TYPE = "application/json"
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
REQUEST_ID_BYTES = 18


@dataclass
class ServerState:
    """What the routes share: the service once loaded, and the rest from the start."""

    marker: str
    auth: BearerAuth
    lifecycle: Lifecycle
    metrics: ServerMetrics
    max_request_bytes: int
    metrics_public: bool = False  # METRICS_PUBLIC: /metrics answered without the key
    limits: TransportLimits = field(default_factory=lambda: TransportLimits.from_settings(Settings()))
    connections: ConnectionGuard | None = None  # installed on the server once it listens
    service: ModelService | None = None
    apis: ApiStates | None = None  # what the APIs keep across requests (opened at start)


STATE = web.AppKey("state", ServerState)


def new_request_id() -> str:
    return secrets.token_urlsafe(REQUEST_ID_BYTES)


def build_app(state: ServerState) -> web.Application:
    app = web.Application(client_max_size=state.max_request_bytes, middlewares=[_edge])
    app[STATE] = state
    app.router.add_route("*", "/{path:.*}", dispatch)
    return app


# ---------------------------------------------------------------------------------------------------
# the middleware: request id, auth, error shapes


def _error_response(path: str, error: ApiError, marker: str, request_id: str, shape: str | None = None) -> web.Response:
    body = error_body(shape or error_shape(path, "server"), error, marker)
    return _response(error.status, body, JSON_CONTENT_TYPE, request_id, error.headers())


def _response(status: int, body: str | bytes, content_type: str, request_id: str,
              headers: dict[str, str] | None = None) -> web.Response:
    """``headers``: an answer's own (``Retry-After``); never request data."""
    data = body.encode("utf-8") if isinstance(body, str) else body
    return web.Response(status=status, body=data, headers={"Content-Type": content_type, "x-request-id": request_id,
                                                           **(headers or {})})


def _closing(response: web.Response) -> web.Response:
    """The answer, and then the connection closes (its rest is not read: a slow body, a connection over the
    cap)."""
    response.force_close()
    return response


@web.middleware
async def _edge(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    state = request.app[STATE]
    request_id = new_request_id()
    request["request_id"] = request_id
    path = request.path
    public = is_public(path, state.metrics_public)
    guard, connection = state.connections, request.protocol
    if guard is not None:
        guard.request_started(connection)
    try:
        if not public:
            try:  # one identity per request, derived here once (llm_api.service.owners)
                owner = state.auth.owner(request_credential(request.headers.getall("Authorization", []),
                                                            request.headers.getall("x-api-key", [])))
            except ApiError as error:
                return _error_response(path, error, state.marker, request_id)
            if owner is None:
                return _error_response(path, ApiError(401, "unauthorized", MISSING_KEY), state.marker, request_id)
            request["owner"] = owner
            if guard is not None and not guard.trusted(connection):  # (llm_api.server.connections)
                return _closing(_error_response(path, too_many_connections(state.limits), state.marker,
                                                request_id))  # (a 503: Retry-After)
        return await _handled(request, handler, state, path, request_id)
    finally:
        if guard is not None:
            guard.request_ended(connection)


async def _handled(request: web.Request, handler, state: ServerState, path: str, request_id: str) -> web.StreamResponse:
    try:
        return await handler(request)
    except RouteError as error:  # a refusal before anything was sent, in its route's shape
        logger.info("request %s refused: %s", request_id, error.error.code)
        response = _error_response(path, error.error, state.marker, request_id, error.shape)
        return _closing(response) if error.error.status == 408 else response
    except web.HTTPRequestEntityTooLarge:  # (the rest of the body is not read: the connection closes)
        return _closing(_error_response(path, ApiError(413, "request_too_large", "the body is larger than "
                                                       f"MAX_REQUEST_BYTES={state.max_request_bytes}"),
                                        state.marker, request_id))
    except web.HTTPException as exc:
        return _error_response(path, ApiError(exc.status, "http_error", exc.reason), state.marker, request_id)


class RouteError(Exception):
    """An ``ApiError`` raised while serving a route, with the shape to render it in."""

    def __init__(self, error: ApiError, shape: str):
        super().__init__(error.message)
        self.error = error
        self.shape = shape


# ---------------------------------------------------------------------------------------------------
# the one handler


async def _row(request: web.Request) -> dict:
    """The request as TorchServe hands it to the handler: a JSON body as ``{"body": bytes}``, form fields
    as ``{name: bytes}`` (so the native parser sees the same rows), nothing for a body-less request."""
    limits = request.app[STATE].limits
    if request.content_type in FORM_TYPES:
        form = await read_body(request, limits, form=True)
        names = list(form.keys())
        if len(names) != len(set(names)):
            raise ApiError(400, "invalid_request", "a form field is given more than once")
        row = {}
        for name, value in form.items():
            if isinstance(value, web.FileField):
                value = value.file.read()
            row[name] = value.encode("utf-8") if isinstance(value, str) else value
        return row
    if request.method in ("GET", "HEAD", "DELETE") and not request.body_exists:
        return {}
    return {"body": await read_body(request, limits)}


async def dispatch(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    request_id = request["request_id"]
    shape = error_shape(request.path, "server")
    try:
        route, params = find(request.method, request.path, "server")
        shape = route.errors
        headers = {name.lower(): value for name, value in request.headers.items()}
        owner = request.get("owner", "")
        call = Call(request_id, request.method, await _row(request), headers, query=dict(request.query), owner=owner,
                    tenant=owner if state.auth.enabled else "")
        ctx = RouteContext(state.marker, state.service, state.lifecycle.draining,
                           lambda: (state.metrics.render(), METRICS_CONTENT_TYPE), apis=state.apis)
        result = await answer(route, params, ctx, call)
    except ApiError as error:
        raise RouteError(error, shape) from None
    try:
        return await _answer(request, result)
    except ApiError as error:  # (refused before anything was sent: llm_api.protocols.wire)
        raise RouteError(error, shape) from None


# ---------------------------------------------------------------------------------------------------
# writing an answer


async def _answer(request: web.Request, result: Answer) -> web.StreamResponse:
    """Write a route's answer (``llm_api.protocols.wire``: what goes out, and what a failure becomes): a whole
    answer as one response, a streamed one as a chunked 200. What is left here is aiohttp's transport: a
    client gone or not reading ends the request (its answer closed: the request aborted in the engine)."""
    state = request.app[STATE]
    request_id = request["request_id"]
    response: web.StreamResponse | None = None
    with state.lifecycle.track(request_id):
        try:
            async with aclosing(wire(result, request_id)) as events:
                async for event in events:
                    if isinstance(event, Whole):
                        return _response(event.status, event.body, event.content_type, request_id, event.headers)
                    if response is None:
                        response = await _open_stream(request, event.content_type, request_id)
                    await write(request, response, event.payload.encode("utf-8"), state.limits,
                                eof=isinstance(event, Final))
            assert response is not None  # (wire ends with a Whole, or with a Final after chunks)
            return response
        except WriteTimeout:
            # (the answer is closed by now: the request is aborted in the engine, its blocks freed)
            logger.info("request %s: the client read nothing for WRITE_TIMEOUT_S=%g s; aborted", request_id,
                        state.limits.write_timeout_s)
            if request.transport is not None:
                request.transport.abort()  # what it buffered is for nobody now
            assert response is not None
            return response
        except asyncio.CancelledError:
            logger.info("request %s: the client went away; aborted", request_id)
            raise
        except ConnectionError:
            logger.info("request %s: the client went away while being written to; aborted", request_id)
            # (no stream opened yet: the client left while it was being prepared; nobody reads this answer)
            return response if response is not None else web.Response(status=499)


async def _open_stream(request: web.Request, content_type: str, request_id: str) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers={"Content-Type": content_type, "x-request-id": request_id,
                                                       "Cache-Control": "no-cache"})
    response.enable_chunked_encoding()
    bound_send_buffer(request, request.app[STATE].limits)
    await response.prepare(request)
    return response
