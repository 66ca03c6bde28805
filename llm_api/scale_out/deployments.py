"""llm_api as a Ray Serve application: an ingress that speaks HTTP and model replicas that answer.

``application(settings, key, scaling)`` builds it (``llm_api serve --ray`` runs it: ``llm_api.scale_out.run``):

* ``Ingress`` (one replica, no CPU reserved): behind Ray Serve's HTTP proxy (which issues the
  ``x-request-id``). Per request it checks the bearer key (the same ``BearerAuth`` and one-``Authorization`` rule as
  ``llm_api serve``), finds the route in ``llm_api.protocols.table`` (404/405 as there), reads the body
  (413 past ``MAX_REQUEST_BYTES``), and forwards a ``Forwarded`` (the route's name, its parameters, the
  transport-neutral ``Call`` and the text it is routed by) to the model replicas through a streaming
  handle, then writes what comes back: one response, or a chunked stream chunk by chunk as the replica
  yields them (token by token, as ``llm_api serve`` writes them).
* ``ModelReplica`` (``scaling.replicas`` of them, or autoscaled): the package's own ``ModelService`` with
  the APIs' state (``open_api_states``) and its own metrics, answering a ``Forwarded`` with the route
  table's ``answer``. It yields ``Opening`` first (a whole answer, or the start of a stream with the
  format's error tail prepared), then the stream's payloads.
* The router between them is ``llm_api.scale_out.router.PrefixAffinityRouter``.
* Adapters: every replica loads ``LORA_ADAPTERS`` at start (they are registered in host memory), and
  holds ``MAX_LORAS`` of them in its slots at a time, swapping the least recently used out (the LoRA
  registry). A request whose ``model`` (native: ``adapter``) names one of ``LORA_ADAPTERS`` carries it as
  Ray's multiplexed model id; the replica records it with ``serve.multiplexed`` (its ``MAX_LORAS`` most
  recently served adapters: the ones its slots hold), and Ray's multiplexing rule, the router's first
  step, sends a request to a replica that holds its adapter, else to one holding the fewest. So one
  adapter's requests gather on the replicas already holding it (no swap, fewer adapters mixed per batch).
  An adapter loaded at run time (``/v1/load_lora_adapter``) exists only on the replica that answered that
  call and is not routed so (docs/scale-out.md).

Failures: a replica that dies mid-stream ends that stream with its format's error (the tail the
replica prepared when the stream opened: a native error line with the marker, an SSE error event and
``[DONE]``), and the next request goes to a live replica. A replica being scaled down gets no new
requests and keeps serving its streams for up to ``DRAIN_GRACE_S`` (Ray's graceful shutdown).

What is not here: gRPC (Ray's gRPC proxy needs the service compiled into it: use ``llm_api serve`` or
TorchServe for gRPC), multipart forms (JSON or urlencoded bodies), and the standalone server's
transport guards (slow heads, connection caps: Ray's proxy owns the sockets).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import re
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator
from urllib.parse import parse_qsl

from llm_api.errors import ApiError, internal_error
from llm_api.model.settings import Settings
from llm_api.protocols.route import Call, RouteContext, Streamed, Whole, error_body
from llm_api.protocols.table import BY_NAME, answer, error_shape, find, is_public, open_api_states
from llm_api.protocols.wire import wire
from llm_api.scale_out.affinity import affinity_text
from llm_api.server.auth import BearerAuth
from llm_api.server.http_api import JSON_CONTENT_TYPE, new_request_id
from llm_api.server.log_format import LOG_FORMAT
from llm_api.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from llm_api.server.metrics import ServerMetrics
from llm_api.service.owners import MISSING_KEY, request_credential

logger = logging.getLogger(__name__)

URLENCODED = "application/x-www-form-urlencoded"
REPLICA_HEADER = "x-llm-api-replica"
SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass
class Forwarded:
    """One request, from the ingress to a model replica (pickled across processes)."""

    route: str  # the route's name in llm_api.protocols.table
    params: dict[str, str]
    call: Call
    affinity: str = ""  # the text it is routed by (llm_api.scale_out.affinity)


@dataclass
class Opening:
    """A replica's first answer to a ``Forwarded``: a whole answer (``streamed`` False), or the start of
    a stream (its content type, and the payload that ends it if the replica dies: ``error_tail``)."""

    status: int
    content_type: str
    body: str | bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    streamed: bool = False
    error_tail: str = ""


@dataclass(frozen=True)
class Scaling:
    """How many model replicas, the CPUs each reserves (its torch threads), and how requests are routed."""

    replicas: int = 1
    max_replicas: int | None = None  # set: autoscale between ``replicas`` and this
    cpus_per_replica: float = 1.0
    routing: str = "prefix"  # "prefix": PrefixAffinityRouter's policy; "random": its fallback alone
    # Fields of Ray Serve's AutoscalingConfig over autoscaling_config()'s defaults (``--autoscaling-config``)
    autoscaling: dict[str, Any] = field(default_factory=dict)


# Ours, not Ray's (its own: a target of 2 requests, 30 s up, 600 s down): a replica at its batch size is busy,
# not overloaded, so the target is MAX_NUM_SEQS requests in flight (target_ongoing); 10 s before adding a
# replica (a model load costs more than a short burst), 120 s before removing one.
UPSCALE_DELAY_S = 10
DOWNSCALE_DELAY_S = 120
BOUNDS_ARE_FLAGS = ("min_replicas", "max_replicas", "initial_replicas")


def target_ongoing(settings: Settings) -> int:
    """Requests in flight a replica is meant to hold: its batch, MAX_NUM_SEQS (Ray counts a replica's
    ongoing requests; the engine batches up to that many of them)."""
    return max(1, settings.max_num_seqs)


def autoscaling_config(settings: Settings, scaling: Scaling) -> Any:
    """Ray's ``AutoscalingConfig`` for ``scaling`` (None without ``max_replicas``): the defaults above, then
    ``scaling.autoscaling`` over them. ValueError names a field Ray does not have, a bound given there (the
    replica counts are the flags'), or a value Ray refuses."""
    from ray.serve.config import AutoscalingConfig

    if scaling.max_replicas is None:
        if scaling.autoscaling:
            raise ValueError("--autoscaling-config needs --max-replicas (autoscaling is off without it)")
        return None
    unknown = sorted(set(scaling.autoscaling) - set(AutoscalingConfig.model_fields))
    if unknown:
        raise ValueError(f"--autoscaling-config: {', '.join(unknown)}: not a field of Ray Serve's AutoscalingConfig")
    bounds = sorted(set(scaling.autoscaling) & set(BOUNDS_ARE_FLAGS))
    if bounds:
        raise ValueError(f"--autoscaling-config: {', '.join(bounds)}: set by --replicas and --max-replicas")
    fields = {"min_replicas": scaling.replicas, "max_replicas": scaling.max_replicas,
              "target_ongoing_requests": target_ongoing(settings), "upscale_delay_s": UPSCALE_DELAY_S,
              "downscale_delay_s": DOWNSCALE_DELAY_S, **scaling.autoscaling}
    try:
        return AutoscalingConfig(**fields)
    except Exception as err:  # (pydantic's ValidationError: a value Ray refuses)
        raise ValueError(f"--autoscaling-config: {err}") from err


class ModelReplica:
    def __init__(self, settings: Settings):
        from llm_api.service.service import ModelService  # (imports torch: in the replica only)

        from ray import serve

        self.settings = settings
        # Every answer names the replica that gave it (``x-llm-api-replica``: Ray's id for it, the name of
        # its log file under Ray's logs/serve/); its log says its pid, for whoever must stop it.
        self.replica_name = serve.get_replica_context().replica_id.unique_id
        _log_to_stderr()
        logger.info("llm_api replica %s: pid %d, loading the model", self.replica_name, os.getpid())
        # (an async function of one argument: Ray keeps the wrapper on it, one per replica)
        async def hold(adapter: str) -> str:
            return adapter  # (registered since start: what Ray tracks is which adapters this replica served last)

        self._hold = serve.multiplexed(max_num_models_per_replica=settings.max_loras)(hold)
        self.apis = open_api_states(settings)
        self.metrics = ServerMetrics(settings.model_name)
        self.service = ModelService.load(settings, self.metrics.sink)
        self.metrics.watch_service(self.service)

    def _context(self) -> RouteContext:
        return RouteContext(self.settings.end_of_stream_token, self.service,
                            metrics_text=lambda: (self.metrics.render(), METRICS_CONTENT_TYPE), apis=self.apis)

    async def answer(self, forwarded: Forwarded) -> AsyncIterator[Opening | str]:
        """``Opening``, then (a stream) each payload as the engine produces it."""
        from ray import serve

        adapter = serve.get_multiplexed_model_id()
        if adapter:
            await self._hold(adapter)
        async for item in self._answer(forwarded):
            if isinstance(item, Opening):
                item.headers[REPLICA_HEADER] = self.replica_name
            yield item

    async def _answer(self, forwarded: Forwarded) -> AsyncIterator[Opening | str]:
        route = BY_NAME[forwarded.route]
        marker = self.settings.end_of_stream_token
        try:
            result = await answer(route, forwarded.params, self._context(), forwarded.call)
        except ApiError as error:
            yield Opening(error.status, JSON_CONTENT_TYPE, error_body(route.errors, error, marker), error.headers())
            return
        opened = False
        try:  # (llm_api.protocols.wire: what goes out, and what a failure becomes)
            async with aclosing(wire(result, forwarded.call.request_id)) as events:
                async for event in events:
                    if isinstance(event, Whole):
                        yield Opening(event.status, event.content_type, event.body, event.headers)
                        return
                    if not opened:
                        opened = True
                        assert isinstance(result, Streamed)
                        # What the ingress ends the stream with if this replica dies (on a copy: fail() moves an
                        # encoder to its failed state, the Responses API's with the output so far, which this
                        # stream has not reached).
                        died = internal_error("the replica serving this request failed")
                        tail = copy.deepcopy(result.encoder).fail(died)
                        yield Opening(200, event.content_type, streamed=True, error_tail=tail)
                    yield event.payload
        except (asyncio.CancelledError, GeneratorExit):  # (the ingress cancelled the call: its client left)
            logger.info("request %s: the client went away; aborted", forwarded.call.request_id)
            raise
        except ApiError as error:  # (refused before anything was sent)
            yield Opening(error.status, JSON_CONTENT_TYPE, error_body(route.errors, error, marker), error.headers())

    def __del__(self):  # (Ray Serve calls it once the replica's requests are done or DRAIN_GRACE_S passed)
        service = getattr(self, "service", None)
        if service is not None:
            service.shutdown()
        apis = getattr(self, "apis", None)
        if apis is not None:
            apis.close()


class Ingress:
    def __init__(self, replicas: Any, settings: Settings, key: str | None):
        _log_to_stderr()
        self.replicas = replicas  # the model replicas' DeploymentHandle
        self.auth = BearerAuth(key)
        self.marker = settings.end_of_stream_token
        self.max_request_bytes = settings.max_request_bytes
        self.metrics_public = settings.metrics_public
        self.adapters = frozenset(name for name, _ in settings.lora_adapters)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response, StreamingResponse

        request_id = _request_id()
        path = request.url.path
        shape = error_shape(path, "server")
        try:
            forwarded, adapter = await self._forwarded(request, request_id)
            shape = BY_NAME[forwarded.route].errors
            stream = self.replicas.options(stream=True, multiplexed_model_id=adapter).answer.remote(forwarded)
            opening = await stream.__anext__()
        except ApiError as error:
            return Response(error_body(shape, error, self.marker), error.status, error.headers(),
                            media_type=JSON_CONTENT_TYPE)
        except Exception:  # the replica died before answering, or Ray could not reach one
            logger.exception("request %s: no replica answered", request_id)
            unavailable = ApiError(503, "unavailable", "no model replica could answer; retry", retry_after=1)
            return Response(error_body(shape, unavailable, self.marker), unavailable.status, unavailable.headers(),
                            media_type=JSON_CONTENT_TYPE)
        headers = opening.headers
        if not opening.streamed:
            return Response(opening.body, opening.status, headers, media_type=opening.content_type)
        return StreamingResponse(_payloads(stream, opening.error_tail, request_id), 200,
                                 {**headers, "Cache-Control": "no-cache"}, media_type=opening.content_type)

    async def _forwarded(self, request: Any, request_id: str) -> tuple[Forwarded, str]:
        """The request as a ``Forwarded`` (401, 404/405, 413, 415 as ``ApiError``s), and the adapter of
        ``LORA_ADAPTERS`` it names ('' for none: the base model, or a name the replica will judge)."""
        path = request.url.path
        owner = ""
        if not is_public(path, self.metrics_public):
            known = self.auth.owner(request_credential(request.headers.getlist("authorization"),
                                                       request.headers.getlist("x-api-key")))
            if known is None:
                raise ApiError(401, "unauthorized", MISSING_KEY)
            owner = known
        route, params = find(request.method, path, "server")
        body = await _bounded_body(request, self.max_request_bytes)
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        parsed: Any = None
        if content_type == URLENCODED:
            pairs = parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
            if len({name for name, _ in pairs}) != len(pairs):
                raise ApiError(400, "invalid_request", "a form field is given more than once")
            row: dict[str, Any] = {name: value.encode("utf-8") for name, value in pairs}
            parsed = {name: value for name, value in pairs}
        elif content_type.startswith("multipart/"):
            raise ApiError(415, "unsupported_media_type", "send a JSON or urlencoded body (multipart is not served "
                           "through Ray Serve)")
        else:
            row = {"body": body} if body or request.method not in ("GET", "HEAD", "DELETE") else {}
            try:
                parsed = json.loads(body) if body else None
            except ValueError:
                parsed = None  # (the route refuses it, in its own words)
        headers = {name.lower(): value for name, value in request.headers.items()}
        call = Call(request_id, request.method, row, headers, query=dict(request.query_params), owner=owner,
                    tenant=owner if self.auth.enabled else "")
        named = (parsed.get("adapter") if route.name == "generate" else parsed.get("model")) \
            if isinstance(parsed, dict) else None
        adapter = named if isinstance(named, str) and named in self.adapters else ""
        return Forwarded(route.name, params, call, affinity_text(route.name, parsed)), adapter


def _log_to_stderr() -> None:
    """The package's log lines (INFO and up, the standalone server's format) on the replica's stderr, which
    Ray passes to the driver's output. Without a handler of its own Python printed WARNING and up only, bare:
    a replica's per-request lines were lost."""
    package = logging.getLogger("llm_api")
    if not package.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        package.addHandler(handler)
        package.setLevel(logging.INFO)
        package.propagate = False  # (Ray's own handlers on the root logger would print each line twice)


def _request_id() -> str:
    """Ray's id for this request (its proxy sends it back as ``x-request-id``; a client may choose it, so
    one that is not a plain token is replaced by ours, which then appears in the logs only)."""
    from ray.serve.context import _get_serve_request_context  # (Ray's own; no public accessor in 2.60)

    candidate = getattr(_get_serve_request_context(), "request_id", "")
    return candidate if isinstance(candidate, str) and SAFE_REQUEST_ID.fullmatch(candidate) else new_request_id()


async def _bounded_body(request: Any, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "request_too_large", f"the body is larger than MAX_REQUEST_BYTES={limit}")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise ApiError(413, "request_too_large", f"the body is larger than MAX_REQUEST_BYTES={limit}")
    return bytes(body)


async def _payloads(stream: Any, error_tail: str, request_id: str) -> AsyncIterator[bytes]:
    """A stream's payloads from the replica; its format's error ending if the replica dies mid-way. A
    client that goes away closes this generator: the replica's call is cancelled, which closes its
    answer there and aborts the request in its engine (its KV blocks freed at the next step)."""
    done = False
    try:
        async for payload in stream:
            yield payload.encode("utf-8")
        done = True
    except Exception:
        done = True
        logger.warning("request %s: its replica failed mid-stream; ended with an error", request_id, exc_info=True)
        yield error_tail.encode("utf-8")
    finally:
        if not done:
            stream.cancel()


def application(settings: Settings, key: str | None, scaling: Scaling) -> Any:
    """The bound Ray Serve application (``serve.run`` it)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    # Twice a replica's batch may wait there before Ray queues at the router.
    target = target_ongoing(settings)
    autoscaling = autoscaling_config(settings, scaling)
    model = serve.deployment(
        ModelReplica, name="ModelReplica",
        num_replicas=None if autoscaling else scaling.replicas, autoscaling_config=autoscaling,
        max_ongoing_requests=2 * target,
        ray_actor_options={"num_cpus": scaling.cpus_per_replica},
        graceful_shutdown_timeout_s=settings.drain_grace_s, graceful_shutdown_wait_loop_s=1.0,
        health_check_period_s=5, health_check_timeout_s=30,
        request_router_config=RequestRouterConfig(
            request_router_class="llm_api.scale_out.router:PrefixAffinityRouter",
            request_router_kwargs={"affinity": scaling.routing == "prefix"},
            request_routing_stats_period_s=2, request_routing_stats_timeout_s=5),
    ).bind(settings)
    ingress = serve.deployment(Ingress, name="Ingress", num_replicas=1, max_ongoing_requests=10_000,
                               ray_actor_options={"num_cpus": 0},
                               graceful_shutdown_timeout_s=settings.drain_grace_s)
    return ingress.bind(model, settings, key)
