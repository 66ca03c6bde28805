"""OpenAI's ``POST v1/embeddings`` (``translate`` has the contract): the inputs admitted in waves of at most
MAX_NUM_SEQS (a list of 2,048 inputs never takes more of the server's request slots than a batch can run),
each wave's prefills run together in the engine, their pooled states gathered in input order. The inputs'
work is summed against MAX_REQUEST_WORK as a completion's prompt list is; the first failure ends the call
(what was admitted with it released)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from llm_api.errors import ApiError, internal_error
from llm_api.protocols.embeddings.translate import embeddings_answer, parse_embeddings
from llm_api.protocols.route import Answer, Call, RouteContext, Whole
from llm_api.service.answer import admit, parse_large
from llm_api.service.events import Finished

if TYPE_CHECKING:  # (annotations only: the route table loads without the engine and torch)
    from llm_api.service.service import Generation


async def embeddings(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.serving()
    parsed = await parse_large(service, parse_embeddings, call.json_body(), service.model_names, service.limits,
                               tuple(service.adapter_names()))
    wave = max(1, service.limits.max_n)
    works: list[int] = []
    vectors: list[Any] = []
    num_prompt_tokens = 0
    for start in range(0, len(parsed.requests), wave):
        part = parsed.requests[start : start + wave]
        generations = await admit(service, part, f"{call.request_id}.{start // wave}", ctx.marker, call.owner,
                                  call.tenant)
        works += [g.work for g in generations]
        try:
            service.admission.prompt_list(works, len(parsed.requests), "input")
        except ApiError:
            for generation in generations:
                generation.release()
            raise
        ends = await asyncio.gather(*(_end(g) for g in generations))
        for end in ends:
            if end.error is not None:
                raise end.error
            if end.embedding is None:
                raise internal_error("the engine returned no pooled state")
            vectors.append(end.embedding)
            num_prompt_tokens += end.num_prompt_tokens
    # (2,048 vectors of 576 values are ~25 MB of JSON: written on the worker pool, the event loop serves on)
    return Whole(200, await service.inputs.offload(embeddings_answer, parsed, vectors, num_prompt_tokens))


async def _end(generation: Generation) -> Finished:
    """The request's last event (its text deltas, the one sampled token's, are not the answer)."""
    async with aclosing(generation.events()) as events:
        async for event in events:
            if isinstance(event, Finished):
                return event
    raise RuntimeError("the request ended without a final event")
