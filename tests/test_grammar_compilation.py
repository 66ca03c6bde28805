"""Grammar compilation at admission (llm_api.service.grammars) with the embedded tokenizer: off the event
loop, bounded (503 when the queue is full, 408 at the deadline), cached, and errors naming the field."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("xgrammar")

from llm_api.errors import ApiError  # noqa: E402
from llm_api.service.constraints import json_schema_constraint, tool_constraint  # noqa: E402
from llm_api.service.grammars import GrammarCompilation  # noqa: E402
from llm_api.structured.spec import Constraint, GrammarSpec  # noqa: E402
from llm_api.text.tools import HERMES  # noqa: E402

# About 2 to 4 s of compile each on one core (distinct string-length bounds), under the limits.
SLOW = [{"type": "object", "properties": {"a": {"type": "string", "maxLength": 100 + i}}} for i in range(4)]


@pytest.fixture(scope="module")
def tokenizer(embedded_checkpoint_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_checkpoint_path)


def compilation(tokenizer, **kw) -> GrammarCompilation:
    return GrammarCompilation(tokenizer, 49152, [2], num_workers=1, **kw)


def test_compiles_off_the_loop_then_answers_from_the_cache(tokenizer):
    grammars = compilation(tokenizer)
    constraint = json_schema_constraint(SLOW[0], "json_schema")

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        start = time.monotonic()
        compiled = await grammars.compile(constraint)
        seconds = time.monotonic() - start
        task.cancel()
        again = time.monotonic()
        assert await grammars.compile(constraint) is compiled  # from the cache, on the loop
        return ticks, seconds, time.monotonic() - again

    ticks, seconds, cached_seconds = asyncio.run(main())
    # The loop kept running while it compiled: a tick per ~10 ms when idle; a compile holding the GIL would
    # leave next to none (the bound leaves room for a loaded machine).
    assert seconds > 0.5 and ticks > seconds * 5
    assert cached_seconds < seconds / 5 and grammars.num_pending == 0
    grammars.shutdown()


def test_full_queue_is_a_503_and_a_passed_deadline_a_408(tokenizer):
    grammars = compilation(tokenizer, max_pending=1)

    async def main():
        first = asyncio.create_task(grammars.compile(json_schema_constraint(SLOW[1], "json_schema")))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as busy:
            await grammars.compile(json_schema_constraint(SLOW[2], "json_schema"))
        await first
        # A deadline the compiles would pass by their recent time: 503 at once, before any waiting.
        with pytest.raises(ApiError) as hopeless:
            await grammars.compile(json_schema_constraint(SLOW[3], "json_schema"), deadline=time.monotonic() + 0.2)
        # One the estimate lets through but the compile outlasts: 408 at the deadline.
        grammars._recent_compile_s = 0.01
        with pytest.raises(ApiError) as late:
            await grammars.compile(json_schema_constraint(SLOW[3], "json_schema"), deadline=time.monotonic() + 0.2)
        return busy.value, hopeless.value, late.value

    busy, hopeless, late = asyncio.run(main())
    assert busy.status == 503 and busy.code == "overloaded" and busy.retry_after >= 1
    assert hopeless.status == 503 and "deadline" in hopeless.message and hopeless.retry_after >= 1
    assert late.status == 408 and late.code == "timeout"
    grammars.shutdown()


def test_each_key_gets_its_share_and_keys_take_turns(tokenizer):
    """One owner past its share (a quarter of the queue) gets 503 while another is still accepted; with one
    worker, a second owner's compile starts before the first owner's queued ones."""
    grammars = compilation(tokenizer, max_pending=8)
    assert grammars.max_pending_per_owner == 2
    started: list[str] = []
    compile_one = grammars._compile

    def recording(constraint):
        started.append(constraint.param)
        return compile_one(constraint)

    grammars._compile = recording  # type: ignore[method-assign]

    async def main():
        first = [asyncio.create_task(grammars.compile(json_schema_constraint(SLOW[i], f"a{i}"), owner="a"))
                 for i in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as over_share:
            await grammars.compile(json_schema_constraint(SLOW[2], "a2"), owner="a")
        other = asyncio.create_task(grammars.compile(json_schema_constraint(SLOW[3], "b0"), owner="b"))
        await asyncio.gather(*first, other)
        return over_share.value

    over_share = asyncio.run(main())
    assert over_share.status == 503 and "per key" in over_share.message
    assert started == ["a0", "b0", "a1"], started  # b's compile before a's second
    assert grammars.num_pending == 0
    grammars.shutdown()


def test_errors_name_the_field_and_the_tool_at_fault(tokenizer):
    grammars = compilation(tokenizer)
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "bad", "parameters": {"$ref": "#/$defs/missing"}}}]

    async def refusal(constraint: Constraint) -> ApiError:
        with pytest.raises(ApiError) as err:
            await grammars.compile(constraint)
        return err.value

    bad_regex = asyncio.run(refusal(Constraint(GrammarSpec.regex("(a"), "regex")))
    assert bad_regex.status == 400 and bad_regex.param == "regex" and bad_regex.code == "invalid_grammar"
    assert "'regex'" in bad_regex.message and "regex" in bad_regex.message.lower()
    bad_tool = asyncio.run(refusal(tool_constraint(HERMES, tools, "auto", True)))
    assert bad_tool.param == "tools[1].function.parameters" and "missing" in bad_tool.message
    grammars.shutdown()
