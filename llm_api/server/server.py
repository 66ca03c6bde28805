"""One process, one event loop: the HTTP and gRPC listeners, the model, and an orderly stop.

``serve(settings, options)``:

1. opens the HTTP listener first, so ``/health`` answers (and ``/ready`` says "loading") while the model
   loads on a worker thread (minutes on a first CPU start); a load failure stops the process (exit 1);
2. once loaded, opens the gRPC listener, hands the service to the routes and logs one line saying where
   it listens and where the key is;
3. on SIGTERM or SIGINT: readiness turns false at once and new requests get 503 (gRPC: UNAVAILABLE),
   requests in flight get ``DRAIN_GRACE_S`` seconds to finish, then those left are cancelled (their
   streams end with an error line, never cut); the listeners close, the engine stops, exit 0. A second
   signal skips what is left of the grace period.

With ``SSL_CERTFILE`` (``llm_api.server.tls``) both listeners speak TLS only, from one key and certificate
loaded before either opens (a bad file: exit 2, nothing listened); the log lines say ``https://``. The CLI
loads it before torch is imported and hands it over in ``ServeOptions.tls``; a caller that gives none gets
the settings' own.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from llm_api.model import preflight
from llm_api.model.settings import ConfigError, Settings
from llm_api.protocols.table import open_api_states
from llm_api.server.connections import ConnectionGuard
from llm_api.server.auth import BearerAuth, resolve_key
from llm_api.server.grpc_api import build_grpc_server
from llm_api.server.http_api import ServerState, build_app
from llm_api.server.lifecycle import Lifecycle
from llm_api.server.metrics import ServerMetrics
from llm_api.server.tls import ServerTLS, load_server_tls
from llm_api.server.transport import Site, TransportLimits, fixed_error_pages, quiet_bad_requests
from llm_api.service.service import ModelService

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051  # 0: no gRPC listener
    key_file: Path = Path("llm_api.key")
    auth: bool = True
    tls: ServerTLS | None = None  # loaded by the CLI (None: serve loads the settings' own, if any)


async def serve(settings: Settings, options: ServeOptions) -> int:
    loop = asyncio.get_running_loop()
    lifecycle = Lifecycle()
    key, key_path = resolve_key(settings.api_key, options.key_file) if options.auth else (None, None)
    if not options.auth:
        logger.warning("bearer-key auth is OFF (--no-auth): anyone who reaches %s:%d can use the model",
                       options.host, options.port)
    try:
        # (a bad TLS file, model file or setting stops the start here, before a port opens)
        tls = options.tls if options.tls is not None else load_server_tls(settings)
        preflight.check(settings)
        apis = open_api_states(settings)  # (an unusable RESPONSES_STORE_PATH stops the start here)
    except ConfigError as err:
        logger.error("llm_api serve: %s", err)
        return 2
    state = ServerState(marker=settings.end_of_stream_token, auth=BearerAuth(key), lifecycle=lifecycle,
                        metrics=ServerMetrics(settings.model_name), max_request_bytes=settings.max_request_bytes,
                        limits=TransportLimits.from_settings(settings), apis=apis,
                        metrics_public=settings.metrics_public)
    # handler_cancellation: aiohttp cancels a handler whose client disconnected (http_api's docstring);
    # the transport limits: llm_api.server.transport.
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None,
                           **state.limits.runner_options())
    quiet_bad_requests()
    await runner.setup()
    server = runner.server
    assert server is not None
    fixed_error_pages(server)  # (llm_api.server.transport: no request bytes in aiohttp's own error pages)
    guard = state.connections = ConnectionGuard(state.limits.connections)  # (llm_api.server.connections)
    guard.install(server)
    await Site(runner, options.host, options.port, limits=state.limits,
               ssl_context=tls.context if tls is not None else None).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, lifecycle)
    scheme = "http" if tls is None else "https"
    logger.info("llm_api serve: HTTP on %s://%s:%d (loading model %s)%s", scheme, options.host, options.port,
                settings.model_name, _tls_note(tls))
    grpc_server = None
    service: ModelService | None = None
    try:
        load = _load_in_background(loop, settings, state.metrics)
        stop = asyncio.ensure_future(lifecycle.stop_requested.wait())
        await asyncio.wait([load, stop], return_when=asyncio.FIRST_COMPLETED)
        if not load.done():  # stopped while loading: nothing to drain (the loading thread is a daemon)
            logger.info("llm_api serve: stopped before the model finished loading")
            return 0
        stop.cancel()
        try:
            service = load.result()
        except Exception:
            logger.exception("llm_api serve: the model failed to load")
            return 1
        state.service = service
        state.metrics.watch_service(service)
        if options.grpc_port:
            grpc_server = build_grpc_server(state, f"{options.host}:{options.grpc_port}",
                                            tls.grpc_credentials() if tls is not None else None)
            await grpc_server.start()
        lifecycle.loaded = True
        grpc_where = "off" if not options.grpc_port else \
            f"{options.host}:{options.grpc_port}" + (" (TLS)" if tls is not None else "")
        logger.info("llm_api serve: ready; model %s (%s), HTTP %s://%s:%d, gRPC %s, auth %s",
                    service.model_name, service.path_name, scheme, options.host, options.port, grpc_where,
                    "off" if key is None else f"bearer key in {key_path}" if key_path else "bearer key from LLM_API_KEY")
        await lifecycle.stop_requested.wait()
        await lifecycle.drain(settings.drain_grace_s, service.cancel)
        logger.info("llm_api serve: stopped")
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if grpc_server is not None:
            await grpc_server.stop(1.0)
        guard.close()
        await runner.cleanup()
        if service is not None:
            service.shutdown()
        apis.close()


def _tls_note(tls: ServerTLS | None) -> str:
    if tls is None:
        return ""
    note = f"; TLS with {tls.certfile}"
    return note + f", client certificates required (CA {tls.ca_certs})" if tls.mutual else note


def _on_signal(lifecycle: Lifecycle) -> None:
    lifecycle.request_stop()


def _load_in_background(loop: asyncio.AbstractEventLoop, settings: Settings, metrics: ServerMetrics
                        ) -> asyncio.Future:
    """The loaded service, from a daemon thread: a stop during a long load need not wait for it."""
    future = loop.create_future()

    def settle(result, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def work():
        try:
            service = ModelService.load(settings, metrics.sink)
            _ = service.inputs.prompts  # built here rather than by the first request, on the event loop
        except BaseException as error:  # noqa: BLE001 (reported through the future)
            loop.call_soon_threadsafe(settle, None, error)
            return
        loop.call_soon_threadsafe(settle, service, None)

    threading.Thread(target=work, name="llm-load", daemon=True).start()
    return future
