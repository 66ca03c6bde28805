"""The paged decode attention kernel on a GPU at Llama-3.1-8B's shapes, by number of context partitions.

``paged_decode_attention`` splits each sequence's context into P partitions (one program per sequence,
KV head and partition) and merges them in a second kernel when P > 1; ``choose_num_partitions`` picks P
from the shapes (``TARGET_PROGRAMS``, ``PARTITION_MIN_TOKENS``). At batch 1 a step of the 8B model spent
~9 us a layer in these two kernels on an H200 (bench/gpu_step_profile.py, 2026-11-27), for ~4 MB of K/V:
launch and latency, not bandwidth. This times one layer's call (32 query heads, 8 KV heads, head size
128, bf16, blocks of 16) at each ``--partitions`` value, replayed from a CUDA graph of ``--layers`` calls
(as inside the engine's decode graph), for ``--batches`` sequences of ``--context`` tokens, and prints
microseconds per call with the P that ``choose_num_partitions`` would pick marked.

    python bench/gpu_decode_attention.py [--batches 1,64] [--context 1100] [--partitions 1,2,4,6,9,16,32]
"""

from __future__ import annotations

import argparse
import json

import torch
from harness.gpu_timing import graph_replay_seconds

from llm_api.kernels.decode_attention import choose_num_partitions, paged_decode_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def time_call(batch: int, context: int, partitions: int, layers: int, replays: int) -> float:
    """Seconds per call of the kernel(s), from ``replays`` replays of a graph of ``layers`` calls."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    generator = torch.Generator(device="cuda").manual_seed(0)
    caches = [(torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           generator=generator),
               torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                           generator=generator)) for _ in range(layers)]
    order = torch.randperm(num_blocks - 1, device="cuda", generator=generator)
    block_tables = order[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    context_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    out = torch.empty_like(query)

    def step():
        for key_cache, value_cache in caches:
            paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, HEAD_DIM**-0.5,
                                   out=out, num_partitions=partitions)

    return graph_replay_seconds(step, replays) / layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=1100)
    parser.add_argument("--partitions", default="1,2,4,6,9,16,32")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        chosen = choose_num_partitions(batch, NUM_KV_HEADS, args.context)
        for partitions in sorted({int(p) for p in args.partitions.split(",")} | {chosen}):
            seconds = time_call(batch, args.context, partitions, args.layers, args.replays)
            kv_bytes = 2 * batch * args.context * NUM_KV_HEADS * HEAD_DIM * 2
            results.append({"batch": batch, "context": args.context, "partitions": partitions,
                            "chosen": partitions == chosen, "us_per_call": seconds * 1e6,
                            "kv_read_bytes_per_s": kv_bytes / seconds})
            print(f"batch {batch:3d} context {args.context} P={partitions:2d}{' (chosen)' if partitions == chosen else '':9s}"
                  f" {seconds * 1e6:8.2f} us a layer, K/V read {kv_bytes / seconds / 1e9:7.0f} GB/s", flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
