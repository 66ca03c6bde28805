"""The batched sampler: greedy rows are argmax, seeded rows are reproducible whatever shares the batch."""

import math

import pytest
import torch

from llm_api.engine import sampler as sampler_module
from llm_api.engine.sampler import Sampler, SamplerBatch, SamplingState, sequence_seed
from llm_api.engine.sampling_params import SamplingParams


def run(logits, params, seen=None, states=None):
    states = states or [SamplingState.for_params(p) for p in params]
    return Sampler()(logits, SamplerBatch(params, states, seen or [None] * len(params))).token_ids.tolist()


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    assert run(logits, [SamplingParams()] * 3) == logits.argmax(-1).tolist()


def test_seeded_row_is_independent_of_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    p = SamplingParams(do_sample=True, temperature=1.0, seed=123)
    alone = [run(logits[2:3], [p])[0] for _ in range(3)]
    in_batch = run(logits, [SamplingParams(), SamplingParams(do_sample=True, seed=9), p, SamplingParams(do_sample=True)])[2]
    assert alone == [alone[0]] * 3 and in_batch == alone[0]


def test_top_k_one_and_tiny_top_p_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(2, 100)
    params = [SamplingParams(do_sample=True, top_k=1, seed=1), SamplingParams(do_sample=True, top_p=1e-6, seed=2)]
    assert run(logits, params) == logits.argmax(-1).tolist()


def test_top_k_limits_choices():
    logits = torch.arange(10, dtype=torch.float).repeat(1, 1)
    p = SamplingParams(do_sample=True, top_k=3, temperature=5.0)
    state = SamplingState.for_params(p)
    picks = {run(logits, [p], states=[state])[0] for _ in range(200)}
    assert picks <= {7, 8, 9} and len(picks) > 1


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(2)
    logits = torch.randn(1, 30)
    seen = [3, 5, 5, 7]
    expected = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([seen]), logits.clone()).argmax(-1).tolist()
    assert run(logits, [SamplingParams(repetition_penalty=1.5)], seen=[seen]) == expected


@pytest.mark.parametrize("params", [
    SamplingParams(do_sample=True, temperature=1.2e-296),
    SamplingParams(do_sample=True, top_p=5e-324),
    SamplingParams(do_sample=True, repetition_penalty=4.6e-197),
    SamplingParams(do_sample=True, repetition_penalty=100.0, temperature=1e-4),
], ids=["temperature", "top_p", "repetition_penalty", "both"])
def test_extreme_valid_parameters_still_pick_a_token(params):
    # Found by the schemathesis run: these used to give inf/NaN probabilities (a 500 for the request).
    logits = torch.randn(1, 64) * 30
    token = Sampler()(logits, SamplerBatch([params], [SamplingState.for_params(params)], [[1, 2, 3]]))
    assert 0 <= int(token.token_ids[0]) < 64


# ---------------------------------------------------------------------------------------------------
# logprobs, penalties, logit bias, per-choice seeds



def sample(logits, params, states=None, seen=None):
    states = states or [SamplingState.for_params(p) for p in params]
    return Sampler()(logits, SamplerBatch(params, states, seen or [None] * len(params)))


def test_logprobs_are_log_softmax_of_the_distribution_drawn_from():
    torch.manual_seed(3)
    logits = torch.randn(3, 200) * 3
    params = [SamplingParams(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, seed=1, logprobs=5),
              SamplingParams(logprobs=3, logit_bias=((7, 4.0),), presence_penalty=0.5),  # greedy
              SamplingParams(do_sample=True, temperature=1.3, seed=2)]  # no logprobs
    states = [SamplingState.for_params(p) for p in params]
    states[1].output_counts = torch.zeros(200)
    states[1].output_counts[[3, 9]] = 1.0  # as if tokens 3 and 9 had been generated
    out = sample(logits, params, states)
    # Row 0 by hand: temperature, then top-k, then top-p (the order of the transforms).
    row = logits[0] / 0.7
    row = row.masked_fill(row < row.topk(50).values[-1], float("-inf"))
    ordered, order = row.sort(descending=True)
    probs = ordered.softmax(-1)
    cut = (probs.cumsum(-1) - probs) >= 0.9
    row = torch.full_like(row, float("-inf")).scatter(0, order, ordered.masked_fill(cut, float("-inf")))
    expected = row.log_softmax(-1)
    lp = out.logprobs[0]
    token = int(out.token_ids[0])
    assert lp.token_id == token and math.isfinite(lp.logprob)
    assert lp.logprob == pytest.approx(float(expected[token]), abs=1e-5)
    assert [t for t, _ in lp.top] == expected.topk(5).indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(expected.topk(5).values.tolist(), abs=1e-5)
    # Row 1 (greedy): bias and presence penalty at temperature 1; the greedy token is the top one.
    row1 = logits[1].clone()
    row1[7] += 4.0
    row1[[3, 9]] -= 0.5
    expected1 = row1.log_softmax(-1)
    lp1 = out.logprobs[1]
    assert int(out.token_ids[1]) == int(row1.argmax()) == lp1.top[0][0] and len(lp1.top) == 3
    assert lp1.logprob == pytest.approx(float(expected1.max()), abs=1e-5)
    assert out.logprobs[2] is None
    assert sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-6


