"""The per-step token budget sized to a CPU (MAX_NUM_BATCHED_TOKENS=0): measured at engine start, a
multiple of the block size, never below max_num_seqs, robust to noisy timings, and the engine it sizes still
matches generate()."""

from __future__ import annotations

import torch

from engine_helpers import assert_engine_idle, get_model, greedy, make_engine, random_prompt, reference_greedy
from llm_api.engine.step_budget import MAX_TOKEN_BUDGET, budget_from_timings


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


def test_budget_from_timings_fits_the_step_target():
    # 3 ms per token and 100 ms per step: (0.4 - 0.1) / 0.003 = 100 tokens = 6 blocks, rounded down to a
    # power of two blocks: 4 blocks.
    budget, per_token, fixed = budget_from_timings(16, 0.148, 80, 0.340, block_size=16, max_num_seqs=8)
    assert budget == 64 and abs(per_token - 0.003) < 1e-9 and abs(fixed - 0.1) < 1e-9
    assert budget_from_timings(16, 0.148, 80, 0.340, block_size=16, max_num_seqs=128)[0] == 128  # never below
    # A step whose fixed cost alone exceeds the target: one block (then max_num_seqs).
    assert budget_from_timings(16, 0.5, 80, 0.564, block_size=16, max_num_seqs=8)[0] == 16
    # Tokens so cheap the target would fit more than the cap.
    assert budget_from_timings(16, 0.0016, 80, 0.0080, block_size=16, max_num_seqs=8)[0] == MAX_TOKEN_BUDGET


def test_noise_that_swamps_the_difference_errs_toward_short_steps():
    # The small chunk was slowed by contention past the large one: the difference is no cost estimate
    # (read as one, tokens would look free and the budget would be the cap, steps of seconds).
    budget, per_token, fixed = budget_from_timings(16, 0.30, 80, 0.25, block_size=16, max_num_seqs=8)
    assert per_token == 0.25 / 80 and fixed == 0.0
    assert budget == 128  # 0.4 s / 3.125 ms per token = 128 tokens = 8 blocks, a power of two


def test_timings_a_third_apart_give_the_same_budget_or_the_next_one_down():
    """A busy host slows the probe: the budget may halve, never less, and quiet starts agree exactly."""
    quiet = budget_from_timings(16, 0.040, 80, 0.088, block_size=16, max_num_seqs=8)[0]
    for slowdown in (1.0, 1.1, 1.2, 1.33):
        busy = budget_from_timings(16, 0.040 * slowdown, 80, 0.088 * slowdown, block_size=16, max_num_seqs=8)[0]
        assert busy in (quiet, quiet // 2), (slowdown, busy, quiet)
        assert (busy // 16) & (busy // 16 - 1) == 0  # a power of two blocks
