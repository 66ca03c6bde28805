"""Speculative decoding (n-gram prompt lookup): proposer, greedy identity, the sampled distribution, rollback.

Greedy identity: the same tokens with speculation on and off (tiny random fp32 families, the embedded
model in float32), on prompts whose drafts get accepted (text repeated) and on prompts where they mostly
do not; each grounded run asserts that drafts were accepted, so the test cannot pass by never drafting.
Distribution: sampled tokens on a tiny-vocabulary model against the exact distribution (chi-square), with
the check shown to fail for a wrong acceptance rule. Rollback: no leaked blocks and no prefix-cache entry
for a block holding a rejected token (and the blocks it did register hold the right K/V).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import (
    EMBEDDED_CHATS,
    assert_engine_idle,
    embedded_models,
    get_model,
    greedy,
    make_engine,
    needs_cpu_triton,
    random_prompt,
    run_engine,
)
from transformers import AutoModelForCausalLM, LlamaConfig

from llm_api.engine.block_pool import hash_block
from llm_api.engine.request import FinishReason
from llm_api.engine.sampling_params import SamplingParams
from llm_api.engine.speculative import verify as verify_module
from llm_api.engine.speculative.drafter import SpeculativeConfig
from llm_api.engine.speculative.ngram import TokenBuffer, propose

SPEC = dict(speculative_tokens=4, speculative_max_batch=64)


# ----------------------------------------------------------------- the proposer


def test_propose_takes_the_longest_ngram_and_its_most_recent_match():
    tokens = np.array([1, 2, 3, 9, 9, 7, 2, 3, 5, 6, 1, 2, 3])
    # "1 2 3" (n=3) last matched at 0 -> 9 9 7; a 2-gram "2 3" matched later (at 6 -> 5 6) must not win.
    assert propose(tokens, 3, 1, 4) == [9, 9, 7]
    assert propose(tokens, 3, 1, 2) == [5, 6, 1]  # n <= 2: "2 3", most recent match at 6
    assert propose(tokens, 10, 1, 2) == [5, 6, 1, 2, 3]  # bounded by the sequence
    assert propose(np.array([4, 5, 6, 7]), 3, 1, 4) == []  # no earlier occurrence (the suffix never matches itself)
    assert propose(np.array([4, 4]), 3, 1, 4) == [4]
    assert propose(tokens, 0, 1, 4) == []
    assert propose(np.array([1, 2, 1, 2]), 3, 3, 4) == []  # no 3-gram repeats


def test_token_buffer_appends_only_new_ids():
    buffer = TokenBuffer(capacity=4)
    prompt = list(range(10))
    buffer.sync(prompt, [])
    assert buffer.view().tolist() == prompt
    output = []
    for token in range(100, 140):
        output.append(token)
        buffer.sync(prompt, output)
    assert buffer.view().tolist() == prompt + output


def test_config_is_checked():
    with pytest.raises(ValueError):
        SpeculativeConfig(4, ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError):
        SpeculativeConfig(-1)
    assert not SpeculativeConfig(0).enabled


# ----------------------------------------------------------------- greedy identity


def _prompts(seed: int, count: int) -> list[list[int]]:
    """Half grounded (a random passage repeated: its continuation is a copy), half random."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        if i % 2 == 0:
            passage = random_prompt(generator, 5 + i)
            prompts.append(passage * 3 + passage[: 2 + i % 3])
        else:
            prompts.append(random_prompt(generator, 7 + 3 * i))
    return prompts


def _run(model, prompts, params, arrivals_at=(0,), **config):
    engine = make_engine(model, **config)
    requests = [(str(i), p, params) for i, p in enumerate(prompts)]
    step = {at: requests[i::len(arrivals_at)] for i, at in enumerate(arrivals_at)}
    return run_engine(engine, step), engine.stats()


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gpt2", "gemma2", "phi3", "granite"])
def test_greedy_identity_on_tiny_families(tiny_models, arch):
    model, _ = get_model(tiny_models, arch)
    prompts = _prompts(seed=3, count=8)
    off, _ = _run(model, prompts, greedy(20), arrivals_at=(0, 3))
    on, stats = _run(model, prompts, greedy(20), arrivals_at=(0, 3), **SPEC)
    assert on == off
    assert stats.spec_decode_num_accepted_tokens > 0, "no draft was accepted: the test proves nothing"
    assert 0 < stats.spec_decode_acceptance_rate <= 1  # (rejections: the rollback tests make sure of them)


