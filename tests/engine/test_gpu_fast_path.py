"""The GPU fast path on a real GPU (skipped without CUDA): Triton attention, CUDA-graph decode, KV sizing.

- A replayed decode step gives exactly (bit for bit) the logits of the same padded step run eagerly.
- The engine with everything on (the owned decoder on the Triton set, graphs, profiled pool) generates greedily what
  ``generate()`` does for random-weight models, in fp32 (in bf16 a one-ulp tie may flip a token).
- The profiled pool fits: after the engine is built, torch holds no more than the utilization allows.
- The paths added since, on the GPU: speculative verification beside replayed steps, LoRA deltas in mixed
  batches (PEFT's answers), grammar masks beside free rows, n > 1 choices (each its own seed's).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from llm_api.engine.cuda_graphs import capture_batch_sizes

from engine_helpers import (TINY_CONFIGS, greedy, make_engine, on_transformers_path, random_prompt, reference_greedy,
                            run_engine)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda_model(arch: str, dtype: torch.dtype, seed: int = 0, **config_overrides):
    from transformers import AutoModelForCausalLM

    config = TINY_CONFIGS[arch]()
    for name, value in config_overrides.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to("cuda").eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2", "qwen3"])
def test_engine_with_graphs_matches_generate(arch):
    model = _cuda_model(arch, torch.float32)
    reference = copy.deepcopy(model)  # the engine switches its model's attention to the paged one
    engine = make_engine(model, num_blocks=256, max_num_seqs=8, cuda_graph_max_batch_size=8)
    assert engine.attention.name == "triton"
    assert engine.cuda_graph_batch_sizes == capture_batch_sizes(8)
    # The owned decoder on the Triton set (gemma2: transformers' classes with the paged attention)
    path = engine.runner.path
    assert (path.name, path.kernels) == (("transformers", "") if arch == "gemma2" else ("owned", "Triton"))
    generator = torch.Generator().manual_seed(11)
    arrivals = {step: [(f"r{step}-{i}", random_prompt(generator, 3 + 7 * i + step), greedy(12 + i))
                       for i in range(3)] for step in (0, 2, 5)}
    results = run_engine(engine, arrivals)
    for arrival in arrivals.values():
        for request_id, prompt, params in arrival:
            assert results[request_id][0] == reference_greedy(reference, prompt, params.max_new_tokens), request_id
    assert sum(engine.runner.decode_graphs.steps_by_size.values()) > 0


def _first_logprobs(engine, prompt: list[int], tokens: int) -> list:
    engine.add_request("x", prompt, greedy(tokens, logprobs=5))
    rows = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            rows += list(output.logprobs or ())
    return rows


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_owned_decoder_gives_transformers_logprobs_on_the_gpu(monkeypatch, arch):
    """Finer than greedy tokens: every logprob of a float32 run (Triton set, graphs) agrees with transformers'
    classes' (the paged attention, no graphs) to float32 rounding."""
    model = _cuda_model(arch, torch.float32)
    oracle_model = copy.deepcopy(model)
    owned = make_engine(model, num_blocks=256, max_num_seqs=8, cuda_graph_max_batch_size=8)
    with monkeypatch.context() as patch:
        on_transformers_path(patch)
        oracle = make_engine(oracle_model, num_blocks=256, max_num_seqs=8, cuda_graphs=False)
    prompt = random_prompt(torch.Generator().manual_seed(3), 9)
    got, expected = _first_logprobs(owned, prompt, 6), _first_logprobs(oracle, prompt, 6)
    assert [r.token_id for r in got] == [r.token_id for r in expected]
    for row, wanted in zip(got, expected, strict=True):
        assert abs(row.logprob - wanted.logprob) < 1e-4


