"""What every front end does with one request, whatever owns its sockets: parse, admit, drive, encode.

The TorchServe handler and the standalone server differ only in how bytes reach a client; the steps in
between are the same and live here, so the two edges cannot drift apart:

* ``parse_large(service, parse, body, *args)`` / ``parse_sized(service, size, parse, *args)``: a request
  format's parser (``llm_api.protocols``: each API's routes call theirs), run on the service's worker
  threads when the body is large (embeddings: up to ~6 MB of JSON; a /detokenize body may hold a million
  ids), so the event loop keeps serving the other streams meanwhile. They raise ``ApiError``.
* ``admit(service, request, request_id, marker, owner)``: a call's requests admitted (``ModelService.admit``;
  several prompts of one completions call each as ``<request_id>.<p>``), or the first refusal raised with
  every request admitted before it released. A route admits before it answers, so a refusal (4xx, 503)
  leaves the route as a raised ``ApiError``, before the edge writes anything: its one way out.
* ``encoded_parts(generations, encoder)``: the admitted requests' events (text deltas and choice ends of
  every choice, then one ``Finished``) through any ``AnswerEncoder`` (``llm_api.service.encoding``: native,
  OpenAI chat/completions, responses) into what the client receives, as ``Part``s: ``Chunk`` (send it now,
  the answer is a 200 from here on), then exactly one of ``Final`` (the last payload of a 200 answer,
  possibly the whole answer when nothing was streamed) or ``Refusal`` (the request failed after admission
  and before anything was sent, such as its deadline or a cancel: its status and error body). Chunks and
  finals carry the encoder's content type. A unary answer outgrowing the native encoder's
  ``max_unary_bytes`` raises ``response_too_large`` before the first part.

Closing the parts (``aclose``, what every edge's ``aclosing`` does), whether or not they were read, releases
the admitted requests: one read part-way is aborted in the engine and its KV blocks are freed; one never
read leaves the live table it was admitted to.
"""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Sequence, TypeVar, cast

from llm_api.service.encoding import AnswerEncoder
from llm_api.service.events import ChoiceFinished, Event, Finished, TextDelta
from llm_api.service.request import GenerateRequest

if TYPE_CHECKING:  # (annotations only: the route table imports this module, and an edge that only routes,
    # the Ray ingress, must not load torch with the engine)
    from llm_api.service.service import Generation, ModelService

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


async def admit(service: ModelService, request: GenerateRequest | Sequence[GenerateRequest], request_id: str,
                marker: str = "", owner: str = "", tenant: str = "") -> list[Generation]:
    """``request`` (or each request of a call with several prompts: ids ``<request_id>.<p>``) admitted, or
    the first refusal raised with the ones admitted before it released. ``marker``: text the detokenizer
    keeps out of the answer (the native end-of-stream marker); ``owner``: who sent it (``Call.owner``);
    ``tenant``: whose share of the engine it runs in (``Call.tenant``). The prompts of one call are one
    request's work: their sum over MAX_REQUEST_WORK is refused (``Admission.prompt_list``)."""
    requests = [request] if isinstance(request, GenerateRequest) else list(request)
    if len(requests) == 1:  # (its own id: what a cancel names)
        return [await service.admit(requests[0], request_id, marker, owner, tenant)]
    admitted: list[Generation] = []
    try:
        for p, one in enumerate(requests):
            admitted.append(await service.admit(one, f"{request_id}.{p}", marker, owner, tenant))
            service.admission.prompt_list([g.work for g in admitted], len(requests))
    except BaseException:
        for generation in admitted:
            generation.release()
        raise
    return admitted


class EncodedParts:
    """The ``Part``s of an admitted answer (module docstring): an async iterator whose ``aclose`` releases
    the admitted requests, read or not (an async generator never started runs no ``finally``). ``wrap``:
    a route's own pass over the parts (the Responses API stores the answer before its last part)."""

    def __init__(self, generations: list[Generation], encoder: AnswerEncoder,
                 wrap: Callable[[AsyncGenerator[Part, None]], AsyncGenerator[Part, None]] | None = None):
        self._generations = generations
        parts = _encoded_parts(generations, encoder)
        self._parts = wrap(parts) if wrap is not None else parts

    def __aiter__(self) -> "EncodedParts":
        return self

    async def __anext__(self) -> Part:
        return await self._parts.__anext__()

    async def aclose(self) -> None:
        try:
            await self._parts.aclose()
        finally:
            for generation in self._generations:
                generation.release()


# What a streamed answer is read from: an admitted request's parts, or a route's own stream of parts (a
# background response's event log, read again); closing either is what ends it.
Parts = EncodedParts | AsyncGenerator[Part, None]


def encoded_parts(generations: list[Generation], encoder: AnswerEncoder,
                  wrap: Callable[[AsyncGenerator[Part, None]], AsyncGenerator[Part, None]] | None = None
                  ) -> EncodedParts:
    """The parts of the admitted ``generations`` (one, or a call's several prompts) through ``encoder``."""
    return EncodedParts(generations, encoder, wrap)


async def _encoded_parts(generations: list[Generation], encoder: AnswerEncoder) -> AsyncGenerator[Part, None]:
    started = False
    kind = encoder.content_type
    async with aclosing(batch_events(generations)) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                chunk = encoder.delta(event.text, event.index, event.logprobs, num_tokens=event.num_tokens)
            elif isinstance(event, ChoiceFinished):
                chunk = encoder.choice_finish(event.index, event.reason, event.num_generated_tokens,
                                              stop_sequence=event.stop_sequence)
            elif event.error is None:
                assert event.reason is not None  # a Finished without an error has its reason
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


async def batch_events(generations: list[Generation]) -> AsyncGenerator[Event, None]:
    """The events of a call's admitted requests as one answer's. One request: its own events. Several (a
    completions call with a list of prompts): they run at once, prompt ``p``'s choice ``i`` becomes choice
    ``p * n + i``, and one ``Finished`` ends the answer: the first prompt's reason with every prompt's token
    counts, or the first error, which closes the other prompts' generations and so frees their KV blocks."""
    if len(generations) == 1:
        async with aclosing(generations[0].events()) as events:
            async for event in events:
                yield event
        return
    n = generations[0].params.n
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue(maxsize=BATCH_QUEUE_EVENTS)

    async def run(p: int, generation: Generation) -> None:
        async with aclosing(generation.events()) as events:
            async for event in events:
                await queue.put((p, event))

    tasks = [asyncio.create_task(run(p, generation)) for p, generation in enumerate(generations)]
    try:
        ends: dict[int, Finished] = {}
        while len(ends) < len(generations):
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
    """The next queued event; a task that failed without one (a bug: ``Generation.events`` ends every request
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