def test_greedy_identity_one_at_a_time_with_small_blocks_and_budget(tiny_models):
    """Batch 1 (the case speculation is for), blocks of 2 tokens (drafts span several new blocks), a step
    budget that cuts drafts short, EOS inside accepted drafts, max_new_tokens reached mid-draft."""
    model, _ = get_model(tiny_models, "llama")
    prompts = _prompts(seed=5, count=6)
    off, _ = _run(model, prompts[:1], greedy(30))
    eos = off["0"][0][7]  # a token the grounded answer produces: EOS must cut an accepted draft there
    for prompt in prompts:
        for max_new in (1, 2, 9, 30):
            kwargs = dict(block_size=2, max_num_batched_tokens=3, eos_token_ids={eos})
            off, _ = _run(model, [prompt], greedy(max_new), **kwargs)
            on, _ = _run(model, [prompt], greedy(max_new), speculative_tokens=5, **kwargs)
            assert on == off, (prompt, max_new)


def test_large_batches_do_not_draft(tiny_models):
    model, _ = get_model(tiny_models, "llama")
    prompts = _prompts(seed=7, count=6)
    on, stats = _run(model, prompts, greedy(12), speculative_tokens=4, speculative_max_batch=5)
    off, _ = _run(model, prompts, greedy(12))
    assert on == off and stats.spec_decode_num_draft_tokens == 0
    _, stats = _run(model, prompts, greedy(12), speculative_tokens=4, speculative_max_batch=6)
    assert stats.spec_decode_num_draft_tokens > 0


def test_low_acceptance_pauses_drafting(tiny_models):
    """A sequence whose drafts are rejected stops drafting for a while (acceptance measured per sequence)."""
    model, _ = get_model(tiny_models, "llama")
    generator = torch.Generator().manual_seed(11)
    prompt = random_prompt(generator, 60)
    _, free = _run(model, [prompt], greedy(80), speculative_tokens=4, ngram_min=1)
    engine = make_engine(model, speculative_tokens=4)
    engine.scheduler.drafter.config = SpeculativeConfig(4, 1, 4, 64, min_drafted=4, min_acceptance=1.0,
                                                        pause_steps=1000)
    run_engine(engine, {0: [("0", prompt, greedy(80))]})
    paused = engine.stats()
    # With an unreachable acceptance bar, drafting stops after the first judgement.
    assert 0 < paused.spec_decode_num_draft_tokens < free.spec_decode_num_draft_tokens
    assert paused.spec_decode_num_draft_tokens <= 4 + 3  # judged once past 4 drafted tokens (<= 4 per draft)


@needs_cpu_triton
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_triton_kernels_verify_drafts(tiny_models, arch):
    """The verification query (1 + k tokens after a cached context) through the Triton prefill kernel."""
    model, _ = get_model(tiny_models, arch)
    prompts = _prompts(seed=13, count=4)
    off, _ = _run(model, prompts, greedy(12), attention_backend="torch")
    on, stats = _run(model, prompts, greedy(12), attention_backend="triton", **SPEC)
    assert on == off and stats.spec_decode_num_accepted_tokens > 0


# ----------------------------------------------------------------- rollback


def test_rejected_drafts_leave_no_blocks_and_no_prefix_cache_entries(tiny_models):
    model, _ = get_model(tiny_models, "llama")
    prompts = _prompts(seed=17, count=6)
    engine = make_engine(model, block_size=2, **SPEC)
    results = run_engine(engine, {0: [(str(i), p, greedy(25)) for i, p in enumerate(prompts)]})  # (checks blocks)
    stats = engine.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    pool = engine.scheduler.block_pool
    # Every registered block hash is a block of some final sequence (never one holding a rejected token).
    valid = set()
    for i, prompt in enumerate(prompts):
        tokens = prompt + results[str(i)][0]
        parent = None
        for start in range(0, len(tokens) - len(tokens) % 2, 2):
            parent = hash_block(parent, tokens[start : start + 2])
            valid.add(parent)
    assert pool.cached_block_ids and set(pool.cached_block_ids) <= valid
    # And those blocks hold the right K/V: continuing a finished sequence from the cache (its drafted
    # output blocks are hits) gives what a fresh engine computes.
    continued = [(f"c{i}", prompt + results[str(i)][0], greedy(6)) for i, prompt in enumerate(prompts)]
    hits_before = stats.prefix_cache_hits
    from_cache = run_engine(engine, {0: continued})
    assert engine.stats().prefix_cache_hits - hits_before > sum(len(r[0]) for r in results.values()) // 2
    fresh = run_engine(make_engine(model, block_size=2), {0: continued})
    assert from_cache == fresh


