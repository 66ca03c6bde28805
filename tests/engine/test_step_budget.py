"""The per-step token budget sized to a CPU (MAX_NUM_BATCHED_TOKENS=0): measured at engine start, a
multiple of the block size, never below max_num_seqs, robust to noisy timings, and the engine it sizes still
matches generate(); cached per host and settings, re-measured while idle and only ever raised, bounded below
by the model's arithmetic; a re-measurement gives way to a request that arrives."""

from __future__ import annotations

import json
import shutil
import time

import torch

from engine_helpers import KERNELS_CACHE, assert_engine_idle, get_model, greedy, make_engine, random_prompt, reference_greedy
from llm_api.engine import step_budget
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


# -------------------------------------------------------------------------------------------------------
# The quiet figure: cached per host, model and settings, re-measured while idle, raised only.


def test_a_second_engine_takes_the_cached_budget_without_probing(tiny_models, tmp_path, monkeypatch, caplog):
    model, _ = get_model(tiny_models, "llama")
    cache = str(tmp_path / "step-budget")
    with caplog.at_level("INFO", logger="llm_api.engine.step_budget"):
        first = make_engine(model, max_num_batched_tokens=None, max_num_seqs=8, step_budget_cache=cache)
    assert any("measured at start" in r.getMessage() for r in caplog.records)
    assert len(list((tmp_path / "step-budget").glob("*.json"))) == 1

    def no_probe(*args, **kwargs):
        raise AssertionError("probed although the budget was cached")

    monkeypatch.setattr(step_budget, "measure", no_probe)
    caplog.clear()
    with caplog.at_level("INFO", logger="llm_api.engine.step_budget"):
        second = make_engine(model, max_num_batched_tokens=None, max_num_seqs=8, step_budget_cache=cache)
    assert second.config.max_num_batched_tokens == first.config.max_num_batched_tokens
    assert any("from the cache" in r.getMessage() for r in caplog.records)
    # Another setting the budget depends on is another key: measured again.
    monkeypatch.undo()
    third = make_engine(model, max_num_batched_tokens=None, max_num_seqs=4, step_budget_cache=cache)
    assert third.step_budget is not None and third.step_budget.key != second.step_budget.key
    assert len(list((tmp_path / "step-budget").glob("*.json"))) == 2
    # So is running the owned model's whole layers in C (a shorter step), where a C compiler builds them.
    if shutil.which("cc") or shutil.which("gcc"):
        fourth = make_engine(model, max_num_batched_tokens=None, max_num_seqs=4, step_budget_cache=cache,
                             cpu_kernels_cache=KERNELS_CACHE)
        assert fourth.runner.path.whole_layers and fourth.step_budget is not None
        assert fourth.step_budget.key != third.step_budget.key


def test_re_measuring_while_idle_only_raises_the_budget(tiny_models, tmp_path, monkeypatch):
    """A busy start measures a small budget; a quiet re-measurement raises it (engine and cache); a busy one
    later changes nothing."""
    model, reference_model = get_model(tiny_models, "llama")
    busy, quiet = step_budget.Timing(0.004, 0.1), step_budget.Timing(0.0005, 0.01)  # 64 and 512 tokens
    timings = iter([busy, quiet, busy])
    monkeypatch.setattr(step_budget, "measure", lambda *args, **kwargs: next(timings))
    # (this tiny model's arithmetic alone would allow the largest budget: floor it at one block here)
    monkeypatch.setattr(step_budget, "analytic_floor", lambda *args: step_budget.Timing(1.0, 0.0))
    cache = tmp_path / "step-budget"
    engine = make_engine(model, max_num_batched_tokens=None, max_num_seqs=8, step_budget_cache=str(cache))
    assert engine.config.max_num_batched_tokens == 64
    assert engine.idle_work_delay() == step_budget.REFINE_IDLE_S[0]
    engine.idle_work()
    assert engine.config.max_num_batched_tokens == engine.scheduler.config.max_num_batched_tokens == 512
    engine.idle_work()
    assert engine.scheduler.config.max_num_batched_tokens == 512  # the busy figure is ignored
    assert json.loads(next(cache.glob("*.json")).read_text())["budget"] == 512  # the cache keeps the quiet one
    assert_engine_idle(engine)  # the probes' blocks went back to the pool
    prompt = random_prompt(torch.Generator().manual_seed(5), 30)
    engine.add_request("r", prompt, greedy(8))
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert tokens == reference_greedy(reference_model, prompt, 8)


