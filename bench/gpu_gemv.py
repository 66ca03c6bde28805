"""The one-row product kernel (``llm_api.kernels.gemv``) against cuBLAS, on a GPU (issue 39).

For each product of a Llama-3.1-8B batch-1 decode step (merged q/k/v, o_proj, merged gate/up, down after
SiLU x up, and the output head), bf16: ``--copies`` distinct random weights of the shape (as a step's
layers are: nothing stays in L2 from one to the next), one call each in one CUDA graph, replayed; the time
per call and the read rate, for the library's way (``F.linear``; for down, ``silu_and_mul`` then
``F.linear``: what the step ran before) and for every configuration of a grid of (rows per program,
columns per tile, warps). The table lists each shape's library figure, its best configurations and how
``kernels.gemv.CANDIDATES`` do; the JSON (``--out``) has every figure.

  python bench/gpu_gemv.py --out /tmp/gemv.json
  python bench/gpu_gemv.py --quick     # CANDIDATES only (seconds)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
from harness.gpu_timing import graph_replay_seconds

from llm_api.kernels import gemv

# (name, outputs, inputs, SiLU x up first, copies): Llama-3.1-8B's products at batch 1
SHAPES = (("qkv", 6144, 4096, False, 32), ("o_proj", 4096, 4096, False, 32), ("gate_up", 28672, 4096, False, 32),
          ("down", 4096, 14336, True, 32), ("lm_head", 128256, 4096, False, 4))
GRID = [gemv.GemvConfig(n, k, w) for n, k, w in itertools.product((2, 4, 8, 16), (256, 512, 1024), (4, 8))]


def time_per_call(calls, replays: int = 20) -> float:
    """Seconds per call of ``calls`` (a list of thunks) replayed from one CUDA graph."""

    def work():
        for call in calls:
            call()

    return graph_replay_seconds(work, replays) / len(calls)


def measure_shape(name: str, n: int, k: int, silu_mul: bool, copies: int, configs) -> dict:
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    x = torch.randn(1, 2 * k if silu_mul else k, device="cuda", dtype=torch.bfloat16)
    read = n * k * 2
    result: dict = {"shape": [n, k], "silu_mul": silu_mul, "copies": copies, "weight_bytes": read}
    seconds = time_per_call([lambda w=w: gemv.library_product(x, w, None, silu_mul) for w in weights])
    result["library"] = {"us": seconds * 1e6, "tb_per_s": read / seconds / 1e12}
    expected = gemv.library_product(x, weights[0], None, silu_mul).float()
    timings = []
    for config in configs:
        try:
            error = (gemv.launch(config, x, weights[0], None, silu_mul).float() - expected).abs().max().item()
            seconds = time_per_call([lambda w=w: gemv.launch(config, x, w, None, silu_mul)  # noqa: B023
                                     for w in weights])
            timings.append({"config": [config.block_n, config.block_k, config.num_warps], "us": seconds * 1e6,
                            "tb_per_s": read / seconds / 1e12, "max_abs_error": error,
                            "candidate": config in gemv.CANDIDATES})
        except Exception as error:  # (a configuration that does not compile or fit: recorded, the sweep goes on)
            timings.append({"config": [config.block_n, config.block_k, config.num_warps], "error": repr(error)[:200]})
    result["configs"] = sorted(timings, key=lambda t: t.get("us", float("inf")))
    del weights
    torch.cuda.empty_cache()
    return result


def print_header(doc: dict) -> None:
    print(f"{doc['device']} | torch {doc['torch']} | triton {doc['triton']} | {doc['date']}")
    print("| product | shape | library us (TB/s) | best config us (TB/s) | next best | candidates' best |")
    print("| --- | --- | ---: | ---: | --- | ---: |", flush=True)


def print_row(name: str, r: dict) -> None:
    ok = [t for t in r["configs"] if "us" in t]
    best = ok[0] if ok else None
    candidates = [t for t in ok if t["candidate"]]
    following = ", ".join(f"{tuple(t['config'])} {t['us']:.1f}" for t in ok[1:4])
    print(f"| {name} | {r['shape'][0]}x{r['shape'][1]}{' (SiLU x up)' if r['silu_mul'] else ''} | "
          f"{r['library']['us']:.1f} ({r['library']['tb_per_s']:.2f}) | "
          + (f"{tuple(best['config'])} {best['us']:.1f} ({best['tb_per_s']:.2f}) | {following} | "
             if best else "(none ran) | | ")
          + (f"{tuple(candidates[0]['config'])} {candidates[0]['us']:.1f} |" if candidates else " |"), flush=True)
    for t in ok:
        if t["max_abs_error"] > 0.05:
            print(f"    {tuple(t['config'])}: max error {t['max_abs_error']:.3g} against the library", flush=True)
    for t in r["configs"]:
        if "error" in t:
            print(f"    {tuple(t['config'])}: {t['error']}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only kernels.gemv.CANDIDATES, not the grid")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    import triton

    configs = list(gemv.CANDIDATES) if args.quick else sorted(set(GRID) | set(gemv.CANDIDATES),
                                                             key=lambda c: (c.block_n, c.block_k, c.num_warps))
    doc: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "date": time.strftime("%Y-%m-%d"), "shapes": {}}
    print_header(doc)
    for name, n, k, silu_mul, copies in SHAPES:
        doc["shapes"][name] = measure_shape(name, n, k, silu_mul, copies, configs)
        if args.out:
            Path(args.out).write_text(json.dumps(doc, indent=1))
        print_row(name, doc["shapes"][name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
