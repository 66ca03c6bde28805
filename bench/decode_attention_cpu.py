"""Decode attention of the torch backend (CPU) at serving shapes: all decode rows in one padded batch
against batches of similar context length (``TorchBackend(pad_ratio=...)``).

One decode step of ``--batch`` sequences whose contexts are drawn uniformly from ``--context``, through
every layer's ``TorchBackend.forward`` (store the step's K/V, gather, SDPA), in the embedded model's shape
(SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads, head size 64, blocks of 16). A fresh metadata per
step, so the grouping's per-step cost counts. Alternating rounds in one process (this machine's timings
swing by 30% between runs; ratios inside one run hold); each variant is checked against the padded one.

    python bench/decode_attention_cpu.py [--batch 32] [--context 32 512] [--rounds 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from llm_api.engine.attention.torch_backend import TorchBackend, group_by_length

LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, nargs=2, default=(32, 512))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--pad-ratios", default="inf,2,1.5")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)

    context_lens = [rng.randint(*args.context) for _ in range(args.batch)]
    num_blocks = [-(-n // BLOCK_SIZE) for n in context_lens]
    pool_blocks = sum(num_blocks) + 1
    caches = [(torch.randn(pool_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype),
               torch.randn(pool_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)) for _ in range(LAYERS)]
    shuffled = torch.randperm(pool_blocks - 1).add(1).tolist()  # block 0 pads the tables
    rows, start = [], 0
    for n in num_blocks:
        rows.append(shuffled[start:start + n])
        start += n
    width = max(num_blocks)
    block_tables = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    slots = torch.tensor([rows[i][(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                          for i, n in enumerate(context_lens)])
    query = torch.randn(args.batch, NUM_HEADS, HEAD_DIM, dtype=dtype)
    key = torch.randn(args.batch, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    value = torch.randn_like(key)

    def step(backend: TorchBackend) -> torch.Tensor:
        metadata = backend.metadata(
            key_caches=[k for k, _ in caches], value_caches=[v for _, v in caches], slot_mapping=slots,
            block_tables=block_tables, context_lens=torch.tensor(context_lens),
            query_start_loc=list(range(args.batch + 1)), context_lens_list=context_lens, num_decode_seqs=args.batch)
        out = None
        for layer in range(LAYERS):
            out = backend.forward(metadata, layer, query, key, value, HEAD_DIM ** -0.5, None, None)
        assert out is not None
        return out

    ratios = [float(r) for r in args.pad_ratios.split(",")]
    backends = {r: TorchBackend(pad_ratio=r) for r in ratios}
    reference = step(TorchBackend(pad_ratio=float("inf")))
    for backend in backends.values():
        torch.testing.assert_close(step(backend), reference)
    real = sum(num_blocks)
    print(f"{args.batch} decode rows, contexts {args.context[0]}-{args.context[1]} ({real} blocks), {args.dtype}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for ratio in ratios:
        groups = group_by_length(num_blocks, ratio)
        padded = sum(len(g) * num_blocks[g[0]] for g in groups)
        print(f"  pad_ratio {ratio:>4}: {len(groups)} groups, {padded} blocks gathered ({padded / real:.2f}x the real)")
    times: dict[float, list[float]] = {r: [] for r in ratios}
    for round_index in range(args.rounds):
        order = ratios if round_index % 2 == 0 else ratios[::-1]
        for ratio in order:
            start_time = time.perf_counter()
            for _ in range(args.steps):
                step(backends[ratio])
            times[ratio].append((time.perf_counter() - start_time) / args.steps)
    base = statistics.median(times[ratios[0]])
    for ratio in ratios:
        median = statistics.median(times[ratio])
        print(f"  pad_ratio {ratio:>4}: {median * 1e3:7.1f} ms per step (all layers)  ({median / base:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
