"""The OpenAI generation routes: ``POST v1/chat/completions`` and ``POST v1/completions``
(``llm_api.api.openai``: the body becomes a ``GenerateRequest`` and the ``OpenAICall`` that encodes
the answer, SSE when streamed)."""

from __future__ import annotations

from llm_api.service.answer import encoded_parts, parse_openai
from llm_api.service.routes.route import Answer, Call, RouteContext, Streamed


async def _call(kind: str, ctx: RouteContext, call: Call) -> Answer:
    service = ctx.serving()
    requests, encoder = await parse_openai(service, kind, call.json_body())
    encoder.marker = ctx.marker
    return Streamed(encoded_parts(service, requests, encoder, call.request_id, owner=call.owner), encoder)


async def chat(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    return await _call("chat", ctx, call)


async def completions(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    return await _call("completions", ctx, call)
