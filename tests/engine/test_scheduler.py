"""The scheduler: one named test per scheduling rule, and thousands of seeded random operations.

Rules (llm_api/engine/scheduler.py): running requests are scheduled before waiting ones; the token
budget caps a step; a long prompt is prefilled in chunks; full cached blocks are reused (prefix hits);
when blocks run out the newest running request is preempted and recomputed later, and nothing waiting is
admitted in that step; the output carries each request's new block ids. No model, no torch.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from llm_api.engine.block_pool import BlockPool
from llm_api.engine.model_runner import BlockTables
from llm_api.engine.request import FinishReason, Request, RequestStatus
from llm_api.engine.sampling_params import SamplingParams
from llm_api.engine.scheduler import PromptTooLongError, Scheduler
from llm_api.engine.scheduler_config import SchedulerConfig

BLOCK_SIZE = 4


def _scheduler(num_blocks=64, max_num_seqs=8, budget=64, max_model_len=200, eos=()):
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), BlockPool(num_blocks, BLOCK_SIZE), set(eos))


def _step(scheduler, token=1):
    """One schedule + update with every sampling request given ``token``; returns the output."""
    output = scheduler.schedule()
    scheduler.update(output, {s.request.request_id: token for s in output.scheduled if s.samples})
    return output


def _ids(output):
    return [s.request.request_id for s in output.scheduled]


def test_running_requests_are_scheduled_before_waiting_ones():
    scheduler = _scheduler(budget=10)
    scheduler.add(_request("a", [1] * 8, 20))
    scheduler.add(_request("b", [2] * 8, 20))
    first = _step(scheduler)
    assert _ids(first) == ["a", "b"] and [s.num_new_tokens for s in first.scheduled] == [8, 2]  # b: a chunk
    scheduler.add(_request("c", [3] * 4, 20))
    second = _step(scheduler)
    # a decodes (1), b finishes its prompt (6), only then c is admitted with what is left (3).
    assert _ids(second) == ["a", "b", "c"] and [s.num_new_tokens for s in second.scheduled] == [1, 6, 3]


def test_the_token_budget_caps_every_step_and_max_num_seqs_the_running_set():
    scheduler = _scheduler(budget=12, max_num_seqs=2)
    for i in range(4):
        scheduler.add(_request(f"r{i}", [i + 1] * 5, 3))
    output = _step(scheduler)
    assert output.num_batched_tokens <= 12 and len(scheduler.running) == 2 and len(scheduler.waiting) == 2


def test_a_long_prompt_is_prefilled_in_chunks_and_samples_only_at_its_end():
    scheduler = _scheduler(budget=16)
    scheduler.add(_request("long", list(range(1, 41)), 2))
    chunks = []
    while True:
        output = _step(scheduler)
        item = output.scheduled[0]
        chunks.append((item.num_new_tokens, item.samples))
        if item.samples:
            break
    assert chunks == [(16, False), (16, False), (8, True)]


def test_full_cached_blocks_are_reused_by_a_request_with_the_same_prefix():
    scheduler = _scheduler()
    prefix = list(range(1, 13))  # three full blocks
    scheduler.add(_request("first", prefix + [50, 51], 1))
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    scheduler.add(_request("second", prefix + [60], 1))
    output = scheduler.schedule()
    item = output.scheduled[0]
    assert item.request.num_computed_tokens == 12 and item.num_new_tokens == 1  # only the new token computed
    assert scheduler.counters.prefix_cache_hits == 12


def test_each_output_reports_the_prompt_tokens_its_first_admission_found_cached():
    scheduler = _scheduler()
    prefix = list(range(1, 13))  # three full blocks
    scheduler.add(_request("first", prefix + [50, 51], 1))
    firsts = []
    while scheduler.has_unfinished_requests():
        firsts += scheduler.update(output := scheduler.schedule(),
                                   {s.request.request_id: 1 for s in output.scheduled if s.samples})
    assert [o.num_cached_tokens for o in firsts] == [0]  # nothing was cached before it
    scheduler.add(_request("second", prefix + [60], 2))
    seconds = []
    while scheduler.has_unfinished_requests():
        seconds += scheduler.update(output := scheduler.schedule(),
                                    {s.request.request_id: 1 for s in output.scheduled if s.samples})
    assert [o.num_cached_tokens for o in seconds] == [12, 12]


def test_the_newest_running_request_is_preempted_first_and_recomputed_later():
    scheduler = _scheduler(num_blocks=6, budget=64)  # 24 token slots; each request alone needs 20
    scheduler.add(_request("old", [1] * 7, 13))
    scheduler.add(_request("new", [2] * 7, 13))
    preempted = []
    while not preempted:
        output = _step(scheduler)
        preempted = output.preempted_request_ids
        assert "new" not in _ids(output) or "old" in _ids(output)
    assert preempted == ["new"] and scheduler.requests["new"].status is RequestStatus.PREEMPTED
    assert output.ended_request_ids == ["new"]  # the runner drops its copy of the table
    assert scheduler.requests["new"].block_ids == [] and scheduler.waiting[0].request_id == "new"
    while "new" not in _ids(output):
        output = _step(scheduler)
    resumed = next(s for s in output.scheduled if s.request.request_id == "new")
    assert resumed.is_new and resumed.new_block_ids == resumed.request.block_ids  # rebuilt from scratch


def test_nothing_waiting_is_admitted_in_a_step_that_preempted():
    scheduler = _scheduler(num_blocks=6, budget=64)
    scheduler.add(_request("a", [1] * 7, 30))
    scheduler.add(_request("b", [2] * 7, 30))
    while True:
        scheduler.add(_request(f"w{len(scheduler.requests)}", [9], 1)) if not scheduler.waiting else None
        output = _step(scheduler)
        if output.preempted_request_ids:
            assert not any(s.is_new for s in output.scheduled)
            break


def test_the_output_carries_new_block_ids_per_step():
    scheduler = _scheduler(budget=64)
    scheduler.add(_request("r", [1] * 6, 10))
    first = _step(scheduler)
    assert first.scheduled[0].is_new and first.scheduled[0].new_block_ids == scheduler.requests["r"].block_ids
    grown = []
    for _ in range(6):
        output = _step(scheduler)
        grown += output.scheduled[0].new_block_ids
        assert not output.scheduled[0].is_new
    assert first.scheduled[0].new_block_ids + grown == scheduler.requests["r"].block_ids


def test_eos_max_new_tokens_and_abort_finish_and_free():
    scheduler = _scheduler(eos={0})
    scheduler.add(_request("eos", [1, 2], 10))
    scheduler.add(_request("len", [1, 2], 2))
    outputs = {}
    for tokens in ({"eos": 5, "len": 5}, {"eos": 0, "len": 6}):  # 0 is the EOS id
        output = scheduler.schedule()
        for out in scheduler.update(output, {s.request.request_id: tokens[s.request.request_id]
                                             for s in output.scheduled if s.samples}):
            outputs.setdefault(out.request_id, []).append(out)
    assert outputs["eos"][-1].finish_reason is FinishReason.STOP and outputs["len"][-1].finish_reason is FinishReason.LENGTH
    scheduler.add(_request("cut", [1, 2, 3], 10))
    _step(scheduler)
    [aborted] = scheduler.abort("cut")
    assert aborted.finish_reason is FinishReason.ABORT
    assert scheduler.block_pool.num_free_blocks == scheduler.block_pool.num_blocks


def _request(request_id: str, prompt: list[int], max_new_tokens: int, arrival: int = 0, priority: int = 0,
             owner: str = "") -> Request:
    return Request(request_id, prompt, SamplingParams(max_new_tokens=max_new_tokens), priority=priority, owner=owner)


def _waiting(scheduler):
    return [r.request_id for r in scheduler.waiting]


def test_the_waiting_queue_is_in_priority_order_then_arrival_order():
    scheduler = _scheduler(max_num_seqs=1)
    for name, priority in (("a", 0), ("b", 1), ("c", 0), ("d", -1), ("e", 1)):
        scheduler.add(_request(name, [1] * 4, 2, priority=priority))
    assert _waiting(scheduler) == ["d", "a", "c", "b", "e"]
    served = []
    while scheduler.has_unfinished_requests():
        served += [i for i in _ids(_step(scheduler)) if i not in served]
    assert served == ["d", "a", "c", "b", "e"]


def test_memory_short_preempts_the_worst_priority_not_the_newest():
    scheduler = _scheduler(num_blocks=6, budget=64)  # 24 token slots; each request alone needs 20
    scheduler.add(_request("old-low", [1] * 7, 13, priority=5))
    scheduler.add(_request("new-high", [2] * 7, 13, priority=0))
    preempted = []
    while not preempted:
        preempted = _step(scheduler).preempted_request_ids
    assert preempted == ["old-low"] and _waiting(scheduler) == ["old-low"]


def test_a_better_priority_preempts_worse_running_sequences_to_be_admitted():
    # Sequence slots: two low-priority sequences hold both; a high-priority one preempts the newer.
    scheduler = _scheduler(max_num_seqs=2)
    scheduler.add(_request("low1", [1] * 4, 30, priority=1))
    scheduler.add(_request("low2", [2] * 4, 30, priority=1))
    _step(scheduler)
    scheduler.add(_request("high", [3] * 4, 3, priority=0))
    output = _step(scheduler)
    assert output.preempted_request_ids == ["low2"] and "high" in _ids(output)
    assert _waiting(scheduler) == ["low2"]  # in front of its own priority, behind nothing better
    # Blocks: low-priority sequences hold the pool; a high-priority prompt preempts as many as it needs.
    scheduler = _scheduler(num_blocks=8, budget=64)  # 32 slots
    for i in range(3):
        scheduler.add(_request(f"low{i}", [i + 1] * 9, 30, priority=2))
    _step(scheduler)  # 3 x 3 blocks > 8: the third waits
    assert _ids(_step(scheduler)) == ["low0", "low1"] and _waiting(scheduler) == ["low2"]
    scheduler.add(_request("high", [7] * 12, 2, priority=-1))
    output = _step(scheduler)
    assert output.preempted_request_ids == ["low1"] and "high" in _ids(output)
    assert _waiting(scheduler) == ["low1", "low2"]
    # Equal priorities never preempt for admission: the newcomer waits its turn.
    scheduler = _scheduler(max_num_seqs=2)
    for name in ("a", "b"):
        scheduler.add(_request(name, [1] * 4, 30))
    _step(scheduler)
    scheduler.add(_request("c", [3] * 4, 3))
    assert not _step(scheduler).preempted_request_ids and _waiting(scheduler) == ["c"]


@pytest.mark.parametrize("seed, priorities, owners, grants", [
    (0, False, 1, {}), (1, False, 1, {}), (2, True, 1, {}), (3, True, 1, {}), (4, False, 3, {}), (5, True, 2, {}),
    (6, True, 3, {"owner0": -1, "owner2": 1})])
def test_random_scheduler_operations_keep_invariants(seed, priorities, owners, grants):
    """Scheduler + pool with fake sampled tokens: adds, aborts, steps, preemptions, prefix hits (and with
    ``priorities`` each request of a random priority, so priority preemptions too; with several ``owners``
    each request of a random one, so fair-share preemptions, caps and reservations too; with ``grants``, owners
    ranked against each other, so rank preemptions too)."""
    rng = random.Random(seed)
    pool = BlockPool(num_blocks=40, block_size=BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=120,
                                          priority_grants=grants), pool, eos_token_ids={0})
    shared_prefix = [rng.randrange(1, 50) for _ in range(14)]
    runner_tables = BlockTables()  # what the model runner rebuilds from the scheduler's deltas
    tokens_out: dict[str, list[int]] = {}
    limits: dict[str, tuple[int, int]] = {}  # request id -> (prompt length, max_new_tokens)
    finished: dict[str, str] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.15:
            prompt = (shared_prefix if rng.random() < 0.5 else []) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
            request_id = f"r{step}"
            max_new_tokens = rng.randrange(1, 40)
            scheduler.add(_request(request_id, prompt, max_new_tokens, step,
                                   rng.choice((-1, 0, 0, 1)) if priorities else 0, f"owner{rng.randrange(owners)}"))
            tokens_out[request_id] = []
            limits[request_id] = (len(prompt), max_new_tokens)
        elif op < 0.2 and scheduler.requests:
            request_id = rng.choice(list(scheduler.requests))
            assert len(scheduler.abort(request_id)) == 1
            finished[request_id] = "abort"
        else:
            output = scheduler.schedule()
            assert output.num_batched_tokens <= 24 and len(scheduler.running) <= 6
            runner_tables.update(output)
            for s in output.scheduled:  # the deltas rebuild exactly the scheduler's tables
                assert runner_tables[s.request.request_id] == s.request.block_ids
            # A deterministic "model": the next token depends only on the position, so recomputation
            # after preemption must reproduce the same tokens.
            sampled = {s.request.request_id: (s.request.num_tokens * 7) % 50 for s in output.scheduled if s.samples}
            for out in scheduler.update(output, sampled):
                tokens_out[out.request_id] += out.new_token_ids
                if out.finished:
                    finished[out.request_id] = out.finish_reason
        holders = {r.request_id: r.block_ids for r in scheduler.running}
        assert all(not r.block_ids for r in scheduler.waiting)
        pool.check_invariants(holders)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update(output, {s.request.request_id: 1 for s in output.scheduled if s.samples})
    pool.check_invariants({})
    assert pool.num_free_blocks == pool.num_blocks
    assert scheduler.counters.num_preemptions > 0 and scheduler.counters.prefix_cache_hits > 0
    # No token lost or repeated across preemptions; stops exactly at EOS (0), max_new_tokens or length.
    for request_id, reason in finished.items():
        if reason == "abort":
            continue
        num_prompt, max_new_tokens = limits[request_id]
        expected = []
        while True:
            expected.append(((num_prompt + len(expected)) * 7) % 50)
            if expected[-1] == 0 or len(expected) == max_new_tokens or num_prompt + len(expected) >= 120:
                break
        assert tokens_out[request_id] == expected, request_id
        assert reason == ("stop" if expected[-1] == 0 else "length")


def test_scheduler_refuses_prompt_that_cannot_fit():
    scheduler = Scheduler(SchedulerConfig(4, 64, max_model_len=32), BlockPool(8, BLOCK_SIZE), set())
    with pytest.raises(PromptTooLongError, match="limit is 31"):
        scheduler.add(_request("r", list(range(32)), 4, 0))
    scheduler.add(_request("ok", list(range(31)), 4, 1))


def test_scheduler_and_block_pool_do_not_import_torch():
    code = ("import sys; import llm_api.engine.scheduler, llm_api.engine.block_pool; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
