"""The native route: ``POST /predictions/<model>`` (TorchServe: the model's own path; gRPC: every call).

The body (JSON or form fields, ``translate``; answers: ``encoder``) asks for a generation, streamed as text ending
with the end-of-stream marker (or JSON lines), or, with ``{"cancel": id}``, ends the live request whose
``x-request-id`` is ``id`` (a drain still takes cancels: they help it finish). Over gRPC the answer is
one message unless the client reads a stream and the request asks for one (``stream``); a unary answer
is bounded by gRPC's default message limit (``response_too_large`` beyond it).
"""

from __future__ import annotations

import json
import logging

from typing import TYPE_CHECKING, Any, Mapping

from llm_api.errors import ApiError, model_not_found
from llm_api.protocols.native.encoder import GRPC_MAX_MESSAGE_BYTES, NativeStream
from llm_api.protocols.native.translate import parse_request
from llm_api.protocols.route import Answer, Call, RouteContext, Streamed, Whole
from llm_api.service.answer import admit, encoded_parts, parse_sized, row_size
from llm_api.service.request import CancelRequest, GenerateRequest

if TYPE_CHECKING:  # (annotations only: the route table loads without the engine and torch)
    from llm_api.service.service import ModelService

logger = logging.getLogger(__name__)


async def parse_native(service: ModelService, row: Mapping[str, Any], default_stream: bool
                       ) -> GenerateRequest | CancelRequest:
    """A native row -> its request (off the event loop when large: embeddings may be ~6 MB of JSON)."""
    return await parse_sized(service, row_size(row), parse_request, row, service.limits, default_stream)


def native_encoder(request: GenerateRequest, marker: str, max_unary_bytes: int | None = None) -> NativeStream:
    """The native format's encoder for ``request`` (its ``output`` and ``stream`` decide the shape)."""
    json_lines = request.output == "jsonl"
    return NativeStream(marker, streaming=request.stream, json_lines=json_lines,
                        with_logprobs=request.params.logprobs is not None, max_unary_bytes=max_unary_bytes)


async def generate(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.loaded()
    model = params.get("model")
    if model is not None and model not in service.model_names:
        raise model_not_found(model, service.model_names, param=None)
    request = await parse_native(service, call.row, default_stream=not call.grpc)
    if isinstance(request, CancelRequest):
        found = service.cancel(request.target_id)
        logger.info("cancel of request %s: %s", request.target_id[:64], "done" if found else "not running")
        return Whole(200, json.dumps({"cancelled": found}))
    ctx.serving()
    if request.constraint is not None and ctx.marker in request.constraint.spec.source:
        # The marker is reserved on this route: an answer holding its text would be cut (or end the stream
        # early), and a grammar's answer is never silently altered (the OpenAI routes keep it intact).
        raise ApiError(400, "invalid_grammar", f"the {request.constraint.param!r} constraint holds the end-of-stream "
                       "marker's text, which this route reserves for the end of a stream; use an OpenAI route",
                       request.constraint.param)
    if call.grpc and not call.grpc_stream:
        request.stream = False  # a second message to a unary call kills TorchServe's worker
    # A unary gRPC answer is one message, which gRPC clients refuse above 4 MiB by default.
    encoder = native_encoder(request, ctx.marker, GRPC_MAX_MESSAGE_BYTES if call.grpc else None)
    generations = await admit(service, request, call.request_id, ctx.marker, call.owner, call.tenant)
    return Streamed(encoded_parts(generations, encoder), encoder)
