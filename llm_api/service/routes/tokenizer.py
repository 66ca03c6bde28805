"""vLLM's tokenizer routes: ``POST tokenize`` (a prompt or chat -> the ids ``generate`` would use),
``POST detokenize`` (ids -> text), bodies parsed off the event loop when large, and ``GET tokenizer_info``
(``llm_api.api.tokenize``)."""

from __future__ import annotations

from llm_api.api.tokenize import detokenize_answer, tokenize_answer, tokenizer_info_answer
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


async def tokenizer_info(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.loaded()
    return Whole(200, tokenizer_info_answer(service.lm.tokenizer, service.max_model_len))
