"""The standalone server's transport limits: what a client can hold of the server by how it sends and reads.

Every limit below is aiohttp's or asyncio's own mechanism where one exists; each has its answer:

* **Request head (slow headers) and idle keep-alive**: ``KEEPALIVE_TIMEOUT_S`` (15 s), aiohttp's
  ``keepalive_timeout``. aiohttp starts that timer when a connection opens and again after each answer,
  and closes the connection if no complete request head has arrived when it fires; bytes of a partial
  head do not restart it. So one deadline covers a connection that sends nothing, one that trickles its
  head (slowloris), and an idle keep-alive connection: each is closed without an answer (there is no
  request to answer).
* **Request line and header sizes**: aiohttp's parser limits, passed explicitly so they are written
  down here: a request line or one header field over ``MAX_LINE_BYTES``/``MAX_FIELD_BYTES`` (8190), or
  more than ``MAX_HEADERS`` (128) fields, gets aiohttp's own 400 (or 431 where aiohttp says so) and the
  connection closes. So do malformed framing such as both ``Content-Length`` and
  ``Transfer-Encoding`` (llhttp refuses the pair: request smuggling), or an invalid chunk size. These
  answers come from the parser before any route is chosen; ``fixed_error_pages`` makes each a fixed JSON
  object per status (``TRANSPORT_ERRORS``: ``{"code", "type", "message"}``) instead of aiohttp's text page,
  which quoted the offending request bytes back (markup, the end-of-stream marker, anything). aiohttp logs
  each with a traceback at ERROR; ``OneLineBadRequests`` makes that one INFO line, so a client cannot flood
  the log with malformed requests.
* **Body size**: ``MAX_REQUEST_BYTES`` (aiohttp's ``client_max_size``): 413 ``request_too_large``.
* **Slow body**: ``BODY_TIMEOUT_S`` (60 s) from the start of the handler to the body's last byte
  (``read_body``): 408 ``request_timeout``, then the connection closes after at most ``LINGER_S`` (2 s;
  aiohttp's ``lingering_time``) spent reading and dropping what more of the body comes, so the client can
  read its answer rather than a reset. A 413 closes the same way.
* **A client that stops reading a stream**: the kernel buffers at most ``SEND_BUFFER_BYTES`` (256 KiB,
  ``SO_SNDBUF``) of its answer and the transport as much again (its high-water mark; after each write
  the request waits on ``drain`` while the transport holds more, as aiohttp's own writer does only every
  64 KiB); each write must finish within ``WRITE_TIMEOUT_S`` (30 s, ``write``). When one does
  not, the connection is aborted and the request with it: the generator is closed, which aborts the
  request in the engine and frees its KV blocks at the next step.
* **Many connections**: ``MAX_CONNECTIONS`` (512), ``MAX_UNTRUSTED_CONNECTIONS`` (64),
  ``MAX_CONNECTIONS_PER_CLIENT`` (128) and ``HEADER_TIMEOUT_S`` (5 s), kept by
  ``llm_api.server.connections.ConnectionGuard``: a connection no authenticated request has used gives way
  (closed, oldest first) to newer ones, so idle or unauthenticated sockets cannot lock key holders out. An
  authenticated request beyond ``MAX_CONNECTIONS`` busy authenticated connections gets 503
  ``too_many_connections`` with ``Retry-After`` and its connection is closed; the probes (``/health``,
  ``/ready``, ``/metrics``) still answer. Why not a gated ``accept``: it leaves clients hanging in the kernel
  backlog (no answer, a client timeout); the kernel's listen backlog (``BACKLOG``, 128) bounds the
  connections not yet accepted.
* **TLS** (``SSL_CERTFILE``, ``llm_api.server.tls``): asyncio runs the handshake before aiohttp sees the
  connection, so the guard above does not count a connection until its handshake is done. ``Site`` bounds
  that phase instead: a handshake must finish within ``HEADER_TIMEOUT_S`` (asyncio's default is 60 s), after
  which the guard's head deadline starts; and a closing TLS connection waits at most ``LINGER_S`` for the
  client's ``close_notify`` (asyncio's default: 30 s), so neither a silent socket nor a client that never
  answers the close holds a descriptor for long.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from llm_api.errors import ApiError
from llm_api.model.settings import Settings
from llm_api.server.connections import ConnectionLimits

MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 128
BACKLOG = 128
LINGER_S = 2.0


@dataclass(frozen=True)
class TransportLimits:
    keepalive_timeout_s: float
    body_timeout_s: float
    write_timeout_s: float
    send_buffer_bytes: int
    connections: ConnectionLimits

    @classmethod
    def from_settings(cls, settings: Settings) -> "TransportLimits":
        return cls(keepalive_timeout_s=settings.keepalive_timeout_s, body_timeout_s=settings.body_timeout_s,
                   write_timeout_s=settings.write_timeout_s, send_buffer_bytes=settings.send_buffer_bytes,
                   connections=ConnectionLimits(settings.max_connections, settings.max_connections_per_client,
                                                settings.max_untrusted_connections, settings.header_timeout_s))

    def runner_options(self) -> dict:
        """aiohttp's own limits, for ``web.AppRunner``."""
        return {"keepalive_timeout": self.keepalive_timeout_s, "max_line_size": MAX_LINE_BYTES,
                "max_field_size": MAX_FIELD_BYTES, "max_headers": MAX_HEADERS, "lingering_time": LINGER_S}