def test_a_request_stops_the_re_measurement_before_its_next_chunk(tiny_models, tmp_path, monkeypatch):
    """measure() runs no chunk once interrupted; an interrupted re-measurement changes nothing, counts as
    not done (the same one is due at the next idle spell) and gives its blocks back."""
    model, reference_model = get_model(tiny_models, "llama")
    engine = make_engine(model, max_num_batched_tokens=None, max_num_seqs=8, step_budget_cache=str(tmp_path / "c"))
    budget, done = engine.config.max_num_batched_tokens, engine.step_budget._refinements_done
    chunks = []
    real = step_budget._timed_prefill
    monkeypatch.setattr(step_budget, "_timed_prefill", lambda *args: chunks.append(args[1]) or real(*args))
    engine.idle_work(lambda: len(chunks) >= 3)  # (a request arrives during the third chunk)
    assert len(chunks) == 3
    assert engine.config.max_num_batched_tokens == budget and engine.step_budget._refinements_done == done
    assert_engine_idle(engine)
    engine.idle_work()  # uninterrupted: it runs to its end and counts (the next delay is due)
    assert len(chunks) > 3 + 2 and engine.step_budget._refinements_done == done + 1


def test_the_engine_loop_interrupts_idle_work_when_a_message_arrives():
    """The loop's idle work is told when a message waits (it stops within a chunk), and the message is then
    applied."""
    import threading

    from llm_api.service.engine_loop import EngineLoop

    class Core:
        def __init__(self):
            self.began, self.waited, self.aborted = threading.Event(), None, []

        def add_request(self, *args, **kwargs): ...
        def abort_request(self, request_id, index=None): self.aborted.append(request_id)
        def has_unfinished_requests(self): return False
        def run_step(self, on_outputs): ...
        def stats(self): return None
        def idle_work_delay(self): return 0.01 if self.waited is None else None

        def idle_work(self, interrupted):  # a long re-measurement, asking between its chunks
            self.began.set()
            started = time.monotonic()
            while not interrupted() and time.monotonic() - started < 30:
                time.sleep(0.01)
            self.waited = time.monotonic() - started

    core = Core()
    loop = EngineLoop(core)
    try:
        assert core.began.wait(5)
        loop.abort("x")  # any message
        deadline = time.monotonic() + 5
        while not core.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.aborted == ["x"] and core.waited is not None and core.waited < 5
    finally:
        loop.shutdown()


def test_the_analytic_floor_bounds_a_swamped_probe(tiny_models, monkeypatch):
    """A probe whose fixed cost alone exceeds the step target would give one block; the floor, from the
    model's arithmetic, gives what a slow core still manages."""
    model, _ = get_model(tiny_models, "llama")
    monkeypatch.setattr(step_budget, "measure", lambda *args, **kwargs: step_budget.Timing(0.01, 5.0))
    engine = make_engine(model, max_num_batched_tokens=None, max_num_seqs=2, block_size=4)
    floor = step_budget.budget_for(step_budget.analytic_floor(model, torch.get_num_threads()), 4, 2)
    assert floor > 4 and engine.config.max_num_batched_tokens == floor


def test_the_engine_loop_runs_idle_work_only_when_idle():
    """The loop calls idle_work() once the core has been idle for its delay, not while it has requests."""
    from llm_api.service.engine_loop import EngineLoop

    class Core:
        def __init__(self):
            self.idle_calls = 0

        def add_request(self, *args, **kwargs): ...
        def abort_request(self, *args, **kwargs): ...
        def has_unfinished_requests(self): return False
        def run_step(self, on_outputs): ...
        def stats(self): return None
        def idle_work_delay(self): return 0.05 if self.idle_calls < 3 else None
        def idle_work(self, interrupted): self.idle_calls += 1

    core = Core()
    loop = EngineLoop(core)
    try:
        deadline = time.monotonic() + 5
        while core.idle_calls < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert core.idle_calls == 3  # and none once the core says there is nothing left
    finally:
        loop.shutdown()
