"""The passkey significance rule (calib/evaluation/significance.py) against brute force: the exact McNemar
p-value against every sign assignment of the paired outcomes, the power against every outcome tuple, and
the verdict that says "within noise" for one flipped prompt."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from fractions import Fraction

import pytest

from calib.evaluation import markdown, passkey, report, significance
from calib.evaluation.verdict import Thresholds, failures, verdict
from calib.evaluation.results import PasskeyRow, passkey_rows
from helpers import arm_metrics, reference_metrics


def power(prompts: int, p_loss: float, p_gain: float, alpha: float) -> float:
    """Probability that the one-sided exact test rejects at `alpha` when each prompt is independently a loss
    with probability p_loss, a gain with p_gain, concordant otherwise (exact sum over the multinomial)."""
    tie = 1.0 - p_loss - p_gain
    total = 0.0
    for b in range(prompts + 1):
        for c in range(prompts - b + 1):
            if significance.mcnemar_p(b, c) < alpha:
                total += (math.comb(prompts, b) * math.comb(prompts - b, c) * p_loss ** b * p_gain ** c
                          * tie ** (prompts - b - c))
    return total


def prompts_needed(drop: float, alpha: float, target: float = significance.POWER, flips: float = 0.0,
                   most: int = 1000) -> int:
    """The fewest prompts whose test detects `drop` (losses at drop + flips, gains at flips) with `target` power."""
    for n in range(1, most + 1):
        if power(n, drop + flips, flips, alpha) >= target:
            return n
    raise ValueError(f"more than {most} prompts needed to detect a drop of {drop} at alpha {alpha}")


def _flip_p(pairs: list[tuple[bool, bool]]) -> Fraction:
    """Permutation p-value of the drop: under "no difference" the two runs' answers to a prompt are exchangeable,
    so each of the 2^n swaps is equally likely; the share of swaps whose drop (reference correct - arm correct)
    is at least the observed one."""
    observed = sum(r for r, _ in pairs) - sum(a for _, a in pairs)
    hits = 0
    for swap in itertools.product((False, True), repeat=len(pairs)):
        drop = sum((a if s else r) - (r if s else a) for (r, a), s in zip(pairs, swap))
        hits += drop >= observed
    return Fraction(hits, 2 ** len(pairs))


def test_exact_mcnemar_equals_the_permutation_test_on_every_small_table():
    for n in range(0, 11):
        for lost, gained in itertools.product(range(n + 1), repeat=2):
            both = n - lost - gained
            if both < 0:
                continue
            # concordant prompts are split between both-right and both-wrong: they never change the p-value
            pairs = [(True, False)] * lost + [(False, True)] * gained + [(True, True)] * (both // 2) + \
                [(False, False)] * (both - both // 2)
            assert significance.mcnemar_p(lost, gained) == float(_flip_p(pairs)), (lost, gained, both)


def test_two_sided_is_twice_the_smaller_tail_and_symmetric():
    assert significance.mcnemar_p(1, 0, "two-sided") == 1.0
    assert significance.mcnemar_p(3, 3, "two-sided") == 1.0
    for b, c in itertools.product(range(9), repeat=2):
        n = b + c
        tail = Fraction(sum(math.comb(n, i) for i in range(min(b, c) + 1)), 2 ** n)
        assert significance.mcnemar_p(b, c, "two-sided") == float(min(Fraction(1), 2 * tail))
        assert significance.mcnemar_p(b, c, "two-sided") == significance.mcnemar_p(c, b, "two-sided")
    assert significance.mcnemar_p(5, 0) == 1 / 32 and significance.mcnemar_p(0, 0) == 1.0
    with pytest.raises(ValueError):
        significance.mcnemar_p(1, 1, "greater")


def test_power_equals_the_sum_over_every_outcome_tuple():
    p_loss, p_gain, alpha = 0.3, 0.05, 0.1
    for n in range(1, 8):
        brute = 0.0
        for outcome in itertools.product("lgt", repeat=n):
            b, c = outcome.count("l"), outcome.count("g")
            if significance.mcnemar_p(b, c) < alpha:
                brute += p_loss ** b * p_gain ** c * (1 - p_loss - p_gain) ** (n - b - c)
        assert power(n, p_loss, p_gain, alpha) == pytest.approx(brute, rel=1e-12, abs=1e-15)


def test_the_default_prompts_detect_a_ten_point_drop():
    """The numbers significance.py documents."""
    assert prompts_needed(0.10, 0.05) == 66
    assert prompts_needed(0.10, 0.05 / 3) == 78
    assert significance.DEFAULT_PROMPTS >= 78
    assert significance.DEFAULT_TRIALS * len(passkey.DEPTHS) == significance.DEFAULT_PROMPTS
    assert significance.DEPTH_COUNT == len(passkey.DEPTHS)
    assert power(80, 0.10, 0.0, 0.05 / 3) == pytest.approx(0.823, abs=5e-4)
    assert power(80, 0.12, 0.02, 0.05 / 3) == pytest.approx(0.512, abs=5e-4)


def _rows(bucket: str, outcomes: list[bool], depths=(0.0, 0.5)) -> dict:
    """Typed passkey rows for one bucket, prompts cycling through `depths`."""
    return passkey_rows(passkey.summarize([passkey.Outcome(int(bucket), depths[i % len(depths)], "12345", "", c)
                                           for i, c in enumerate(outcomes)]))


def test_one_flipped_prompt_is_within_noise_and_a_real_drop_fails():
    ref = _rows("256", [True] * 7 + [False] * 3)
    one = _rows("256", [True] * 6 + [False] * 4)                    # 6/10 vs 7/10: prompt 7 flipped
    d = significance.decide(ref, one)
    assert d.failed == () and d.buckets[0].conclusion() == "within noise"
    assert d.notes == ("passkey 6/10 vs reference 7/10 in bucket <= 256 (1 lost, 0 gained; exact McNemar p = 0.5 "
                       ">= 0.05): within noise",)
    assert {t.depth: (t.losses, t.gains) for t in d.depths} == {"0": (1, 0), "0.5": (0, 0)}
    worse = _rows("256", [False] * 7 + [False] * 3)                 # 0/10: seven lost
    d = significance.decide(ref, worse)
    assert d.failed == ("passkey 0/10 vs reference 7/10 in bucket <= 256 (7 lost, 0 gained; exact McNemar "
                        "p = 0.00781 < 0.05)",)
    assert significance.decide(ref, worse, allowed=7).failed == ()


def test_bonferroni_over_buckets_and_too_few_prompts():
    ref = {**_rows("256", [True] * 10), **_rows("512", [True] * 4)}
    arm = {**_rows("256", [True] * 5 + [False] * 5), **_rows("512", [False] * 4)}
    d = significance.decide(ref, arm)
    by = {t.bucket: t for t in d.buckets}
    assert by["256"].alpha == 0.025 and by["256"].p == 1 / 32 and by["256"].conclusion() == "within noise"
    assert not by["512"].conclusive and by["512"].conclusion() == "too few prompts to conclude"
    assert d.failed == () and "too few prompts to conclude" in d.notes[1]
    assert [t.bucket for t in d.buckets if not t.powered] == ["256", "512"]


def test_rows_without_outcomes_fall_back_to_counts():
    old = {"256": PasskeyRow(5, 5, {}, 1.0)}
    assert significance.decide(old, {"256": PasskeyRow(4, 5, {}, 0.8)}).failed == ("passkey 4/5 < reference 5/5",)
    assert significance.decide(old, {"256": PasskeyRow(5, 5, {}, 1.0)}).failed == ()
    assert significance.decide(None, old) is None


def test_the_verdict_ships_an_arm_one_prompt_below_the_reference():
    ref = reference_metrics()
    ref = replace(ref, passkey=_rows("64", [True] * 7 + [False] * 3))
    arm = arm_metrics(passkey=_rows("64", [True] * 6 + [False] * 4))
    v = verdict(ref, {"calibrated": arm}, Thresholds(), "bf16")
    assert v.action == "ship" and v.arm == "calibrated"
    assert "`calibrated` passkey 6/10 vs reference 7/10 in bucket <= 64 (1 lost, 0 gained; exact McNemar p = 0.5 " \
           ">= 0.05): within noise." in v.text
    drop = arm_metrics(passkey=_rows("64", [False] * 10))
    assert failures(drop, ref, Thresholds()) == [
        "passkey 0/10 vs reference 7/10 in bucket <= 64 (7 lost, 0 gained; exact McNemar p = 0.00781 < 0.05)"]
    assert verdict(ref, {"calibrated": drop}, Thresholds(), "bf16").action == "keep_reference"


def test_report_shows_the_paired_test_per_bucket_and_depth():
    ref = replace(reference_metrics(), passkey=_rows("64", [True] * 7 + [False] * 3))
    arm = arm_metrics(passkey=_rows("64", [True] * 6 + [False] * 4))
    rep = report.Report({"reference": "bf16"}, ref, {"calibrated": arm}, Thresholds(),
                        verdict(ref, {"calibrated": arm}, Thresholds(), "bf16"))
    lines = markdown._significance_lines(rep)
    assert "| calibrated | 64 | 10 | 7 | 6 | 1 | 0 | 0.5 | 0.05 | within noise (underpowered) | 0:1-/0+ 0.5:0-/0+ |" \
        in lines
    sig = rep.to_dict()["arms"]["calibrated"]["passkey_significance"]
    assert sig["buckets"]["64"]["conclusion"] == "within noise" and sig["buckets"]["64"]["powered"] is False
    assert [(d["depth"], d["losses"]) for d in sig["depths"]] == [("0", 1), ("0.5", 0)]
