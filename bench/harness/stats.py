"""Percentiles of measured latencies, in the two conventions the reports use.

``nearest_rank(values, q)``: the smallest value with at least ``q`` percent of the values at or below it
(one of the samples, never an interpolation; NaN for no values). ``quantile_summary(values)``: p50, p95
and p99 interpolated between samples (``statistics.quantiles``, inclusive method) and the mean; every
entry is None for no values, and a single value is all of them. Standard library only.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def nearest_rank(values: Iterable[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = math.ceil(q / 100 * len(ordered))
    return ordered[min(len(ordered), max(1, rank)) - 1]


def quantile_summary(values: Iterable[float]) -> dict[str, float | None]:
    samples = list(values)
    if not samples:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    cuts = statistics.quantiles(samples, n=100, method="inclusive") if len(samples) > 1 else [samples[0]] * 99
    return {"p50": cuts[49], "p95": cuts[94], "p99": cuts[98], "mean": statistics.fmean(samples)}
