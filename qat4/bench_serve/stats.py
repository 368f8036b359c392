"""The statistics of `qat4 bench serve`: percentiles as numpy computes them, and the mean, p50 and
p99 of durations in milliseconds."""

from __future__ import annotations

import math
from collections.abc import Sequence

QUANTILES = (50, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50 and p99 of durations in seconds, in milliseconds; None each when there are none."""
    if not seconds:
        return {"mean": None, **{f"p{q}": None for q in QUANTILES}}
    return {"mean": 1e3 * sum(seconds) / len(seconds), **{f"p{q}": 1e3 * percentile(seconds, q) for q in QUANTILES}}

