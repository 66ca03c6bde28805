"""Serving metrics and the readiness signal (no TorchServe here: the handler passes a sink).

``ServingMetrics`` is told about each request's life (``start`` -> ``RequestTimer.tokens`` per
output -> ``RequestTimer.finish``) and reads the engine's ``stats()``; it reports every value through a
``sink(name, value, unit, kind)`` callable, where ``kind`` is "counter" (the value is an increment),
"gauge" or "histogram" (one observation). The handler's sink writes TorchServe's ``[METRICS]`` log
lines, which the frontend turns into Prometheus series on the metrics port (``METRICS`` lists them).

Latencies are in seconds, so TorchServe's fixed histogram buckets (Prometheus' defaults, 5 ms to 10 s)
fit them. Inter-token latency is observed once per request as its mean gap between tokens (a line per
token would flood the worker's stdout pipe that TorchServe parses). Gauges are published when a
request starts or ends and at most once per ``gauge_interval_s`` while tokens flow; counters of what
happened meanwhile (tokens generated; from the engine: preemptions, prefix-cache lookups, speculative
draft and accepted tokens) are published with them, as increments since the last publication. (Tokens
were once reported per output: on TorchServe each report is a log line written on the worker's event
loop, and a profile of a streaming worker found 13% of its GIL-holding time there.)

``health()`` is the readiness signal: not ready when the engine loop is gone, or when requests are in
flight and no token has been produced for ``stall_after_s`` seconds (the engine is not making progress).
It reads only counters kept here and the engine loop's published snapshot: it never waits on the engine.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable

Sink = Callable[[str, float, str, str], None]

# name -> (kind, unit, help); the README and the metrics test read this table.
METRICS: dict[str, tuple[str, str, str]] = {
    "llm_time_to_first_token_seconds": ("histogram", "Seconds", "arrival at the handler to the first token"),
    "llm_inter_token_latency_seconds": ("histogram", "Seconds", "mean gap between a request's tokens, once per request"),
    "llm_e2e_request_latency_seconds": ("histogram", "Seconds", "arrival at the handler to the last token"),
    "llm_prompt_tokens_total": ("counter", "Count", "prompt tokens of accepted requests"),
    "llm_generation_tokens_total": ("counter", "Count", "tokens generated"),
    "llm_requests_finished_total": ("counter", "Count", "requests that ended (any reason)"),
    "llm_num_requests_running": ("gauge", "Count", "requests the engine is decoding"),
    "llm_num_requests_waiting": ("gauge", "Count", "requests queued in the engine (scale-out signal)"),
    "llm_kv_cache_usage_ratio": ("gauge", "Ratio", "share of KV-cache blocks in use"),
    "llm_prefix_cache_hit_rate": ("gauge", "Ratio", "prompt tokens found in the prefix cache / looked up, since start"),
    "llm_prefix_cache_queries_total": ("counter", "Count", "prompt tokens looked up in the prefix cache"),
    "llm_prefix_cache_hits_total": ("counter", "Count", "prompt tokens found in the prefix cache"),
    "llm_num_preemptions_total": ("counter", "Count", "requests preempted (blocks freed, recomputed later)"),
    "llm_spec_decode_num_draft_tokens_total": ("counter", "Count", "draft tokens proposed (speculative decoding)"),
    "llm_spec_decode_num_accepted_tokens_total": ("counter", "Count", "draft tokens accepted (speculative decoding)"),
    "llm_generation_tokens_per_second": ("gauge", "Count", "tokens generated per second over the last 10 s"),
}
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class Health:
    ready: bool
    status: str  # "ok" | "idle" | "stalled" | "stopped"
    num_active_requests: int
    tokens_per_second: float
    seconds_since_progress: float | None
    stall_after_s: float
    engine: dict | None  # the engine's stats, when the paged engine runs

    def to_json(self) -> dict:
        return asdict(self)


class ServingMetrics:
    def __init__(self, sink: Sink, stats_fn: Callable[[], Any] | None = None, clock: Callable[[], float] = time.monotonic,
                 stall_after_s: float = 30.0, gauge_interval_s: float = 1.0,
                 engine_alive: Callable[[], bool] = lambda: True):
        self.sink = sink
        self.stats_fn = stats_fn
        self.engine_alive = engine_alive
        self.clock = clock
        self.stall_after_s = stall_after_s
        self.gauge_interval_s = gauge_interval_s
        self._lock = threading.Lock()  # classic mode reports from TorchServe's thread, async from the loop
        self._num_active = 0
        self._last_progress: float | None = None
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) within RATE_WINDOW_S
        self._last_gauges = float("-inf")
        self._published: dict[str, int] = {}  # engine counter -> value already published
        self._unpublished_tokens = 0  # generated since the last publication
        self._emitted: set[str] = set()

    # ---------------------------------------------------------------------------------------------
    # requests

    def start(self, num_prompt_tokens: int, arrival: float | None = None) -> "RequestTimer":
        now = self.clock()
        with self._lock:
            if self._num_active == 0:
                self._last_progress = now  # the stall clock starts when work arrives
            self._num_active += 1
        self._emit("llm_prompt_tokens_total", num_prompt_tokens)
        self.publish_gauges(force=True)
        return RequestTimer(self, arrival if arrival is not None else now)

    def _on_tokens(self, n: int, now: float) -> None:
        with self._lock:
            self._last_progress = now
            self._recent.append((now, n))
            self._unpublished_tokens += n
        self.publish_gauges()

    def _on_finish(self) -> None:
        with self._lock:
            self._num_active = max(0, self._num_active - 1)
        self._emit("llm_requests_finished_total", 1)
        self.publish_gauges(force=True)

    # ---------------------------------------------------------------------------------------------
    # gauges and health

    def tokens_per_second(self, now: float | None = None) -> float:
        now = self.clock() if now is None else now
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def publish_gauges(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._last_gauges < self.gauge_interval_s:
            return
        self._last_gauges = now
        with self._lock:
            tokens, self._unpublished_tokens = self._unpublished_tokens, 0
        if tokens:
            self._emit("llm_generation_tokens_total", tokens)
        self._emit("llm_generation_tokens_per_second", self.tokens_per_second(now))
        stats = self.stats_fn() if self.stats_fn is not None else None
        if stats is None:
            self._emit("llm_num_requests_running", self._num_active)
            self._emit("llm_num_requests_waiting", 0)
            return
        self._emit("llm_num_requests_running", stats.num_running)
        self._emit("llm_num_requests_waiting", stats.num_waiting)
        total = max(1, stats.num_total_blocks)
        self._emit("llm_kv_cache_usage_ratio", (stats.num_total_blocks - stats.num_free_blocks) / total)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self._emit("llm_prefix_cache_hit_rate", hits / queries if queries else 0.0)
        for name, value in (("llm_prefix_cache_queries_total", queries), ("llm_prefix_cache_hits_total", hits),
                            ("llm_num_preemptions_total", stats.num_preemptions),
                            ("llm_spec_decode_num_draft_tokens_total", stats.spec_decode_num_draft_tokens),
                            ("llm_spec_decode_num_accepted_tokens_total", stats.spec_decode_num_accepted_tokens)):
            with self._lock:
                delta = value - self._published.get(name, 0)
                self._published[name] = value
            if delta > 0 or name not in self._emitted:
                self._emit(name, max(0, delta))

    def health(self) -> Health:
        now = self.clock()
        rate = self.tokens_per_second(now)
        with self._lock:
            active, last = self._num_active, self._last_progress
        since = None if last is None else now - last
        stats = self.stats_fn() if self.stats_fn is not None else None
        if not self.engine_alive():
            status = "stopped"
        elif active == 0:
            status = "idle"
        elif since is not None and since > self.stall_after_s:
            status = "stalled"
        else:
            status = "ok"
        return Health(
            ready=status in ("idle", "ok"), status=status, num_active_requests=active, tokens_per_second=round(rate, 3),
            seconds_since_progress=None if since is None else round(since, 3), stall_after_s=self.stall_after_s,
            engine=None if stats is None else {
                "num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "num_free_blocks": stats.num_free_blocks, "num_total_blocks": stats.num_total_blocks},
        )

    # ---------------------------------------------------------------------------------------------

    def announce(self) -> None:
        """Publish every counter (as +0) and gauge once, so the series exist before the first request.

        TorchServe registers a backend metric when it first sees it; histograms appear with the first
        request, since an observation cannot be faked."""
        for name, (kind, _, _) in METRICS.items():
            if kind == "counter" and not name.startswith(("llm_prefix_cache_", "llm_num_preemptions", "llm_spec_decode_")):
                self._emit(name, 0)
        self.publish_gauges(force=True)

    def _emit(self, name: str, value: float) -> None:
        kind, unit, _ = METRICS[name]
        self._emitted.add(name)
        try:
            self.sink(name, float(value), unit, kind)
        except Exception:  # metrics must never fail a request
            pass


class RequestTimer:
    """One request's clock: time to first token, mean inter-token gap, end-to-end latency."""

    def __init__(self, metrics: ServingMetrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.done = False

    def tokens(self, n: int) -> None:
        if n <= 0 or self.done:
            return
        now = self.metrics.clock()
        if self.first_token is None:
            self.first_token = now
            self.metrics._emit("llm_time_to_first_token_seconds", now - self.arrival)
        self.last_token = now
        self.num_tokens += n
        self.metrics._on_tokens(n, now)

    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        now = self.metrics.clock()
        self.metrics._emit("llm_e2e_request_latency_seconds", now - self.arrival)
        if self.first_token is not None and self.num_tokens > 1:
            assert self.last_token is not None  # tokens() sets it with first_token
            self.metrics._emit("llm_inter_token_latency_seconds",
                               (self.last_token - self.first_token) / (self.num_tokens - 1))
        self.metrics._on_finish()
