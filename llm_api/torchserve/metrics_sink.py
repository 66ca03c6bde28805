"""Serving metrics as TorchServe ``[METRICS]`` lines: the sink ``llm_api.service.metrics`` reports through.

Each observation becomes a line on the worker's stdout, which the frontend parses and, with
``model_metrics_auto_detect=true``, registers and serves on its metrics port (a metric appears after its
first report; histograms use the frontend's default buckets).
"""

from __future__ import annotations

from ts.metrics.caching_metric import CachingMetric
from ts.metrics.metric_type_enum import MetricTypes


class TorchServeMetricSink:
    def __init__(self, model_name: str):
        self._model_name = model_name
        self._metrics: dict[str, CachingMetric] = {}

    def __call__(self, name: str, value: float, unit: str, kind: str) -> None:
        metric = self._metrics.get(name)
        if metric is None:
            metric = self._metrics[name] = CachingMetric(name, unit, ["model_name"], MetricTypes[kind.upper()])
        metric.add_or_update(value, [self._model_name])
