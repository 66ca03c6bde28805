"""Structured output under continuous batching: what JSON schemas cost the engine, on this machine.

(a) throughput: 16 concurrent requests on the embedded model, loaded and sized as the server does
    (``Settings`` defaults: its dtype choice, the CPU step budget), through two ``LLMEngine``s sharing the
    model: the "plain" engine runs 16 requests without schemas, the "mixed" engine the same 16 with half
    of them under a JSON schema (four distinct schemas, two requests each). Every request generates
    exactly ``--tokens`` tokens (plain ones with ignore_eos; the schemas describe lists longer than that,
    so their grammars never end early), so both engines do the same model work, step for step. The two
    are stepped in lockstep, alternating which goes first, and each step is timed: on a shared machine
    whose load drifts, neighbouring steps see the same load, so the ratio of the summed step times
    (plain / mixed = mixed throughput / plain throughput) is the cost of the masks (filling 8 rows'
    bitmasks, applying them, accepting the tokens) and little else. Reported per round and pooled.
(b) compile: each distinct schema compiled cold (cache cleared), median of ``--compile-rounds``.
(c) stalls: a plain stream through ``ModelService`` (the server's request driver) while another request
    brings a schema that takes seconds to compile (a distinct one each round): the stream's inter-token
    gaps during the compile against the same stream alone.

    python bench/structured_output.py --rounds 4 --out /tmp/structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
from harness.host import cpu_model
from harness.models import model_dir

from llm_api.engine.engine import EngineConfig, LLMEngine
from llm_api.structured.compiler import GrammarCompiler
from llm_api.structured.spec import GrammarSpec
from llm_api.engine.sampling_params import SamplingParams
from llm_api.model import loader
from llm_api.model.settings import Settings

NUM_REQUESTS = 16
ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}
SCHEMAS: dict[str, dict] = {  # lists that do not end within the token budget
    "people": {"type": "array", "items": ITEM, "minItems": 60},
    "numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9999}, "minItems": 200},
    "words": {"type": "object", "properties": {"words": {"type": "array", "minItems": 100, "items": {
        "enum": ["red", "green", "blue", "yellow", "black", "white"]}}}, "required": ["words"]},
    "records": {"type": "array", "minItems": 40, "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "ok": {"type": "boolean"}, "tag": {"type": "string", "maxLength": 8}},
        "required": ["id", "ok", "tag"]}},
}
QUESTIONS = ["List some people with their ages.", "Give me many numbers.", "Name lots of colours.",
             "Write down some records.", "Tell me about Paris.", "What is the capital of Spain?",
             "Explain photosynthesis.", "Write a poem about the sea."]


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(NUM_REQUESTS)]


def lockstep_round(engines: dict, workloads: dict, tag: str) -> dict:
    """Both engines' requests added, then one step of each in turn (alternating who goes first) until
    both are done. Returns each engine's summed step seconds and tokens."""
    seconds = {name: 0.0 for name in engines}
    tokens = {name: 0 for name in engines}
    for name, engine in engines.items():
        for i, (prompt, params) in enumerate(workloads[name]):
            engine.add_request(f"{tag}-{name}-{i}", prompt, params)
    order = list(engines)
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name in order:
            engine = engines[name]
            if not engine.has_unfinished_requests():
                continue
            start = time.perf_counter()
            outputs = engine.step()
            seconds[name] += time.perf_counter() - start
            tokens[name] += sum(len(o.new_token_ids) for o in outputs)
        order.reverse()
    return {"seconds": seconds, "tokens": tokens}


