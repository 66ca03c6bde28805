"""Hostile grammars through both front ends (TorchServe async mode and ``llm_api serve``).

What this proves, with a witness stream beside every request (``hostile.Witness``):

* a generated corpus of grammars built to cost compile time or memory -- deep nesting (10 to 2,000
  levels), wide alternations (``enum``/``anyOf`` of 10 to 10,000), length and item-count explosions
  (``maxLength``/``minItems`` up to 10**9), recursive and self-referencing ``$ref``, regex repetition
  counts up to 10**6 and nested quantifiers -- sent as the native ``json_schema``/``regex``/``grammar``
  fields and as OpenAI ``response_format``: each gets either a 400 in its route's error shape whose
  message names the limit (``invalid_grammar``; request JSON nested deeper than 32 levels is refused
  before it is a grammar: ``invalid_json``/``invalid_parameter``), or a 200, each within a bounded time; the witness does not
  stall and the worker (or the server) is the same process afterwards;
* a burst of slow but legal compiles (more than the 16 that may be pending) gets only 200s and 503
  ``overloaded`` with ``Retry-After``, never a 5xx or a hang, without stalling the witness; afterwards the
  server answers a normal structured request with output that follows its schema.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from bench.harness import hostile
import pytest

pytestmark = pytest.mark.server

# Where an answer names the limit it hit: each refusal's message must hold one of these.
LIMIT_WORDS = ("limit is", "nested deeper than", "nested too deeply", "invalid JSON schema", "invalid regex",
               "invalid EBNF", "accepts no output")
# A grammar is refused as a grammar (invalid_grammar), or earlier, as request JSON nested deeper than a
# request may be (32 levels: invalid_json for a body, invalid_parameter for a JSON-valued native field).
REFUSAL_TYPES = ("invalid_grammar", "invalid_json", "invalid_parameter")
SERVED_WITHIN_S = 30  # a hostile grammar that is served must still be answered in bounded time
BURST = 40  # more than MAX_PENDING_COMPILES (16) at once


def _deep_object(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + '},"required":["a"]}' * depth


def _deep_array(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


def _deep_any_of(depth: int) -> str:
    return '{"anyOf":[{"type":"null"},' * depth + '{"type":"integer"}' + "]}" * depth


def corpus() -> list[tuple[str, str, str]]:
    """(case name, native field, grammar source): parameters -> grammars, one per size of each shape."""
    cases = []
    for depth in (10, 30, 65, 400, 2000):
        cases += [(f"object nested {depth}", "json_schema", _deep_object(depth)),
                  (f"array nested {depth}", "json_schema", _deep_array(depth)),
                  (f"anyOf nested {depth}", "json_schema", _deep_any_of(depth)),
                  (f"regex groups nested {depth}", "regex", "(" * depth + "a" + ")" * depth)]
    for width in (10, 1000, 10000):
        cases += [(f"enum of {width}", "json_schema", json.dumps({"enum": [f"v{i}" for i in range(width)]})),
                  (f"anyOf of {width}", "json_schema",
                   json.dumps({"anyOf": [{"const": i} for i in range(width)]})),
                  (f"regex alternation of {width}", "regex", "|".join(f"w{i}" for i in range(width)))]
    for bound in (300, 10**6, 10**9):
        cases += [(f"maxLength {bound}", "json_schema", json.dumps({"type": "string", "maxLength": bound})),
                  (f"minLength {bound}", "json_schema", json.dumps({"type": "string", "minLength": bound})),
                  (f"items {bound}", "json_schema",
                   json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": bound, "maxItems": bound})),
                  (f"regex a{{{bound}}}", "regex", f"a{{{bound}}}"),
                  (f"pattern (ab){{{bound}}}", "json_schema",
                   json.dumps({"type": "string", "pattern": f"(ab){{{bound}}}"})),
                  (f"ebnf a{{{bound}}}", "grammar", f'root ::= "a"{{{bound}}}')]
    cases += [("recursive $ref", "json_schema", json.dumps(
                  {"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
                   "$ref": "#/$defs/n"})),
              ("self $ref", "json_schema", json.dumps({"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"})),
              ("$ref cycle of 300", "json_schema", json.dumps(
                  {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % 300}"} for i in range(300)}, "$ref": "#/$defs/d0"})),
              ("nested quantifiers", "regex", "((a*)*)*b"),
              ("nested quantifiers 2", "regex", "(((a|b)+)+)+c{200}"),
              ("nested counted", "regex", "((a{15}){15}){15}"),
              ("65,537 characters", "regex", "a" * 65537)]
    return cases


def _request(server, index: int, field: str, source: str) -> tuple[str, bool, hostile.Answer, float]:
    """Case ``index`` alternates between the native route and OpenAI's ``response_format`` (JSON schemas)."""
    openai = field == "json_schema" and index % 2 == 1
    if openai:
        try:
            schema = json.loads(source)
        except (ValueError, RecursionError):
            openai = False
    start = time.monotonic()
    if openai:
        answer = hostile.post_json(server, hostile.openai_path(server, "chat/completions"), {
            "model": server.model_name, "messages": [{"role": "user", "content": "JSON:"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    else:
        answer = hostile.post_json(server, hostile.native_path(server),
                                   {"text": "Answer:", field: source, "max_new_tokens": 4, "stream": False})
    return ("openai" if openai else "native"), openai, answer, time.monotonic() - start


def test_hostile_grammar_corpus(async_frontend):
    server = async_frontend
    cases = corpus()
    answers: Counter = Counter()
    slowest = 0.0
    problems = []
    with hostile.Witness(server) as witness:
        for index, (name, field, source) in enumerate(cases):
            route, openai, answer, seconds = _request(server, index, field, source)
            answers[hostile.outcome(answer)] += 1
            slowest = max(slowest, seconds)
            label = f"{name} ({route})"
            if seconds > 1:
                print(f"slow: {label}: {hostile.outcome(answer)} after {seconds:.2f} s")
            if answer.status == 200:
                if seconds > SERVED_WITHIN_S:
                    problems.append(f"{label}: served after {seconds:.1f} s")
                continue
            problems += hostile.refusal_problems(label, answer, openai=openai)
            error = answer.json().get("error", answer.json()) if answer.status < 500 else {}
            if hostile.error_type(answer) not in REFUSAL_TYPES:
                problems.append(f"{label}: {hostile.outcome(answer)}, not one of {REFUSAL_TYPES}")
            elif not any(word in error.get("message", "") for word in LIMIT_WORDS):
                problems.append(f"{label}: the refusal names no limit: {error.get('message')!r}")
    hostile.report("grammar: hostile corpus", server, inputs=len(cases), answers=dict(answers), witness=witness,
                   slowest_answer_s=round(slowest, 2))
    assert not problems, "\n".join(problems)
    # The corpus is hostile: most of it must be refused, and whatever is refused names its limit.
    assert sum(n for outcome, n in answers.items() if outcome.startswith("400")) >= len(cases) // 2, answers


def _slow_schema(index: int, length: int = 12) -> dict:
    # Distinct specs (the description), each a few tenths of a second of compile at the default length (two
    # string length bounds, the cost growing with ``length``: ~0.35 s at 12, ~1.1 s at 30 on a 2-core Xeon):
    # a burst queues far more than the pool takes.
    return {"type": "object", "description": f"burst {index}",
            "properties": {"a": {"type": "string", "maxLength": length},
                           "b": {"type": "string", "maxLength": length + 1}},
            "required": ["a", "b"]}


def test_a_burst_of_slow_compiles_gets_200_or_503_with_retry_after(async_frontend):
    server = async_frontend
    salt = time.time_ns()  # specs never compiled before on this server (its compile cache would answer)

    def send(index: int) -> hostile.Answer:
        return hostile.post_json(server, hostile.native_path(server), {
            "text": "Answer:", "json_schema": _slow_schema(salt + index), "max_new_tokens": 2, "stream": False})

    problems = []
    start = time.monotonic()
    with hostile.Witness(server) as witness:
        with ThreadPoolExecutor(BURST) as pool:
            burst = list(pool.map(send, range(BURST)))
    burst_seconds = time.monotonic() - start
    answers = Counter(hostile.outcome(answer) for answer in burst)
    for index, answer in enumerate(burst):
        if answer.status != 200:
            problems += hostile.refusal_problems(f"burst {index}", answer, openai=False, statuses=(503,))
            if hostile.error_type(answer) != "overloaded":
                problems.append(f"burst {index}: {hostile.outcome(answer)}")
            if not answer.headers.get("retry-after", "").isdigit():
                problems.append(f"burst {index}: Retry-After {answer.headers.get('retry-after')!r} is not whole seconds")
    # Afterwards: a normal structured request is served and follows its schema.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}  # a bounded answer
    after = hostile.post_json(server, hostile.native_path(server),
                              {"text": "Is the sky blue? As JSON:", "json_schema": schema, "max_new_tokens": 60, "stream": False})
    hostile.report("grammar: burst of slow compiles", server, inputs=BURST, answers=dict(answers), witness=witness,
                   burst_s=round(burst_seconds, 2), after=hostile.outcome(after))
    assert not problems, "\n".join(problems)
    assert answers["503 overloaded"] > 0, f"the burst never filled the compile queue: {answers}"
    assert answers["200"] > 0, answers
    assert after.status == 200, after.body[:300]
    text = after.body.decode()
    value = json.loads(text.replace(hostile.MARKER, "").strip()) if text.strip() else None
    assert isinstance(value, dict) and isinstance(value.get("ok"), bool), value


def _flood_schema(index: int) -> dict:
    return _slow_schema(index, length=40)


def test_one_keys_flood_of_schemas_cannot_hold_up_another_key(start_standalone):
    """The red team's flood: 24 requests of one key at once, each with its own small schema. That key gets its
    share of the compile queue (MAX_PENDING_COMPILES / 4) and a quick 503 with Retry-After for the rest; a
    request of another key whose schema is cached answers meanwhile (before the first key's compiles are
    done), and one with a new schema is compiled in turn (not behind all of the first key's); the witness
    streams on (llm_api.service.grammars).

    The flood's schemas each take over a second to compile, and its 24 requests leave together (a barrier), so
    the whole flood has arrived before the first of its admitted compiles is done: with ~0.3 s compiles, places
    freed while the 24 requests were still arriving let a sixth or seventh in, and with ~1.1 s compiles sent as
    the pool's threads started, a fifth on a loaded 2-core host (CI, 2026-11-29): the share check failed for a
    reason that is not a fairness bug."""
    from llm_api.service.grammars import MAX_PENDING_COMPILES

    first, second = "first-key-123", "second-key-456"
    server = start_standalone("grammar-owners", {"LLM_API_KEY": f"{first},{second}", "DTYPE": "float32"})
    server.key = lambda kind="inference": first  # (the witness streams as the first key)
    try:
        path = hostile.native_path(server)
        cached = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        body = {"text": "Is the sky blue? As JSON:", "json_schema": cached, "max_new_tokens": 4, "stream": False}
        assert hostile.post_json(server, path, body, key=second).status == 200  # (compiled: now cached)
        salt = time.time_ns()
        together = threading.Barrier(24)

        def flood(index: int) -> tuple[hostile.Answer, float]:
            together.wait(60)
            start = time.monotonic()
            answer = hostile.post_json(server, path, {"text": "Answer:", "json_schema": _flood_schema(salt + index),
                                                      "max_new_tokens": 2, "stream": False}, key=first)
            return answer, time.monotonic() - start

        def other_key(schema) -> tuple[hostile.Answer, float]:
            start = time.monotonic()
            answer = hostile.post_json(server, path, {**body, "json_schema": schema}, key=second)
            return answer, time.monotonic() - start

        with hostile.Witness(server) as witness:
            with ThreadPoolExecutor(26) as pool:
                flooded = [pool.submit(flood, i) for i in range(24)]
                time.sleep(0.5)  # (the flood is queued)
                new_schema = pool.submit(other_key, _slow_schema(salt + 1000))
                cached_answer, cached_seconds = other_key(cached)
                flooded_results = [f.result() for f in flooded]
                new_answer, new_seconds = new_schema.result()
        answers = Counter(hostile.outcome(answer) for answer, _ in flooded_results)
        share = MAX_PENDING_COMPILES // 4
        hostile.report("grammar: one key's flood of schemas", server, inputs=24, answers=dict(answers), witness=witness,
                       other_key_cached_s=round(cached_seconds, 2), other_key_new_s=round(new_seconds, 2))
        assert answers["200"] <= share and answers["503 overloaded"] >= 24 - share, answers
        # It came back before the first key's last compile did (the flood started 0.5 s before it), so it
        # waited behind none of them; and within the witness's bound (the engine's steps stretch beside
        # other xdist workers).
        last_compiled = max(seconds for answer, seconds in flooded_results if answer.status == 200)
        assert cached_answer.status == 200, cached_answer.body[:300]
        assert 0.5 + cached_seconds < last_compiled and cached_seconds < hostile.STALL_LIMIT_S, (
            cached_seconds, last_compiled)
        slowest_refusal = max(seconds for answer, seconds in flooded_results if answer.status == 503)
        assert slowest_refusal < 5, f"a refusal took {slowest_refusal:.1f} s"
        for answer, _ in flooded_results:
            if answer.status == 503:
                assert answer.headers.get("retry-after", "").isdigit(), answer.headers
        assert new_answer.status == 200, new_answer.body[:300]
        compile_s = last_compiled / share
        # In turn: behind the compile running when it came and at most one more of the first key's.
        assert new_seconds < 3 * compile_s + 5, (new_seconds, compile_s)
        assert witness.max_gap < hostile.STALL_LIMIT_S
    finally:
        server.stop()
