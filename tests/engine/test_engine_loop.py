"""EngineLoop: streams interleave, aborts and cancelled consumers free blocks, errors end streams."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch

from engine_helpers import assert_engine_idle, get_model, greedy, make_engine, random_prompt, reference_greedy
from llm_api.service.engine_loop import EngineLoop
from llm_api.engine.scheduler import PromptTooLongError


@pytest.fixture
def async_engine(tiny_models):
    model, reference_model = get_model(tiny_models, "llama")
    engine = EngineLoop(make_engine(model, num_blocks=32))
    yield engine, reference_model
    engine.shutdown()


def _wait_idle(engine: EngineLoop, timeout: float = 10.0) -> None:
    """The engine thread applies aborts between steps: wait for it, then check every block is free."""
    deadline = time.monotonic() + timeout
    while engine.core.has_unfinished_requests() or engine._commands:
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.01)
    assert_engine_idle(engine.core)


def test_concurrent_streams_interleave_and_match_generate(async_engine):
    engine, reference_model = async_engine
    generator = torch.Generator().manual_seed(21)
    prompts = {"first": random_prompt(generator, 12), "second": random_prompt(generator, 7)}
    events: list[tuple[str, list[int], bool]] = []

    async def consume(request_id, after: asyncio.Event | None, streaming: asyncio.Event | None):
        if after is not None:
            await after.wait()  # not a fixed delay: a slow or fast machine could finish the first by then
        tokens = []
        async for output in engine.generate(request_id, prompts[request_id], greedy(40)):
            tokens += output.new_token_ids
            events.append((request_id, output.new_token_ids, output.finished))
            if streaming is not None:
                streaming.set()
        return tokens

    async def main():
        first_streams = asyncio.Event()
        return await asyncio.gather(consume("first", None, first_streams), consume("second", first_streams, None))

    first, second = asyncio.run(main())
    assert first == reference_greedy(reference_model, prompts["first"], 40)
    assert second == reference_greedy(reference_model, prompts["second"], 40)
    first_done = next(i for i, e in enumerate(events) if e[0] == "first" and e[2])
    second_starts = next(i for i, e in enumerate(events) if e[0] == "second")
    assert second_starts < first_done, "the second request should stream before the first finishes"
    _wait_idle(engine)


def test_add_errors_reach_the_caller_before_any_output(async_engine):
    engine, _ = async_engine

    async def main():
        with pytest.raises(PromptTooLongError):
            async for _ in engine.generate("long", list(range(500)), greedy(4)):
                pass
        # The engine keeps serving afterwards.
        return [o async for o in engine.generate("ok", [1, 2, 3], greedy(3))]

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    _wait_idle(engine)


def test_duplicate_request_id_is_refused_without_touching_the_first(async_engine):
    engine, reference_model = async_engine
    prompt = [9, 8, 7, 6]

    async def main():
        first = engine.generate("same", prompt, greedy(30))
        second = engine.generate("same", [1, 2], greedy(5))
        # Both adds reach the engine thread in one batch (it takes its commands under this lock), so the first
        # is still running when the second is applied, however soon a loaded host would let it finish.
        with engine._wakeup:
            first_output = asyncio.ensure_future(first.__anext__())
            second_output = asyncio.ensure_future(second.__anext__())
            while len(engine._commands) < 2:
                await asyncio.sleep(0)
        with pytest.raises(ValueError, match="already in use"):
            await second_output
        output = await first_output
        tokens = list(output.new_token_ids)
        async for output in first:
            tokens += output.new_token_ids
        return tokens, output.finish_reason

    assert asyncio.run(main()) == (reference_greedy(reference_model, prompt, 30), "length")
    _wait_idle(engine)


def test_abort_ends_the_stream_and_frees_blocks(async_engine):
    engine, _ = async_engine

    async def main():
        outputs = []
        async for output in engine.generate("r", [5, 6, 7, 8, 9], greedy(100)):
            outputs.append(output)
            if len(outputs) == 3:
                engine.abort("r")
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert 3 <= len(outputs) < 100
    _wait_idle(engine)


def test_consumer_that_stops_or_is_cancelled_aborts_its_request(async_engine):
    engine, _ = async_engine

    async def stops_early():
        # aclosing: leaving the loop closes the generator at once, and its finally aborts the request.
        async with contextlib.aclosing(engine.generate("leaver", [1, 2, 3, 4], greedy(100))) as stream:
            async for _ in stream:
                break
        await asyncio.to_thread(_wait_idle, engine)  # freed while this event loop is still running

    async def cancelled():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate("cancelled", [4, 3, 2, 1], greedy(100)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def main():
        await stops_early()
        await cancelled()

    asyncio.run(main())
    _wait_idle(engine)
    assert engine.core.stats().num_decode_tokens_computed < 150  # both stopped long before 100 tokens


def test_step_error_ends_every_stream_with_the_error(async_engine):
    engine, _ = async_engine
    runner = engine.core.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def failing_execute(scheduled):  # fault injection: the 4th forward raises
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("injected failure")
        return real_execute(scheduled)

    runner.execute = failing_execute

    async def consume(request_id):
        async for _ in engine.generate(request_id, [1, 2, 3], greedy(50)):
            pass

    async def main():
        return await asyncio.wait_for(asyncio.gather(consume("a"), consume("b"), return_exceptions=True), 10)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "injected" in str(r) for r in results)
    runner.execute = real_execute
    _wait_idle(engine)

    async def again():
        return [o async for o in engine.generate("after", [1, 2, 3], greedy(2))]

    assert asyncio.run(again())[-1].finished  # the engine still serves after a failed step


class _SlowCore:
    """A core whose steps take 0.2 s (a contended CPU) and whose requests never finish by themselves."""

    def __init__(self):
        self.live: set[str] = set()

    def add_request(self, request_id, prompt_token_ids, params, prompt_embeds=None):
        self.live.add(request_id)

    def abort_request(self, request_id, index=None):
        self.live.discard(request_id)

    def has_unfinished_requests(self):
        return bool(self.live)

    def run_step(self, on_outputs):
        time.sleep(0.2)
        on_outputs([])

    def stats(self):
        return None


@pytest.mark.parametrize("how", ["caller_leaves", "abort_by_id"])
def test_an_abort_that_arrives_before_its_add_is_applied_leaves_no_request_behind(how):
    from llm_api.engine.sampling_params import SamplingParams

    core = _SlowCore()
    engine = EngineLoop(core, num_threads=1)

    async def consume(request_id):
        async for _ in engine.generate(request_id, [1, 2, 3], SamplingParams(max_new_tokens=5)):
            pass

    async def main():
        busy = asyncio.create_task(consume("busy"))  # keeps the engine in its 0.2 s steps
        await asyncio.sleep(0.1)  # mid-step: the next add and its abort both wait behind this step
        if how == "caller_leaves":  # its deadline passes before the add is applied
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(consume("late"), 0.02)
            waiting = None
        else:  # the cancel route: an abort by id, the caller still reading
            waiting = asyncio.create_task(consume("late"))
            await asyncio.sleep(0.02)
            engine.abort("late")
        await asyncio.sleep(0.6)  # a few steps later
        for task in (busy, waiting):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return set(core.live)

    try:
        assert "late" not in asyncio.run(main())
    finally:
        engine.shutdown()
