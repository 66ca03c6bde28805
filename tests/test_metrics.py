"""ServingMetrics: what each request reports, engine counters as increments, and the readiness signal."""

from dataclasses import dataclass

from llm_api.service.metrics import METRICS, ServingMetrics


@dataclass
class Stats:
    num_running: int = 1
    num_waiting: int = 2
    num_free_blocks: int = 75
    num_total_blocks: int = 100
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make(stats=None):
    seen = []
    clock = Clock()
    metrics = ServingMetrics(lambda *a: seen.append(a), (lambda: stats) if stats else None, clock=clock, stall_after_s=5)
    return metrics, seen, clock


def values(seen, name):
    return [v for n, v, unit, kind in seen if n == name]


def test_request_life_reports_latencies_and_counts():
    stats = Stats()
    metrics, seen, clock = make(stats)
    metrics.announce()
    assert {n for n, *_ in seen} >= {n for n, (k, *_) in METRICS.items() if k != "histogram"}
    assert all(kind == METRICS[n][0] for n, v, unit, kind in seen)
    timer = metrics.start(12, arrival=99.5)
    clock.t = 100.5
    timer.tokens(1)
    clock.t = 101.5
    timer.tokens(2)
    clock.t = 102.0
    timer.finish()
    timer.finish()  # idempotent
    assert values(seen, "llm_time_to_first_token_seconds") == [1.0]
    assert values(seen, "llm_inter_token_latency_seconds") == [0.5]
    assert values(seen, "llm_e2e_request_latency_seconds") == [2.5]
    assert sum(values(seen, "llm_prompt_tokens_total")) == 12
    assert sum(values(seen, "llm_generation_tokens_total")) == 3
    assert values(seen, "llm_kv_cache_usage_ratio")[-1] == 0.25
    assert values(seen, "llm_num_requests_waiting")[-1] == 2


def test_generated_tokens_are_published_with_the_gauges_not_per_output():
    """A stream's outputs are counted, and the count is published at most once per gauge interval (on
    TorchServe every publication is a log line on the worker's event loop) and at the request's end."""
    metrics, seen, clock = make(Stats())
    timer = metrics.start(5, arrival=0.0)
    for step in range(100):  # 100 outputs over 2.5 s, from the start's publication (t=100)
        clock.t = 100.0 + step / 40
        timer.tokens(1)
    assert len(values(seen, "llm_generation_tokens_total")) == 2  # (at t=101 and t=102)
    timer.finish()
    assert len(values(seen, "llm_generation_tokens_total")) == 3
    assert sum(values(seen, "llm_generation_tokens_total")) == 100


def test_engine_counters_are_published_as_increments():
    stats = Stats()
    metrics, seen, clock = make(stats)
    metrics.publish_gauges(force=True)
    stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits = 2, 64, 48
    metrics.publish_gauges(force=True)
    stats.num_preemptions, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens = 3, 40, 25
    metrics.publish_gauges(force=True)
    assert sum(values(seen, "llm_spec_decode_num_draft_tokens_total")) == 40
    assert sum(values(seen, "llm_spec_decode_num_accepted_tokens_total")) == 25
    assert sum(values(seen, "llm_num_preemptions_total")) == 3
    assert sum(values(seen, "llm_prefix_cache_hits_total")) == 48
    assert values(seen, "llm_prefix_cache_hit_rate")[-1] == 0.75


def test_health_goes_unready_when_tokens_stop():
    metrics, seen, clock = make()
    assert metrics.health().ready and metrics.health().status == "idle"
    timer = metrics.start(3)
    clock.t += 4
    assert metrics.health().status == "ok"
    timer.tokens(1)
    clock.t += 6
    health = metrics.health()
    assert not health.ready and health.status == "stalled" and health.num_active_requests == 1
    timer.tokens(1)
    assert metrics.health().ready and metrics.health().tokens_per_second > 0
    timer.finish()
    assert metrics.health().status == "idle"


def test_a_failing_sink_never_fails_a_request():
    def sink(*a):
        raise RuntimeError("pipe closed")

    metrics = ServingMetrics(sink)
    metrics.start(1).finish()
