"""Timing GPU work as a decode step runs it: captured once in a CUDA graph, then replayed.

``graph_replay_seconds(work)`` runs ``work()`` once eagerly (Triton compiles its kernels and cuBLAS picks
its algorithms there, which a capture would not allow), captures it, replays it ``warmup`` times, then
returns the wall time of one replay over ``replays`` of them. The GPU benchmarks that time pieces of a step
(bench/gpu_decode.py's products alone, bench/gpu_gemv.py, bench/gpu_decode_attention.py) share it.
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def graph_replay_seconds(work: Callable[[], object], replays: int = 20, warmup: int = 1,
                         device: torch.device | None = None) -> float:
    work()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        work()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize(device)
    begin = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - begin) / replays
    del graph
    return seconds
