"""The standalone server's HTTP routes on aiohttp's own server.

Routes (the bodies and answers are the TorchServe path's: ``llm_api.service.answer``):

* ``POST /predictions/<model>``: the native format, a JSON body or form fields; the answer streams as
  chunked text ending with the end-of-stream marker (``stream: false``: one body); ``{"cancel": id}``
  ends the request whose ``x-request-id`` is ``id``;
* ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``stream``), ``GET /v1/models``;
* ``POST /tokenize``, ``POST /detokenize`` (vLLM's shapes, ``llm_api.api.tokenize``);
* ``GET /health`` (liveness: the process serves and its engine thread lives), ``GET /ready`` (readiness:
  model loaded, engine stepping, not draining), ``GET /metrics`` (Prometheus text) -- these three need
  no key and never wait behind generation (they read snapshots).

Every answer carries ``x-request-id``, a random id issued here (``secrets.token_urlsafe``). Every route
but the three probes needs ``Authorization: Bearer <key>`` (401 otherwise, in the route's error shape,
and also for paths that do not exist, so a client without the key learns nothing). While the model
loads or the server drains, the generation routes answer 503.

A client that goes away: the server runs with ``handler_cancellation`` on, so aiohttp cancels the
handler's task as soon as the connection is lost, wherever it is waiting (admission, the first token,
between chunks); the cancellation closes ``service.generate``, which aborts the request in the engine
and frees its KV blocks at the engine's next step. A write to a connection already closed ends the same
way, and so does a client that stops reading (a write that does not finish within ``WRITE_TIMEOUT_S``);
the other transport limits (slow heads and bodies, sizes, the connection cap) are
``llm_api.server.transport``'s. Errors a request causes are its own: its status before the first chunk, an error line (native) or
event (SSE) after.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from aiohttp import web

from llm_api.api import openai
from llm_api.api.errors import DEFAULT_RETRY_AFTER_S, ApiError, echo, internal_error
from llm_api.api.request import CancelRequest
from llm_api.api.tokenize import detokenize_answer, tokenize_answer
from llm_api.model.settings import Settings
from llm_api.server.auth import BearerAuth
from llm_api.server.lifecycle import Lifecycle
from llm_api.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from llm_api.server.metrics import ServerMetrics
from llm_api.server.transport import (
    TransportLimits,
    WriteTimeout,
    bound_send_buffer,
    over_connection_cap,
    read_body,
    write,
)
from llm_api.service.answer import (Chunk, Refusal, encoded_parts, native_encoder, parse_detokenize_call, parse_native,
                                    parse_openai, parse_tokenize_call)
from llm_api.service.service import ModelService

logger = logging.getLogger(__name__)


JSON_CONTENT_TYPE = "application/json"
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics"})
FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")
REQUEST_ID_BYTES = 18
LOADING_RETRY_AFTER_S = 5  # the embedded model loads in seconds; a client polling faster only adds load


@dataclass
class ServerState:
    """What the routes share: the service once loaded, and the rest from the start."""

    marker: str
    auth: BearerAuth
    lifecycle: Lifecycle
    metrics: ServerMetrics
    max_request_bytes: int
    limits: TransportLimits = field(default_factory=lambda: TransportLimits.from_settings(Settings()))
    open_connections: Callable[[], int] = lambda: 0  # the server's count, set once it listens
    service: ModelService | None = None


STATE = web.AppKey("state", ServerState)


def new_request_id() -> str:
    return secrets.token_urlsafe(REQUEST_ID_BYTES)


def build_app(state: ServerState) -> web.Application:
    app = web.Application(client_max_size=state.max_request_bytes, middlewares=[_edge])
    app[STATE] = state
    app.add_routes([
        web.get("/health", health),
        web.get("/ready", ready),
        web.get("/metrics", metrics),
        web.post("/predictions/{model}", predictions),
        web.get("/v1/models", models),
        web.post("/v1/completions", completions),
        web.post("/v1/chat/completions", chat_completions),
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
    ])
    return app


# ---------------------------------------------------------------------------------------------------
# the middleware: request id, auth, error shapes


def _is_native(path: str) -> bool:
    return path.startswith("/predictions/")


def _error_response(path: str, error: ApiError, marker: str, request_id: str) -> web.Response:
    body = error.native_text(marker) if _is_native(path) else error.openai_text(marker)
    return _response(error.status, body, JSON_CONTENT_TYPE, request_id, error.headers())


def _response(status: int, body: str | bytes, content_type: str, request_id: str,
              headers: dict[str, str] | None = None) -> web.Response:
    """``headers``: an error's own (``Retry-After``); never request data."""
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
    if path not in PUBLIC_PATHS and (refusal := over_connection_cap(state.open_connections, state.limits)):
        return _closing(_error_response(path, refusal, state.marker, request_id))  # (a 503: Retry-After)
    if path not in PUBLIC_PATHS and not state.auth.allows(request.headers.get("Authorization")):
        return _error_response(path, ApiError(401, "unauthorized", "missing or wrong bearer key (header "
                                                                   "'Authorization: Bearer <key>')"),
                               state.marker, request_id)
    try:
        return await handler(request)
    except ApiError as error:  # a refusal before anything was sent
        logger.info("request %s refused: %s", request_id, error.code)
        response = _error_response(path, error, state.marker, request_id)
        return _closing(response) if error.status == 408 else response
    except web.HTTPRequestEntityTooLarge:  # (the rest of the body is not read: the connection closes)
        return _closing(_error_response(path, ApiError(413, "request_too_large", "the body is larger than "
                                                       f"MAX_REQUEST_BYTES={state.max_request_bytes}"),
                                        state.marker, request_id))
    except web.HTTPMethodNotAllowed as exc:
        return _error_response(path, ApiError(405, "method_not_allowed", f"{request.method} is not allowed here; "
                                                                         f"use {', '.join(sorted(exc.allowed_methods))}"),
                               state.marker, request_id)
    except web.HTTPNotFound:
        return _error_response(path, ApiError(404, "not_found", f"no route {echo(path)}"), state.marker, request_id)
    except web.HTTPException as exc:
        return _error_response(path, ApiError(exc.status, "http_error", exc.reason), state.marker, request_id)


