"""The Responses API: ``POST v1/responses``, ``GET`` / ``DELETE v1/responses/{id}``, ``POST v1/responses/{id}/cancel``.

* create: the body (``translate``) becomes a ``GenerateRequest`` and the ``ResponsesCall``
  that encodes the answer (a Response object, or typed SSE events). ``previous_response_id`` continues a
  stored conversation of the same owner (its turns come first; the prompt they render is the earlier
  prompt and answer, so its blocks come from the prefix cache); unknown, evicted, expired or another's:
  404. With ``store`` (the default) the finished Response and its conversation are stored before the
  answer's last part goes out, so a client may retrieve or continue it the moment it has read it.
* retrieve: a stored response, or one still being generated (its Response object so far,
  ``status: in_progress``); delete: removes a stored one (``{"id", "object": "response.deleted",
  "deleted": true}``); cancel: ends a response still being generated (its stream ends, the stored object
  says ``cancelled``) and answers the Response object; a finished one cannot be cancelled (400).
* background (``"background": true``): the answer is the Response object at once (status ``queued``) and the
  generation runs on as a task of the event loop (``Responses.run_in_background``), known as in flight
  (``retrieve`` shows it ``in_progress``, ``cancel`` ends it) and stored when it ends: completed,
  incomplete, cancelled, or failed with its error (a refusal at admission too, such as 503 overloaded).
  With ``stream`` too, the answer is its event stream (``sequence_number`` on every event), read from the
  response's ``EventLog`` (``state``): a client that drops it leaves the response running, and
  ``GET v1/responses/{id}?stream=true&starting_after=N`` (its owner only) replays the events after N and
  follows the live ones to the end (while the log is kept: in flight, or among the recent ones). One owner
  has at most RESPONSES_BACKGROUND_PER_OWNER background responses in flight (429 past it). A restart does
  not resume them: one still running when the drain's grace ends is cancelled as every request is, and
  after a crash the next start marks it failed (``state.fail_orphans``; with the memory store it is gone).
  TorchServe drops a URL's query before the handler: there the same comes in headers (``_query``).
* The store is called on a worker thread (an SQLite store may wait on another process's lock).
* Owners: the credential the request carried, as its edge derived it once (``Call.owner``,
  ``llm_api.service.owners``): another key gets 404 for an id it did not create, exactly as for an id that
  never existed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import TYPE_CHECKING, AsyncGenerator, Callable

from llm_api.errors import ApiError, echo, internal_error
from llm_api.protocols.common.openai import SSE_CONTENT_TYPE
from llm_api.protocols.responses.encoder import ResponsesCall
from llm_api.protocols.responses.encoder import Replay
from llm_api.protocols.responses.state import INCARNATION, EventLog, InFlightResponse, Responses
from llm_api.protocols.responses.translate import continued, parse_responses
from llm_api.protocols.route import Answer, Call, RouteContext, Streamed, Whole
from llm_api.service.answer import Chunk, Final, Part, Refusal, admit, encoded_parts, parse_large
from llm_api.service.request import GenerateRequest

if TYPE_CHECKING:  # (annotations only: the route table loads without the engine and torch)
    from llm_api.service.service import ModelService

logger = logging.getLogger(__name__)
CANCEL_WAIT_S = 5.0  # how long cancel waits for the response to end before answering it as it stands


def _owner(call: Call) -> str:
    assert call.owner, "the edge names the owner (llm_api.service.owners)"
    return call.owner


def _state(ctx: RouteContext) -> Responses:
    """The API's state (its edge opened it at start); 503 while the model loads, as every route of it."""
    ctx.loaded()
    if ctx.apis is None:
        raise internal_error("this edge does not serve the Responses API")
    return ctx.apis.responses


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, "not_found", f"no response with id {echo(response_id)}", param)


