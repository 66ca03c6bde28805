"""What a route is, what it receives and what it answers: the types every edge and every route module share.

* ``Call``: one request as an edge received it, transport-neutral: the id the edge issued, the HTTP method
  when the edge knows it (TorchServe does not pass it to the handler: ``None``), the request's ``row``
  (TorchServe's shape: a JSON body as ``{"body": bytes}``, form fields or a gRPC input map as
  ``{name: bytes}``), its headers (lower-case names), whether it came over gRPC and, if so, whether the
  client reads a stream.
* ``RouteContext``: what the serving process offers a route: the service (``None`` while the model
  loads), the native end-of-stream marker, whether the process drains, the Prometheus text where the
  edge serves one, and ``ApiStates``: what APIs keep across requests (the Responses API's stored and
  in-flight responses), opened once per serving process by its edge (``table.open_api_states``) and
  closed at its shutdown.
* ``Whole`` (a complete answer: status, body, content type, headers) or ``Streamed`` (``Part``s from
  ``llm_api.service.answer.encoded_parts`` and the encoder whose ``fail`` ends a stream that broke
  mid-way): what a route answers. Errors are ``ApiError``s, raised; the edge renders them in the route's
  ``errors`` shape (``error_body``).
* ``Route``: one table entry: its name, method, its paths below the standalone server's root (``paths``)
  and below TorchServe's ``/predictions/<model>/<version>/`` (``model_paths``; ``{name}`` segments are
  parameters), its answer function, its error shape, whether it needs a key (``public``: probes and
  metrics do not) and the model (``needs_model``: 503 ``loading`` until then).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping

from llm_api.errors import ApiError
from llm_api.protocols.responses.state import Responses
from llm_api.service.answer import Parts
from llm_api.service.encoding import AnswerEncoder

if TYPE_CHECKING:  # (annotations only: the table of routes loads without the engine and torch)
    from llm_api.service.service import ModelService

JSON_CONTENT_TYPE = "application/json"
LOADING_RETRY_AFTER_S = 5  # the embedded model loads in seconds; a client polling faster only adds load


@dataclass
class Call:
    request_id: str
    method: str | None = None  # None: the edge cannot tell (TorchServe hands the handler no method)
    row: Mapping[str, Any] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)  # lower-case names
    query: Mapping[str, str] = field(default_factory=dict)  # the URL's query fields (TorchServe: in the row instead)
    owner: str = ""  # who sent it: derived once by the edge from the credential auth checked (service.owners)
    # Whose share of the engine it runs in (llm_api.engine.fair_share): the owner where the edge checked a key,
    # else "" (everyone one tenant: an unchecked header must not buy a share of its own).
    tenant: str = ""
    grpc: bool = False
    grpc_stream: bool = False  # (gRPC) the client reads a stream: StreamPredictions where that is known

    def json_body(self) -> bytes | bytearray:
        """The JSON body (400 ``invalid_json`` when the request sent none, or sent form fields), as the edge
        received it: not copied (TorchServe hands a bytearray; a copy of a 6 MB body on the event loop
        was a stall of its own)."""
        body = self.row.get("body") if hasattr(self.row, "get") else None
        if not isinstance(body, (bytes, bytearray)):
            raise ApiError(400, "invalid_json", "send a JSON body (Content-Type: application/json)")
        return body


@dataclass
class RouteContext:
    marker: str
    service: ModelService | None  # None while the model loads
    draining: bool = False
    metrics_text: Callable[[], tuple[str | bytes, str]] | None = None  # () -> (Prometheus text, its content type)
    # () -> the key management routes need in X-Management-Key (TorchServe's management key; None: token auth
    # off), where the edge's own auth does not already stand for it (the standalone server's bearer key does).
    management_key: Callable[[], str | None] | None = None
    apis: "ApiStates | None" = None  # None: the edge serves no API that keeps state (gRPC: the native route)

    def loaded(self) -> ModelService:
        """The service, or the 503 a request gets while the model loads."""
        if self.service is None:
            raise ApiError(503, "loading", "the model is still loading; retry shortly", retry_after=LOADING_RETRY_AFTER_S)
        return self.service

    def serving(self) -> ModelService:
        """The service, if it takes new work now (a drain refuses it; cancels and reads still pass)."""
        service = self.loaded()
        if self.draining:
            raise ApiError(503, "shutting_down", "the server is shutting down; retry on another replica")
        return service


@dataclass
class ApiStates:
    """What the APIs keep across requests in one serving process (each API owns its own)."""

    responses: Responses  # llm_api.protocols.responses.state

    def close(self) -> None:
        self.responses.close()


@dataclass(frozen=True)
class Whole:
    status: int
    body: str | bytes
    content_type: str = JSON_CONTENT_TYPE
    headers: dict[str, str] = field(default_factory=dict)  # an answer's own (Retry-After), never request data


@dataclass
class Streamed:
    parts: Parts  # (its aclose releases the admitted requests, read or not)
    encoder: AnswerEncoder  # its fail() ends an answer that broke after chunks went out


Answer = Whole | Streamed
AnswerFunction = Callable[[RouteContext, Call, dict[str, str]], Awaitable[Answer]]


@dataclass(frozen=True)
class Route:
    name: str
    method: str  # "GET" | "POST" | "DELETE"
    answer: AnswerFunction
    paths: tuple[str, ...] = ()  # below the standalone server's root
    model_paths: tuple[str, ...] = ()  # below TorchServe's /predictions/<model>/<version>/
    errors: str = "openai"  # "openai" | "native" | "anthropic": the shape of its error bodies
    public: bool = False  # no key needed (probes; metrics with METRICS_PUBLIC: table.is_public)
    needs_model: bool = True  # 503 loading until the model is loaded


def error_body(shape: str, error: ApiError, marker: str) -> str:
    """An error in a route's shape (the native marker kept out of every one)."""
    if shape == "native":
        return error.native_text(marker)
    return error.anthropic_text(marker) if shape == "anthropic" else error.openai_text(marker)
