"""The bfloat16 paths, run on purpose on every host (README, "Testing").

DTYPE unset is bfloat16 only on CPUs with bfloat16 instructions, and the suite's shared servers pin
float32 (their tests compare greedy tokens exactly), so without this module the bfloat16 engine would be
covered only on the hosts that happen to default to it. Here the embedded model is loaded with
DTYPE=bfloat16 whatever the host (slower on a CPU without the instructions, still correct), and every
assertion holds in bfloat16:

* engine greedy == generate() greedy up to a near-tie: where the two first part, both tokens' logits
  under the reference (on the shared prefix) lie within a few bfloat16 ulps of each other; a wrong KV
  block, mask or position gives gaps of whole units instead;
* the service with every sampling feature at once (n > 1, seeds, penalties, logit_bias, logprobs, stop
  strings, a JSON schema, greedy and sampled rows in one batch): each choice ends, logprobs are
  log-probabilities of the returned tokens with a greedy token among the most likely ones (equal logprobs
  may order either way), the schema's answer validates, and every KV block is free afterwards.
"""

from __future__ import annotations

import asyncio
import json
import math

import jsonschema
import pytest
import torch

from llm_api.model.packed_linear import pack_linear_weights

from engine_helpers import EMBEDDED_CHATS, embedded_models, reference_greedy, run_embedded_chats

MAX_NEW_TOKENS = 32
NEAR_TIE_ULPS = 4
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


