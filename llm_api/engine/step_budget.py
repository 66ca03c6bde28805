"""How many tokens one engine step may compute, when the setting leaves it to the engine.

A step's running time is what every running stream waits between two tokens, so a long prompt must be
prefilled in chunks small enough to keep a step short (chunked prefill). On CUDA the budget is a fixed
2,048 tokens (a step of that size takes milliseconds). On a CPU the right size depends on the model and
the machine by orders of magnitude, so ``cpu_token_budget`` measures it: it times two prefill chunks of
the real model on the real KV cache (before any request exists, into blocks nobody holds), derives the
cost per token and the fixed cost per step, and picks the largest multiple of the block size whose step
stays within ``STEP_TARGET_S``. Measured on a 2-core x86-64 with the embedded 135M model: see
docs/reliability.md (one 2,048-token prefill in one step froze every other stream for ~31 s).

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


def _timed_prefill(runner: ModelRunner, num_tokens: int, block_size: int, repeats: int = 1) -> float:
    num_blocks = -(-num_tokens // block_size)
    best = float("inf")
    for attempt in range(repeats + 1):  # the first run warms up (allocator, kernels)
        request = Request(request_id=f"budget-probe-{num_tokens}-{attempt}", prompt_token_ids=[0] * num_tokens,
                          params=SamplingParams())
        scheduled = ScheduledRequest(request, num_tokens, samples=True, new_block_ids=list(range(num_blocks)),
                                     is_new=True)
        start = time.perf_counter()
        runner.execute(SchedulerOutput([scheduled], num_tokens))
        if attempt:
            best = min(best, time.perf_counter() - start)
        runner.block_tables.update(SchedulerOutput(ended_request_ids=[request.request_id]))  # forget the probe
    return best


@torch.inference_mode()
def cpu_token_budget(runner: ModelRunner, block_size: int, num_blocks: int, max_num_seqs: int,
                     max_model_len: int) -> int:
    small, large = (min(n, max_model_len - 1, num_blocks * block_size) for n in PROBE_TOKENS)
    t_small = _timed_prefill(runner, small, block_size)
    t_large = _timed_prefill(runner, large, block_size)
    per_token = max((t_large - t_small) / max(large - small, 1), 1e-6)
    fixed = max(t_small - per_token * small, 0.0)
    fitting = int((STEP_TARGET_S - fixed) / per_token) if STEP_TARGET_S > fixed else block_size
    budget = max(block_size, fitting // block_size * block_size)
    budget = min(max(budget, max_num_seqs), MAX_TOKEN_BUDGET)
    logger.info("token budget per step: %d (a prefill token costs %.2f ms and a step %.0f ms more on this CPU; "
                "steps aim at %.1f s; set MAX_NUM_BATCHED_TOKENS to choose)", budget, per_token * 1e3, fixed * 1e3,
                STEP_TARGET_S)
    return budget
