"""The chat route: ``POST v1/chat/completions`` (``translate``: the body becomes a ``GenerateRequest`` and the
``OpenAICall`` that encodes the answer, SSE when streamed; parsed off the event loop when large)."""

from __future__ import annotations

from llm_api.protocols.chat.translate import parse_chat
from llm_api.protocols.route import Answer, Call, RouteContext, Streamed
from llm_api.service.answer import admit, encoded_parts, parse_large


async def chat(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.serving()
    request, encoder = await parse_large(service, parse_chat, call.json_body(), service.model_names, service.limits,
                                         service.adapter_names(), ctx.marker)
    generations = await admit(service, request, call.request_id, owner=call.owner, tenant=call.tenant)
    return Streamed(encoded_parts(generations, encoder), encoder)
