"""Latency distributions (calib/load/records.py) against brute force: percentiles against numpy's linear
interpolation, the mean and p50 / p90 / p99 of a distribution."""

from __future__ import annotations

import random

import numpy as np
import pytest

from calib.load import records as stats


def test_percentile_is_numpys_linear_interpolation():
    rng = random.Random(0)
    for n in (1, 2, 3, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert stats.percentile([], 50) is None
    d = stats.distribution([3.0, 1.0, 2.0])
    assert d == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98)}
    assert stats.distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
