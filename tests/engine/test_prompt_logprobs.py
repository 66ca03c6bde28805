"""Prompt logprobs (``SamplingParams.prompt_logprobs``, what /v1/completions' ``echo`` serves): each prompt
token's logprob equals a full forward pass of the model over the prompt, whatever the engine does around it
(chunked prefill over several steps, a cached prefix of the same prompt, other requests in the batch, a
preemption, n > 1 choices)."""

from __future__ import annotations

import math

import torch

from engine_helpers import get_model, greedy, make_engine, random_prompt


@torch.inference_mode()
def forward_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the reference model's logits over the whole prompt: row i scores token i + 1."""
    logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def run_collecting(engine, requests, max_steps=10_000):
    """requests: [(request id, prompt, params)] added before step 0 -> request id -> {index: prompt logprobs}."""
    found: dict[str, dict[int, tuple]] = {rid: {} for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.prompt_logprobs is not None:
                assert output.index not in found[output.request_id], "prompt logprobs reported twice"
                found[output.request_id][output.index] = output.prompt_logprobs
    return found


def assert_matches(entries, prompt, reference, k):
    assert len(entries) == len(prompt) - 1
    for i, entry in enumerate(entries):
        assert entry.token_id == prompt[i + 1]
        assert math.isclose(entry.logprob, reference[i, prompt[i + 1]].item(), abs_tol=1e-4)
        assert len(entry.top) == k
        top_ids = [t for t, _ in entry.top]
        values, _ = reference[i].topk(k)
        # Tie-aware: the values must be the reference's k largest, and each id must have its value.
        for (token_id, value), expected in zip(entry.top, values.tolist()):
            assert math.isclose(value, expected, abs_tol=1e-4)
            assert math.isclose(reference[i, token_id].item(), value, abs_tol=1e-4)
        assert len(set(top_ids)) == k


def test_prompt_logprobs_equal_a_full_forward_pass(tiny_models):
    model, reference_model = get_model(tiny_models, "llama")
    generator = torch.Generator().manual_seed(21)
    long_prompt = random_prompt(generator, 45)
    short_prompt = random_prompt(generator, 7)
    # A budget of 16 tokens a step: the long prompt is prefilled in chunks, beside the short one.
    engine = make_engine(model, max_num_batched_tokens=16)
    plain = run_collecting(engine, [("plain", long_prompt, greedy(3))])
    assert plain["plain"] == {}, "a request that did not ask gets no prompt logprobs"
    # The same prompt again: its blocks are cached, yet every position is computed for the logprobs.
    found = run_collecting(engine, [("long", long_prompt, greedy(3, prompt_logprobs=2)),
                                    ("short", short_prompt, greedy(3, prompt_logprobs=0)),
                                    ("n3", short_prompt, greedy(2, prompt_logprobs=1, n=3))])
    assert_matches(found["long"][0], long_prompt, forward_logprobs(reference_model, long_prompt), 2)
    assert_matches(found["short"][0], short_prompt, forward_logprobs(reference_model, short_prompt), 0)
    assert set(found["n3"]) == {0, 1, 2}
    for index in range(3):
        assert_matches(found["n3"][index], short_prompt, forward_logprobs(reference_model, short_prompt), 1)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_prompt_logprobs_survive_preemption(tiny_models):
    """A pool too small for all of them at once: requests are preempted and recomputed; each still reports
    its prompt logprobs once, equal to the forward pass."""
    model, reference_model = get_model(tiny_models, "llama")
    generator = torch.Generator().manual_seed(22)
    prompts = [random_prompt(generator, 22) for _ in range(3)]
    engine = make_engine(model, num_blocks=20, max_num_batched_tokens=8)
    found = run_collecting(engine, [(str(i), p, greedy(20, prompt_logprobs=1)) for i, p in enumerate(prompts)])
    assert engine.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert_matches(found[str(i)][0], prompt, forward_logprobs(reference_model, prompt), 1)