def test_presence_and_frequency_penalties_match_a_hand_computation():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 1.0  # the favourite
    p = SamplingParams(frequency_penalty=0.4, presence_penalty=0.3, logprobs=0)
    state = SamplingState.for_params(p)
    picks, counts = [], [0] * 10
    for _ in range(6):
        out = sample(logits, [p], [state])
        token = int(out.token_ids[0])
        expected = [float(logits[0, t]) - 0.4 * counts[t] - 0.3 * (counts[t] > 0) for t in range(10)]
        assert token == max(range(10), key=lambda t: (expected[t], -t))
        expected_lp = torch.tensor(expected).log_softmax(-1)[token]
        assert out.logprobs[0].logprob == pytest.approx(float(expected_lp), abs=1e-5)
        counts[token] += 1
        picks.append(token)
    # 4 is taken until its penalties (0.3 + 0.4 k) outweigh its lead of 1: twice, then the others take turns.
    assert picks[:2] == [4, 4] and picks[2] != 4
    assert state.output_counts.tolist() == counts


def test_logit_bias_steers_and_bans():
    torch.manual_seed(4)
    logits = torch.randn(2, 50)
    top = int(logits[0].argmax())
    out = sample(logits, [SamplingParams(logit_bias=((top, -100.0),)), SamplingParams(logit_bias=((11, 100.0),))])
    assert int(out.token_ids[0]) != top and int(out.token_ids[1]) == 11


def test_greedy_only_batch_stays_a_bare_argmax(monkeypatch):
    def boom(*args):
        raise AssertionError("the argmax-only path ran a transform")

    for name in ("_apply_logit_bias", "_apply_penalties", "_temper_and_cut", "_logprobs", "_count_output_tokens"):
        monkeypatch.setattr(sampler_module, name, boom)
    logits = torch.randn(4, 64).bfloat16()
    out = sample(logits, [SamplingParams()] * 4)
    assert out.token_ids.tolist() == logits.float().argmax(-1).tolist() and out.logprobs is None


def test_mixed_batch_rows_keep_their_own_parameters():
    torch.manual_seed(5)
    logits = torch.randn(4, 100)
    params = [SamplingParams(), SamplingParams(logprobs=2), SamplingParams(do_sample=True, seed=3, logprobs=0),
              SamplingParams(repetition_penalty=2.0)]
    out = sample(logits, params, seen=[None, None, None, [int(logits[3].argmax())]])
    assert int(out.token_ids[0]) == int(logits[0].argmax()) and int(out.token_ids[1]) == int(logits[1].argmax())
    assert out.logprobs[0] is None and len(out.logprobs[1].top) == 2 and out.logprobs[2].top == ()
    row3, seen = logits[3].clone(), int(logits[3].argmax())
    row3[seen] = row3[seen] / 2 if row3[seen] > 0 else row3[seen] * 2
    assert int(out.token_ids[3]) == int(row3.argmax())
    alone = sample(logits[2:3], [params[2]])  # the seeded row draws the same alone
    assert int(alone.token_ids[0]) == int(out.token_ids[2])


def test_sequence_seeds():
    assert sequence_seed(7, 0) == 7
    seeds = {sequence_seed(7, i) for i in range(1, 50)} | {sequence_seed(8, 1)}
    assert len(seeds) == 50 and all(0 <= s < 2**63 for s in seeds)
    torch.manual_seed(6)
    logits = torch.randn(1, 1000)
    p = SamplingParams(do_sample=True, seed=7)
    draws = [[int(sample(logits, [p], [state]).token_ids[0]) for _ in range(8)]
             for state in (SamplingState.for_params(p, index=i) for i in (0, 1, 0))]
    assert draws[0] == draws[2] != draws[1]


def test_a_sampled_row_with_no_allowed_token_costs_only_itself():
    """All logits -inf (a grammar at a dead end): the row takes an argmax instead of failing the batch."""
    logits = torch.randn(3, 50)
    logits[1] = float("-inf")
    tokens = run(logits, [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, seed=2),
                          SamplingParams(temperature=1.0, seed=3)])
    assert len(tokens) == 3 and all(0 <= t < 50 for t in tokens)
