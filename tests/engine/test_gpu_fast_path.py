"""The GPU fast path on a real GPU (skipped without CUDA): Triton attention, CUDA-graph decode, KV sizing.

- A replayed decode step gives exactly (bit for bit) the logits of the same padded step run eagerly.
- The engine with everything on (Triton kernels, graphs, profiled pool) generates greedily what
  ``generate()`` does for random-weight models, in fp32 (in bf16 a one-ulp tie may flip a token).
- The profiled pool fits: after the engine is built, torch holds no more than the utilization allows.
"""

from __future__ import annotations

import copy

import pytest
import torch

from llm_api.engine.cuda_graphs import capture_batch_sizes

from engine_helpers import TINY_CONFIGS, greedy, make_engine, random_prompt, run_engine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda_model(arch: str, dtype: torch.dtype, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(TINY_CONFIGS[arch](), dtype=dtype).to("cuda").eval()


@torch.inference_mode()
def _generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    input_ids = torch.tensor([prompt], device="cuda")
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                            max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return output[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2", "qwen3"])
def test_engine_with_graphs_matches_generate(arch):
    model = _cuda_model(arch, torch.float32)
    reference = copy.deepcopy(model)  # the engine switches its model's attention to the paged one
    engine = make_engine(model, num_blocks=256, max_num_seqs=8, cuda_graph_max_batch_size=8)
    assert engine.attention.name == "triton"
    assert engine.cuda_graph_batch_sizes == capture_batch_sizes(8)
    generator = torch.Generator().manual_seed(11)
    arrivals = {step: [(f"r{step}-{i}", random_prompt(generator, 3 + 7 * i + step), greedy(12 + i))
                       for i in range(3)] for step in (0, 2, 5)}
    results = run_engine(engine, arrivals)
    for arrival in arrivals.values():
        for request_id, prompt, params in arrival:
            assert results[request_id][0] == _generate(reference, prompt, params.max_new_tokens), request_id
    assert sum(engine.runner.decode_graphs.steps_by_size.values()) > 0


def test_replay_equals_eager_bit_for_bit():
    model = _cuda_model("llama", torch.bfloat16)
    engine = make_engine(model, num_blocks=256, max_num_seqs=8, cuda_graph_max_batch_size=8)
    graphs = engine.runner.decode_graphs
    generator = torch.Generator().manual_seed(5)
    for i, length in enumerate([4, 17, 9]):
        engine.add_request(f"s{i}", random_prompt(generator, length), greedy(4))
    engine.step()  # the prompts, eagerly
    scheduled = engine.scheduler.schedule().scheduled
    rows = engine.runner._graph_decode_rows(scheduled)
    assert rows is not None and graphs.padded_size(len(rows)) == 4
    replayed = graphs.run(rows).clone()
    graphs.capture_enabled = False  # the same padded step, eagerly (rewrites the same K/V into the same slots)
    try:
        eager = graphs.run(rows).clone()
    finally:
        graphs.capture_enabled = True
    assert torch.equal(replayed, eager)
    for i in range(3):
        engine.abort_request(f"s{i}")


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
