"""Greedy parity: the engine's tokens equal generate()'s, request by request, for tiny random models of
every supported family, with staggered arrivals, EOS, forced preemption, chunked prefill and prompt
embeddings."""

from __future__ import annotations

import pytest
import torch

from llm_api.engine.scheduler import PromptTooLongError
from llm_api.engine.sampling_params import SamplingParams

from engine_helpers import (
    assert_engine_idle,
    get_model,
    greedy,
    make_engine,
    needs_cpu_triton,
    random_prompt,
    reference_greedy,
    run_engine,
)

# Every family listed as supported in docs/model-options.md (tiny random configs in engine_helpers.py).
ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gpt2", "gemma2", "gemma3", "phi3", "phi", "gpt_neox", "granite",
         "olmo2", "starcoder2"]
MAX_NEW_TOKENS = 16


def _workload(seed: int, lengths=(3, 11, 30, 7, 45), max_new_tokens: int = MAX_NEW_TOKENS):
    """Requests of different prompt lengths, arriving at steps 0, 0, 2, 5, 9, generating ``max_new_tokens``
    and more (one more each)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [random_prompt(generator, n) for n in lengths]
    arrival_steps = [0, 0, 2, 5, 9]
    arrivals: dict[int, list] = {}
    for i, (prompt, step) in enumerate(zip(prompts, arrival_steps)):
        arrivals.setdefault(step, []).append((f"r{i}", prompt, greedy(max_new_tokens + i)))
    return arrivals


def _check_against_generate(reference_model, arrivals, results, eos_token_id=None):
    for requests in arrivals.values():
        for request_id, prompt, params in requests:
            expected = reference_greedy(reference_model, prompt, params.max_new_tokens, eos_token_id)
            tokens, reason = results[request_id]
            assert tokens == expected, f"{request_id}: engine {tokens} != generate {expected}"
            hit_eos = eos_token_id is not None and tokens[-1] == eos_token_id
            assert reason == ("stop" if hit_eos else "length")


@pytest.mark.parametrize("arch", ARCHS)
def test_staggered_requests_match_generate(tiny_models, arch):
    model, reference_model = get_model(tiny_models, arch)
    arrivals = _workload(seed=1)
    results = run_engine(make_engine(model), arrivals)
    _check_against_generate(reference_model, arrivals, results)


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_keeps_outputs(tiny_models, arch):
    model, reference_model = get_model(tiny_models, arch)
    arrivals = _workload(seed=2)
    # 24 blocks of 4 tokens: the five requests need up to ~70 tokens each, so they cannot all run.
    engine = make_engine(model, num_blocks=24)
    results = run_engine(engine, arrivals)
    assert engine.stats().num_preemptions > 0
    _check_against_generate(reference_model, arrivals, results)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2", "gemma2"])
def test_chunked_prefill_keeps_outputs(tiny_models, arch):
    model, reference_model = get_model(tiny_models, arch)
    arrivals = _workload(seed=3)
    engine = make_engine(model, max_num_batched_tokens=7)
    results = run_engine(engine, arrivals)
    _check_against_generate(reference_model, arrivals, results)


def test_eos_finishes_request_and_ignore_eos_continues(tiny_models):
    model, reference_model = get_model(tiny_models, "llama")
    generator = torch.Generator().manual_seed(4)
    prompt = random_prompt(generator, 9)
    free_run = reference_greedy(reference_model, prompt, 12)
    eos = free_run[5]  # a token the model emits mid-way: becomes EOS
    arrivals = {0: [("stops", prompt, greedy(12)), ("ignores", prompt, greedy(12, ignore_eos=True))]}
    results = run_engine(make_engine(model, eos_token_ids={eos}), arrivals)
    assert results["stops"] == (free_run[: free_run.index(eos) + 1], "stop")
    assert results["ignores"] == (free_run, "length")


def test_prompt_embeds_match_generate(tiny_models):
    model, reference_model = get_model(tiny_models, "llama")
    generator = torch.Generator().manual_seed(5)
    prompt = random_prompt(generator, 13)
    embeds = reference_model.get_input_embeddings()(torch.tensor(prompt)).detach()  # [13, H]
    with torch.inference_mode():
        expected = reference_model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, 13, dtype=torch.long),
                                            do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)[0].tolist()
    engine = make_engine(model, num_blocks=12)  # small: the embeddings request gets preempted too
    engine.add_request("embeds", None, greedy(10), prompt_embeds=embeds)
    engine.add_request("ids", random_prompt(generator, 20), greedy(10))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() if o.request_id == "embeds" for t in o.new_token_ids]
    assert tokens == expected[-10:]
    assert_engine_idle(engine)


def test_seeded_sampling_is_independent_of_batch(tiny_models):
    model, _ = get_model(tiny_models, "qwen2")
    generator = torch.Generator().manual_seed(6)
    prompt = random_prompt(generator, 10)
    params = SamplingParams(max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9, top_k=50,
                            repetition_penalty=1.2, seed=1234)
    alone = run_engine(make_engine(model), {0: [("a", prompt, params)]})["a"]
    crowd = {0: [("a", prompt, params)] + [(f"o{i}", random_prompt(generator, 5 + i), greedy(8)) for i in range(3)]}
    together = run_engine(make_engine(model), crowd)["a"]
    assert alone == together


def test_bad_prompts_are_refused_at_add(tiny_models):
    model, _ = get_model(tiny_models, "llama")
    engine = make_engine(model, num_blocks=8)  # 32 tokens in the whole pool
    with pytest.raises(PromptTooLongError, match="limit is 31"):
        engine.add_request("long", list(range(40)), greedy(4))
    with pytest.raises(ValueError):
        engine.add_request("empty", [], greedy(4))
    with pytest.raises(ValueError):
        engine.add_request("oov", [1, 2, 10**6], greedy(4))
    engine.add_request("ok", [1, 2, 3], greedy(4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [1, 2, 3], greedy(4))
    engine.abort_request("ok")
    engine.abort_request("unknown")  # a no-op
    assert [(o.request_id, o.finished, o.finish_reason) for o in engine.step()] == [("ok", True, "abort")]
    assert_engine_idle(engine)


def test_generation_stops_at_max_model_len(tiny_models):
    model, reference_model = get_model(tiny_models, "llama")
    prompt = list(range(1, 26))
    engine = make_engine(model, num_blocks=8)  # max_model_len = 32 tokens
    results = run_engine(engine, {0: [("r", prompt, greedy(100))]})
    assert results["r"] == (reference_greedy(reference_model, prompt, 7), "length")


def test_batch_stream_helper(tiny_models):
    model, reference_model = get_model(tiny_models, "gpt2")
    generator = torch.Generator().manual_seed(7)
    prompts = [random_prompt(generator, n) for n in (4, 19)]
    engine = make_engine(model)
    tokens = {"a": [], "b": []}
    for outputs in engine.generate_batch_stream([("a", prompts[0], greedy(6), None), ("b", prompts[1], greedy(9), None)]):
        for output in outputs:
            tokens[output.request_id] += output.new_token_ids
    assert tokens["a"] == reference_greedy(reference_model, prompts[0], 6)
    assert tokens["b"] == reference_greedy(reference_model, prompts[1], 9)
    # Closing the stream early aborts what is left.
    stream = engine.generate_batch_stream([("c", prompts[1], greedy(50), None)])
    next(stream)
    stream.close()
    assert_engine_idle(engine)


def test_engine_config_from_settings():
    from llm_api.model.settings import Settings
    from llm_api.engine.engine import EngineConfig

    settings = Settings.from_env({"KV_BLOCK_SIZE": "32", "MAX_NUM_SEQS": "8", "MAX_NUM_BATCHED_TOKENS": "512",
                                  "KV_CACHE_MEMORY_MIB": "64", "MAX_INPUT_TOKENS": "100", "MAX_NEW_TOKENS": "20"})
    config = EngineConfig.from_settings(settings)
    assert (config.block_size, config.max_num_seqs, config.max_num_batched_tokens) == (32, 8, 512)
    assert (config.kv_cache_memory_mib, config.max_model_len) == (64, 120)


def test_abort_from_another_thread_waits_for_the_step_and_frees_blocks(tiny_models):
    import threading

    model, _ = get_model(tiny_models, "llama")
    engine = make_engine(model)
    outputs = []
    stream = engine.generate_batch_stream([("a", [1, 2, 3], greedy(200), None), ("b", [4, 5], greedy(6), None)])
    for step_outputs in stream:
        outputs += step_outputs
        if len(outputs) == 4:
            aborter = threading.Thread(target=engine.abort_request, args=("a",))
            aborter.start()
            aborter.join()
    assert sorted((o.request_id, o.finish_reason) for o in outputs if o.finished) == [("a", "abort"), ("b", "length")]
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "b") == 6
    assert_engine_idle(engine)


# The Triton kernels see only what a layer hands the attention backend: the heads (grouped or not), the scale,
# a sliding window and a logit softcap. One family per distinct kind of call runs the kernels here, under the
# CPU interpreter (10-36 s each on a 2-core host): every family reaches the same backend call through the
# torch backend in the tests above, and runs the kernels for real on a GPU (tests/engine/test_gpu_fast_path.py).
# Granite (attention_multiplier as the scale: another number where gemma2 already passes its own) and gemma3
# (windowed and full layers in a pattern: each call is mistral's or llama's) ran here too, 58 s of the suite on
# the 2-core host for no call the others do not make.
TRITON_ARCHS = [
    "llama",  # grouped-query heads, the default scale: also what qwen2/3, phi, phi3, olmo2 and granite hand the kernels
    "gpt2",  # one K/V head per query head (also gpt_neox)
    "mistral",  # a sliding window (also starcoder2, and gemma3's windowed layers)
    "gemma2",  # window, logit softcap and its own query scale (also gemma3's)
]
# Interpreted kernels are slow (the llama run: 10 s with the common workload, 6 s with this one, alone on a
# 2-core EPYC), so the Triton runs generate fewer tokens: the last request still arrives at step 9 beside
# running ones (prefill and decode in one step), and is decoded alone after they finish. Every
# context stays under one decode partition either way (PARTITION_MIN_TOKENS); the partitioned decode is
# tests/kernels' to check.
TRITON_NEW_TOKENS = 6


@needs_cpu_triton
@pytest.mark.parametrize("arch", TRITON_ARCHS)
def test_triton_kernels_match_generate(tiny_models, arch):
    """The GPU attention path (Triton store/prefill/decode kernels, interpreted on CPU) in the same
    staggered workload: mixed prefill + decode steps go through the prefill kernel, pure decode steps
    through the split-context decode kernel."""
    model, reference_model = get_model(tiny_models, arch)
    arrivals = _workload(seed=1, max_new_tokens=TRITON_NEW_TOKENS)
    engine = make_engine(model, attention_backend="triton")
    assert engine.attention.name == "triton"
    results = run_engine(engine, arrivals)
    _check_against_generate(reference_model, arrivals, results)


@needs_cpu_triton
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_triton_kernels_read_cached_prefixes_and_chunks(tiny_models, arch):
    """Prompts sharing a long prefix (reused from the prefix cache, so the prefill kernel reads blocks it
    did not write this step), prefilled in chunks of 7 tokens."""
    model, reference_model = get_model(tiny_models, arch)
    generator = torch.Generator().manual_seed(6)
    prefix = random_prompt(generator, 21)
    arrivals = {0: [("a", prefix + random_prompt(generator, 5), greedy(8))],
                4: [("b", prefix + random_prompt(generator, 9), greedy(8)), ("c", prefix[:16], greedy(6))]}
    engine = make_engine(model, attention_backend="triton", max_num_batched_tokens=7)
    results = run_engine(engine, arrivals)
    assert engine.stats().prefix_cache_hits >= 16
    _check_against_generate(reference_model, arrivals, results)