@pytest.mark.parametrize("lengths,padded", [([4, 17, 9], 4), ([11], 1)], ids=["batch-3", "batch-1"])
def test_replay_equals_eager_bit_for_bit(lengths, padded):
    """(batch 1: every product is the one-row kernel's, kernels.gemv, in bf16 where it measures faster)"""
    model = _cuda_model("llama", torch.bfloat16)
    engine = make_engine(model, num_blocks=256, max_num_seqs=8, cuda_graph_max_batch_size=8)
    graphs = engine.runner.decode_graphs
    generator = torch.Generator().manual_seed(5)
    for i, length in enumerate(lengths):
        engine.add_request(f"s{i}", random_prompt(generator, length), greedy(4))
    engine.step()  # the prompts, eagerly
    scheduler_output = engine.scheduler.schedule()
    engine.runner.block_tables.update(scheduler_output)  # (what runner.execute does first)
    rows = engine.runner._graph_decode_rows(scheduler_output.scheduled)
    assert rows is not None and graphs.padded_size(len(rows)) == padded
    replayed = graphs.run(rows).clone()
    graphs.capture_enabled = False  # the same padded step, eagerly (rewrites the same K/V into the same slots)
    try:
        eager = graphs.run(rows).clone()
    finally:
        graphs.capture_enabled = True
    assert torch.equal(replayed, eager)
    for i in range(len(lengths)):
        engine.abort_request(f"s{i}")


def test_one_row_products_give_transformers_logprobs_in_bf16(monkeypatch):
    """The batch-1 path in bf16, with the one-row kernel forced for every product (the head's included): the
    owned decoder's logprobs agree with transformers' classes' to bf16 rounding."""
    from llm_api.kernels import gemv

    monkeypatch.setattr(gemv, "mode", "triton")
    model = _cuda_model("llama", torch.bfloat16)
    oracle_model = copy.deepcopy(model)
    owned = make_engine(model, num_blocks=256, max_num_seqs=8, cuda_graph_max_batch_size=8)
    with monkeypatch.context() as patch:
        on_transformers_path(patch)
        oracle = make_engine(oracle_model, num_blocks=256, max_num_seqs=8, cuda_graphs=False)
    got, expected = _first_logprobs(owned, [17], 1), _first_logprobs(oracle, [17], 1)
    assert got[0].token_id == expected[0].token_id
    assert abs(got[0].logprob - expected[0].logprob) <= 0.05


def test_profiled_pool_respects_the_utilization():
    model = _cuda_model("llama", torch.bfloat16)
    utilization = 0.3
    engine = make_engine(model, num_blocks=None, gpu_memory_utilization=utilization, max_num_seqs=16,
                         max_num_batched_tokens=1024, max_model_len=512)
    total = torch.cuda.mem_get_info()[1]
    assert engine.kv_cache.num_blocks > 1000  # a tiny model leaves most of the GPU to the cache
    assert torch.cuda.memory_allocated() <= utilization * total


def test_speculative_steps_beside_graph_decode_steps():
    """Speculation on a GPU with graphs on: drafted steps run eagerly through the Triton prefill kernel,
    undrafted decode steps replay graphs, and the greedy tokens are those of speculation off."""
    model = _cuda_model("llama", torch.float32)
    generator = torch.Generator().manual_seed(13)
    prompts = []
    for i in range(4):
        passage = random_prompt(generator, 6 + i)
        prompts.append(passage * 3 + passage[:2])
        prompts.append(random_prompt(generator, 9 + i))
    results = {}
    for k in (0, 4):
        engine = make_engine(model, num_blocks=256, max_num_seqs=16, cuda_graph_max_batch_size=16,
                             speculative_tokens=k, speculative_max_batch=16)
        results[k] = run_engine(engine, {0: [(str(i), p, greedy(24)) for i, p in enumerate(prompts)]})
        if k:
            assert engine.stats().spec_decode_num_accepted_tokens > 0
    assert results[4] == results[0]


def test_lora_mixed_batch_on_the_gpu_matches_peft(tmp_path):
    """Requests of two adapters and of the base model in the same steps, the deltas through the Triton
    BGMV kernel (graphs are off while adapters are served): PEFT's greedy answers on the same GPU."""
    pytest.importorskip("peft")
    from lora_helpers import make_adapter, peft_greedy

    from llm_api.lora.registry import LoraRegistry

    oracle = _cuda_model("llama", torch.float32, seed=3)
    oracle.generation_config.eos_token_id, oracle.generation_config.pad_token_id = None, 0
    folders = {"a": make_adapter(oracle, tmp_path / "a", seed=4, r=16, alpha=32, scale=1.0),
               "b": make_adapter(oracle, tmp_path / "b", seed=5, r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"],
                                 scale=1.0)}
    generator = torch.Generator().manual_seed(17)
    prompts = [random_prompt(generator, 5 + 6 * i) for i in range(3)]
    expected = {}
    for i, prompt in enumerate(prompts):
        expected[f"base-{i}"] = reference_greedy(oracle, prompt, 12)
        for name, folder in folders.items():
            expected[f"{name}-{i}"] = peft_greedy(oracle, folder, prompt, 12)
            assert expected[f"{name}-{i}"] != expected[f"base-{i}"]  # the adapter matters, or this proves nothing
    model = copy.deepcopy(oracle)
    registry = LoraRegistry(model, max_loras=2, max_rank=16)
    ids = {name: registry.load(name, folder).lora_id for name, folder in folders.items()}
    engine = make_engine(model, num_blocks=256, max_num_seqs=16, lora=registry)
    assert engine.attention.name == "triton"
    for i, prompt in enumerate(prompts):
        for name in ("base", *folders):
            engine.add_request(f"{name}-{i}", prompt, greedy(12), lora_id=ids.get(name, 0))
    got = {request_id: [] for request_id in expected}
    while engine.has_unfinished_requests():
        for output in engine.step():
            got[output.request_id].extend(output.new_token_ids)
    assert got == expected


