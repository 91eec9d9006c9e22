"""Ratios from side-by-side repeats: the median of the paired ratios and its 95 % bootstrap interval. Plain Python."""

from __future__ import annotations

import random
import statistics


def bootstrap_interval(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """95 % interval of the median of ``values`` (the paired per-round ratios), by the percentile bootstrap:
    resample the rounds with replacement, take each resample's median, read the 2.5th and 97.5th percentiles.
    None below 3 rounds, where it says nothing."""
    if len(values) < 3:
        return None
    rng = random.Random(seed)
    estimates = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return estimates[int(0.025 * resamples)], estimates[int(0.975 * resamples) - 1]


def paired_ratio(a: list[float], b: list[float]) -> dict:
    """A / B from rounds run A B A B (``a[i]`` and ``b[i]`` measured side by side in round i): the median of the
    per-round ratios with its 95 % interval (slow drift of a shared machine hits both sides of a round alike), and
    the ratio of the two sides' medians over all rounds ("pooled"), steadier when single runs scatter more than the
    machine drifts."""
    paired = [x / y for x, y in zip(a, b)]
    return {
        "median": statistics.median(paired),
        "interval": bootstrap_interval(paired),
        "rounds": paired,
        "pooled": statistics.median(a) / statistics.median(b),
    }
