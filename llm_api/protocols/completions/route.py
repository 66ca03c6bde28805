"""The completions route: ``POST v1/completions`` (``llm_api.api.openai``: the body becomes one
``GenerateRequest`` per prompt and the ``OpenAICall`` that encodes the answer, SSE when streamed)."""

from __future__ import annotations

from llm_api.protocols.chat.route import openai_call
from llm_api.protocols.route import Answer, Call, RouteContext


async def completions(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    return await openai_call("completions", ctx, call)