def test_drafts_take_only_spare_blocks(tiny_models):
    """A pool too small for every sequence to draft: drafting never costs a preemption, outputs unchanged."""
    model, _ = get_model(tiny_models, "llama")
    prompts = _prompts(seed=37, count=4)
    config = dict(block_size=2, num_blocks=sum(len(p) // 2 for p in prompts) + 12)
    off, plain = _run(model, prompts, greedy(16), **config)
    on, stats = _run(model, prompts, greedy(16), **config, **SPEC)
    assert on == off and stats.spec_decode_num_draft_tokens > 0
    assert stats.num_preemptions <= plain.num_preemptions


def test_abort_during_speculation_frees_everything(tiny_models):
    model, _ = get_model(tiny_models, "llama")
    prompts = _prompts(seed=19, count=4)
    engine = make_engine(model, **SPEC)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy(40))
    for _ in range(30):  # until some sequence drafted (its blocks then reach past its accepted tokens)
        assert engine.step()
        if engine.stats().spec_decode_num_draft_tokens > 0:
            break
    assert engine.stats().spec_decode_num_draft_tokens > 0
    for i in range(len(prompts)):
        engine.abort_request(str(i))
    outputs = engine.step()
    assert {o.finish_reason for o in outputs} == {FinishReason.ABORT}
    assert_engine_idle(engine)


# ----------------------------------------------------------------- processors, logprobs, n > 1


def test_logprobs_penalties_and_bias_see_the_accepted_tokens(tiny_models):
    """Greedy with logit bias, presence / frequency / repetition penalties and logprobs: each verified
    position sees the counts of the tokens accepted before it, so tokens and logprobs match spec off."""
    model, _ = get_model(tiny_models, "llama")
    prompts = _prompts(seed=23, count=6)
    # Penalties mild enough that the tiny model still repeats itself (drafts get accepted), strong enough
    # to move every logprob by far more than the tolerance when a count is off.
    params = greedy(16, logprobs=3, presence_penalty=0.05, frequency_penalty=0.035, repetition_penalty=1.017,
                    logit_bias=((5, 1.0),))
    for p in (params, greedy(16, logprobs=2)):
        logprobs = {}
        for k in (0, 4):
            engine = make_engine(model, speculative_tokens=k, speculative_max_batch=64)
            collected = {}
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, p)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
                    collected.setdefault(out.request_id, []).extend(out.logprobs)
            assert_engine_idle(engine)
            logprobs[k] = collected
            if k:
                assert engine.stats().spec_decode_num_accepted_tokens > 0
        for request_id, off in logprobs[0].items():
            on = logprobs[4][request_id]
            assert [lp.token_id for lp in on] == [lp.token_id for lp in off]
            for a, b in zip(on, off):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


def _choices(model, prompts, params, **config):
    """(request id, choice index) -> tokens, for n > 1."""
    engine = make_engine(model, **config)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    assert_engine_idle(engine)
    return tokens, engine.stats()


def test_parallel_sampling_with_speculation(tiny_models):
    model, _ = get_model(tiny_models, "llama")
    prompts = _prompts(seed=29, count=4)
    params = SamplingParams(max_new_tokens=14, do_sample=False, n=3)
    off, _ = _choices(model, prompts, params)
    on, stats = _choices(model, prompts, params, block_size=2, **SPEC)  # (copy on write of the shared tail block)
    assert on == off and stats.spec_decode_num_accepted_tokens > 0
    sampled = SamplingParams(max_new_tokens=14, do_sample=True, temperature=0.8, n=3, seed=1)
    tokens, _ = _choices(model, prompts, sampled, block_size=2, **SPEC)
    assert all(len(t) == 14 for t in tokens.values()) and len(tokens) == 12


# ----------------------------------------------------------------- the sampled distribution

SMALL_VOCAB = 8


@pytest.fixture(scope="module")
def small_vocab_models():
    def build():
        torch.manual_seed(31)
        config = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             intermediate_size=64, vocab_size=SMALL_VOCAB, max_position_embeddings=64)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():  # a peaked distribution: some draft tokens likely, some not
            model.lm_head.weight.mul_(6.0)
        return model
    return build(), build()  # (the engine's, the exact distribution's)


