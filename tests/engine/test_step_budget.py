"""The per-step token budget sized to a CPU (MAX_NUM_BATCHED_TOKENS=0): measured at engine start, a
multiple of the block size, never below max_num_seqs, and the engine it sizes still matches generate()."""

from __future__ import annotations

import torch

from engine_helpers import assert_engine_idle, get_model, greedy, make_engine, random_prompt, reference_greedy
from llm_api.engine.step_budget import MAX_TOKEN_BUDGET


def test_budget_is_measured_on_cpu_and_bounded(tiny_models, caplog):
    model, reference_model = get_model(tiny_models, "llama")
    with caplog.at_level("INFO", logger="llm_api.engine.step_budget"):
        engine = make_engine(model, max_num_batched_tokens=None, max_num_seqs=8)
    budget = engine.config.max_num_batched_tokens
    assert budget % 4 == 0 and 8 <= budget <= MAX_TOKEN_BUDGET
    assert engine.scheduler.config.max_num_batched_tokens == budget
    assert any("token budget per step" in r.getMessage() for r in caplog.records)
    assert engine.runner.block_tables is not None and len(engine.runner.block_tables) == 0  # the probe left nothing
    prompt = random_prompt(torch.Generator().manual_seed(4), 30)
    engine.add_request("r", prompt, greedy(12))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == reference_greedy(reference_model, prompt, 12)
    assert_engine_idle(engine)
