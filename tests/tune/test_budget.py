"""tune's plan (calib/tune/search.py Planner) in the evaluation's cost model: what --budget-minutes drops, in which
order, named; the engine's share from eval's stated figures. Hand-computed seconds on a linear cost model."""

from __future__ import annotations

import pytest

from calib.evaluation import plan
from calib.tune.search import Parts, Planner

COST = plan.Cost(1.0, 0.0)                                # a sample of n tokens is n units of work
RATES = plan.default_rates("cpu", 1e-3, 1e-3, 16)         # 1 ms per unit: 5 s per arm over 5 x 1,000 tokens
GROUPS = ((), ("a1", "a2"), ("b",), ("c",))               # the default scale 1.0, then three measured arms
PLANNER = Planner(COST, RATES, (1000,) * 5, (1000,) * 2, 8, 3, 2, True, GROUPS)
FULL = Parts(4, True, False, 3)
START, RATE = plan.ENGINE_START_S["cpu"], plan.ENGINE_TOKENS_PER_S["cpu"]
ENGINE_ARM = START + 5000 / RATE                          # a start and 5,000 tokens scored: 23.3 s


def test_full_plan_is_every_phase_by_hand():
    got = PLANNER.fit(FULL, None)
    assert dict(got.phases) == pytest.approx({
        "candidates: 4 of 4 (4 measured arm(s) with the default scale 1.0)": 5 * (1 + 4),    # one pass of 4 arms
        "layer skips: sensitivity of 3 layers, skips of 1..2": 2 * (1 + 3) + 5 * (1 + 2),    # 2 samples, then 5
        "the sliding-window skip": 0.0,
        "engine: 3 candidate(s), the default scale 1.0 and the reference": 5 * ENGINE_ARM})
    assert got.dropped == ()


@pytest.mark.parametrize("budget, parts, total, before, dropped", [
    # the plan one drop earlier (`before`: one more engine arm, or one more measured arm) does not fit
    (100, Parts(4, False, False, 1), 25 + 3 * ENGINE_ARM, 25 + 4 * ENGINE_ARM,
     ["layer skips (sensitivity of 3 layers, skips of 1..2)", "engine confirmation 3 -> 1 candidate(s)"]),
    (20, Parts(3, False, False, 0), 5 * 4, 5 * 5, ["layer skips (sensitivity of 3 layers, skips of 1..2)",
                                     "engine confirmation 3 -> 0 candidate(s)", "1 candidate(s) not scored: c"]),
    (0, Parts(0, False, False, 0), 0, 5 * 3, ["layer skips (sensitivity of 3 layers, skips of 1..2)",
                                    "engine confirmation 3 -> 0 candidate(s)",
                                    "4 candidate(s) not scored: a1, a2, b, c"]),
])
def test_budget_drops_skips_then_engine_arms_then_candidates_last_first(budget, parts, total, before, dropped):
    got = PLANNER.fit(FULL, budget)
    assert got.parts == parts and list(got.dropped) == dropped
    assert got.total == pytest.approx(total) and got.total <= budget < before
    lines = got.lines(RATES, "tune plan")
    assert lines[0].startswith("tune plan (probe: one forward at 16 tokens")
    assert lines[-1] == "  dropped to fit the budget: " + "; ".join(dropped)


def test_the_candidate_pass_counts_the_reference_once_per_chunk():
    two = Planner(COST, RATES, (1000,) * 5, (), 2, 0, 0, False, GROUPS)
    assert two.passes(4, two.lengths) == pytest.approx(2 * 5 * (1 + 2))      # two passes of two arms
    assert two.passes(3, two.lengths) == pytest.approx(5 * 3 + 5 * 2)