class Site(web.TCPSite):
    """aiohttp's ``TCPSite``; with an SSL context, asyncio's TLS deadlines set as the module docstring says
    (``TCPSite`` has no option for them: its ``start`` is repeated here with the two added)."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, limits: TransportLimits,
                 ssl_context: ssl.SSLContext | None = None):
        super().__init__(runner, host, port, ssl_context=ssl_context, backlog=BACKLOG)
        self._handshake_timeout_s = limits.connections.header_timeout_s

    async def start(self) -> None:
        if self._ssl_context is None:
            await super().start()
            return
        await web.BaseSite.start(self)  # (registers the site with its runner, as TCPSite.start does first)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            ssl_handshake_timeout=self._handshake_timeout_s, ssl_shutdown_timeout=LINGER_S)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port


def too_many_connections(limits: TransportLimits) -> ApiError:
    """The 503 for a request when MAX_CONNECTIONS authenticated connections are all busy (``ConnectionGuard``)."""
    return ApiError(503, "too_many_connections", f"MAX_CONNECTIONS={limits.connections.max_connections} "
                    "authenticated connections are busy; retry shortly")


async def read_body(request: web.Request, limits: TransportLimits, *, form: bool = False):
    """The request's body (``form``: its form fields), or a 408 when it has not all arrived within
    ``BODY_TIMEOUT_S``. A ``Content-Length`` over ``MAX_REQUEST_BYTES`` gets its 413 at once (aiohttp
    would read up to the limit first, or wait for bytes that never come)."""
    if request.content_length is not None and request.content_length > request.client_max_size:
        raise web.HTTPRequestEntityTooLarge(max_size=request.client_max_size, actual_size=request.content_length)
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            return await (request.post() if form else request.read())
    except TimeoutError:
        raise ApiError(408, "request_timeout", f"the body did not arrive within BODY_TIMEOUT_S="
                       f"{limits.body_timeout_s:g} s") from None


def bound_send_buffer(request: web.Request, limits: TransportLimits) -> None:
    """Cap the kernel's and the transport's send buffers of this connection: a client that stops reading
    holds at most that much of the server's memory."""
    transport = request.transport
    if not limits.send_buffer_bytes or transport is None:
        return
    transport.set_write_buffer_limits(high=limits.send_buffer_bytes)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)


class OneLineBadRequests(logging.Filter):
    """On aiohttp's server logger: a malformed request (the client's fault) as one INFO line, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            said = record.getMessage()  # (before msg and args change)
            record.msg, record.args = "%s: %s", (said, f"{error.code} {error.message}".replace("\n", " ")[:300])
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def quiet_bad_requests() -> None:
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, OneLineBadRequests) for f in logger.filters):
        logger.addFilter(OneLineBadRequests())


# The transport's own answers, one fixed body per status: nothing of the request is ever in them.
TRANSPORT_ERRORS = {
    400: ("bad_request", "the request is not valid HTTP/1.1 (request line, headers or framing)"),
    413: ("request_too_large", "the request is larger than this server accepts"),
    431: ("headers_too_large", "the request's header fields are too large or too many"),
    500: ("internal_error", "the server failed to handle this request"),
    504: ("timeout", "the server did not answer in time"),
}


class _FixedErrorPages(RequestHandler):
    """aiohttp's per-connection protocol, answering its own errors with ``TRANSPORT_ERRORS``' bodies."""

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        if request.writer.output_size > 0:  # (as aiohttp: an answer had begun; the connection is broken)
            raise ConnectionError("Response is sent already, cannot send another response with the error message")
        kind, text = TRANSPORT_ERRORS.get(status, ("http_error", "the request could not be handled"))
        response = web.Response(status=status, text=json.dumps({"code": status, "type": kind, "message": text}),
                                content_type="application/json")
        response.force_close()
        return response


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _FixedErrorPages(self, loop=self._loop, **self._kwargs)


def fixed_error_pages(server: web.Server) -> None:
    """Make aiohttp's server answer its own errors (parser refusals, escaped failures) with fixed JSON bodies:
    the connections it accepts from now on use ``_FixedErrorPages``."""
    server.__class__ = _Server


class WriteTimeout(Exception):
    """A write of an answer did not finish within ``WRITE_TIMEOUT_S``: the client stopped reading."""


async def write(request: web.Request, response: web.StreamResponse, data: bytes, limits: TransportLimits, *,
                eof: bool = False) -> None:
    """Write ``data`` and wait until the transport's buffer is below its high-water mark (``WriteTimeout``
    when that takes over ``WRITE_TIMEOUT_S``); ``eof``: then end the answer."""
    try:
        async with asyncio.timeout(limits.write_timeout_s):
            await response.write(data)
            await request.writer.drain()
            if eof:
                await response.write_eof()
    except TimeoutError:
        raise WriteTimeout() from None
