"""The CUDA-graph decode runner's logic, on CPU: its static-buffer path run eagerly (``capture=False``).

What is checked here is everything but the capture itself: the ladder of batch sizes, padding a batch up
to the next size (padding rows must not touch any real sequence's cache), which steps the runner takes
(pure decode steps that fit) and which it leaves to the eager path, and that an engine stepping through it
still generates what ``generate()`` does. The attention runs in the Triton kernels (interpreted on CPU:
``TRITON_INTERPRET=1`` from tests/conftest.py), as it will inside a captured graph. Capture and replay
themselves are checked on a GPU (tests/engine/test_gpu_fast_path.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llm_api.engine.cuda_graphs import DecodeGraphRunner, DecodeRow, capture_batch_sizes

from engine_helpers import (get_model, greedy, make_engine, needs_cpu_triton, random_prompt, reference_greedy,
                            run_engine)


def test_capture_ladder():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    ladder = capture_batch_sizes(128)
    assert ladder[:5] == [1, 2, 4, 8, 16] and ladder[-1] == 128
    assert all(b - a == 8 for a, b in zip(ladder[4:], ladder[5:]))
    with pytest.raises(ValueError):
        capture_batch_sizes(0)


def _graph_engine(tiny_models, arch, sizes, **config):
    engine_model, _ = get_model(tiny_models, arch)
    engine = make_engine(engine_model, attention_backend="triton", **config)
    engine.runner.enable_decode_graphs(engine.max_model_len, sizes, capture=False)
    return engine


@needs_cpu_triton
@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: sliding window and softcap inside the step
def test_engine_through_the_graph_runner_matches_generate(tiny_models, arch):
    """Five requests arriving over time: decode batches of 1..5 rows, padded to 1, 2 or 4, and 5 rows run
    eagerly (above the largest size); prompt steps run eagerly too."""
    engine = _graph_engine(tiny_models, arch, [1, 2, 4])
    _, reference_model = get_model(tiny_models, arch)
    generator = torch.Generator().manual_seed(7)
    prompts = {f"r{i}": random_prompt(generator, length) for i, length in enumerate([5, 9, 3, 14, 7])}
    arrivals = {0: [("r0", prompts["r0"], greedy(10))], 2: [("r1", prompts["r1"], greedy(8))],
                3: [("r2", prompts["r2"], greedy(9)), ("r3", prompts["r3"], greedy(6))],
                5: [("r4", prompts["r4"], greedy(7))]}
    results = run_engine(engine, arrivals)
    for arrival in arrivals.values():
        for request_id, prompt, params in arrival:
            assert results[request_id][0] == reference_greedy(reference_model, prompt, params.max_new_tokens), request_id
    steps = engine.runner.decode_graphs.steps_by_size
    assert set(steps) == {1, 2, 4} and steps[4] > 0, steps  # some padded (3 rows -> 4), all sizes used


@needs_cpu_triton
def test_preempted_requests_get_fresh_block_rows(tiny_models):
    """Too few blocks for everyone: requests are preempted (their block lists freed and replaced) and
    come back on other blocks, while the runner rewrites only the changed part of each table row."""
    engine = _graph_engine(tiny_models, "llama", [1, 2, 4], block_size=4, num_blocks=14)
    _, reference_model = get_model(tiny_models, "llama")
    generator = torch.Generator().manual_seed(9)
    arrivals = {0: [(f"p{i}", random_prompt(generator, 6 + 3 * i), greedy(14)) for i in range(4)]}
    results = run_engine(engine, arrivals)
    assert engine.stats().num_preemptions > 0
    for request_id, prompt, params in arrivals[0]:
        assert results[request_id][0] == reference_greedy(reference_model, prompt, params.max_new_tokens), request_id
    assert sum(engine.runner.decode_graphs.steps_by_size.values()) > 0


@needs_cpu_triton
def test_padded_step_equals_the_eager_step_and_leaves_other_slots_alone(tiny_models):
    engine = _graph_engine(tiny_models, "llama", [1, 4], block_size=4, num_blocks=64)
    runner, graphs = engine.runner, engine.runner.decode_graphs
    generator = torch.Generator().manual_seed(3)
    # Three prefilled sequences, then one decode step of 3 rows (padded to 4) both ways.
    for i, length in enumerate([6, 8, 11]):
        engine.add_request(f"s{i}", random_prompt(generator, length), greedy(5))
    engine.step()  # prefill (eager): every sequence now holds its prompt and one sampled token
    output = engine.scheduler.schedule()
    scheduled = output.scheduled
    assert [s.num_new_tokens for s in scheduled] == [1, 1, 1]
    caches = [c.clone() for c in engine.kv_cache.key_caches + engine.kv_cache.value_caches]

    graph_logits, requests = runner.execute(output)
    graph_logits = graph_logits.clone()
    assert graphs.steps_by_size == {4: 1}
    written = {s.request.block_ids[s.request.num_computed_tokens // 4] * 4 + s.request.num_computed_tokens % 4
               for s in scheduled}
    for before, after in zip(caches, engine.kv_cache.key_caches + engine.kv_cache.value_caches):
        rows_before, rows_after = before.view(-1, *before.shape[2:]), after.view(-1, *after.shape[2:])
        changed = {int(r) for r in (rows_before != rows_after).any(-1).any(-1).nonzero().flatten()}
        assert changed <= written and changed  # the three real slots only; padding wrote nothing

    runner.decode_graphs = None
    # The same step again, eagerly (its block-table deltas were applied already).
    again = dataclasses.replace(output, scheduled=[dataclasses.replace(s, new_block_ids=[]) for s in scheduled])
    eager_logits, eager_requests = runner.execute(again)
    runner.decode_graphs = graphs
    assert eager_requests == requests
    torch.testing.assert_close(graph_logits, eager_logits, atol=1e-5, rtol=1e-5)
    for i in range(3):
        engine.abort_request(f"s{i}")


@needs_cpu_triton
def test_run_refuses_what_it_cannot_take(tiny_models):
    engine = _graph_engine(tiny_models, "llama", [1, 2])
    graphs = engine.runner.decode_graphs
    assert graphs.accepts(2) and not graphs.accepts(3)
    with pytest.raises(ValueError):
        graphs.run([DecodeRow(1, 0, 0, "r", 0, [0])] * 3)
    too_long = DecodeRow(1, 0, 0, "r", 0, list(range(graphs.max_blocks + 1)))
    with pytest.raises(ValueError, match="blocks"):
        graphs.run([too_long])


def test_graphs_need_a_backend_that_supports_them(tiny_models):
    engine_model, _ = get_model(tiny_models, "llama")
    engine = make_engine(engine_model, attention_backend="torch")
    with pytest.raises(ValueError, match="supports them, not torch"):
        engine.runner.enable_decode_graphs(engine.max_model_len, [1], capture=False)
    assert engine.cuda_graph_batch_sizes == []


@needs_cpu_triton
def test_runner_without_capture_is_not_reported_as_graphs(tiny_models):
    engine = _graph_engine(tiny_models, "llama", [1])
    assert isinstance(engine.runner.decode_graphs, DecodeGraphRunner)
    assert engine.cuda_graph_batch_sizes == []  # eager static-buffer path: no graph was captured
