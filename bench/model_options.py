"""Model options benchmark: the embedded model in bf16, 8-bit and 4-bit through the paged engine.

For each option a fresh Python process (so resident memory is its own) loads the model the way the
server does (``model_loader.load`` with DTYPE / QUANTIZATION), then through the engine
(``ModelService``, classic-batch path):

* greedy answer to "What is the capital of France?" (chat template, 32 new tokens at most);
* memory: ``model.get_memory_footprint()`` (weights and buffers) and the process's resident set size
  (RSS) growth from before the load to after generating (weights, KV pool, activations, allocator);
* tokens/s: one request of 128 new tokens (``ignore_eos``) after a warm-up, and 8 such requests decoded
  together, wall time from adding them to the last token.

Prints a Markdown table (the one in docs/model-options.md) and writes JSON.

    .venv/bin/python bench/model_options.py --out bench/results/model_options.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.host import cpu_model
from harness.report import markdown_table, write_json

OPTIONS = {  # name -> environment for Settings
    "bf16": {"DTYPE": "bfloat16"},
    "8bit": {"DTYPE": "bfloat16", "QUANTIZATION": "8bit"},
    "4bit-nf4": {"DTYPE": "bfloat16", "QUANTIZATION": "4bit", "BNB_4BIT_QUANT_TYPE": "nf4"},
}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DECODE_TOKENS = 128
BATCH = 8


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def measure(option: str) -> dict:
    import torch
    from harness.models import model_dir

    from llm_api.model import loader as model_loader
    from llm_api.model.settings import Settings
    from llm_api.protocols.native.translate import parse_request
    from llm_api.service.events import Finished, TextDelta
    from llm_api.service.service import ModelService

    model_path = model_dir()
    env = {"MODEL_PATH": str(model_path), "KV_CACHE_MEMORY_MIB": "64", **OPTIONS[option]}
    rss_before = _rss_mib()
    lm = model_loader.load(Settings.from_env(env))
    service = ModelService(Settings.from_env(env), lm)
    assert service.path_name == "paged engine" and service.engine is not None
    model: Any = lm.model  # a transformers model (get_memory_footprint)

    def run(rows: list[dict]) -> tuple[list[tuple[str, int]], float]:
        """The rows sent together: ((text, generated tokens) per row, seconds)."""

        async def one(i, row):
            events = [e async for e in service.generate(parse_request(row, service.limits), f"r{i}")]
            finished = events[-1]
            assert isinstance(finished, Finished) and finished.error is None, finished
            return "".join(e.text for e in events if isinstance(e, TextDelta)), finished.num_generated_tokens

        async def all_rows():
            return await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))

        start = time.perf_counter()
        results = asyncio.run(all_rows())
        return results, time.perf_counter() - start

    ((answer, _),), _ = run([{"messages": QUESTION, "max_new_tokens": 32}])
    long_row = {"text": "Once upon a time", "max_new_tokens": DECODE_TOKENS, "ignore_eos": True}
    run([{**long_row, "max_new_tokens": 8}])  # warm-up
    (single,), single_s = run([long_row])
    batch, batch_s = run([long_row] * BATCH)
    return {
        "option": option,
        "settings": OPTIONS[option],
        "answer": answer,
        "memory_footprint_mib": model.get_memory_footprint() / 2**20,
        "rss_growth_mib": _rss_mib() - rss_before,
        "kv_pool_mib": service.engine.kv_cache.num_bytes / 2**20,
        "tokens_per_s_batch1": single[1] / single_s,
        f"tokens_per_s_batch{BATCH}": sum(n for _, n in batch) / batch_s,
        "torch_threads": torch.get_num_threads(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", default=",".join(OPTIONS), help="comma-separated: " + ", ".join(OPTIONS))
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child mode: measure one option, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return 0
    results = []
    for option in args.options.split(","):
        child = subprocess.run([sys.executable, __file__, "--one", option], capture_output=True, text=True, check=False)
        if child.returncode != 0:
            print(child.stderr, file=sys.stderr)
            return child.returncode
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(markdown_table(
        ("option", "greedy answer", "get_memory_footprint", f"RSS growth (incl. {results[0]['kv_pool_mib']:.0f} MiB KV pool)",
         "tokens/s, 1 request", f"tokens/s, {BATCH} requests"),
        [(r["option"], repr(r["answer"]), f"{r['memory_footprint_mib']:.0f} MiB", f"{r['rss_growth_mib']:.0f} MiB",
          f"{r['tokens_per_s_batch1']:.1f}", f"{r[f'tokens_per_s_batch{BATCH}']:.1f}") for r in results]))
    if args.out:
        machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, {cpu_model()}"
        write_json(args.out, {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine,
                              "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
