"""How many tokens one engine step may compute, when the setting leaves it to the engine.

A step's running time is what every running stream waits between two tokens, so a long prompt must be
prefilled in chunks small enough to keep a step short (chunked prefill). On CUDA the budget is a fixed
2,048 tokens (a step of that size takes milliseconds). On a CPU the right size depends on the model and
the machine by orders of magnitude, so it is measured: ``measure`` times two prefill chunks of the real
model on the real KV cache, derives the cost per token and the fixed cost per step, and ``budget_for``
picks the largest multiple of the block size whose step stays within ``STEP_TARGET_S``. Measured on a
2-core x86-64 with the embedded 135M model: see docs/reliability.md (one 2,048-token prefill in one step
froze every other stream for ~31 s).

A busy neighbour must not decide the budget for the server's whole life (a start beside a test run
measured 6.93 ms a token and 988 ms a step, and chose 64 tokens where a quiet start of the same host
chooses 512). Contention only ever adds time, so the quiet figure is the largest budget ever measured, and
``CpuStepBudget`` only ever moves towards it:

* **cached**: every measurement is kept per host, model and settings (``BudgetKey``: the CPU's model and
  flags, the thread count, the model's config, dtype and layer kinds, the block size, ``max_num_seqs`` and
  ``max_model_len``, the torch and llm_api versions) under the user cache (``BudgetCache``:
  ``<LLM_API_CACHE>/step-budget/``), and the largest wins. A start that finds its key uses it at once: no
  probe, ready seconds after the weights load;
* **measured at start** only when nothing is cached, and then for at most ``PROBE_MAX_S`` (each size
  timed up to ``PROBE_REPEATS`` times after a warm-up, the sizes interleaved, the fastest counting);
* **re-measured while idle** after serving starts (``idle_work``, run by the engine loop once it has been
  idle for the next delay of ``REFINE_IDLE_S``): a larger budget replaces the one in use and the cache's;
  a smaller one is ignored. A request that arrives meanwhile stops the re-measurement before its next
  timed chunk (it waits for one probe chunk at most, not the whole re-measurement: seconds on a busy host),
  and the same re-measurement is tried at the next idle spell;
* **bounded below** by an analytic estimate (``analytic_floor``: the model's multiply-adds at
  ``FLOOR_FLOPS_PER_THREAD``, a rate every x86-64 or arm64 core running torch's kernels exceeds), so a
  probe swamped by noise cannot shrink the steps below what the arithmetic alone allows.

Every choice is logged with where it came from. When noise swamps the difference between the two sizes
(the large chunk no slower than the small one), the difference says nothing about the cost per token;
``budget_from_timings`` then charges the large chunk's whole time to its tokens, which errs toward short
steps. The budget is rounded down to a power of two (in blocks): timings 30% apart land on the same budget
or the next one down, never further. It is never below ``max_num_seqs``: the scheduler gives running
requests their tokens first, so a smaller budget would starve the newest.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from llm_api.layers.quantized import QuantizedLinear
from llm_api.engine.model_runner import ModelRunner
from llm_api.engine.request import Request
from llm_api.engine.sampling_params import SamplingParams
from llm_api.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from llm_api.model import cpu

logger = logging.getLogger(__name__)

CUDA_TOKEN_BUDGET = 2048
MAX_TOKEN_BUDGET = 2048
STEP_TARGET_S = 0.4  # a step's target length on CPU: streams' inter-token gaps stay well under a second
PROBE_TOKENS = (16, 80)  # two chunk sizes: the difference gives the cost per token, without fixed costs
PROBE_REPEATS = 5  # timed runs per size at most, after one warm-up run each; the fastest counts
PROBE_MAX_S = 6.0  # a probe stops repeating after this long (a busy host: one timed run of each size)
REFINE_REPEATS = 3
REFINE_IDLE_S = (1.0, 20.0, 120.0, 600.0)  # idle time before each re-measurement while serving
FLOOR_FLOPS_PER_THREAD = 2e9  # multiply-adds x 2 per second: far below any core's rate (module docstring)
PROBE_VERSION = 2  # part of the cache key: a change to how the probe measures invalidates old figures


@dataclass(frozen=True)
class Timing:
    per_token_s: float  # seconds per prefill token
    fixed_s: float  # seconds per step beyond its tokens


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
    return budget_for(Timing(per_token, fixed), block_size, max_num_seqs), per_token, fixed


def budget_for(timing: Timing, block_size: int, max_num_seqs: int) -> int:
    """The largest power of two blocks whose step fits ``STEP_TARGET_S``, within [max_num_seqs, MAX_TOKEN_BUDGET]."""
    fitting = (int((STEP_TARGET_S - timing.fixed_s) / timing.per_token_s) if STEP_TARGET_S > timing.fixed_s
               else block_size)
    blocks = max(1, fitting // block_size)
    budget = block_size * (1 << (blocks.bit_length() - 1))  # a power of two blocks (module docstring)
    return min(max(budget, max_num_seqs), MAX_TOKEN_BUDGET)


def analytic_floor(model: nn.Module, num_threads: int) -> Timing:
    """The slowest a prefill token can plausibly be: 2 x parameters flops at ``FLOOR_FLOPS_PER_THREAD``. A
    quantized linear's weights are a buffer of blocks, no parameter: its in x out products count (left out,
    a GGUF model's floor was its norms' alone, and the floor raised the step budget to 2,048 tokens: 10 s
    steps on a 2-core host)."""
    num_params = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if name.endswith("packed_weight")) + sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, QuantizedLinear))
    return Timing(2 * num_params / (FLOOR_FLOPS_PER_THREAD * max(num_threads, 1)), 0.0)


def _timed_prefill(runner: ModelRunner, num_tokens: int, block_ids: list[int], tag: str) -> float:
    request = Request(request_id=f"budget-probe-{num_tokens}-{tag}", prompt_token_ids=[0] * num_tokens,
                      params=SamplingParams())
    scheduled = ScheduledRequest(request, num_tokens, samples=True, new_block_ids=list(block_ids), is_new=True)
    start = time.perf_counter()
    runner.execute(SchedulerOutput([scheduled], num_tokens))
    seconds = time.perf_counter() - start
    runner.block_tables.update(SchedulerOutput(ended_request_ids=[request.request_id]))  # forget the probe
    return seconds


def probe_sizes(block_size: int, num_blocks: int, max_model_len: int) -> tuple[int, int]:
    small, large = (min(n, max_model_len - 1, num_blocks * block_size) for n in PROBE_TOKENS)
    return small, large


@torch.inference_mode()
def measure(runner: ModelRunner, block_ids: list[int], block_size: int, max_model_len: int, repeats: int,
            max_seconds: float, interrupted: Callable[[], bool] = lambda: False) -> Timing | None:
    """Time prefill chunks of the two probe sizes into ``block_ids`` (blocks nobody else holds now); None
    when ``interrupted()`` turns true before a chunk (the measurement is abandoned)."""
    small, large = probe_sizes(block_size, len(block_ids), max_model_len)
    needed = -(-large // block_size)
    best = {small: float("inf"), large: float("inf")}
    started = time.monotonic()
    for attempt in range(repeats + 1):  # the first run of each size warms up (allocator, kernels)
        for num_tokens in (small, large):
            if interrupted():
                return None
            seconds = _timed_prefill(runner, num_tokens, block_ids[:needed], str(attempt))
            if attempt:
                best[num_tokens] = min(best[num_tokens], seconds)
        if attempt and time.monotonic() - started > max_seconds:
            break
    _, per_token, fixed = budget_from_timings(small, best[small], large, best[large], block_size, 1)
    return Timing(per_token, fixed)


@dataclass(frozen=True)
class BudgetKey:
    """What a measured budget depends on (module docstring); its digest names the cache file."""

    cpu_model: str
    cpu_flags_digest: str
    num_threads: int
    model_digest: str
    block_size: int
    max_num_seqs: int
    max_model_len: int
    torch_version: str
    llm_api_version: str
    probe_version: int = PROBE_VERSION

    @classmethod
    def for_engine(cls, model: nn.Module, block_size: int, max_num_seqs: int, max_model_len: int,
                   path: str = "") -> "BudgetKey":
        model_config: Any = getattr(model, "config", None)
        described = json.dumps({
            "class": type(model).__name__,
            "config": model_config.to_dict() if hasattr(model_config, "to_dict") else repr(model_config),
            "dtype": str(next(model.parameters()).dtype),
            "layers": sorted({type(m).__name__ for m in model.modules()}),  # packed, quantized, LoRA-wrapped
            "path": path,  # the model runner's path and kernel set (the C set's whole layers: a shorter step)
        }, sort_keys=True, default=str)
        return cls(
            cpu_model=cpu.cpu_model_name(),
            cpu_flags_digest=_digest(" ".join(sorted(cpu.this_cpu_features()))),
            num_threads=torch.get_num_threads(),
            model_digest=_digest(described),
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            torch_version=torch.__version__,
            llm_api_version=_package_version(),
        )

    def digest(self) -> str:
        return _digest(json.dumps(asdict(self), sort_keys=True))


@dataclass(frozen=True)
class CachedBudget:
    budget: int
    per_token_ms: float
    fixed_ms: float
    measured_at: str  # ISO time of the measurement that gave this figure


class BudgetCache:
    """One JSON file per ``BudgetKey`` in ``folder``; unreadable or foreign files count as absent, and a
    write that fails (a read-only home) is logged and otherwise ignored: the cache only saves time."""

    def __init__(self, folder: Path | None):
        self.folder = folder

    def read(self, key: BudgetKey) -> CachedBudget | None:
        if self.folder is None:
            return None
        try:
            data = json.loads((self.folder / f"{key.digest()}.json").read_text())
            if data.get("key") != asdict(key):
                return None
            return CachedBudget(int(data["budget"]), float(data["per_token_ms"]), float(data["fixed_ms"]),
                                str(data["measured_at"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None

    def write(self, key: BudgetKey, entry: CachedBudget) -> None:
        if self.folder is None:
            return
        path = self.folder / f"{key.digest()}.json"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps({"key": asdict(key), **asdict(entry)}, indent=1))
            partial.replace(path)  # atomic: two servers starting at once never read half a file
        except OSError as err:
            logger.info("step budget: not cached (%s)", err)


class CpuStepBudget:
    """The CPU step budget of one engine: where it came from, and its re-measurement while idle."""

    def __init__(self, runner: ModelRunner, model: nn.Module, cache: BudgetCache, block_size: int,
                 max_num_seqs: int, max_model_len: int):
        self.runner = runner
        self.cache = cache
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.key = BudgetKey.for_engine(model, block_size, max_num_seqs, max_model_len, runner.path.describe())
        self.floor = budget_for(analytic_floor(model, self.key.num_threads), block_size, max_num_seqs)
        self.budget = 0
        self._refinements_done = 0

    def probe_blocks_needed(self, num_blocks: int) -> int:
        return -(-probe_sizes(self.block_size, num_blocks, self.max_model_len)[1] // self.block_size)

    def start(self, free_block_ids: list[int]) -> int:
        """The budget to start with: cached, else measured now into ``free_block_ids`` (module docstring)."""
        cached = self.cache.read(self.key)
        if cached is not None:
            self.budget = max(cached.budget, self.floor)
            logger.info("token budget per step: %d, from the cache (measured %s: a prefill token %.2f ms, a step "
                        "%.0f ms more; %s); re-measured while idle, raised only; set MAX_NUM_BATCHED_TOKENS to choose",
                        self.budget, cached.measured_at, cached.per_token_ms, cached.fixed_ms, self.cache.folder)
            self._refinements_done = len(REFINE_IDLE_S) - 1  # one more look, once idle
            return self.budget
        timing = measure(self.runner, free_block_ids, self.block_size, self.max_model_len, PROBE_REPEATS, PROBE_MAX_S)
        assert timing is not None  # (nothing interrupts the start's probe)
        measured = budget_for(timing, self.block_size, self.max_num_seqs)
        self.budget = max(measured, self.floor)
        logger.info("token budget per step: %d, measured at start (a prefill token costs %.2f ms and a step %.0f ms "
                    "more on this CPU; steps aim at %.1f s%s); re-measured while idle, raised only; set "
                    "MAX_NUM_BATCHED_TOKENS to choose", self.budget, timing.per_token_s * 1e3, timing.fixed_s * 1e3,
                    STEP_TARGET_S, f"; the analytic floor {self.floor} applies" if self.floor > measured else "")
        self._remember(measured, timing)
        return self.budget

    def idle_delay(self) -> float | None:
        """Seconds of idleness before the next re-measurement; None when none is left."""
        if self._refinements_done >= len(REFINE_IDLE_S) or self.budget >= MAX_TOKEN_BUDGET:
            return None
        return REFINE_IDLE_S[self._refinements_done]

    def refine(self, free_block_ids: list[int], interrupted: Callable[[], bool] = lambda: False) -> int | None:
        """Re-measure into ``free_block_ids``; the new budget when it is larger than the one in use, else None.
        Stopped, and not counted as done, once ``interrupted()`` (module docstring)."""
        timing = measure(self.runner, free_block_ids, self.block_size, self.max_model_len, REFINE_REPEATS,
                         PROBE_MAX_S / 2, interrupted)
        if timing is None:
            logger.debug("step budget re-measurement stopped: a request arrived")
            return None
        self._refinements_done += 1
        measured = budget_for(timing, self.block_size, self.max_num_seqs)
        self._remember(measured, timing)
        if measured <= self.budget:
            logger.debug("step budget re-measured while idle: %d (keeping %d)", measured, self.budget)
            return None
        logger.info("token budget per step raised from %d to %d (re-measured while idle: a prefill token %.2f ms, "
                    "a step %.0f ms more)", self.budget, measured, timing.per_token_s * 1e3, timing.fixed_s * 1e3)
        self.budget = measured
        return measured

    def _remember(self, budget: int, timing: Timing) -> None:
        cached = self.cache.read(self.key)
        if cached is not None and cached.budget >= budget:
            return  # the cache keeps the quietest figure
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.cache.write(self.key, CachedBudget(budget, round(timing.per_token_s * 1e3, 3),
                                                round(timing.fixed_s * 1e3, 1), now))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _package_version() -> str:
    try:
        return metadata.version("llm_api")
    except metadata.PackageNotFoundError:
        return "unknown"