# Every token occurs in the prompt with a successor, so whatever the first (plainly sampled) token t0 is,
# the next step drafts one token d1 for t1 (max_new_tokens 3 leaves room for one draft and the bonus t2).
DIST_PROMPT = list(range(SMALL_VOCAB)) * 2 + [0]
DIST_PARAMS = dict(temperature=0.9, presence_penalty=0.7, logit_bias=((3, 0.5),))
NUM_SAMPLES = 1500


def _exact_pair_distributions(model) -> tuple[np.ndarray, np.ndarray]:
    """P(t0, t1) (the draft for t1 depends on t0) and P(t1, t2) (t2 is the bonus token after an accepted
    draft), with the same processors: bias, presence penalty on the output tokens before each position,
    temperature."""
    vocab = SMALL_VOCAB
    bias = torch.zeros(vocab)
    for token, value in DIST_PARAMS["logit_bias"]:
        bias[token] += value
    temperature, presence = DIST_PARAMS["temperature"], DIST_PARAMS["presence_penalty"]
    with torch.no_grad():
        p0 = ((model(torch.tensor([DIST_PROMPT])).logits[0, -1] + bias) / temperature).softmax(-1)  # [V]
        pairs = torch.tensor([DIST_PROMPT + [t0, t1] for t0 in range(vocab) for t1 in range(vocab)])
        logits = model(pairs).logits.view(vocab, vocab, -1, vocab)  # [t0, t1, position, V]
        first = logits[:, 0, -2] + bias  # [t0, V]: the distribution of t1
        first[torch.arange(vocab), torch.arange(vocab)] -= presence
        p1 = (first / temperature).softmax(-1)
        second = logits[:, :, -1] + bias  # [t0, t1, V]: the distribution of t2
        seen = torch.zeros(vocab, vocab, vocab, dtype=torch.bool)
        seen[torch.arange(vocab)[:, None], :, torch.arange(vocab)[:, None]] = True  # t0 was output
        seen[:, torch.arange(vocab), torch.arange(vocab)] = True  # t1 was output
        p2 = ((second - presence * seen) / temperature).softmax(-1)
        joint = p0[:, None, None] * p1[:, :, None] * p2  # [t0, t1, t2]
    return joint.sum(2).numpy(), joint.sum(0).numpy()