def _probe_headers(ok: bool) -> dict[str, str]:
    """A probe's 503 says when to look again, like every other 503."""
    return {} if ok else {"Retry-After": str(DEFAULT_RETRY_AFTER_S)}


def _serving(state: ServerState) -> ModelService:
    """The service, if it takes new requests now (else the 503 the edge sends)."""
    if state.service is None:
        raise ApiError(503, "loading", "the model is still loading; retry shortly", retry_after=LOADING_RETRY_AFTER_S)
    if state.lifecycle.draining:
        raise ApiError(503, "shutting_down", "the server is shutting down; retry on another replica")
    return state.service


# ---------------------------------------------------------------------------------------------------
# probes and metrics


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    alive = state.service is None or state.service.loop.alive
    body = json.dumps({"status": "alive" if alive else "engine_stopped"})
    return _response(200 if alive else 503, body, JSON_CONTENT_TYPE, request["request_id"], _probe_headers(alive))


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.service is None:
        answer = {"ready": False, "status": "loading"}
    else:
        answer = state.service.metrics.health().to_json()
        if state.lifecycle.draining:
            answer.update(ready=False, status="draining")
    return _response(200 if answer["ready"] else 503, json.dumps(answer), JSON_CONTENT_TYPE, request["request_id"],
                     _probe_headers(bool(answer["ready"])))


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return _response(200, state.metrics.render(), METRICS_CONTENT_TYPE, request["request_id"])


# ---------------------------------------------------------------------------------------------------
# the native format


async def _native_row(request: web.Request) -> dict:
    """The request as TorchServe hands it to the handler: a JSON body as ``{"body": bytes}``, form fields
    as ``{name: bytes}`` (so the one parser in ``llm_api.api.native`` sees the same rows)."""
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
    return {"body": await read_body(request, limits)}


