"""Serving benchmark: the paged engine against the generate() reference behind TorchServe (``--compare
reference``), or the two front ends over the same engine (``--compare frontends``).

Each configuration gets its own TorchServe (own ports and TMPDIR), a warm-up, then the same workload
over HTTP streaming:

* ``--in-flight`` clients (default 32) each send requests back to back after an exponential pause
  (mean ``--think`` s), so arrivals are close to Poisson while about 32 requests stay in flight;
* prompts of mixed length (``--prompt-tokens``, drawn uniformly) cut from a fixed text, outputs of
  ``--min-out``..``--max-out`` tokens (``ignore_eos``, so every request produces exactly what it asked
  for), greedy, all drawn from ``--seed``.

Configurations: the engine in the shipped async mode, and the reference in classic TorchServe
batching at each ``--batch-sizes`` with a short ``maxBatchDelay``; the best reference (by throughput)
is the one compared. Records output tokens/s, time to first token (TTFT), inter-token latency (gaps
between chunks) and end-to-end latency at p50/p95/p99; prints a table and the ratios; writes JSON.

``--compare frontends``: TorchServe (shipped async mode) and ``llm_api serve`` run side by side with the
same settings (the per-step token budget pinned, ``--max-num-batched-tokens``, so neither start's CPU
probe decides it), both warmed up, then ``--rounds`` rounds of the same workload against each in
alternating order (the idle one costs nothing: its engine thread sleeps); each front end's records are
pooled over its rounds.

    .venv/bin/python bench/serving.py --compare reference
    .venv/bin/python bench/serving.py --compare frontends --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch
from harness.models import model_dir
from harness.report import write_json
from harness.standalone_server import StandaloneServer
from harness.stats import quantile_summary
from harness.torchserve_server import REPO, TorchServe
from transformers import AutoTokenizer

from llm_api.client import AsyncHTTPClient

TEXT = (
    "The history of the city begins with a small settlement on the bank of a wide river, where traders "
    "stopped to rest their horses and exchange grain, salt and cloth. Over the centuries the settlement "
    "grew into a market town with stone bridges, a cathedral and a university that drew scholars from "
    "distant lands. Its streets were paved, its walls were extended twice, and its harbour filled with "
    "ships carrying wool, wine and spices. Floods, fires and wars tested the people many times, yet each "
    "generation rebuilt what had been lost and added something of its own: a library, a theatre, a "
    "railway station, a park along the water. "
)


@dataclass
class RequestRecord:
    prompt_tokens: int
    max_new_tokens: int
    sent: float = 0.0
    first: float | None = None
    done: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    ok: bool = False
    error: str = ""


def make_workload(tokenizer, args) -> list[tuple[str, int, int]]:
    rng = random.Random(args.seed)
    corpus_ids = tokenizer(TEXT * 40)["input_ids"]
    lo, hi = args.prompt_tokens
    work = []
    for _ in range(args.num_requests):
        n_prompt = rng.randint(lo, hi)
        start = rng.randint(0, len(corpus_ids) - n_prompt - 1)
        prompt = tokenizer.decode(corpus_ids[start : start + n_prompt])
        work.append((prompt, len(tokenizer(prompt)["input_ids"]), rng.randint(args.min_out, args.max_out)))
    return work


async def run_workload(server, work, args) -> tuple[list[RequestRecord], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    records: list[RequestRecord] = []
    rng = random.Random(args.seed + 1)
    connector = aiohttp.TCPConnector(limit=args.in_flight + 4)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = AsyncHTTPClient(server.http, server.model_name, server.key(), session=session)

        async def worker():
            while True:
                try:
                    prompt, n_prompt, n_out = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await asyncio.sleep(rng.expovariate(1.0 / args.think))
                rec = RequestRecord(n_prompt, n_out)
                records.append(rec)
                rec.sent = time.perf_counter()
                try:
                    payload = {"text": prompt, "max_new_tokens": n_out, "ignore_eos": True}
                    async for _ in client.stream(payload, chunk_size=1 << 16):
                        now = time.perf_counter()
                        rec.first = rec.first or now
                        rec.chunk_times.append(now)
                    rec.done = time.perf_counter()
                    rec.ok = True
                except Exception as exc:  # recorded, counted as lost
                    rec.error = repr(exc)[:200]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.in_flight)))
        return records, time.perf_counter() - start


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.max_new_tokens for r in ok)
    gaps = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if not r.ok})[:5],
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "throughput_tok_s": out_tokens / wall_s,
        "ttft_s": quantile_summary([r.first - r.sent for r in ok if r.first]),
        "itl_s": quantile_summary(gaps),
        "e2e_s": quantile_summary([r.done - r.sent for r in ok if r.done is not None]),  # (every ok one has it)
    }


def serve_and_measure(name: str, model_config: str, env: dict, work, args, root: Path) -> dict:
    server = TorchServe(root / name, model_config=model_config, env=env)
    print(f"[{name}] starting TorchServe", flush=True)
    try:
        server.start(timeout=600)
        warm_up(server, work, args)
        records, wall = asyncio.run(run_workload(server, work, args))
    finally:
        server.stop()
    result = summarize(records, wall)
    print(f"[{name}] {result['completed']}/{result['requests']} ok, {result['throughput_tok_s']:.1f} tok/s, "
          f"TTFT p95 {result['ttft_s']['p95']:.2f}s", flush=True)
    return result


def warm_up(server, work, args) -> None:
    warm = [(work[0][0], work[0][1], 8)] * 2
    warm_args = argparse.Namespace(**{**vars(args), "in_flight": 2, "think": 0.01})
    asyncio.run(run_workload(server, warm, warm_args))


def compare_frontends(work, args, env: dict, root: Path) -> dict[str, dict]:
    env = {**env, "ENGINE": "paged", "MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens)}
    servers = {
        "TorchServe (async)": TorchServe(root / "torchserve", model_config=(REPO / "model-config.yaml").read_text(),
                                         env=env),
        "llm_api serve": StandaloneServer(root / "standalone", env=env),
    }
    pooled: dict[str, tuple[list, float]] = {name: ([], 0.0) for name in servers}
    try:
        for name, server in servers.items():
            print(f"[{name}] starting", flush=True)
            server.start(timeout=600)
            warm_up(server, work, args)
        names = list(servers)
        for round_index in range(args.rounds):
            for name in names if round_index % 2 == 0 else names[::-1]:
                records, wall = asyncio.run(run_workload(servers[name], work, args))
                pooled[name] = (pooled[name][0] + records, pooled[name][1] + wall)
                one = summarize(records, wall)
                print(f"[{name}] round {round_index + 1}: {one['completed']}/{one['requests']} ok, "
                      f"{one['throughput_tok_s']:.1f} tok/s, TTFT p95 {one['ttft_s']['p95']:.2f}s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return {name: summarize(records, wall) for name, (records, wall) in pooled.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF checkpoint folder (default: $MODEL_PATH, else the embedded model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--think", type=float, default=0.5, help="mean pause (s) before each client's next request")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--min-out", type=int, default=16)
    parser.add_argument("--max-out", type=int, default=256)
    parser.add_argument("--batch-sizes", default="4,8,16,32")
    parser.add_argument("--max-batch-delay-ms", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON report (default bench/results/serving[-frontends].json)")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--compare", choices=("reference", "frontends"), default="reference")
    parser.add_argument("--rounds", type=int, default=2, help="--compare frontends: rounds per front end")
    parser.add_argument("--max-num-batched-tokens", type=int, default=128,
                        help="--compare frontends: the engine's per-step token budget, the same for both")
    args = parser.parse_args()
    args.model = str(model_dir(args.model))
    if args.out is None:
        args.out = str(REPO / "bench" / "results" / ("serving-frontends.json" if args.compare == "frontends"
                                                     else "serving.json"))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    work = make_workload(tokenizer, args)
    env = {"MODEL_PATH": args.model, "DTYPE": args.dtype}
    if args.compare == "frontends":
        with tempfile.TemporaryDirectory(prefix="bench-frontends-") as tmp:
            fronts = compare_frontends(work, args, env, Path(tmp))
        print_table(fronts)
        torchserve, standalone = fronts["TorchServe (async)"], fronts["llm_api serve"]
        ratios = {"throughput_x": standalone["throughput_tok_s"] / torchserve["throughput_tok_s"],
                  "ttft_p95_x": standalone["ttft_s"]["p95"] / torchserve["ttft_s"]["p95"]}
        print(f"\nllm_api serve / TorchServe: throughput x{ratios['throughput_x']:.2f}, p95 TTFT "
              f"x{ratios['ttft_p95_x']:.2f} (aims: >= 1, <= 1)")
        return write_report(args, fronts, ratios)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        root = Path(tmp)
        engine_config = (REPO / "model-config.yaml").read_text()
        results["engine (async)"] = serve_and_measure("engine", engine_config, {**env, "ENGINE": "paged"}, work, args, root)
        if not args.skip_reference:
            for bs in [int(b) for b in args.batch_sizes.split(",")]:
                config = (f"minWorkers: 1\nmaxWorkers: 1\nbatchSize: {bs}\nmaxBatchDelay: {args.max_batch_delay_ms}\n"
                          "responseTimeout: 600\n")
                results[f"reference bs={bs}"] = serve_and_measure(
                    f"reference-bs{bs}", config, {**env, "ENGINE": "generate"}, work, args, root
                )

    print_table(results)
    engine = results["engine (async)"]
    refs = {k: v for k, v in results.items() if k.startswith("reference")}
    ratios = {}
    if refs:
        best_name, best = max(refs.items(), key=lambda kv: kv[1]["throughput_tok_s"])
        ratios = {
            "best_reference": best_name,
            "throughput_x": engine["throughput_tok_s"] / best["throughput_tok_s"],
            "ttft_p95_lower_x": best["ttft_s"]["p95"] / engine["ttft_s"]["p95"],
        }
        print(f"\nbest reference: {best_name}; engine throughput x{ratios['throughput_x']:.2f}, "
              f"p95 TTFT {ratios['ttft_p95_lower_x']:.1f}x lower (aims: >= 1.5x, >= 5x)")
    return write_report(args, results, ratios)


def write_report(args, results: dict, ratios: dict) -> int:
    import grpc

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"aiohttp": aiohttp.__version__, "grpcio": grpc.__version__,
                     "torchserve": _version("torchserve")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "python": sys.version.split()[0]},
        "args": {k: v for k, v in vars(args).items()},
        "results": results,
        "ratios": ratios,
    }
    write_json(args.out, report)
    print(f"wrote {args.out}")
    return 0


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def print_table(results: dict) -> None:
    head = (f"{'config':<20}{'ok':>8}{'tok/s':>9}{'TTFT p50/p95/p99 (s)':>24}{'ITL p50/p95/p99 (ms)':>24}"
            f"{'E2E p50/p95/p99 (s)':>24}")
    print("\n" + head + "\n" + "-" * len(head))
    for name, r in results.items():
        t, i, e = r["ttft_s"], r["itl_s"], r["e2e_s"]
        print(f"{name:<20}{r['completed']:>4}/{r['requests']:<3}{r['throughput_tok_s']:>9.1f}"
              f"{t['p50']:>8.2f}{t['p95']:>8.2f}{t['p99']:>8.2f}"
              f"{i['p50'] * 1e3:>8.0f}{i['p95'] * 1e3:>8.0f}{i['p99'] * 1e3:>8.0f}"
              f"{e['p50']:>8.1f}{e['p95']:>8.1f}{e['p99']:>8.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
