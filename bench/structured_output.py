"""Structured output under continuous batching: what JSON schemas cost the engine, on this machine.

(a) throughput: 16 concurrent requests on the embedded model, loaded and sized as the server does
    (``Settings`` defaults: its dtype choice, the CPU step budget), through ``LLMEngine``: a "plain" round
    (16 requests, no schema) and a "mixed" round (the same 16, half of them under a JSON schema: four
    distinct schemas, two requests each), alternating, in one run. Every request generates exactly
    ``--tokens`` tokens (plain ones with ignore_eos; the schemas describe lists longer than that, so their
    grammars never end early), so the rounds do the same model work and the ratio of their throughputs
    (mixed / plain, per pair of rounds, then the median) is the cost of the masks: filling 8 rows'
    bitmasks, applying them, accepting the tokens, per step.
(b) compile: each distinct schema compiled cold (cache cleared), median of ``--compile-rounds``.
(c) stalls: a plain stream through ``ModelService`` (the server's request driver) while another request
    brings a schema that takes seconds to compile (a distinct one each round): the stream's inter-token
    gaps during the compile against the same stream alone.

    flock /work/notes/bench.lock python bench/structured_output.py --rounds 4 --out /tmp/structured.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from llm_api.engine.engine import EngineConfig, LLMEngine
from llm_api.engine.grammar import GrammarCompiler, GrammarSpec
from llm_api.engine.sampler import SamplingParams
from llm_api.model import loader
from llm_api.model.settings import Settings, default_model_path

NUM_REQUESTS = 16
ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}
SCHEMAS = {  # lists that do not end within the token budget
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
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(NUM_REQUESTS)]


def run_round(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], tag: str) -> tuple[float, int]:
    start = time.perf_counter()
    num_tokens = 0
    batch = [(f"{tag}-{i}", p, sp, None) for i, (p, sp) in enumerate(requests)]
    for outputs in engine.generate_batch_stream(batch):
        num_tokens += sum(len(o.new_token_ids) for o in outputs)
    return time.perf_counter() - start, num_tokens


def throughput(args, lm, engine: LLMEngine, compiler: GrammarCompiler) -> dict:
    ids = prompts(lm.tokenizer)
    compiled = [compiler.compile(GrammarSpec.json_schema(s)) for s in SCHEMAS.values()]
    plain = [(p, SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)) for p in ids]
    # Half the requests under a schema (each of the 4 schemas twice), the other half as in the plain round.
    mixed = [(p, SamplingParams(max_new_tokens=args.tokens, grammar=compiled[i // 2 % 4]) if i % 2 == 0 else sp)
             for i, (p, sp) in enumerate(plain)]
    # Every prompt once first: later rounds all find them in the prefix cache alike (decode-bound rounds).
    run_round(engine, plain, "warmup")
    run_round(engine, mixed[:4], "warmup-mixed")
    rounds = []
    for r in range(args.rounds):
        order = [("plain", plain), ("mixed", mixed)] if r % 2 == 0 else [("mixed", mixed), ("plain", plain)]
        result = {}
        for name, requests in order:
            seconds, tokens = run_round(engine, requests, f"{name}{r}")
            assert tokens == NUM_REQUESTS * args.tokens, (name, tokens)
            result[name] = tokens / seconds
        result["ratio"] = result["mixed"] / result["plain"]
        rounds.append(result)
        print(f"round {r}: plain {result['plain']:.1f} tok/s, mixed {result['mixed']:.1f} tok/s, "
              f"ratio {result['ratio']:.3f}", flush=True)
    return {"rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds),
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
    from llm_api.api.constraints import json_schema_constraint
    from llm_api.api.request import GenerateRequest
    from llm_api.service.service import ModelService, TextDelta

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
        async for event in service.generate(request, f"slow{i}"):
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
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    settings = Settings.from_env({**os.environ, "MODEL_PATH": os.environ.get("MODEL_PATH") or str(default_model_path(os.environ))})
    lm = loader.load(settings)
    engine = LLMEngine(lm.model, EngineConfig.from_settings(settings), set(lm.eos_token_ids))
    compiler = GrammarCompiler(lm.tokenizer, engine.vocab_size, lm.eos_token_ids)
    report = {"machine": machine(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "dtype": str(lm.model.dtype), "max_num_batched_tokens": engine.config.max_num_batched_tokens,
              "num_requests": NUM_REQUESTS, "tokens_per_request": args.tokens}
    print(report, flush=True)
    report["compile_seconds"] = compile_times(args, compiler)
    print("compile seconds per distinct schema:", report["compile_seconds"], flush=True)
    report["throughput"] = throughput(args, lm, engine, compiler)
    del engine
    if not args.skip_stalls:
        report["stalls"] = asyncio.run(stalls(args, settings, lm))
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
