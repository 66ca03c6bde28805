"""The service's request path, this tree against another commit's: served tokens/s of ``ModelService.generate``.

What sits between a route and the engine (admission, input processing, the per-request output state:
detokenizing, stop strings, logprobs, n choices, metrics) runs once per request and once per engine output.
This drives it in process, without HTTP: a round loads the embedded model through ``ModelService.load`` (the
server's settings; float32; a fixed step budget so both trees take the same steps) and runs ``--requests``
concurrent requests of ``--tokens`` tokens each (``ignore_eos``, greedy, chat prompts, ``--stop`` stop
strings that never match and ``--logprobs`` top logprobs so that work is done per token), after one warm-up
round of the same; it reports output tokens/s over the wall time and the engine's share of it is the same
in both trees (same model, same steps), so a slower request path shows as fewer tokens/s.

Each round runs in its own process (the package imported from one tree or the other), the trees alternating
(this host's timings swing by 30% between runs; ratios within one run hold). The other tree is a git
worktree of ``--base`` made in a temporary folder and removed afterwards:

    python bench/request_path.py --base a593a58 --rounds 4
    python bench/request_path.py --smoke      # one short round of this tree only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


async def _drive(num_requests: int, num_tokens: int, num_stops: int, logprobs: int | None) -> dict:
    from llm_api.engine.sampling_params import SamplingParams
    from llm_api.model.settings import Settings
    from llm_api.service.request import GenerateRequest
    from llm_api.service.service import ModelService

    settings = Settings.from_env({**os.environ, "DTYPE": "float32", "KV_CACHE_MEMORY_MIB": "128",
                                  "MAX_NUM_BATCHED_TOKENS": "256", "MAX_NUM_SEQS": str(max(num_requests, 1))})
    service = ModelService.load(settings)
    stops = [f"never-{i}-\u2603" for i in range(num_stops)]

    async def one(i: int) -> int:
        params = SamplingParams(max_new_tokens=num_tokens, ignore_eos=True, stop=tuple(stops), logprobs=logprobs)
        request = GenerateRequest(messages=[{"role": "user", "content": f"Tell story number {i} about the sea."}],
                                  params=params)
        counted = 0
        async for event in service.generate(request, f"bench-{i}"):
            finished: Any = event  # (either tree's Finished: its class lives in another module in each)
            if type(event).__name__ == "Finished":
                assert finished.error is None, finished.error
                counted = finished.num_generated_tokens
        return counted

    try:
        await asyncio.gather(*(one(i) for i in range(num_requests)))  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(num_requests + i) for i in range(num_requests)))
        seconds = time.perf_counter() - start
    finally:
        service.shutdown()
    return {"tokens": sum(counts), "seconds": seconds, "tokens_per_s": sum(counts) / seconds}


def _round(tree: Path, args) -> dict:
    """One round in a fresh process importing llm_api from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--requests", str(args.requests),
               "--tokens", str(args.tokens), "--stops", str(args.stops), "--logprobs", str(args.logprobs)]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the round in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the commit to compare with (a git worktree of it is made)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--stops", type=int, default=2, help="stop strings per request (never met)")
    parser.add_argument("--logprobs", type=int, default=2, help="top logprobs per token (-1: none)")
    parser.add_argument("--smoke", action="store_true", help="one short round of this tree")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = asyncio.run(_drive(args.requests, args.tokens, args.stops, None if args.logprobs < 0 else args.logprobs))
        print(json.dumps(result))
        return
    if args.smoke:
        args.requests, args.tokens = 2, 8
        print(json.dumps({"this tree": _round(REPO, args)}))
        return
    if not args.base:
        parser.error("--base is required (or --smoke)")
    from harness.host import cpu_flags, cpu_model

    folder = Path(tempfile.mkdtemp(prefix="request-path-"))
    base_tree = folder / "base"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(base_tree), args.base], check=True)
    rates: dict[str, list[float]] = {"base": [], "this tree": []}
    try:
        for round_index in range(args.rounds):
            order = [("base", base_tree), ("this tree", REPO)]
            for name, tree in order if round_index % 2 == 0 else reversed(order):
                rates[name].append(_round(tree, args)["tokens_per_s"])
                print(f"round {round_index}: {name} {rates[name][-1]:.1f} tok/s", flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)], check=False)
        shutil.rmtree(folder, ignore_errors=True)
    ratios = [new / old for new, old in zip(rates["this tree"], rates["base"])]
    print(json.dumps({"cpu": cpu_model(), "flags": [f for f in cpu_flags() if f.startswith(("avx", "amx"))],
                      "base": args.base, "requests": args.requests, "tokens": args.tokens,
                      "tokens_per_s": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
                      "median_ratio_this_over_base": round(statistics.median(ratios), 3)}))


if __name__ == "__main__":
    main()
