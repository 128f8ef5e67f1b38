"""The serving decision (calib/load/decide.py) against hand-made tables and a brute-force statement of the rule."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from calib.load.decide import Arm, decide, dominates, mix


def ref(goodput=10.0, capacity=10, noise=0.0):
    return Arm("bf16", True, 0.0, capacity, goodput, noise, reference=True)


def test_fp8_with_twice_the_capacity_and_more_goodput_is_recommended():
    d = decide([ref(), Arm("fp8", True, 0.012, 20, 19.0)])
    assert d.recommended == "fp8"
    assert d.ratios["fp8"] == pytest.approx(1.9)
    assert "1.90x" in d.why


def test_no_gain_beyond_noise_keeps_bf16_and_says_fp8_buys_nothing():
    d = decide([ref(noise=0.02), Arm("fp8", True, 0.01, 20, 10.4, noise=0.02)], floor=0.03)
    assert d.recommended == "bf16"
    assert "buys nothing" in d.why and "fp8" in d.why


def test_an_arm_whose_server_failed_is_named_and_fp8_is_not_said_to_buy_nothing():
    # measured on the GPU: the FP8 server failed at start-up (memory held by another process); the decision had
    # read "FP8 KV buys nothing" from BF16 alone
    d = decide([ref(), Arm("fp8", True, None, None, None, why_not="server exited with code 1 at start-up")])
    assert d.recommended == "bf16"
    assert "buys nothing" not in d.why.replace("does not show that FP8 KV buys nothing", "")
    assert "`fp8` not measured (server exited with code 1 at start-up)" in d.why
    # a measured winner still wins, and the unserved arm is still named
    d = decide([ref(), Arm("fp8", True, 0.01, 20, 19.0), Arm("fp8-skip", True, 0.0, None, None, why_not="budget")])
    assert d.recommended == "fp8" and "`fp8-skip` not measured (budget)" in d.why
    # an arm outside the quality bar that was not served changes nothing
    d = decide([ref(), Arm("fp8", False, 0.3, None, None, why_not="x"), Arm("c", True, 0.0, 20, 10.1)])
    assert "buys nothing for this workload" in d.why and "not measured" not in d.why


def test_every_fp8_arm_outside_the_bar_says_so_not_that_fp8_buys_nothing():
    # measured on CPU vLLM: both FP8 arms failed the bar, and the decision read "FP8 KV buys nothing for this workload"
    d = decide([ref(), Arm("fp8", False, 0.02, 20, 9.4), Arm("cal", False, 0.01, 20, 9.4)])
    assert d.recommended == "bf16" and "no FP8 arm is within the quality bar" in d.why and "buys nothing" not in d.why


def test_slower_fp8_at_short_context_keeps_bf16():
    d = decide([ref(goodput=30.0, capacity=400), Arm("fp8", True, 0.01, 800, 27.0)])
    assert d.recommended == "bf16"


def test_an_arm_outside_the_quality_bar_is_never_recommended_however_fast():
    d = decide([ref(), Arm("fp8", False, 0.2, 20, 40.0), Arm("fp8-cal", True, 0.01, 20, 15.0)])
    assert d.recommended == "fp8-cal"


def test_dominated_arm_is_never_recommended_even_when_fastest_within_noise():
    # the calibrated arm shares the default arm's sweep (same speed) and has the better quality
    arms = [ref(), Arm("fp8", True, 0.015, 20, 20.5, 0.01), Arm("fp8-cal", True, 0.010, 20, 20.0, 0.01)]
    d = decide(arms, floor=0.03)
    assert d.dominated == {"fp8": "fp8-cal"}
    assert d.recommended == "fp8-cal"


def test_ties_on_all_three_keep_the_earlier_arm():
    arms = [ref(), Arm("a", True, 0.01, 20, 20.0), Arm("b", True, 0.01, 20, 20.0)]
    d = decide(arms)
    assert d.dominated == {"b": "a"} and d.recommended == "a"


def test_a_skip_with_bf16s_capacity_and_no_speed_gain_is_dominated_by_bf16():
    arms = [ref(), Arm("fp8", True, 0.012, 20, 14.0), Arm("fp8-skip", True, 0.003, 10, 10.1)]
    d = decide(arms)
    assert d.dominated["fp8-skip"] == "bf16"
    assert d.recommended == "fp8"


def test_the_skip_that_serves_fastest_wins_although_it_holds_fewer_requests():
    # docs/design.md §12: the sliding-window skip measured 1.21x BF16 at saturation, FP8 everywhere 1.14x
    arms = [ref(goodput=20.9, capacity=14), Arm("fp8", True, 0.0117, 28, 23.9), Arm("fp8-skip", True, 0.0008, 15, 25.2)]
    d = decide(arms, floor=0.03)
    assert d.recommended == "fp8-skip" and not d.dominated


def test_without_a_served_reference_nothing_is_recommended():
    d = decide([Arm("bf16", True, 0.0, None, None, reference=True, why_not="server did not start: OOM"),
                Arm("fp8", True, 0.01, 20, 30.0)])
    assert d.recommended is None and "not measured" in d.why and "OOM" in d.why


def test_unknown_capacity_never_dominates():
    assert not dominates(Arm("a", True, 0.0, None, 50.0), Arm("b", True, 0.1, 10, 1.0), 0.03, True)


def test_bf16_missing_every_slo_and_fp8_meeting_some():
    d = decide([ref(goodput=0.0), Arm("fp8", True, 0.01, 20, 2.0)])
    assert d.recommended == "fp8" and d.ratios["fp8"] == math.inf


# --------------------------------------------------------------------------- brute force

def _brute(arms, floor):
    """The rule written out directly over every ordered pair, independently of decide's helpers."""
    ref_arm = next(a for a in arms if a.reference)
    order = [ref_arm] + [a for a in arms if not a.reference]
    cands = [a for a in order if a.goodput is not None and (a.quality_ok or a.reference)]

    def tol(a, b):
        return max(floor, a.noise + b.noise)

    def faster(x, y):        # x's goodput beyond y's noise
        return x.goodput > y.goodput * (1 + tol(x, y)) or (y.goodput == 0 and x.goodput > 0)

    def not_slower(x, y):
        return not faster(y, x)

    dominated = set()
    for a, b in itertools.permutations(cands, 2):
        if a.capacity is None or b.capacity is None:
            continue
        if b.ppl_rel <= a.ppl_rel and b.capacity >= a.capacity and not_slower(b, a):
            strictly = b.ppl_rel < a.ppl_rel or b.capacity > a.capacity or faster(b, a)
            if strictly or order.index(b) < order.index(a):
                dominated.add(a.name)
    winners = [a for a in cands if not a.reference and a.name not in dominated and faster(a, ref_arm)]
    if not winners:
        return ref_arm.name
    top = max(a.goodput for a in winners)
    return next(a.name for a in winners if a.goodput == top)


