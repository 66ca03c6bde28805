"""The route table: every route any edge serves, one line each, and the one way a request finds its route.

The TorchServe handler, the standalone HTTP server and the gRPC servicer hold no route logic: they turn
what they received into a ``Call``, ask ``find`` for the route (by the path below their root), run
``answer`` and write the ``Whole`` or ``Streamed`` it returns, rendering a raised ``ApiError`` with
``error_body`` in the route's shape. Adding a route is a ``route`` module in its API's folder of
``llm_api.protocols`` and a line below. An API that keeps state across requests (the Responses API's
stored responses) opens it in ``open_api_states``, which each edge calls once at start.

``find(method, path, edge, headers)``: ``edge`` is ``"server"`` (paths below ``/``) or
``"torchserve"`` (paths below ``/predictions/<model>/<version>/``, where the empty path is the native
route). A path no route has is 404; a known path with another method is 405 naming the allowed ones.
TorchServe does not tell the handler the HTTP method (docs/torchserve.md), so where two routes share a
path (``GET`` and ``DELETE v1/responses/{id}``) the request must say which in ``X-HTTP-Method-Override``;
without it a request that accepts JSON (what every client's GET sends) is the GET, and any other is
refused with 400 ``method_unknown`` rather than guessed (a DELETE taken for a GET would report a
deletion that never happened).
"""

from __future__ import annotations

import functools

from llm_api.errors import ApiError, echo
from llm_api.model.settings import Settings
from llm_api.protocols.chat import route as chat
from llm_api.protocols.completions import route as completions
from llm_api.protocols.embeddings import route as embeddings
from llm_api.protocols.lora import route as lora
from llm_api.protocols.messages import route as messages
from llm_api.protocols.native import route as native
from llm_api.protocols.probes import route as probes
from llm_api.protocols.responses import route as responses
from llm_api.protocols.responses.state import open_responses
from llm_api.protocols.route import Answer, ApiStates, Call, Route, RouteContext
from llm_api.protocols.tokenize import route as tokenizer

METHOD_OVERRIDE_HEADER = "x-http-method-override"


def open_api_states(settings: Settings) -> ApiStates:
    """What the APIs keep across requests (``RouteContext.apis``); raises ConfigError for a setting that
    cannot be served (an unusable RESPONSES_STORE_PATH)."""
    return ApiStates(open_responses(settings))


ROUTES: tuple[Route, ...] = (
    Route("generate", "POST", native.generate, paths=("predictions/{model}",), model_paths=("",), errors="native"),
    Route("chat", "POST", chat.chat, paths=("v1/chat/completions",), model_paths=("v1/chat/completions",)),
    Route("completions", "POST", completions.completions, paths=("v1/completions",),
          model_paths=("v1/completions",)),
    Route("responses", "POST", responses.create, paths=("v1/responses",), model_paths=("v1/responses",)),
    Route("retrieve_response", "GET", responses.retrieve, paths=("v1/responses/{id}",),
          model_paths=("v1/responses/{id}",)),
    Route("delete_response", "DELETE", responses.delete, paths=("v1/responses/{id}",),
          model_paths=("v1/responses/{id}",)),
    Route("cancel_response", "POST", responses.cancel, paths=("v1/responses/{id}/cancel",),
          model_paths=("v1/responses/{id}/cancel",)),
    Route("embeddings", "POST", embeddings.embeddings, paths=("v1/embeddings",), model_paths=("v1/embeddings",)),
    Route("messages", "POST", messages.messages, paths=("v1/messages",), model_paths=("v1/messages",),
          errors="anthropic"),
    Route("count_tokens", "POST", messages.count_tokens, paths=("v1/messages/count_tokens",),
          model_paths=("v1/messages/count_tokens",), errors="anthropic"),
    Route("tokenize", "POST", tokenizer.tokenize, paths=("tokenize",), model_paths=("tokenize",)),
    Route("detokenize", "POST", tokenizer.detokenize, paths=("detokenize",), model_paths=("detokenize",)),
    Route("tokenizer_info", "GET", tokenizer.tokenizer_info, paths=("tokenizer_info",),
          model_paths=("tokenizer_info",)),
    Route("load_lora_adapter", "POST", lora.load, paths=("v1/load_lora_adapter",),
          model_paths=("v1/load_lora_adapter",)),
    Route("unload_lora_adapter", "POST", lora.unload, paths=("v1/unload_lora_adapter",),
          model_paths=("v1/unload_lora_adapter",)),
    Route("models", "GET", probes.models, paths=("v1/models",), model_paths=("v1/models",)),
    Route("health", "GET", probes.health, paths=("health",), public=True, needs_model=False),
    Route("ready", "GET", probes.ready, paths=("ready", "v1/health"), model_paths=("v1/health",), public=True,
          needs_model=False),
    Route("metrics", "GET", probes.metrics, paths=("metrics",), public=True, needs_model=False),
)
BY_NAME = {route.name: route for route in ROUTES}


