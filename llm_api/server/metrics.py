"""Prometheus metrics of the standalone server, on ``prometheus_client`` with a registry of its own.

Two sources, one registry (``ServerMetrics.registry``; ``render()`` writes the text format):

* ``sink``: the ``sink(name, value, unit, kind)`` that ``llm_api.service.metrics.ServingMetrics``
  reports through, turned into a Counter, Gauge or Histogram per name of its ``METRICS`` table (the
  same ``llm_*`` series TorchServe's metrics port shows, labelled ``model_name``). The histograms get
  buckets of our own: TorchServe can only use Prometheus' defaults (5 ms to 10 s), so a long stream's
  latency fell into ``+Inf`` there; here time to first token goes to 5 minutes and end-to-end latency to
  30 minutes (REQUEST_TIMEOUT_S is 10 minutes by default).
* ``EngineCollector``: the series a router or autoscaler reads, under vLLM's names (the Gateway API
  Inference Extension and KEDA examples query these), computed from the engine loop's stats snapshot at
  scrape time, so they are never stale and a scrape never waits on the engine:
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0-1),
  ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens) and
  ``vllm:num_preemptions_total``, and for speculative decoding ``vllm:spec_decode_num_draft_tokens_total``
  / ``vllm:spec_decode_num_accepted_tokens_total`` (0 while it is off), labelled ``model_name`` and
  ``engine`` as vLLM does.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase

from llm_api.service.metrics import METRICS

if TYPE_CHECKING:
    from llm_api.service.service import ModelService

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds. Each covers what one request can take on a CPU as well as on a GPU.
BUCKETS: dict[str, tuple[float, ...]] = {
    "llm_time_to_first_token_seconds": (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80,
                                        160, 300),
    "llm_inter_token_latency_seconds": (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                                        0.4, 0.5, 0.75, 1, 2.5, 5),
    "llm_e2e_request_latency_seconds": (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 240, 480, 600, 900, 1200,
                                        1800),
}


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self._series: dict[str, Any] = {}
        for name, (kind, _, help_text) in METRICS.items():
            metric: MetricWrapperBase
            if kind == "counter":
                metric = Counter(name, help_text, ["model_name"], registry=self.registry)
            elif kind == "gauge":
                metric = Gauge(name, help_text, ["model_name"], registry=self.registry)
            else:
                metric = Histogram(name, help_text, ["model_name"], buckets=BUCKETS[name], registry=self.registry)
            self._series[name] = metric.labels(model_name)
        self._before_scrape: Callable[[], None] = lambda: None

    def sink(self, name: str, value: float, unit: str, kind: str) -> None:
        series = self._series.get(name)
        if series is None:
            return
        if kind == "counter":
            if value > 0:
                series.inc(value)
        elif kind == "gauge":
            series.set(value)
        else:
            series.observe(value)

    def watch_engine(self, stats_fn: Callable[[], Any], num_live: Callable[[], int],
                     refresh: Callable[[], None], lora_fn: Callable[[], Any] | None = None) -> None:
        """Once the model is loaded: the vLLM-named series, and ``refresh`` (the service's gauges) before
        each scrape, so gauges pushed at a request's end show the engine after it, not before. ``lora_fn``:
        () -> ((running adapters, waiting adapters, MAX_LORAS) or None, {adapter: requests since start})."""
        self.registry.register(EngineCollector(self.model_name, stats_fn, num_live, lora_fn))
        self._before_scrape = refresh

    def watch_service(self, service: "ModelService") -> None:
        """``watch_engine`` for a loaded service, and its series announced (they exist before the first
        request): what every process serving a ModelService with this registry does once it is loaded."""
        self.watch_engine(lambda: service.loop.stats, lambda: service.num_live_requests,
                          lambda: service.metrics.publish_gauges(force=True),
                          lambda: (service.lora_info(), dict(service.lora_requests)))
        service.metrics.announce()

    def render(self) -> bytes:
        try:
            self._before_scrape()
        except Exception:  # a scrape must answer whatever the service's state
            pass
        return generate_latest(self.registry)


class EngineCollector:
    def __init__(self, model_name: str, stats_fn: Callable[[], Any], num_live: Callable[[], int],
                 lora_fn: Callable[[], Any] | None = None):
        self.labels = {"model_name": model_name, "engine": "0"}
        self.stats_fn = stats_fn
        self.num_live = num_live
        self.lora_fn = lora_fn

    def describe(self):
        return []  # (nothing is collected at registration)

    def collect(self):
        stats = self.stats_fn()
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name, help_text, value):
            family = GaugeMetricFamily(name, help_text, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name, help_text, value):
            family = CounterMetricFamily(name, help_text, labels=names)
            family.add_metric(values, value)
            return family

        if stats is None:  # the generate() reference core: no scheduler queue, no paged cache
            yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", self.num_live())
            yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", 0)
            return
        yield from self._lora()
        total = max(1, stats.num_total_blocks)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    (stats.num_total_blocks - stats.num_free_blocks) / total)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      stats.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      stats.prefix_cache_hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats.num_preemptions)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                      stats.spec_decode_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      stats.spec_decode_num_accepted_tokens)

    def _lora(self):
        """vLLM's ``vllm:lora_requests_info`` (the Gateway API Inference Extension routes by it): one series
        whose labels list the adapters running and waiting (comma-separated) and MAX_LORAS, its value the
        time of this reading; and requests per adapter since start."""
        if self.lora_fn is None:
            return
        info, counts = self.lora_fn()
        if info is None:
            return
        running, waiting, max_loras = info
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
        family.add_metric([",".join(running), str(max_loras), ",".join(waiting)], time.time())
        yield family
        requests = CounterMetricFamily("llm_lora_requests", "Requests admitted per LoRA adapter since start.",
                                       labels=["model_name", "lora_name"])
        for name, count in sorted(counts.items()):
            requests.add_metric([self.labels["model_name"], name], count)
        yield requests
