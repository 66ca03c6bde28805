"""CPU_PACKED_WEIGHTS side by side: decode speed of the embedded model with each layout of its weight products.

Loads the model once per layout through the loader, as the servers do (``false``: ``F.linear``; ``true``:
oneDNN's packed weights, ``llm_api.model.packed_linear``; ``split``: products of a few rows split across the
cores, ``llm_api.model.split_linear``), builds one engine each, and times decode in alternating rounds: each
round runs every layout in turn, at each batch size, ``--new-tokens`` greedy tokens per request after a
64-token prompt (prefill untimed). Reports the median tokens/s per layout and batch size, each layout's ratio
to ``F.linear`` measured in the same rounds, and whether every layout produced the same greedy tokens.

  python bench/cpu_products.py --dtype float32 --rounds 5
  python bench/cpu_products.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from harness.host import describe
from harness.report import markdown_table, write_json

LAYOUTS = ("false", "true", "split")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="seconds: batch 1, 2 rounds of 4 tokens")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser.parse_args()


def build_engine(dtype: str, layout: str, max_batch: int, max_tokens: int):
    from llm_api.engine.engine import EngineConfig, LLMEngine
    from llm_api.model.loader import load
    from llm_api.model.settings import Settings

    lm = load(Settings.from_env(dict(os.environ, DTYPE=dtype, CPU_PACKED_WEIGHTS=layout)))
    config = EngineConfig(num_blocks=max_batch * (-(-max_tokens // 16) + 1) + 8, max_num_seqs=max_batch,
                          max_num_batched_tokens=2048, enable_prefix_caching=False)
    model: Any = lm.model  # (a transformers model: nn.Module's typing would read the method as a tensor)
    return LLMEngine(model, config, set(lm.eos_token_ids)), type(model.get_output_embeddings()).__name__


def decode(engine, batch: int, new_tokens: int, tag: str) -> tuple[float, list[list[int]]]:
    """Tokens/s of the decode steps of ``batch`` requests, and each request's tokens."""
    from llm_api.engine.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, engine.vocab_size, (64,), generator=generator).tolist()
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    tokens: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(batch)}
    while engine.scheduler.waiting:  # prefill, untimed
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        steps += 1
    return batch * steps / (time.perf_counter() - start), [tokens[f"{tag}-{i}"] for i in range(batch)]


def main():
    args = parse_args()
    if args.smoke:
        args.batch_sizes, args.new_tokens, args.rounds = "1", 4, 2
    batches = [int(b) for b in args.batch_sizes.split(",")]
    engines = {layout: build_engine(args.dtype, layout, max(batches), 64 + args.new_tokens + 4) for layout in LAYOUTS}
    speeds: dict[tuple[str, int], list[float]] = {}
    ratios: dict[tuple[str, int], list[float]] = {}
    answers: dict[tuple[str, int], list[list[int]]] = {}
    for round_index in range(args.rounds):
        for batch in batches:
            order = LAYOUTS if round_index % 2 == 0 else LAYOUTS[::-1]
            this_round = {}
            for layout in order:
                speed, tokens = decode(engines[layout][0], batch, args.new_tokens, f"{layout}-{round_index}-{batch}")
                this_round[layout] = speed
                speeds.setdefault((layout, batch), []).append(speed)
                answers[(layout, batch)] = tokens  # same prompts every round (seeded by batch)
            for layout in LAYOUTS:
                ratios.setdefault((layout, batch), []).append(this_round[layout] / this_round["false"])
    same = {batch: all(answers[(layout, batch)] == answers[("false", batch)] for layout in LAYOUTS) for batch in batches}
    host = describe()
    print(f"\nhost: {host}\n{args.dtype}, {args.rounds} alternating rounds, {args.new_tokens} tokens per request\n")
    rows = [[f"`{layout}` ({engines[layout][1]})",
             *(f"{statistics.median(speeds[(layout, b)]):.1f} ({statistics.median(ratios[(layout, b)]):.2f}x)"
               for b in batches)] for layout in LAYOUTS]
    rows.append(["same greedy tokens as `false`", *("yes" if same[b] else "**no**" for b in batches)])
    print(markdown_table(["CPU_PACKED_WEIGHTS", *(f"batch {b} tok/s (vs `false`)" for b in batches)], rows))
    if args.out:
        write_json(args.out, {"host": host, "dtype": args.dtype, "new_tokens": args.new_tokens,
                              "speeds": {f"{k[0]}@{k[1]}": v for k, v in speeds.items()},
                              "ratios": {f"{k[0]}@{k[1]}": v for k, v in ratios.items()},
                              "same_tokens": same})


if __name__ == "__main__":
    main()
