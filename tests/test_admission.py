"""Admission before the answer (llm_api.service.answer): a route admits its call's requests before it answers,
so a refusal is raised before anything is written, and the parts of an admitted answer release what was
admitted when they are closed, read or not.

In process, on the embedded model (float32) with a service that holds one live request at most
(MAX_NUM_SEQS=1, MAX_WAITING_REQUESTS=0):

* a second request is refused with 503 ``overloaded`` at admission, raised (not a part);
* several prompts of one call where a later prompt is refused: the ones admitted before it are released;
* parts closed before their first read release the admission (the next request is admitted), and parts
  read to the end leave the live table empty too;
* admission leaves the request as the route built it: the parameters the engine runs (a token ceiling cut to
  the KV room, the compiled grammar) are the generation's own;
* a key's priority grant (LLM_API_KEY's ``priority=N``) reaches the scheduler keyed by that key's owner;
* the longest request admission lets through (prompt + max_new_tokens = the engine's max_model_len) runs, one
  token more is refused at admission (tests/test_admission_limits.py: each limit on its own).
"""

from __future__ import annotations

import asyncio

import pytest

from llm_api.engine.request import FinishReason
from llm_api.engine.sampling_params import SamplingParams
from llm_api.errors import ApiError
from llm_api.model.settings import Settings
from llm_api.protocols.native.route import native_encoder
from llm_api.service.answer import Final, admit, encoded_parts
from llm_api.service.events import Finished
from llm_api.service.request import GenerateRequest
from llm_api.service.service import ModelService


@pytest.fixture
def one_at_a_time(embedded_lm_fp32, embedded_model_path):
    settings = Settings.from_env({"MODEL_PATH": str(embedded_model_path), "DTYPE": "float32",
                                  "KV_CACHE_MEMORY_MIB": "16", "MAX_NUM_SEQS": "1", "MAX_WAITING_REQUESTS": "0",
                                  "MAX_NUM_BATCHED_TOKENS": "64"})
    service = ModelService(settings, embedded_lm_fp32)
    yield service
    service.shutdown()


def request(text: str = "Once upon a time") -> GenerateRequest:
    return GenerateRequest(text=text, params=SamplingParams(max_new_tokens=4))


def test_a_refusal_is_raised_at_admission_and_closing_unread_parts_releases(one_at_a_time):
    service = one_at_a_time

    async def run():
        first = await admit(service, request(), "a")
        assert service.num_live_requests == 1
        with pytest.raises(ApiError) as refused:
            await admit(service, request(), "b")
        assert refused.value.status == 503 and refused.value.code == "overloaded"
        parts = encoded_parts(first, native_encoder(request(), "<|endoftext|>"))
        await parts.aclose()  # (an edge whose client left before the answer began)
        assert service.num_live_requests == 0
        again = await admit(service, request(), "c")
        parts = encoded_parts(again, native_encoder(request(), "<|endoftext|>"))
        read = [part async for part in parts]
        await parts.aclose()
        assert isinstance(read[-1], Final) and service.num_live_requests == 0

    asyncio.run(run())


def test_a_refused_prompt_releases_the_prompts_admitted_before_it(one_at_a_time):
    service = one_at_a_time

    async def run():
        with pytest.raises(ApiError) as refused:
            await admit(service, [request("One"), request("Two")], "batch")
        assert refused.value.status == 503
        assert service.num_live_requests == 0
        assert len(await admit(service, request(), "next")) == 1  # (the first prompt's share is back)

    asyncio.run(run())


def test_admission_leaves_the_request_as_the_route_built_it(one_at_a_time):
    """What the engine runs (a ceiling cut to the KV room, a compiled grammar) is the admitted generation's
    own parameters; the request object is not changed by admission (so a route may read it afterwards)."""
    import copy

    from llm_api.service.constraints import json_object_constraint

    service = one_at_a_time
    built = GenerateRequest(text="Once upon a time", params=SamplingParams(max_new_tokens=100_000),
                            max_tokens_fits=True, constraint=json_object_constraint("response_format"))
    before = copy.deepcopy(built)

    async def admitted():
        generation = await service.admit(built, "fits", "")
        generation.release()
        return generation

    generation = asyncio.run(admitted())
    assert built == before
    room = service.max_model_len - generation.num_prompt_tokens
    assert generation.params.max_new_tokens == room < built.params.max_new_tokens
    assert generation.params.grammar is not None and built.params.grammar is None


def test_a_keys_priority_grant_reaches_the_scheduler_by_owner(embedded_lm_fp32, embedded_model_path):
    """LLM_API_KEY's ``priority=N`` reaches the engine's scheduler keyed by the owner the edge names for a
    request with that key (llm_api.service.owners), and by nothing else (tests/engine/test_fair_share.py: what
    the scheduler does with it)."""
    from llm_api.server.auth import BearerAuth

    keys = "plain-key-0123, granted-key-4567 priority=-5"
    settings = Settings.from_env({"MODEL_PATH": str(embedded_model_path), "DTYPE": "float32", "LLM_API_KEY": keys,
                                  "KV_CACHE_MEMORY_MIB": "16", "MAX_NUM_BATCHED_TOKENS": "64"})
    service = ModelService(settings, embedded_lm_fp32)
    try:
        assert service.engine is not None
        owner = BearerAuth(settings.api_key).owner("Bearer granted-key-4567")
        assert dict(service.engine.scheduler.config.priority_grants) == {owner: -5}
    finally:
        service.shutdown()


def test_what_admission_lets_through_the_engine_takes(one_at_a_time):
    """The KV room admission holds a request to is the engine's own ``max_model_len`` (llm_api.service.admission):
    the longest request admitted (prompt + max_new_tokens = max_model_len) runs to its length in the engine, and
    one token more is a 400 at admission, before anything runs: the engine's own check never decides it."""
    service = one_at_a_time
    assert service.engine is not None and service.admission.kv_max_model_len == service.engine.max_model_len
    limit = service.engine.max_model_len
    hello = service.lm.tokenizer.encode("hello")[0]

    def longest(extra: int) -> GenerateRequest:
        return GenerateRequest(token_ids=[hello] * (limit - 2 + extra), params=SamplingParams(max_new_tokens=2,
                                                                                               ignore_eos=True))

    async def run():
        with pytest.raises(ApiError) as refused:
            await service.admit(longest(1), "over")
        assert refused.value.status == 400 and refused.value.code == "prompt_too_long"
        events = [event async for event in service.generate(longest(0), "longest")]
        return events[-1]

    end = asyncio.run(run())
    assert isinstance(end, Finished) and end.error is None, end
    assert end.reason == FinishReason.LENGTH and (end.num_prompt_tokens, end.num_generated_tokens) == (limit - 2, 2)
