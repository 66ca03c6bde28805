"""How many tokens one engine step may compute, when the setting leaves it to the engine.

A step's running time is what every running stream waits between two tokens, so a long prompt must be
prefilled in chunks small enough to keep a step short (chunked prefill). On CUDA the budget is a fixed
2,048 tokens (a step of that size takes milliseconds). On a CPU the right size depends on the model and
the machine by orders of magnitude, so ``cpu_token_budget`` measures it: it times two prefill chunks of
the real model on the real KV cache (before any request exists, into blocks nobody holds), derives the
cost per token and the fixed cost per step, and picks the largest multiple of the block size whose step
stays within ``STEP_TARGET_S``. Measured on a 2-core x86-64 with the embedded 135M model: see
docs/reliability.md (one 2,048-token prefill in one step froze every other stream for ~31 s).

Noise: a server often starts while its machine is busy (TorchServe's JVM, other workers), and contention
only ever adds time, so each chunk size is timed ``PROBE_REPEATS`` times, the sizes interleaved, and the
fastest run of each counts. When noise still swamps the difference between the sizes (the large chunk
no slower than the small one), the difference says nothing about the cost per token; rather than read it
as "tokens are free" (the largest budget: steps of seconds), ``budget_from_timings`` then charges the
large chunk's whole time to its tokens, which overstates their cost and errs toward short steps.

The budget is then rounded down to a power of two (in blocks): the estimate moves with the host's load
(the same server measured 16 tokens on one start and 112 on the next while a neighbour started, and
208-656 on a host shared with test runs), and a budget that moves moves throughput by a third and time to
first token threefold. With powers of two, timings 30% apart land on the same budget or the next one down,
never further; and the start-up log names the budget, so MAX_NUM_BATCHED_TOKENS can pin what a benchmark
or a deployment wants.

The budget is never below ``max_num_seqs``: the scheduler gives running requests their tokens first, so
a budget smaller than the number of running requests would starve the newest.
"""

from __future__ import annotations

import logging
import time

import torch

from llm_api.engine.model_runner import ModelRunner
from llm_api.engine.request import Request
from llm_api.engine.sampler import SamplingParams
from llm_api.engine.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

CUDA_TOKEN_BUDGET = 2048
MAX_TOKEN_BUDGET = 2048
STEP_TARGET_S = 0.4  # a step's target length on CPU: streams' inter-token gaps stay well under a second
PROBE_TOKENS = (16, 80)  # two chunk sizes: the difference gives the cost per token, without fixed costs
PROBE_REPEATS = 5  # timed runs per size, after one warm-up run each; the fastest counts


def _timed_prefill(runner: ModelRunner, num_tokens: int, block_size: int, tag: str) -> float:
    num_blocks = -(-num_tokens // block_size)
    request = Request(request_id=f"budget-probe-{num_tokens}-{tag}", prompt_token_ids=[0] * num_tokens,
                      params=SamplingParams())
    scheduled = ScheduledRequest(request, num_tokens, samples=True, new_block_ids=list(range(num_blocks)),
                                 is_new=True)
    start = time.perf_counter()
    runner.execute(SchedulerOutput([scheduled], num_tokens))
    seconds = time.perf_counter() - start
    runner.block_tables.update(SchedulerOutput(ended_request_ids=[request.request_id]))  # forget the probe
    return seconds


def budget_from_timings(small: int, t_small: float, large: int, t_large: float, block_size: int,
                        max_num_seqs: int) -> tuple[int, float, float]:
    """(budget, seconds per token, fixed seconds per step) from the fastest step of ``small`` and of
    ``large`` prefill tokens, on the model t(n) = fixed + per_token * n (module docstring: noise)."""
    if t_large > t_small:
        per_token = (t_large - t_small) / max(large - small, 1)
        fixed = max(t_small - per_token * small, 0.0)
    else:
        per_token, fixed = t_large / large, 0.0
    per_token = max(per_token, 1e-6)
    fitting = int((STEP_TARGET_S - fixed) / per_token) if STEP_TARGET_S > fixed else block_size
    blocks = max(1, fitting // block_size)
    budget = block_size * (1 << (blocks.bit_length() - 1))  # a power of two blocks (module docstring)
    return min(max(budget, max_num_seqs), MAX_TOKEN_BUDGET), per_token, fixed


@torch.inference_mode()
def cpu_token_budget(runner: ModelRunner, block_size: int, num_blocks: int, max_num_seqs: int,
                     max_model_len: int) -> int:
    small, large = (min(n, max_model_len - 1, num_blocks * block_size) for n in PROBE_TOKENS)
    best = {small: float("inf"), large: float("inf")}
    for attempt in range(PROBE_REPEATS + 1):  # the first run of each size warms up (allocator, kernels)
        for num_tokens in (small, large):
            seconds = _timed_prefill(runner, num_tokens, block_size, str(attempt))
            if attempt:
                best[num_tokens] = min(best[num_tokens], seconds)
    budget, per_token, fixed = budget_from_timings(small, best[small], large, best[large], block_size, max_num_seqs)
    logger.info("token budget per step: %d (a prefill token costs %.2f ms and a step %.0f ms more on this CPU; "
                "steps aim at %.1f s; set MAX_NUM_BATCHED_TOKENS to choose)", budget, per_token * 1e3, fixed * 1e3,
                STEP_TARGET_S)
    return budget