async def predictions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    request_id = request["request_id"]
    service = _serving_or_cancel(state)
    if request.match_info["model"] != service.model_name:
        raise ApiError(404, "model_not_found", f"no model {echo(request.match_info['model'])}; this server serves "
                       f"{service.model_name!r}")
    parsed = await parse_native(service, await _native_row(request), default_stream=True)
    if isinstance(parsed, CancelRequest):
        found = service.cancel(parsed.target_id)
        logger.info("cancel of request %s: %s", parsed.target_id[:64], "done" if found else "not running")
        return _response(200, json.dumps({"cancelled": found}), JSON_CONTENT_TYPE, request_id)
    _serving(state)
    encoder = native_encoder(parsed, state.marker)
    return await _answer(request, encoded_parts(service, parsed, encoder, request_id, state.marker), encoder.fail)


def _serving_or_cancel(state: ServerState) -> ModelService:
    """Like ``_serving``, but a drain still takes cancels (they help it finish)."""
    if state.service is None:
        raise ApiError(503, "loading", "the model is still loading; retry shortly", retry_after=LOADING_RETRY_AFTER_S)
    return state.service


# ---------------------------------------------------------------------------------------------------
# OpenAI-compatible routes


async def models(request: web.Request) -> web.Response:
    service = _serving_or_cancel(request.app[STATE])
    return _response(200, openai.models_list(service.model_name, service.created), JSON_CONTENT_TYPE,
                     request["request_id"])


async def completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, "chat")


async def _openai(request: web.Request, api: str) -> web.StreamResponse:
    service = _serving(request.app[STATE])
    generate_request, call = await parse_openai(service, api, await read_body(request, request.app[STATE].limits))
    call.marker = service.settings.end_of_stream_token
    return await _answer(request, encoded_parts(service, generate_request, call, request["request_id"]), call.fail)


# ---------------------------------------------------------------------------------------------------
# tokenizer routes


async def tokenize(request: web.Request) -> web.Response:
    service = _serving(request.app[STATE])
    parsed = await parse_tokenize_call(service, await read_body(request, request.app[STATE].limits))
    token_ids = await service.tokenize(parsed)
    return _response(200, tokenize_answer(token_ids, service.max_model_len), JSON_CONTENT_TYPE, request["request_id"])


async def detokenize(request: web.Request) -> web.Response:
    service = _serving(request.app[STATE])
    token_ids = await parse_detokenize_call(service, await read_body(request, request.app[STATE].limits))
    text = await service.detokenize(token_ids)
    return _response(200, detokenize_answer(text), JSON_CONTENT_TYPE, request["request_id"])


# ---------------------------------------------------------------------------------------------------
# writing an answer


async def _answer(request: web.Request, parts, error_tail: Callable[[ApiError], str]) -> web.StreamResponse:
    """Write a request's parts: chunks as a chunked 200, or one response when nothing streamed.
    ``error_tail``: how the format ends a stream that broke after it began."""
    state = request.app[STATE]
    request_id = request["request_id"]
    response: web.StreamResponse | None = None
    with state.lifecycle.track(request_id):
        try:
            async with aclosing(parts):
                async for part in parts:
                    if isinstance(part, Refusal):
                        return _response(part.status, part.body, JSON_CONTENT_TYPE, request_id, part.headers)
                    if isinstance(part, Chunk):
                        if response is None:
                            response = await _open_stream(request, part.content_type, request_id)
                        await write(request, response, part.payload.encode("utf-8"), state.limits)
                        continue
                    if response is None:  # nothing streamed: the whole answer in one body
                        return _response(200, part.payload, part.content_type, request_id)
                    await write(request, response, part.payload.encode("utf-8"), state.limits, eof=True)
                    return response
            raise RuntimeError("the request ended without a final part")
        except WriteTimeout:
            # (the generator is closed by now: the request is aborted in the engine, its blocks freed)
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
        except ApiError:
            raise
        except Exception:  # a bug costs this request only
            logger.exception("request %s failed", request_id)
            error = internal_error("the server failed to handle this request")
            if response is None:
                raise error from None
            try:
                await response.write(error_tail(error).encode("utf-8"))
                await response.write_eof()
            except ConnectionError:
                pass
            return response


async def _open_stream(request: web.Request, content_type: str, request_id: str) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers={"Content-Type": content_type, "x-request-id": request_id,
                                                       "Cache-Control": "no-cache"})
    response.enable_chunked_encoding()
    bound_send_buffer(request, request.app[STATE].limits)
    await response.prepare(request)
    return response
