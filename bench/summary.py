"""Shared by the benchmarks: percentiles and the min/median/p99/max summary they print."""

from __future__ import annotations

import statistics


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary_ms(samples: list[float], scale: float = 1000.0) -> dict[str, float]:
    """Seconds in, milliseconds out (or another unit through `scale`)."""
    values = [s * scale for s in samples]
    return {
        "n": len(values),
        "min": round(min(values), 3),
        "median": round(statistics.median(values), 3),
        "p99": round(percentile(values, 99), 3),
        "max": round(max(values), 3),
    }
