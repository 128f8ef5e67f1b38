"""tune --budget-minutes bounds the engine confirmation too: the measuring passes leave it time, and it confirms
fewer candidates (or none) when the time left does not hold them (stated engine figures, a clock set by hand)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from calib.evaluation import plan
from calib.tune.run import confirmations
from calib.tune.search import Clock


def _clock(left_s: float) -> Clock:
    c = Clock(10)
    c.end = time.perf_counter() + left_s
    return c


def test_confirmations_fit_the_time_left():
    start, rate = plan.engine_figures("cpu")
    samples = [SimpleNamespace(ids=range(1000))] * 5                 # 5,000 tokens per engine arm
    per_arm = start + 5000 / rate
    cfg = SimpleNamespace(confirm=3)
    logged = []
    assert confirmations(cfg, Clock(None), samples, "cpu", logged.append) == 3 and not logged
    assert confirmations(cfg, _clock(per_arm * 5.5), samples, "cpu", logged.append) == 3 and not logged
    assert confirmations(cfg, _clock(per_arm * 3.5), samples, "cpu", logged.append) == 1
    assert "engine confirmation 1 of 3 candidates" in logged[-1] and "stated defaults" in logged[-1]
    assert confirmations(cfg, _clock(per_arm * 1.5), samples, "cpu", logged.append) == 0
    assert logged[-1].endswith("engine confirmation dropped")


def test_measuring_stops_early_enough_to_leave_the_engine_its_share():
    c = Clock(10)
    c.reserve(120)
    assert c.end - c.deadline == 120
    c.reserve(1e6)                                                    # never more than half the budget
    assert c.end - c.deadline == 300
    none = Clock(None)
    none.reserve(120)
    assert none.deadline is None and none.left() is None
