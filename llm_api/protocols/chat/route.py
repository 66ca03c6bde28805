"""The chat route: ``POST v1/chat/completions`` (``llm_api.api.openai``: the body becomes a ``GenerateRequest``
and the ``OpenAICall`` that encodes the answer, SSE when streamed)."""

from __future__ import annotations

from llm_api.api import openai
from llm_api.api.request import GenerateRequest
from llm_api.protocols.route import Answer, Call, RouteContext, Streamed
from llm_api.service.answer import encoded_parts, parse_sized
from llm_api.service.service import ModelService


async def parse_openai(service: ModelService, api: str, body: bytes | bytearray
                       ) -> tuple[list[GenerateRequest], openai.OpenAICall]:
    """A chat or completions body -> its requests and encoder (off the event loop when large)."""
    return await parse_sized(service, len(body), openai.parse_calls, api, body, service.model_name, service.limits,
                             service.adapter_names())


async def openai_call(kind: str, ctx: RouteContext, call: Call) -> Answer:
    service = ctx.serving()
    requests, encoder = await parse_openai(service, kind, call.json_body())
    encoder.marker = ctx.marker
    return Streamed(encoded_parts(service, requests, encoder, call.request_id, owner=call.owner), encoder)


async def chat(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    return await openai_call("chat", ctx, call)