def _sampled_pairs(model, speculative_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    engine = make_engine(model, num_blocks=6 * NUM_SAMPLES, max_num_seqs=NUM_SAMPLES, max_num_batched_tokens=32768,
                         speculative_tokens=speculative_tokens, speculative_max_batch=NUM_SAMPLES)
    requests = [(str(i), DIST_PROMPT, SamplingParams(max_new_tokens=3, do_sample=True, seed=i, **DIST_PARAMS))
                for i in range(NUM_SAMPLES)]
    results = run_engine(engine, {0: requests})
    first, second = np.zeros((SMALL_VOCAB, SMALL_VOCAB)), np.zeros((SMALL_VOCAB, SMALL_VOCAB))
    for tokens, _ in results.values():
        first[tokens[0], tokens[1]] += 1
        second[tokens[1], tokens[2]] += 1
    if speculative_tokens:
        stats = engine.stats()
        assert stats.spec_decode_num_drafts == NUM_SAMPLES  # every sequence verified a draft for t1
        assert 0.05 < stats.spec_decode_acceptance_rate < 0.95  # and drafts were both accepted and rejected
    return first, second


def _chi2_bound(df: int, z: float = 3.72) -> float:
    """The chi-square quantile at about 1 - 1e-4 (Wilson-Hilferty): a correct sampler fails 1 run in 10^4."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """-> (statistic, bound). Cells expected fewer than 5 times are pooled into one (the test's validity)."""
    expected = (probs * counts.sum()).ravel()
    observed = counts.ravel()
    assert observed[probs.ravel() == 0].sum() == 0, "a token with probability 0 was sampled"
    small = expected < 5
    cells_expected = np.append(expected[~small], expected[small].sum())
    cells_observed = np.append(observed[~small], observed[small].sum())
    statistic = float(((cells_observed - cells_expected) ** 2 / cells_expected).sum())
    return statistic, _chi2_bound(len(cells_expected) - 1)


def _wrong_rule(probs, transformed, draft_token, generator):
    """Accept with probability p(d), but on rejection draw from p itself (not the residual): d comes out
    too often."""
    if draft_token is not None and torch.rand((), generator=generator) < probs[draft_token]:
        return draft_token
    return int(torch.multinomial(probs, 1, generator=generator)[0])


@pytest.mark.parametrize("rule", ["correct", "wrong"])
def test_sampled_tokens_follow_the_target_distribution(small_vocab_models, monkeypatch, rule):
    """Speculative sampling draws (t0, t1) from exactly the distribution plain sampling draws from, with
    bias, penalty and temperature in force; the same statistic rejects a wrong acceptance rule."""
    model, exact_model = small_vocab_models
    exact = _exact_pair_distributions(exact_model)
    if rule == "wrong":
        monkeypatch.setattr(verify_module, "_draw", _wrong_rule)
    checks = [_chi_square(counts, probs) for counts, probs in zip(_sampled_pairs(model, 2), exact)]
    if rule == "correct":
        assert all(statistic < bound for statistic, bound in checks), checks
        plain = [_chi_square(counts, probs) for counts, probs in zip(_sampled_pairs(model, 0), exact)]
        assert all(statistic < bound for statistic, bound in plain), plain  # (the yardstick: plain sampling)
    else:
        assert any(statistic > bound for statistic, bound in checks), checks


# ----------------------------------------------------------------- the embedded model


@pytest.fixture(scope="module")
def fp32_embedded(embedded_checkpoint_path):
    tokenizer, model, _ = embedded_models(embedded_checkpoint_path, torch.float32)
    return tokenizer, model


def test_embedded_model_greedy_identity(fp32_embedded):
    """A grounded chat (repeat a code snippet with a variable renamed) and two open ones, on and off."""
    tokenizer, model = fp32_embedded
    code = "def area(width, height):\n    result = width * height\n    return result\n"
    chats = [f"Rewrite this Python function with the variable `result` renamed to `total`. Reply with only the "
             f"code.\n\n```python\n{code}```",
             EMBEDDED_CHATS[0], EMBEDDED_CHATS[2]]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for text in chats]
    eos = {tokenizer.eos_token_id}
    config = dict(block_size=16, num_blocks=64, eos_token_ids=eos)
    off, _ = _run(model, prompts, greedy(40), **config)
    on, stats = _run(model, prompts, greedy(40), **config, **SPEC)
    assert on == off
    assert stats.spec_decode_num_accepted_tokens >= 5  # (the code is copied: drafts from the prompt hold)


def test_embedded_model_json_schema_with_speculation(fp32_embedded):
    pytest.importorskip("xgrammar")
    import json

    from llm_api.structured.compiler import GrammarCompiler
    from llm_api.structured.spec import GrammarSpec

    tokenizer, model = fp32_embedded
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size, {tokenizer.eos_token_id})
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["a", "bb"]}}},
              "required": ["name", "tags"]}
    grammar = compiler.compile(GrammarSpec.json_schema(schema))
    text = 'Answer in JSON. {"name": "box", "tags": ["a", "bb", "a", "bb", "a"]} again: '
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    config = dict(block_size=16, num_blocks=64, eos_token_ids={tokenizer.eos_token_id})
    answers = {}
    for k in (0, 4):
        results, stats = _run(model, [prompt], greedy(48, grammar=grammar), speculative_tokens=k, **config)
        answers[k] = results["0"]
        if k:
            assert stats.spec_decode_num_draft_tokens > 0
    assert answers[4] == answers[0]
    tokens, reason = answers[4]
    if reason is FinishReason.STOP:
        json.loads(tokenizer.decode(tokens, skip_special_tokens=True))


def test_pauses_double_while_drafts_keep_failing():
    from llm_api.engine.request import Request
    from llm_api.engine.speculative.drafter import Drafter

    drafter = Drafter(SpeculativeConfig(4, min_drafted=4, min_acceptance=0.5, pause_steps=2, max_pause_steps=8))
    request = Request("r", [1, 2, 3, 1, 2, 3, 1, 2], greedy(100))
    pauses = []
    for _ in range(5):
        assert drafter.draft(request, 4) == [3, 1, 2]  # ("2 3 1 2" matched at 1; the sequence ends 3 later)
        drafter.record(request, 4, 0)  # all rejected: judged and paused
        pause = 0
        while drafter.draft(request, 4) == []:
            pause += 1
        pauses.append(pause)
    assert pauses == [2, 4, 8, 8, 8]
    drafter.record(request, 4, 4)  # a passed judgement resets the pause
    drafter.record(request, 4, 0)
    assert request.draft_state.paused_for == 2
