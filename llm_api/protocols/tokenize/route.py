"""vLLM's tokenizer routes: ``POST tokenize`` (a prompt or chat -> the ids ``generate`` would use),
``POST detokenize`` (ids -> text), bodies parsed off the event loop when large, and ``GET tokenizer_info``
(``translate``, ``encoder``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llm_api.protocols.route import Answer, Call, RouteContext, Whole
from llm_api.protocols.tokenize.encoder import detokenize_answer, tokenize_answer, tokenizer_info_answer
from llm_api.protocols.tokenize.translate import parse_detokenize, parse_tokenize
from llm_api.service.answer import parse_large
from llm_api.service.request import TokenizeRequest

if TYPE_CHECKING:  # (annotations only: the route table loads without the engine and torch)
    from llm_api.service.service import ModelService


async def parse_tokenize_call(service: ModelService, body: bytes | bytearray) -> TokenizeRequest:
    return await parse_large(service, parse_tokenize, body, service.model_names)


async def parse_detokenize_call(service: ModelService, body: bytes | bytearray) -> list[int]:
    """The ids of a /detokenize body, at most MAX_MODEL_LEN of them (a body of a million ids is parsed off
    the event loop)."""
    return await parse_large(service, parse_detokenize, body, service.model_names, service.vocab_size,
                             service.max_model_len)


async def tokenize(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.serving()
    token_ids = await service.inputs.tokenize(await parse_tokenize_call(service, call.json_body()))
    return Whole(200, tokenize_answer(token_ids, service.max_model_len))


async def detokenize(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.serving()
    token_ids = await parse_detokenize_call(service, call.json_body())
    return Whole(200, detokenize_answer(await service.inputs.detokenize(token_ids)))


async def tokenizer_info(ctx: RouteContext, call: Call, params: dict[str, str]) -> Answer:
    service = ctx.loaded()
    return Whole(200, tokenizer_info_answer(service.lm.tokenizer, service.max_model_len))