def test_decide_equals_the_brute_force_rule_on_random_tables():
    rng = random.Random(7)
    for _ in range(3000):
        n = rng.randint(1, 5)
        arms = [Arm("bf16", True, 0.0, rng.choice([5, 10, 20]), rng.choice([0.0, 8.0, 10.0, 10.2, 12.0]),
                    rng.choice([0.0, 0.01, 0.05]), reference=True)]
        for j in range(n):
            arms.append(Arm(f"a{j}", rng.random() < 0.8, rng.choice([0.0, 0.003, 0.01, 0.02]),
                            rng.choice([5, 10, 20, 40]), rng.choice([None, 0.0, 9.0, 10.0, 10.3, 11.0, 14.0, 20.0]),
                            rng.choice([0.0, 0.01, 0.04])))
        floor = rng.choice([0.0, 0.03])
        assert decide(arms, floor).recommended == _brute(arms, floor), arms


def test_the_mix_is_the_share_weighted_harmonic_goodput():
    short = [ref(goodput=30.0, capacity=400), Arm("fp8", True, 0.01, 800, 27.0)]
    long = [ref(goodput=2.0, capacity=3), Arm("fp8", True, 0.01, 6, 4.0)]
    got = mix([short, long], [0.75, 0.25])
    # brute force: 100 requests, 75 short at their best rate and 25 long at theirs
    for a, g_short, g_long in ((got[0], 30.0, 2.0), (got[1], 27.0, 4.0)):
        seconds = 75 / g_short + 25 / g_long
        assert a.goodput == pytest.approx(100 / seconds)
    assert [a.capacity for a in got] == [3, 6]
    assert decide(got).recommended == "fp8"
