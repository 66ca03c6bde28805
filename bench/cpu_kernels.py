"""The CPU kernels (``llm_api.kernels.cpu``, FUSED_KERNELS) against the engine without them, on the embedded model.

Two engines, each loaded through the loader as the servers load it: ``eager`` (``FUSED_KERNELS=false``: what
a CPU ran before the kernels, with ``CPU_PACKED_WEIGHTS=auto``'s layout then: bfloat16 packed, float32
split on AMD CPUs, plain elsewhere) and ``kernels`` (the default now: plain weights, each decoder layer of a
decode step in two C calls around one paged-attention call). Alternating rounds time, per engine: decode at
each batch size (``--new-tokens`` greedy tokens per request after a 64-token prompt, prefill untimed) and a
``--prefill``-token prompt's prefill. Reports medians, the ratio of ``kernels`` to ``eager`` within each
round, and whether the two produced the same greedy tokens (float32: they must; bfloat16 may part at a
one-ulp tie between the top two logits, as packing did).

``--compare amx`` compares the kernels with and without AMX tiles instead (bfloat16 products of 2-16 rows,
on a CPU with AMX): ``vectors`` is the kernels with ``llm_api.kernels.cpu.use_amx(False)``, switched before
each of its runs.

  python bench/cpu_kernels.py --dtype bfloat16 --rounds 5
  python bench/cpu_kernels.py --compare amx --rounds 5
  python bench/cpu_kernels.py --smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
from cpu_products import decode
from harness.host import describe
from harness.report import markdown_table, write_json

COMPARISONS = {"eager": {"eager": "false", "kernels": "true"},  # name -> FUSED_KERNELS
               "amx": {"vectors": "true", "kernels": "true"}}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the timed prefill (0: none)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", default="eager", choices=sorted(COMPARISONS),
                        help="the engine the kernels are compared with")
    parser.add_argument("--smoke", action="store_true", help="seconds: batch 1, 2 rounds of 4 tokens, 64-token prefill")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    return parser.parse_args()


def build_engine(dtype: str, fused: str, max_batch: int, max_tokens: int):
    from llm_api.engine.engine import EngineConfig, LLMEngine
    from llm_api.model.loader import load
    from llm_api.model.settings import Settings

    settings = Settings.from_env(dict(os.environ, DTYPE=dtype, FUSED_KERNELS=fused, CPU_PACKED_WEIGHTS="auto"))
    lm = load(settings)
    config = EngineConfig(num_blocks=max_batch * (-(-max_tokens // 16) + 1) + 8, max_num_seqs=max_batch,
                          max_num_batched_tokens=512, enable_prefix_caching=False, fused_kernels=settings.fused_kernels,
                          cpu_kernels_cache=settings.cache_dir)
    model: Any = lm.model
    engine = LLMEngine(model, config, set(lm.eos_token_ids))
    return engine, type(model.get_output_embeddings()).__name__, int(engine.runner.path.whole_layers)


def prefill(engine, tokens: int, tag: str) -> float:
    """Tokens/s of one ``tokens``-long prompt's prefill (to its first generated token)."""
    from llm_api.engine.sampling_params import SamplingParams

    prompt = torch.randint(0, engine.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    engine.add_request(tag, prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / (time.perf_counter() - start)


def main():
    args = parse_args()
    if args.smoke:
        args.batch_sizes, args.new_tokens, args.rounds, args.prefill = "1", 4, 2, 64
    batches = [int(b) for b in args.batch_sizes.split(",")]
    longest = max(64 + args.new_tokens, args.prefill) + 4
    configs = COMPARISONS[args.compare]
    base = next(iter(configs))  # (the other engine; "kernels" is the second)
    engines = {name: build_engine(args.dtype, fused, max(batches), longest) for name, fused in configs.items()}
    parts = [f"batch {b}" for b in batches] + ([f"prefill {args.prefill}"] if args.prefill else [])
    speeds: dict[tuple[str, str], list[float]] = {}
    ratios: dict[str, list[float]] = {}
    answers: dict[tuple[str, int], list[list[int]]] = {}
    for round_index in range(args.rounds):
        order = list(configs) if round_index % 2 == 0 else list(configs)[::-1]
        this_round: dict[tuple[str, str], float] = {}
        for name in order:
            engine = engines[name][0]
            if args.compare == "amx":
                from llm_api.kernels import cpu

                amx_on = cpu.use_amx(name == "kernels")  # (switched before each engine's runs: off for "vectors")
                if name == "kernels" and not amx_on:
                    raise SystemExit("no AMX here: this library was not built for it, or the kernel refuses its tiles")
            for batch in batches:
                speed, tokens = decode(engine, batch, args.new_tokens, f"{name}-{round_index}-{batch}")
                this_round[(name, f"batch {batch}")] = speed
                answers[(name, batch)] = tokens  # (same prompts every round: seeded by the batch size)
            if args.prefill:
                this_round[(name, f"prefill {args.prefill}")] = prefill(engine, args.prefill, f"{name}-p{round_index}")
        for key, speed in this_round.items():
            speeds.setdefault(key, []).append(speed)
        for part in parts:
            ratios.setdefault(part, []).append(this_round[("kernels", part)] / this_round[(base, part)])
    same = {b: answers[("kernels", b)] == answers[(base, b)] for b in batches}
    host = describe()
    print(f"\nhost: {host}\n{args.dtype}, {args.rounds} alternating rounds, {args.new_tokens} tokens per request\n")
    rows = [[f"`{name}` ({engines[name][1]}, whole layers: {bool(engines[name][2])})",
             *(f"{statistics.median(speeds[(name, part)]):.1f}" for part in parts)] for name in configs]
    rows.append([f"kernels / {base} (median of rounds)", *(f"**{statistics.median(ratios[p]):.2f}x**" for p in parts)])
    rows.append(["same greedy tokens", *("yes" if same[b] else "no" for b in batches), *([""] if args.prefill else [])])
    print(markdown_table(["tok/s", *parts], rows))
    if args.out:
        write_json(args.out, {"host": host, "dtype": args.dtype, "new_tokens": args.new_tokens, "prefill": args.prefill,
                              "speeds": {f"{k[0]}@{k[1]}": v for k, v in speeds.items()}, "ratios": ratios,
                              "same_tokens": same})


if __name__ == "__main__":
    main()
