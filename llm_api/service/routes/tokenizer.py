"""vLLM's tokenizer routes: ``POST tokenize`` (a prompt or chat -> the ids ``generate`` would use) and
``POST detokenize`` (ids -> text), bodies parsed off the event loop when large (``llm_api.api.tokenize``)."""

from __future__ import annotations

from llm_api.api.tokenize import detokenize_answer, tokenize_answer
from llm_api.service.answer import parse_detokenize_call, parse_tokenize_call
from llm_api.service.routes.route import Answer, Call, RouteContext, Whole


async def tokenize(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.serving()
    token_ids = await service.tokenize(await parse_tokenize_call(service, call.json_body()))
    return Whole(200, tokenize_answer(token_ids, service.max_model_len))


async def detokenize(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.serving()
    token_ids = await parse_detokenize_call(service, call.json_body())
    return Whole(200, detokenize_answer(await service.detokenize(token_ids)))
