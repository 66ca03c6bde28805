"""n > 1 (parallel sampling) and logprobs in the paged engine: the prompt's blocks are held once, each
choice is the sequence its own seed gives alone, preemption and aborts keep the pool whole, and logprobs
are the model's log-probabilities (checked against a plain forward)."""

from __future__ import annotations

import random

import pytest
import torch

from llm_api.engine.block_pool import BlockPool
from llm_api.engine.request import Request
from llm_api.engine.sampler import sequence_seed
from llm_api.engine.sampling_params import SamplingParams
from llm_api.engine.scheduler import Scheduler
from llm_api.engine.scheduler_config import SchedulerConfig

from engine_helpers import assert_engine_idle, get_model, greedy, make_engine, random_prompt, reference_greedy

BLOCK_SIZE = 4


def collect(engine, max_steps=10_000):
    """Step until idle: (request id, index) -> (tokens, finish reason, logprobs)."""
    tokens, reasons, logprobs = {}, {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            key = (out.request_id, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            logprobs.setdefault(key, []).extend(out.logprobs or ())
            if out.finished:
                assert key not in reasons, f"{key} finished twice"
                reasons[key] = out.finish_reason
    assert_engine_idle(engine)
    return tokens, reasons, logprobs


def sampled(max_new_tokens, seed, n=1, **kw):
    return SamplingParams(max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, seed=seed, n=n, **kw)


def test_n_sequences_hold_the_prompt_blocks_once(tiny_models):
    model, _ = get_model(tiny_models, "llama")
    prompt = random_prompt(torch.Generator().manual_seed(1), 4 * BLOCK_SIZE + 2)  # 4 full blocks + 2 tokens
    engine = make_engine(model, num_blocks=64)
    pool = engine.scheduler.block_pool
    engine.add_request("r", prompt, sampled(8, seed=3, n=4))
    engine.step()  # prefill + every choice's first token, then the fork
    prompt_blocks = engine.scheduler.running[0].block_ids
    assert len(prompt_blocks) == 5 and all(pool.ref_counts[b] == 4 for b in prompt_blocks)
    assert pool.num_free_blocks == 64 - 5
    engine.step()  # the first decode: the partial block is copied for 3 of the 4 choices, on write
    held = {b for r in engine.scheduler.running for b in r.block_ids}
    assert all(pool.ref_counts[b] == 4 for b in prompt_blocks[:4]) and len(held) == 4 + 4
    assert pool.num_free_blocks == 64 - 8
    pool.check_invariants({r.seq_id: r.block_ids for r in engine.scheduler.running})
    collect(engine)
    # Four separate requests admitted together hold four copies of the prompt (the prefix cache shares
    # only blocks computed in an earlier step).
    engine = make_engine(model, num_blocks=64)
    pool = engine.scheduler.block_pool
    for i in range(4):
        engine.add_request(f"s{i}", prompt, sampled(8, seed=3 + i))
    engine.step()
    assert pool.num_free_blocks == 64 - 4 * 5
    collect(engine)


@pytest.mark.parametrize("prompt_len", [9, 12])  # a partial last block (copied on write), or only full blocks
def test_each_choice_is_what_its_seed_gives_alone(tiny_models, prompt_len):
    model, _ = get_model(tiny_models, "qwen2")
    prompt = random_prompt(torch.Generator().manual_seed(2), prompt_len)
    params = sampled(10, seed=11, n=3, top_k=40, presence_penalty=0.5, logprobs=2)
    tokens, reasons, logprobs = collect_request(make_engine(model), prompt, params)
    choices = [tokens[("r", i)] for i in range(3)]
    assert len({tuple(c) for c in choices}) == 3, "the choices must differ"
    for i, choice in enumerate(choices):
        alone = sampled(10, seed=sequence_seed(11, i), top_k=40, presence_penalty=0.5, logprobs=2)
        solo_tokens, _, solo_logprobs = collect_request(make_engine(model), prompt, alone)
        assert solo_tokens[("r", 0)] == choice
        assert [lp.logprob for lp in solo_logprobs[("r", 0)]] == pytest.approx([lp.logprob for lp in logprobs[("r", i)]],
                                                                             abs=1e-4)
    # Reproducible: the same request again gives the same choices.
    again, _, _ = collect_request(make_engine(model), prompt, params)
    assert [again[("r", i)] for i in range(3)] == choices


def collect_request(engine, prompt, params):
    engine.add_request("r", prompt, params)
    return collect(engine)


def test_greedy_choices_equal_generate_and_each_other(tiny_models):
    model, reference_model = get_model(tiny_models, "gpt2")
    prompt = random_prompt(torch.Generator().manual_seed(3), 13)
    tokens, reasons, _ = collect_request(make_engine(model), prompt, greedy(9, n=3))
    expected = reference_greedy(reference_model, prompt, 9)
    assert [tokens[("r", i)] for i in range(3)] == [expected] * 3
    assert {reasons[("r", i)] for i in range(3)} == {"length"}


def test_preemption_of_choices_keeps_their_tokens(tiny_models):
    model, _ = get_model(tiny_models, "llama")
    generator = torch.Generator().manual_seed(4)
    prompts = [random_prompt(generator, n) for n in (10, 7)]
    arrivals = [("a", prompts[0], sampled(24, seed=5, n=3)), ("b", prompts[1], sampled(20, seed=6, n=2))]
    roomy = make_engine(model, num_blocks=256)
    tight = make_engine(model, num_blocks=16)  # 64 tokens for 5 sequences of up to 34: preemptions
    for engine in (roomy, tight):
        for request_id, prompt, params in arrivals:
            engine.add_request(request_id, prompt, params)
    expected, _, _ = collect(roomy)
    got, reasons, _ = collect(tight)
    assert tight.stats().num_preemptions > 0
    assert got == expected and len(reasons) == 5


def test_abort_ends_every_choice_or_one(tiny_models):
    model, _ = get_model(tiny_models, "llama")
    engine = make_engine(model)
    engine.add_request("r", [1, 2, 3, 4, 5, 6], sampled(50, seed=1, n=3))
    engine.add_request("q", [7, 8, 9], sampled(50, seed=2, n=2))
    engine.step()
    engine.step()
    engine.abort_request("r", index=1)
    ended = [(o.request_id, o.index, o.finish_reason) for o in engine.step() if o.finished]
    assert ended == [("r", 1, "abort")]
    engine.abort_request("r")
    engine.abort_request("q")
    ended = sorted((o.request_id, o.index, o.finish_reason) for o in engine.step() if o.finished)
    assert ended == [("q", 0, "abort"), ("q", 1, "abort"), ("r", 0, "abort"), ("r", 2, "abort")]
    assert_engine_idle(engine)
    # Aborted before its prompt was computed: the choices waiting for it end too.
    engine.add_request("w", list(range(1, 30)), sampled(5, seed=1, n=4))
    engine.abort_request("w")
    assert sorted(o.index for o in engine.step()) == [0, 1, 2, 3]
    assert_engine_idle(engine)


def test_n_is_refused_beyond_max_num_seqs(tiny_models):
    model, _ = get_model(tiny_models, "llama")
    engine = make_engine(model, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request("r", [1, 2, 3], sampled(4, seed=1, n=5))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("b", [1, 2, 3], SamplingParams(logit_bias=((10**6, 1.0),)))
    engine.add_request("ok", [1, 2, 3], sampled(4, seed=1, n=4))
    collect(engine)


@torch.inference_mode()
def test_greedy_logprobs_are_the_models_log_softmax(tiny_models):
    model, reference_model = get_model(tiny_models, "llama")
    prompt = random_prompt(torch.Generator().manual_seed(5), 11)
    tokens, _, logprobs = collect_request(make_engine(model), prompt, greedy(6, logprobs=4))
    sequence = prompt + tokens[("r", 0)]
    logits = reference_model(torch.tensor([sequence])).logits[0].float()
    expected = logits[len(prompt) - 1 : -1].log_softmax(-1)  # the distribution of each generated token
    for position, lp in enumerate(logprobs[("r", 0)]):
        assert lp.token_id == tokens[("r", 0)][position] == lp.top[0][0]
        assert lp.logprob == pytest.approx(float(expected[position].max()), abs=1e-4)
        assert [t for t, _ in lp.top] == expected[position].topk(4).indices.tolist()


# ---------------------------------------------------------------------------------------------------
# the scheduler alone (no torch): forks, copy on write, aborts of a choice, preemptions


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_with_n_keep_the_pool_whole(seed):
    rng = random.Random(seed)
    pool = BlockPool(num_blocks=48, block_size=BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=100), pool,
                          eos_token_ids={0})
    tokens: dict[tuple[str, int], list[int]] = {}
    limits: dict[str, tuple[int, int]] = {}
    finished: dict[tuple[str, int], str] = {}
    copies = forks = 0
    for step in range(1500):
        op = rng.random()
        if op < 0.12:
            n = rng.choice([1, 2, 3, 4])
            prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 25))]
            request_id, max_new = f"r{step}", rng.randrange(1, 30)
            params = SamplingParams(max_new_tokens=max_new, n=n)
            siblings = [Request(request_id, prompt, params, index=i) for i in range(1, n)]
            scheduler.add(Request(request_id, prompt, params), siblings)
            limits[request_id] = (len(prompt), max_new)
            for i in range(n):
                tokens[(request_id, i)] = []
        elif op < 0.17 and scheduler.groups:
            request_id = rng.choice(list(scheduler.groups))
            index = rng.choice([None, 0, 1])
            for request in scheduler.abort(request_id, index):
                finished[(request_id, request.index)] = "abort"
        else:
            output = scheduler.schedule()
            copies += len(output.block_copies)
            for src, dst in output.block_copies:
                assert pool.ref_counts[src] >= 1 and pool.ref_counts[dst] == 1
            # A "model" whose next token depends on the position and the choice index.
            sampled_ids = {}
            for item in output.scheduled:
                if item.samples:
                    for seq in (item.request, *item.forks):
                        sampled_ids[seq.seq_id] = (seq.num_tokens * 7 + seq.index) % 50
                    forks += len(item.forks)
            for out in scheduler.update(output, sampled_ids):
                tokens[(out.request_id, out.index)] += out.new_token_ids
                if out.finished:
                    finished[(out.request_id, out.index)] = out.finish_reason
        assert len(scheduler.running) <= 8
        assert all(not r.block_ids for r in scheduler.waiting)
        pool.check_invariants({r.seq_id: r.block_ids for r in scheduler.running})
    for request_id in list(scheduler.groups):
        scheduler.abort(request_id)
    scheduler.schedule()
    pool.check_invariants({})
    assert forks > 0 and copies > 0 and scheduler.counters.num_preemptions > 0
    for (request_id, index), reason in finished.items():
        if reason == "abort":
            continue
        num_prompt, max_new = limits[request_id]
        expected = []
        while True:
            expected.append(((num_prompt + len(expected)) * 7 + index) % 50)
            if expected[-1] == 0 or len(expected) == max_new or num_prompt + len(expected) >= 100:
                break
        assert tokens[(request_id, index)] == expected, (request_id, index)
