"""What every front end does with one request, whatever owns its sockets: parse, drive, encode.

The TorchServe handler and the standalone server differ only in how bytes reach a client; the steps in
between are the same and live here, so the two edges cannot drift apart:

* ``parse_large(service, parse, body, *args)`` / ``parse_sized(service, size, parse, *args)``: a request
  format's parser (``llm_api.protocols``: each API's routes call theirs), run on the service's worker
  threads when the body is large (embeddings: up to ~6 MB of JSON; a /detokenize body may hold a million
  ids), so the event loop keeps serving the other streams meanwhile. They raise ``ApiError``.
* ``encoded_parts(service, request, encoder, request_id, marker)``: ``service.generate``'s events (text
  deltas and choice ends of every choice, then one ``Finished``) through any ``AnswerEncoder``
  (``llm_api.api.encoding``: native, OpenAI chat/completions, responses) into what the client receives,
  as ``Part``s: ``Chunk`` (send it now, the answer is a 200 from here on), then exactly one of ``Final``
  (the last payload of a 200 answer, possibly the whole answer when nothing was streamed) or ``Refusal``
  (the request failed before anything was sent: its status and error body). Chunks and finals carry the
  encoder's content type. ``ApiError`` from admission, or a unary answer outgrowing the native
  encoder's ``max_unary_bytes`` (``response_too_large``), propagates before the first part, as from
  ``service.generate``.

Leaving the iteration early (a client that went away) closes ``service.generate``, which aborts the
request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Callable, Sequence, TypeVar, cast

from llm_api.api.encoding import AnswerEncoder
from llm_api.api.errors import ApiError
from llm_api.api.request import GenerateRequest
from llm_api.service.events import ChoiceFinished, Event, Finished, TextDelta
from llm_api.service.service import ModelService

LARGE_BODY_BYTES = 64 * 1024  # bodies above this are parsed off the event loop
BATCH_QUEUE_EVENTS = 64  # events of a several-prompt call waiting for the client (its prompts then wait)
T = TypeVar("T")


@dataclass(frozen=True)
class Chunk:
    payload: str
    content_type: str


@dataclass(frozen=True)
class Final:
    payload: str
    content_type: str


@dataclass(frozen=True)
class Refusal:
    status: int
    body: str
    headers: dict[str, str] = field(default_factory=dict)  # the error's own (ApiError.headers: Retry-After)


Part = Chunk | Final | Refusal


def row_size(row: Any) -> int:
    values = row.values() if hasattr(row, "values") else ()
    return sum(len(v) for v in values if isinstance(v, (bytes, bytearray, str)))


async def parse_large(service: ModelService, parse: Callable[..., T], body: bytes | bytearray, *args: Any) -> T:
    """``parse(body, *args)``, on the service's worker threads when the body is large."""
    return await parse_sized(service, len(body), parse, body, *args)


async def parse_sized(service: ModelService, size: int, parse: Callable[..., T], *args: Any) -> T:
    """``parse(*args)`` of a request of ``size`` bytes, on the service's worker threads when that is large."""
    if size > LARGE_BODY_BYTES:
        return await service.inputs.offload(parse, *args)
    return parse(*args)


async def encoded_parts(service: ModelService, request: GenerateRequest | Sequence[GenerateRequest],
                        encoder: AnswerEncoder, request_id: str, marker: str = "", owner: str = ""
                        ) -> AsyncGenerator[Part, None]:
    """``service.generate``'s events through ``encoder``: chunks, then the final part or the refusal.
    ``request``: one, or the requests of a call with several prompts (``batch_events``). ``marker``: text
    the detokenizer keeps out of the answer (the native end-of-stream marker); ``owner``: who sent it
    (``Call.owner``)."""
    started = False
    kind = encoder.content_type
    requests = [request] if isinstance(request, GenerateRequest) else list(request)
    async with aclosing(batch_events(service, requests, request_id, marker, owner)) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                chunk = encoder.delta(event.text, event.index, event.logprobs, num_tokens=event.num_tokens)
            elif isinstance(event, ChoiceFinished):
                chunk = encoder.choice_finish(event.index, event.reason, event.num_generated_tokens)
            elif event.error is None:
                assert event.reason is not None  # a Finished without an error has its reason (Generation._finished)
                yield Final(encoder.finish(event.reason, event.num_prompt_tokens, event.num_generated_tokens,
                                           num_cached_tokens=event.num_cached_tokens), kind)
                return
            elif not started:
                yield Refusal(event.error.status, encoder.refusal(event.error), event.error.headers())
                return
            else:
                yield Final(encoder.fail(event.error), kind)
                return
            if chunk:
                started = True
                yield Chunk(chunk, kind)
    raise RuntimeError("the request ended without a final event")


async def batch_events(service: ModelService, requests: list[GenerateRequest], request_id: str, marker: str,
                       owner: str) -> AsyncGenerator[Event, None]:
    """The events of a call's requests as one answer's. One request: ``service.generate``'s own. Several (a
    completions call with a list of prompts): each runs as its own request (id ``<request_id>.<p>``) at
    once, prompt ``p``'s choice ``i`` becomes choice ``p * n + i``, and one ``Finished`` ends the answer:
    the first prompt's reason with every prompt's token counts, or the first error (a refusal of any
    prompt included), which closes the other prompts' generations and so frees their KV blocks."""
    if len(requests) == 1:
        async with aclosing(service.generate(requests[0], request_id, marker, owner)) as events:
            async for event in events:
                yield event
        return
    n = requests[0].params.n
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue(maxsize=BATCH_QUEUE_EVENTS)

    async def run(p: int, request: GenerateRequest) -> None:
        try:
            async with aclosing(service.generate(request, f"{request_id}.{p}", marker, owner)) as events:
                async for event in events:
                    await queue.put((p, event))
        except ApiError as error:  # (a refusal at admission)
            await queue.put((p, Finished(None, error, 0, 0)))

    tasks = [asyncio.create_task(run(p, request)) for p, request in enumerate(requests)]
    try:
        ends: dict[int, Finished] = {}
        while len(ends) < len(requests):
            p, event = await _next_event(queue, tasks)
            if isinstance(event, TextDelta):
                yield dataclasses.replace(event, index=p * n + event.index)
            elif isinstance(event, ChoiceFinished):
                yield dataclasses.replace(event, index=p * n + event.index)
            elif event.error is not None:
                yield dataclasses.replace(event, num_prompt_tokens=sum(e.num_prompt_tokens for e in ends.values()),
                                          num_generated_tokens=sum(e.num_generated_tokens for e in ends.values()),
                                          num_cached_tokens=sum(e.num_cached_tokens for e in ends.values()))
                return
            else:
                ends[p] = event
        yield Finished(ends[0].reason, None, sum(e.num_prompt_tokens for e in ends.values()),
                       sum(e.num_generated_tokens for e in ends.values()),
                       sum(e.num_cached_tokens for e in ends.values()))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _next_event(queue: asyncio.Queue[tuple[int, Event]], tasks: list[asyncio.Task]) -> tuple[int, Event]:
    """The next queued event; a task that failed without one (a bug: ``service.generate`` ends every request
    with a ``Finished``) raises here rather than leaving the answer waiting."""
    getter = asyncio.ensure_future(queue.get())
    while True:
        done, _ = await asyncio.wait([getter, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            return getter.result()
        failed = next((t for t in done if t.exception() is not None), None)
        if failed is not None:
            getter.cancel()
            raise cast(BaseException, failed.exception())
        tasks = [t for t in tasks if not t.done()]
        if not tasks:
            return await getter
