"""Pooled prompt states (``SamplingParams.pooling``, what /v1/embeddings serves): a request's embedding equals
the decoder's last hidden state over the whole prompt, pooled (mean, or the last token's), whatever the engine
does around it (chunked prefill over several steps, a cached prefix of the same prompt, other requests in the
batch, a preemption)."""

from __future__ import annotations

import torch

from engine_helpers import get_model, greedy, make_engine, random_prompt


@torch.inference_mode()
def reference_pooled(model, prompt: list[int], pooling: str) -> torch.Tensor:
    hidden = model.get_decoder()(input_ids=torch.tensor([prompt])).last_hidden_state[0].float()
    return hidden.mean(dim=0) if pooling == "mean" else hidden[-1]


def run_collecting(engine, requests, max_steps=10_000):
    """requests: [(request id, prompt, params)] added before step 0 -> request id -> its embedding."""
    found: dict[str, torch.Tensor] = {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.embedding is not None:
                assert output.request_id not in found, "embedding reported twice"
                found[output.request_id] = output.embedding
    return found


def test_pooled_states_equal_a_full_forward_pass(tiny_models):
    model, reference_model = get_model(tiny_models, "llama")
    generator = torch.Generator().manual_seed(31)
    long_prompt = random_prompt(generator, 45)
    short_prompt = random_prompt(generator, 7)
    # A budget of 16 tokens a step: the long prompt is prefilled in chunks, beside the others.
    engine = make_engine(model, max_num_batched_tokens=16)
    plain = run_collecting(engine, [("plain", long_prompt, greedy(3))])
    assert plain == {}, "a request that did not ask gets no embedding"
    # The same prompt again: its blocks are cached, yet every position is computed for the pooling.
    found = run_collecting(engine, [("mean", long_prompt, greedy(1, pooling="mean")),
                                    ("last", long_prompt, greedy(1, pooling="last")),
                                    ("short", short_prompt, greedy(1, pooling="mean")),
                                    ("decoding", short_prompt, greedy(6))])
    for rid, prompt, pooling in (("mean", long_prompt, "mean"), ("last", long_prompt, "last"),
                                 ("short", short_prompt, "mean")):
        expected = reference_pooled(reference_model, prompt, pooling)
        assert found[rid].shape == expected.shape and torch.allclose(found[rid], expected, atol=1e-4), rid
    assert set(found) == {"mean", "last", "short"}
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_pooled_states_survive_preemption(tiny_models):
    """A pool too small for everything at once: sequences are preempted and recomputed; each pooling request
    still reports its embedding once, equal to the forward pass."""
    model, reference_model = get_model(tiny_models, "llama")
    generator = torch.Generator().manual_seed(32)
    prompts = [random_prompt(generator, 22) for _ in range(4)]
    engine = make_engine(model, num_blocks=20, max_num_batched_tokens=8)
    requests = [(f"gen{i}", p, greedy(20)) for i, p in enumerate(prompts[:2])]
    requests += [(f"pool{i}", p, greedy(1, pooling="mean")) for i, p in enumerate(prompts[2:])]
    found = run_collecting(engine, requests)
    assert engine.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts[2:]):
        assert torch.allclose(found[f"pool{i}"], reference_pooled(reference_model, prompt, "mean"), atol=1e-4)
