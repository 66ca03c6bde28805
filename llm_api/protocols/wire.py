"""A route's answer as what goes on the wire: the one loop every edge writes an answer with.

``wire(answer, request_id)`` turns a route's ``Answer`` (``llm_api.protocols.route``) into what an edge sends,
in this order:

* ``Whole``: the complete answer, nothing sent before it, nothing after: a route's whole answer, an answer
  that streamed nothing (its ``Final`` alone: a 200), or a request refused after admission and before its
  first chunk (a ``Refusal``: its status, error body and headers);
* or ``Chunk``s, the pieces of a 200 that streams (the first one opens it), then exactly one ``Final``: the
  stream's last payload (possibly empty), after which the edge ends the stream.

A failure while the answer is produced (the engine, an encoder, a bug: anything raised by the answer's parts,
or parts that end without their final part) is decided here, once for every edge. Before anything was
yielded it is raised as an ``ApiError`` (an unexpected exception is logged and raised as a 500
``internal_error``), which the edge renders as it renders any refusal: in the route's error shape, with its
status. After a chunk it is ``Final(encoder.fail(error))``: the route's own in-band ending (a native error
line, a chat or Responses SSE error event, Anthropic's ``error`` event), whichever edge writes it. Exceptions
of an edge's own transport (a client gone, a write that timed out) are raised where the edge writes, outside
this loop, so they never turn into in-band errors. Closing the generator (every edge's ``aclosing``) closes
the answer's parts, which releases its requests (``llm_api.service.answer``).

What each edge keeps is its transport, a few lines each: aiohttp's response (``llm_api.server.http_api``),
TorchServe's reply (``llm_api.torchserve.llm_handler``), gRPC messages (``llm_api.server.grpc_api``) and Ray
Serve's generator of payloads (``llm_api.scale_out.deployments``). tests/test_architecture.py keeps it so: no
edge reads an answer's parts or refusals itself.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from typing import AsyncGenerator

from llm_api.errors import ApiError, internal_error
from llm_api.protocols.route import JSON_CONTENT_TYPE, Answer, Whole
from llm_api.service.answer import Chunk, Final, Refusal

logger = logging.getLogger(__name__)

WireEvent = Whole | Chunk | Final


async def wire(answer: Answer, request_id: str) -> AsyncGenerator[WireEvent, None]:
    """What the edge sends for ``answer`` (module docstring); ``request_id`` names the request in the log."""
    if isinstance(answer, Whole):
        yield answer
        return
    started = False
    async with aclosing(answer.parts) as parts:
        while True:
            # Only what producing the next part raises is the answer's failure: what the edge raises while
            # it writes a yielded event reaches the edge, not this handler.
            try:
                part = await anext(parts)
            except StopAsyncIteration:
                logger.error("request %s: its answer ended without a final part", request_id)
                error = internal_error("the server failed to handle this request")
            except ApiError as raised:
                error = raised
            except Exception:  # a bug costs this request only
                logger.exception("request %s failed", request_id)
                error = internal_error("the server failed to handle this request")
            else:
                if isinstance(part, Refusal):
                    yield Whole(part.status, part.body, JSON_CONTENT_TYPE, part.headers)
                    return
                if isinstance(part, Chunk):
                    started = True
                    yield part
                    continue
                yield part if started else Whole(200, part.payload, part.content_type)
                return
            if not started:
                raise error
            yield Final(answer.encoder.fail(error), answer.encoder.content_type)
            return
