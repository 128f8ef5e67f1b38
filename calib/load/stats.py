"""Latency distributions: mean and percentiles, the way vLLM bench serve reports them.

Percentiles interpolate linearly between order statistics (numpy's default), so a number kvcalib prints can
be checked against numpy on the same values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between order statistics; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean and p50 / p90 / p99 of `values` (seconds), None where there is nothing to measure."""
    out: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out
