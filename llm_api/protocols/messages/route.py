"""Anthropic's routes: ``POST v1/messages`` (``translate``: the body becomes a ``GenerateRequest`` and the
``MessagesCall`` that encodes the answer, SSE when streamed) and ``POST v1/messages/count_tokens`` (the
prompt's tokens as ``v1/messages`` would render it). Bodies are parsed off the event loop when large."""

from __future__ import annotations

import json

from llm_api.protocols.messages.translate import parse_count_tokens, parse_messages
from llm_api.protocols.route import Answer, Call, RouteContext, Streamed, Whole
from llm_api.service.answer import admit, encoded_parts, parse_large


async def messages(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.serving()
    request, encoder = await parse_large(service, parse_messages, call.json_body(), service.model_names,
                                         service.limits, service.adapter_names(), ctx.marker)
    generations = await admit(service, request, call.request_id, owner=call.owner, tenant=call.tenant)
    encoder.num_prompt_tokens = generations[0].num_prompt_tokens
    return Streamed(encoded_parts(generations, encoder), encoder)


async def count_tokens(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.loaded()
    request = await parse_large(service, parse_count_tokens, call.json_body(), service.model_names, service.limits,
                                service.adapter_names())
    return Whole(200, json.dumps({"input_tokens": await service.inputs.count_prompt_tokens(request)}))
