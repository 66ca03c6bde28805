"""Scale-out on Ray Serve: one replica, two with random routing, two with prefix-affinity routing, on a
shared-prefix chat workload: the prefix-cache hit rate and the time to first token.

Each configuration is its own ``llm_api serve --ray`` (a local Ray cluster, the embedded model in float32,
``--kv-mib`` of KV pool per replica) serving the same workload: ``--requests`` streamed chats, ``--clients``
at a time, each opening with one of ``--prefixes`` system prompts of ~``--prefix-tokens`` tokens (chosen
at random, seeded: the same sequence for every configuration) and a question of its own. The prefixes
together are sized past one replica's pool and within two: the regime where routing decides the hit
rate (a pool that holds everything hits whatever the routing; one that holds one prefix hits nothing).

The hit rate is the engine's own count, summed over the requests: ``usage.prompt_tokens_details.cached_tokens``
over ``usage.prompt_tokens``. TTFT: from sending to the first content delta. 2 cores bound the throughput
here (two replicas share them): the hit rate and the TTFT are the point. Prints a markdown table; writes
JSON (every request) to --out or bench/results/.

    .venv/bin/python bench/scale_out.py --requests 60 --out /tmp/scale_out.json
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from harness.host import summary
from harness.models import model_dir
from harness.report import markdown_table, results_path, write_json
from harness.standalone_server import StandaloneServer
from harness.stats import quantile_summary

KEY = "bench-scale-out-key"
CONFIGS = (("1 replica", 1, "prefix"), ("2 replicas, random routing", 2, "random"),
           ("2 replicas, prefix affinity", 2, "prefix"))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--prefixes", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=500)
    parser.add_argument("--kv-mib", type=int, default=96, help="KV pool per replica (96 MiB: ~2,100 float32 tokens)")
    parser.add_argument("--only", choices=[name for name, _, _ in CONFIGS], help="run one configuration")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def workload(args) -> list[list[dict]]:
    chooser = random.Random(7)
    systems = [" ".join(f"Prefix {p}, rule {i}: answer item {i} of set {p} plainly." for i in range(args.prefix_tokens // 14))
               for p in range(args.prefixes)]
    return [[{"role": "system", "content": chooser.choice(systems)},
             {"role": "user", "content": f"Question {n}: what is {n} times {n + 3}?"}] for n in range(args.requests)]


def one_chat(base: str, messages: list[dict]) -> dict:
    start = time.perf_counter()
    first = None
    usage: dict = {}
    replica = ""
    body = {"model": "smollm2", "messages": messages, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {KEY}"}) as answer:
        answer.raise_for_status()
        replica = answer.headers.get("x-llm-api-replica", "")
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter() - start
            if event.get("usage"):
                usage = event["usage"]
    return {"ttft_s": first, "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "replica": replica}


def run_config(args, name: str, replicas: int, routing: str, chats: list[list[dict]]) -> dict:
    server = StandaloneServer(Path(tempfile.mkdtemp(prefix="scale-out-")),
                              args=["--ray", "--replicas", str(replicas), "--routing", routing],
                              env={"MODEL_PATH": str(model_dir()), "LLM_API_KEY": KEY, "DTYPE": "float32",
                                   "KV_CACHE_MEMORY_MIB": str(args.kv_mib), "DRAIN_GRACE_S": "5"})
    try:
        started = time.perf_counter()
        server.start(timeout=600)
        ready_s = time.perf_counter() - started
        one_chat(server.http, [{"role": "user", "content": "warm up"}])
        with ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(lambda m: one_chat(server.http, m), chats))
    finally:
        server.stop()
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    ttft = quantile_summary([r["ttft_s"] for r in results if r["ttft_s"] is not None])
    if ttft["p50"] is None or ttft["p95"] is None:
        raise RuntimeError(f"{name}: no request streamed any text")
    row = {"config": name, "replicas": replicas, "routing": routing, "ready_s": ready_s,
           "hit_rate": cached / max(1, prompt), "ttft_p50_s": ttft["p50"], "ttft_p95_s": ttft["p95"],
           "replicas_used": len({r["replica"] for r in results}), "requests": results}
    print(f"{name}: hit rate {row['hit_rate']:.1%}, TTFT p50 {ttft['p50'] * 1000:.0f} ms, "
          f"p95 {ttft['p95'] * 1000:.0f} ms (ready in {ready_s:.0f} s)", flush=True)
    return row


def main():
    args = parse_args()
    chats = workload(args)
    rows = [run_config(args, name, replicas, routing, chats) for name, replicas, routing in CONFIGS
            if args.only in (None, name)]
    print(f"\n{summary()}; {args.requests} chats, {args.clients} at a time, {args.prefixes} system prompts of "
          f"~{args.prefix_tokens} tokens, {args.kv_mib} MiB KV per replica\n")
    print(markdown_table(["configuration", "prefix-cache hit rate", "TTFT p50 (ms)", "TTFT p95 (ms)"],
                         [[r["config"], f"{r['hit_rate']:.1%}", f"{r['ttft_p50_s'] * 1000:.0f}",
                           f"{r['ttft_p95_s'] * 1000:.0f}"] for r in rows]))
    path = write_json(results_path("scale_out", args.out), {"args": vars(args) | {"out": str(args.out)},
                                                             "host": summary(), "rows": rows})
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