def test_grammar_masks_on_the_gpu(tokenizer_folder):
    """Constrained rows beside free ones with graphs on: the masks (xgrammar's bitmask on CUDA logits) keep
    every token in the grammar, and the free rows get what they get alone."""
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from llm_api.structured.compiler import GrammarCompiler
    from llm_api.structured.matcher import GrammarMatcher
    from llm_api.structured.spec import GrammarSpec
    from llm_api.engine.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    model = _cuda_model("llama", torch.float32, vocab_size=len(tokenizer))
    eos = {tokenizer.eos_token_id}
    compiler = GrammarCompiler(tokenizer, model.config.vocab_size, eos)
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    specs = {"person": GrammarSpec.json_schema(person), "date": GrammarSpec.regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")}
    generator = torch.Generator().manual_seed(23)
    prompts = {rid: random_prompt(generator, 6 + i) for i, rid in enumerate(["person", "date", "free1", "free2"])}
    requests = [(rid, prompts[rid], SamplingParams(max_new_tokens=48, grammar=compiler.compile(specs[rid])))
                for rid in specs] + [(rid, prompts[rid], greedy(16)) for rid in ("free1", "free2")]
    engine = make_engine(model, eos, num_blocks=256, max_num_seqs=8, cuda_graph_max_batch_size=8)
    assert engine.cuda_graph_batch_sizes
    together = run_engine(engine, {0: requests})
    for rid, spec in specs.items():
        tokens, _ = together[rid]
        matcher = GrammarMatcher(compiler.compile(spec))
        assert all(matcher.accept_token(t) for t in tokens), (rid, tokenizer.decode(tokens))
    if together["person"][1] == "stop":
        person_value = json.loads(tokenizer.decode(together["person"][0], skip_special_tokens=True))
        assert set(person_value) == {"name", "age"}
    alone = run_engine(engine, {0: [r for r in requests if r[0].startswith("free")]})
    assert alone == {rid: together[rid] for rid in ("free1", "free2")}
    assert sum(engine.runner.decode_graphs.steps_by_size.values()) > 0


def test_n_choices_on_the_gpu():
    """n > 1 with graphs on: each sampled choice is what its own seed gives alone, and greedy choices are
    generate()'s."""
    from llm_api.engine.sampler import sequence_seed
    from llm_api.engine.sampling_params import SamplingParams

    model = _cuda_model("qwen2", torch.float32, seed=7)
    reference = copy.deepcopy(model)
    prompt = random_prompt(torch.Generator().manual_seed(2), 9)

    def collect(params):
        engine = make_engine(model, num_blocks=256, max_num_seqs=8, cuda_graph_max_batch_size=8)
        engine.add_request("r", prompt, params)
        tokens = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens.setdefault(output.index, []).extend(output.new_token_ids)
        assert sum(engine.runner.decode_graphs.steps_by_size.values()) > 0
        return [tokens[i] for i in sorted(tokens)]

    def sampled(seed, n=1):
        return SamplingParams(max_new_tokens=10, do_sample=True, temperature=1.0, top_k=40, seed=seed, n=n)

    choices = collect(sampled(11, n=3))
    assert len(choices) == 3 and len({tuple(c) for c in choices}) == 3, "the choices must differ"
    for i, choice in enumerate(choices):
        assert collect(sampled(sequence_seed(11, i))) == [choice]
    assert collect(greedy(9, n=2)) == [reference_greedy(reference, prompt, 9)] * 2