def bf16_ulp(value: float) -> float:
    """The spacing of bfloat16 numbers at ``value`` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(value), 1e-30))) - 7)


@pytest.fixture(scope="module")
def bf16_models(embedded_checkpoint_path):
    return embedded_models(embedded_checkpoint_path, torch.bfloat16)


def first_difference(got: list[int], expected: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)


def test_engine_greedy_matches_generate_up_to_a_near_tie(bf16_models):
    assert_greedy_matches_generate_up_to_a_near_tie(*bf16_models)


def test_packed_weights_engine_matches_generate_up_to_a_near_tie(embedded_checkpoint_path):
    """CPU_PACKED_WEIGHTS (on by default for bfloat16): the engine on oneDNN-packed weights against generate()
    on plain ones. Batched bfloat16 products sum in another order packed, so greedy tokens may part at a
    near-tie, never elsewhere. Skipped where this CPU cannot pack bfloat16: nothing is swapped, and the plain case
    is the test above (it ran twice there, ~30 s of the suite on the AVX2 host)."""
    tokenizer, model, reference_model = embedded_models(embedded_checkpoint_path, torch.bfloat16)
    if pack_linear_weights(model) == 0:
        pytest.skip("this CPU cannot pack bfloat16 weights (no avx512_bf16 / AMX): nothing is swapped, the plain "
                    "case is test_engine_greedy_matches_generate_up_to_a_near_tie")
    assert_greedy_matches_generate_up_to_a_near_tie(tokenizer, model, reference_model)


def assert_greedy_matches_generate_up_to_a_near_tie(tokenizer, model, reference_model):
    prompts, answers = run_embedded_chats(tokenizer, model, MAX_NEW_TOKENS)
    parted = 0
    for text, prompt, got in zip(EMBEDDED_CHATS, prompts, answers):
        with torch.inference_mode():
            expected = reference_greedy(reference_model, prompt, MAX_NEW_TOKENS, tokenizer.eos_token_id)
            at = first_difference(got, expected)
            if at is None:
                assert got == expected, (text, tokenizer.decode(got), tokenizer.decode(expected))
                continue
            parted += 1
            logits = reference_model(torch.tensor([prompt + expected[:at]])).logits[0, -1].float()
        mine, theirs = logits[got[at]].item(), logits[expected[at]].item()
        tolerance = NEAR_TIE_ULPS * bf16_ulp(logits.max().item())
        assert abs(mine - theirs) <= tolerance, (
            f"{text!r}: the engine took token {got[at]} (logit {mine:.3f}) where generate() took {expected[at]} "
            f"(logit {theirs:.3f}) after {at} equal tokens: not a near-tie (tolerance {tolerance:.3f})")
    assert parted < len(prompts), "every answer parted from generate(): not a tie, a difference"


def test_every_sampling_feature_at_once_in_bf16(embedded_checkpoint_path):
    from llm_api.protocols.native.translate import parse_request
    from llm_api.model import loader
    from llm_api.model.settings import Settings
    from llm_api.service.events import ChoiceFinished, Finished, TextDelta
    from llm_api.service.service import ModelService

    settings = Settings.from_env({"MODEL_PATH": str(embedded_checkpoint_path), "DTYPE": "bfloat16",
                                  "KV_CACHE_MEMORY_MIB": "32"})
    lm = loader.load(settings)
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    service = ModelService(settings, lm)
    chat = [{"role": "user", "content": "Name three colours."}]
    rows = {
        "greedy-logprobs": {"messages": chat, "max_new_tokens": 20, "logprobs": 5, "output": "jsonl"},
        "sampled-n": {"messages": chat, "max_new_tokens": 20, "n": 3, "temperature": 0.9, "top_p": 0.95, "seed": 7,
                      "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"28": -100},
                      "logprobs": 3, "output": "jsonl"},
        "schema": {"messages": [{"role": "user", "content": "A person as JSON."}], "max_new_tokens": 40,
                   "json_schema": PERSON},
        "stop": {"text": "1, 2, 3, 4, 5,", "max_new_tokens": 24, "stop": [" 8"]},
    }

    async def one(request_id, row):
        request = parse_request(row, service.limits)
        return [e async for e in service.generate(request, request_id)]

    async def together():
        return dict(zip(rows, await asyncio.gather(*(one(i, row) for i, row in rows.items()))))

    try:
        events = asyncio.run(together())
        usage = service.loop.stats
    finally:
        service.shutdown()

    for name, evs in events.items():
        assert isinstance(evs[-1], Finished) and evs[-1].error is None, (name, evs[-1])
    assert usage.num_free_blocks == usage.num_total_blocks, "KV blocks leaked"

    def texts(evs):
        out: dict[int, str] = {}
        for e in evs:
            if isinstance(e, TextDelta):
                out[e.index] = out.get(e.index, "") + e.text
        return out

    for name, num_top, is_greedy in (("greedy-logprobs", 5, True), ("sampled-n", 3, False)):
        deltas = [e for e in events[name] if isinstance(e, TextDelta)]
        for e in deltas:
            for item in e.logprobs:
                top = [lp for _, lp in item.top]
                assert len(top) == num_top and item.logprob <= 0 and top == sorted(top, reverse=True)
                assert sum(math.exp(v) for v in top) <= 1 + 1e-3 and item.logprob <= top[0] + 1e-4
                assert item.token.token_id != 28 or name != "sampled-n", "logit_bias -100 was not applied"
                if is_greedy:  # a most likely token: equal logprobs may order either way
                    assert item.logprob == pytest.approx(top[0], abs=1e-4)
                    assert item.token.token_id in {t.token_id for t, lp in item.top
                                                   if lp == pytest.approx(top[0], abs=1e-4)}
        for index, text in texts(events[name]).items():
            released = b"".join(item.token.bytes for e in deltas if e.index == index for item in e.logprobs)
            assert released.decode(errors="ignore") == text

    finished = {e.index for e in events["sampled-n"] if isinstance(e, ChoiceFinished)}
    assert finished == {0, 1, 2} and len(set(texts(events["sampled-n"]).values())) > 1
    jsonschema.validate(json.loads(texts(events["schema"])[0]), PERSON)
    stopped = texts(events["stop"])[0]
    assert " 8" not in stopped and stopped.startswith(" 6, 7,"), stopped