def _segments(path: str) -> list[str]:
    return [s for s in path.split("?", 1)[0].split("/") if s]


def _match(pattern: tuple[str, ...], segments: list[str]) -> dict[str, str] | None:
    if len(pattern) != len(segments):
        return None
    params = {}
    for want, got in zip(pattern, segments):
        if want.startswith("{") and want.endswith("}"):
            params[want[1:-1]] = got
        elif want != got:
            return None
    return params


@functools.cache
def _patterns(routes: tuple[Route, ...], edge: str) -> tuple[tuple[Route, tuple[str, ...]], ...]:
    """Every (route, path split into segments) an edge serves, split once."""
    return tuple((route, tuple(_segments(path))) for route in routes
                 for path in (route.model_paths if edge == "torchserve" else route.paths))


def error_shape(path: str, edge: str) -> str:
    """The error shape of a path before (or without) a route: the native one for the native route's paths
    (``predictions/...`` on the standalone server, the model's own path on TorchServe), Anthropic's below
    ``v1/messages``, else OpenAI's."""
    segments = _segments(path)
    native = not segments if edge == "torchserve" else segments[:1] == ["predictions"]
    if native:
        return "native"
    return "anthropic" if segments[:2] == ["v1", "messages"] else "openai"


def is_public(path: str, metrics_public: bool = False) -> bool:
    """Whether the standalone server answers ``path`` without a key: the probes, and the metrics only where
    ``metrics_public`` (METRICS_PUBLIC: they name adapters and count every key's requests)."""
    segments = _segments(path)
    return any(route.public and (metrics_public or route.name != "metrics") and _match(pattern, segments) is not None
               for route, pattern in _patterns(ROUTES, "server"))


def find(method: str | None, path: str, edge: str, headers: dict[str, str] | None = None,
         routes: tuple[Route, ...] = ROUTES) -> tuple[Route, dict[str, str]]:
    """The route for ``path`` and its parameters (raises ApiError 404/405/400: the module docstring)."""
    segments = _segments(path)
    candidates = [(route, params) for route, pattern in _patterns(routes, edge)
                  if (params := _match(pattern, segments)) is not None]
    if not candidates:
        raise ApiError(404, "not_found", f"no route {echo('/' + '/'.join(segments))}")
    if method is None:
        if len(candidates) == 1:
            return candidates[0]
        method = _method_of(headers or {}, sorted({route.method for route, _ in candidates}))
    for route, params in candidates:
        if route.method == method or (method == "HEAD" and route.method == "GET"):
            return route, params
    allowed = ", ".join(sorted({route.method for route, _ in candidates}))
    raise ApiError(405, "method_not_allowed", f"{echo(method)} is not allowed here; use {allowed}")


async def answer(route: Route, params: dict[str, str], ctx: RouteContext, call: Call) -> Answer:
    """Run ``route`` for ``call`` (503 ``loading`` first when it needs the model and the model loads)."""
    if route.needs_model:
        ctx.loaded()
    return await route.answer(ctx, call, params)


def _method_of(headers: dict[str, str], methods: list[str]) -> str:
    override = headers.get(METHOD_OVERRIDE_HEADER)
    if override is not None:
        return override.strip().upper()
    accept = headers.get("accept", "")
    if "GET" in methods and ("application/json" in accept or "text/event-stream" in accept):
        return "GET"
    raise ApiError(400, "method_unknown", f"TorchServe does not pass the HTTP method to the model; this path serves "
                   f"{', '.join(methods)}: say which in the header 'X-HTTP-Method-Override'")