async def create(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service, responses = ctx.serving(), _state(ctx)
    request, encoder = await parse_large(service, parse_responses, call.json_body(), service.model_names,
                                         service.limits, service.adapter_names())
    owner = _owner(call)
    if encoder.previous_response_id is not None:
        stored = await asyncio.to_thread(responses.store.get, encoder.previous_response_id, owner)
        if stored is None:
            raise _not_found(encoder.previous_response_id, "previous_response_id")
        request = continued(request, encoder, json.loads(stored.conversation_json))
    if encoder.background:
        if responses.background_of(owner) >= responses.max_background_per_owner:
            raise ApiError(429, "too_many_background_responses", f"this key has {responses.max_background_per_owner} "
                           "background responses in flight (RESPONSES_BACKGROUND_PER_OWNER); wait for one to end",
                           "background", retry_after=1)
        entry = InFlightResponse(owner, call.request_id, encoder, background=True,
                                 log=EventLog() if encoder.stream else None)
        responses.in_flight[encoder.id] = entry  # (before the answer: a poll right after it finds it)
        # Stored as queued and claimed for this process: after a crash, the next start marks it failed (state).
        await asyncio.to_thread(_claim, responses, encoder, owner)
        responses.run_in_background(_background(service, responses, request, encoder, call.request_id, owner, entry,
                                                call.tenant))
        if entry.log is not None:
            return _replay(entry.log, -1)
        return Whole(200, json.dumps({**encoder.response_json(), "status": "queued"}))
    generations = await admit(service, request, call.request_id, owner=owner, tenant=call.tenant)
    return Streamed(encoded_parts(generations, encoder, _tracked(responses, encoder, call.request_id, owner)), encoder)


async def _background(service: ModelService, responses: Responses, request: GenerateRequest, encoder: ResponsesCall,
                      request_id: str, owner: str, entry: InFlightResponse, tenant: str) -> None:
    """A background response to its end; a refusal or an error ends it ``failed`` (stored all the same)."""
    error: ApiError | None = None
    try:
        generations = await admit(service, request, request_id, owner=owner, tenant=tenant)
        parts = encoded_parts(generations, encoder, _tracked(responses, encoder, request_id, owner, entry))
        async with aclosing(parts):
            async for part in parts:
                if isinstance(part, Refusal):
                    detail = json.loads(part.body).get("error") or {}
                    error = ApiError(part.status, str(detail.get("code") or "error"), str(detail.get("message")))
                elif entry.log is not None:
                    entry.log.append(part.payload)
    except ApiError as refused:  # (admission: overloaded, too long, ...)
        error = refused
    except Exception:
        logger.exception("background response %s failed", encoder.id)
        error = internal_error()
    if error is not None:
        tail = encoder.fail(error)
        if entry.log is not None:
            entry.log.append(tail)
    responses.in_flight.pop(encoder.id, None)  # (the answer's pass did, unless admission refused it)
    if entry.log is not None:  # (no await since the pass let it go: a reader finds the log in one place or the other)
        entry.log.end()
        responses.keep_log(encoder.id, owner, entry.log)
    entry.ended.set()
    if error is not None:
        await asyncio.to_thread(responses.store.put, encoder.id, owner, json.dumps(encoder.response_json()),
                                json.dumps(encoder.conversation()))
    await asyncio.to_thread(responses.store.release_background, encoder.id)


def _claim(responses: Responses, encoder: ResponsesCall, owner: str) -> None:
    responses.store.put(encoder.id, owner, json.dumps({**encoder.response_json(), "status": "queued"}),
                        json.dumps(encoder.conversation()))
    responses.store.claim_background(encoder.id, owner, INCARNATION)


def _tracked(responses: Responses, encoder: ResponsesCall, request_id: str, owner: str,
             entry: InFlightResponse | None = None) -> Callable[[AsyncGenerator[Part, None]], AsyncGenerator[Part, None]]:
    """A pass over the answer's parts that keeps the response known as in flight meanwhile and stores it
    before its last part."""

    async def tracked(parts: AsyncGenerator[Part, None]) -> AsyncGenerator[Part, None]:
        nonlocal entry
        live = responses.in_flight
        if entry is None:
            entry = InFlightResponse(owner, request_id, encoder)
            live[encoder.id] = entry
        try:
            async with aclosing(parts):
                async for part in parts:
                    if isinstance(part, Final) and encoder.store:
                        stored = await asyncio.to_thread(responses.store.put, encoder.id, owner,
                                                         json.dumps(encoder.response_json()),
                                                         json.dumps(encoder.conversation()))
                        if not stored:
                            logger.info("response %s was not stored (over RESPONSES_STORE_MAX_BYTES)", encoder.id)
                    yield part
        finally:
            live.pop(encoder.id, None)
            entry.ended.set()

    return tracked


async def retrieve(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    responses = _state(ctx)
    response_id, owner = params["id"], _owner(call)
    query = _query(call)
    if query.get("stream", "false").lower() not in ("false", "0"):
        return await _stream_of(responses, response_id, owner, query)
    live = responses.in_flight.get(response_id)
    if live is not None and live.owner == owner:
        return Whole(200, json.dumps(live.encoder.response_json()))
    stored = await asyncio.to_thread(responses.store.get, response_id, owner)
    if stored is None:
        raise _not_found(response_id)
    return Whole(200, stored.response_json)


def _query(call: Call) -> dict[str, str]:
    """What a retrieve asks for beyond the id: the query's fields (``Call.query``). TorchServe's frontend drops
    a URL's query before the handler (docs/torchserve.md), so there a GET that accepts only
    ``text/event-stream`` (what ``retrieve(id, stream=True)`` of the openai package sends) asks for the stream, and
    ``starting_after`` comes in the header ``X-Starting-After`` (``extra_headers``), taken on every edge."""
    query = dict(call.query)
    if "stream" not in query and call.headers.get("accept", "").strip().startswith("text/event-stream"):
        query["stream"] = "true"
    header = call.headers.get(STARTING_AFTER_HEADER)
    if "starting_after" not in query and header is not None:
        query["starting_after"] = header
    return query


STARTING_AFTER_HEADER = "x-starting-after"


async def _stream_of(responses: Responses, response_id: str, owner: str, query: dict[str, str]) -> Answer:
    """``GET v1/responses/{id}?stream=true&starting_after=N``: the events after N, then the live ones."""
    raw = query.get("starting_after", "-1")
    try:
        starting_after = int(raw)
    except ValueError:
        raise ApiError(400, "invalid_value", f"'starting_after' must be an integer, got {echo(raw)}",
                       "starting_after") from None
    log = responses.log_of(response_id, owner)
    if log is not None:
        return _replay(log, starting_after)
    live = responses.in_flight.get(response_id)
    known = (live is not None and live.owner == owner) or \
        await asyncio.to_thread(responses.store.get, response_id, owner) is not None
    if not known:
        raise _not_found(response_id)
    raise ApiError(400, "invalid_request", f"the response {echo(response_id)} has no event stream to read: only a "
                   "background response created with stream: true has one, kept while it runs and a while after; "
                   "GET it without stream", "stream")


def _replay(log: EventLog, starting_after: int) -> Streamed:
    """A stream that reads ``log`` (its reader's closing leaves the response running)."""
    replay = Replay(log)

    async def parts() -> AsyncGenerator[Part, None]:
        async with aclosing(log.follow(starting_after)) as events:
            async for text in events:
                yield Chunk(text, SSE_CONTENT_TYPE)
        yield Final("", SSE_CONTENT_TYPE)

    return Streamed(parts(), replay)


async def delete(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    response_id = params["id"]
    if not await asyncio.to_thread(_state(ctx).store.delete, response_id, _owner(call)):
        raise _not_found(response_id)
    return Whole(200, json.dumps({"id": response_id, "object": "response.deleted", "deleted": True}))


async def cancel(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service, responses = ctx.loaded(), _state(ctx)
    response_id, owner = params["id"], _owner(call)
    live = responses.in_flight.get(response_id)
    if live is None or live.owner != owner:
        if await asyncio.to_thread(responses.store.get, response_id, owner) is None:
            raise _not_found(response_id)
        raise ApiError(400, "invalid_request", f"the response {echo(response_id)} has finished; only a response "
                       "being generated can be cancelled")
    service.cancel(live.request_id)
    try:
        await asyncio.wait_for(live.ended.wait(), CANCEL_WAIT_S)
    except TimeoutError:
        pass
    return Whole(200, json.dumps(live.encoder.response_json()))
