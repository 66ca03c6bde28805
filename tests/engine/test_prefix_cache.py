"""Prefix caching: a second request sharing a long system prompt reuses its cached blocks (fewer prefill
tokens computed) and still produces generate()'s tokens."""

from __future__ import annotations

import torch

from engine_helpers import get_model, greedy, make_engine, random_prompt, reference_greedy, run_engine


def test_shared_system_prompt_is_computed_once(tiny_models):
    model, reference_model = get_model(tiny_models, "qwen3")
    generator = torch.Generator().manual_seed(11)
    system_prompt = random_prompt(generator, 61)  # 15 full blocks of 4, and one token more
    first = system_prompt + random_prompt(generator, 5)
    second = system_prompt + random_prompt(generator, 9)
    engine = make_engine(model)

    run_engine(engine, {0: [("first", first, greedy(8))]})
    computed_before = engine.stats().num_prefill_tokens_computed
    assert computed_before == len(first)
    results = run_engine(engine, {0: [("second", second, greedy(8))]})
    stats = engine.stats()

    num_computed = stats.num_prefill_tokens_computed - computed_before
    assert num_computed == len(second) - 60, "the 15 full system-prompt blocks should be reused"
    assert stats.prefix_cache_hits == 60
    assert stats.prefix_cache_queries == len(first) + len(second)
    assert results["second"][0] == reference_greedy(reference_model, second, 8)


def test_identical_prompts_in_one_batch_and_after_preemption(tiny_models):
    """Same prompt several times with a tiny pool: shared blocks, preemption and re-admission from the
    cache all at once; every copy must still match generate()."""
    model, reference_model = get_model(tiny_models, "llama")
    generator = torch.Generator().manual_seed(12)
    prompt = random_prompt(generator, 22)
    arrivals = {0: [("a", prompt, greedy(20))], 1: [("b", prompt, greedy(20))], 3: [("c", prompt, greedy(20))]}
    engine = make_engine(model, num_blocks=20)
    results = run_engine(engine, arrivals)
    expected = reference_greedy(reference_model, prompt, 20)
    assert all(results[r][0] == expected for r in "abc")
    assert engine.stats().prefix_cache_hits > 0 and engine.stats().num_preemptions > 0