def throughput(args, lm, engines: dict, compiler: GrammarCompiler) -> dict:
    ids = prompts(lm.tokenizer)
    compiled = [compiler.compile(GrammarSpec.json_schema(s)) for s in SCHEMAS.values()]
    plain = [(p, SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)) for p in ids]
    # Half the requests under a schema (each of the 4 schemas twice), the other half as in the plain engine.
    mixed = [(p, SamplingParams(max_new_tokens=args.tokens, grammar=compiled[i // 2 % 4]) if i % 2 == 0 else sp)
             for i, (p, sp) in enumerate(plain)]
    workloads = {"plain": plain, "mixed": mixed}
    # Every prompt once first: later rounds find them all in each engine's prefix cache (decode-bound rounds).
    lockstep_round(engines, workloads, "warmup")
    rounds = []
    for r in range(args.rounds):
        result = lockstep_round(engines, workloads, f"round{r}")
        for name in engines:
            assert result["tokens"][name] == NUM_REQUESTS * args.tokens, (name, result["tokens"])
        row = {name: result["tokens"][name] / result["seconds"][name] for name in engines}
        row["ratio"] = row["mixed"] / row["plain"]
        rounds.append(row)
        print(f"round {r}: plain {row['plain']:.1f} tok/s, mixed {row['mixed']:.1f} tok/s, ratio {row['ratio']:.3f}",
              flush=True)
    pooled = sum(NUM_REQUESTS * args.tokens / r["mixed"] for r in rounds)
    pooled_plain = sum(NUM_REQUESTS * args.tokens / r["plain"] for r in rounds)
    return {"rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds),
            "pooled_ratio": pooled_plain / pooled,
            "median_plain_tokens_per_s": statistics.median(r["plain"] for r in rounds),
            "median_mixed_tokens_per_s": statistics.median(r["mixed"] for r in rounds)}


def compile_times(args, compiler: GrammarCompiler) -> dict:
    times: dict[str, list[float]] = {name: [] for name in SCHEMAS}
    for _ in range(args.compile_rounds):
        for name, schema in SCHEMAS.items():
            compiler.clear_cache()
            times[name].append(compiler.compile(GrammarSpec.json_schema(schema)).compile_seconds)
    return {name: statistics.median(t) for name, t in times.items()}


async def stalls(args, settings: Settings, lm) -> dict:
    from llm_api.service.constraints import json_schema_constraint
    from llm_api.service.events import TextDelta
    from llm_api.service.request import GenerateRequest
    from llm_api.service.service import ModelService

    service = ModelService(settings, lm)
    prompt = "Write a long story about a dragon."

    async def stream(tag: str) -> list[float]:
        arrivals = []
        request = GenerateRequest(text=prompt, params=SamplingParams(max_new_tokens=args.stall_tokens, ignore_eos=True))
        async for event in service.generate(request, tag):
            if isinstance(event, TextDelta):
                arrivals.append(time.monotonic())
        return arrivals

    async def slow(i: int) -> tuple[float, float]:
        # Distinct bounds each round: a cold compile of a few seconds (under the limits).
        schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 100 + i},
                                                   "b": {"type": "string", "maxLength": 90 + i}}}
        request = GenerateRequest(text="JSON:", params=SamplingParams(max_new_tokens=4),
                                  constraint=json_schema_constraint(schema, "json_schema"))
        start = time.monotonic()
        async for _ in service.generate(request, f"slow{i}"):
            return start, time.monotonic()  # its first event: the compile is done
        return start, time.monotonic()

    def gaps(arrivals, window=None):
        pairs = zip(arrivals, arrivals[1:])
        return [b - a for a, b in pairs if window is None or window[0] <= a and b <= window[1]]

    await stream("warmup")
    rows = []
    for r in range(args.rounds):
        alone = gaps(await stream(f"alone{r}"))
        task = asyncio.create_task(stream(f"beside{r}"))
        await asyncio.sleep(1.0)
        window = await slow(r)
        during = gaps(await task, window)
        rows.append({"compile_wait_s": window[1] - window[0], "alone_mean_gap_s": statistics.mean(alone),
                     "alone_max_gap_s": max(alone), "during_mean_gap_s": statistics.mean(during) if during else None,
                     "during_max_gap_s": max(during) if during else None, "gaps_during": len(during)})
        print(f"stall round {r}: {rows[-1]}", flush=True)
    service.shutdown()
    return {"rounds": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--compile-rounds", type=int, default=3)
    parser.add_argument("--stall-tokens", type=int, default=200, help="tokens of the stream beside a slow compile")
    parser.add_argument("--skip-stalls", action="store_true")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="KV pool of each of the two engines")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    model_path = str(model_dir())
    settings = Settings.from_env({**os.environ, "MODEL_PATH": model_path})
    lm = loader.load(settings)
    # Two engines on one model (each its own KV pool), the second with the step budget the first measured.
    config = dataclasses.replace(EngineConfig.from_settings(settings), kv_cache_memory_mib=args.kv_cache_mib)
    engine = LLMEngine(lm.model, config, set(lm.eos_token_ids))
    config = dataclasses.replace(config, max_num_batched_tokens=engine.config.max_num_batched_tokens)
    engines = {"plain": engine, "mixed": LLMEngine(lm.model, config, set(lm.eos_token_ids))}
    compiler = GrammarCompiler(lm.tokenizer, engine.vocab_size, lm.eos_token_ids)
    report = {"machine": machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "dtype": str(lm.model.dtype), "max_num_batched_tokens": engine.config.max_num_batched_tokens,
              "num_requests": NUM_REQUESTS, "tokens_per_request": args.tokens}
    print(report, flush=True)
    report["compile_seconds"] = compile_times(args, compiler)
    print("compile seconds per distinct schema:", report["compile_seconds"], flush=True)
    report["throughput"] = throughput(args, lm, engines, compiler)
    del engine, engines
    if not args.skip_stalls:
        report["stalls"] = asyncio.run(stalls(args, settings, lm))
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
