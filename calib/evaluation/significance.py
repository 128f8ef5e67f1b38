"""Passkey decisions from a paired test, not from one prompt.

Why: with 10 prompts a bucket, 6/10 against the reference's 7/10 is one prompt whose greedy answer flipped, which FP8
rounding near a tie can do either way; failing an arm on it is noise. Every arm answers the same prompts as the
reference (same ids, same order), so the outcomes pair per prompt, and the exact McNemar test applies: of the discordant
prompts (one run right, the other wrong), under "no difference" each is a loss (reference right, arm wrong) or a gain
with probability 1/2, so losses ~ Binomial(losses + gains, 1/2).

The rule (`decide`): per bucket, the arm fails passkey when it lost more prompts than it gained by more than `allowed`
and the one-sided exact p-value of that drop is below ALPHA / k (Bonferroni over the k buckets with prompts). A lower
count that does not reach it is "within noise"; a bucket where even losing every prompt could not reach it is "too few
prompts to conclude"; one with fewer prompts than DEFAULT_PROMPTS ("underpowered") can miss a 10-point drop. Per depth
the same test is reported, never decided on (a few prompts each). Rows without per-prompt outcomes (older reports) fall
back to comparing counts.

How many prompts (exact power by enumerating the multinomial of losses and gains: `prompts_needed` in
tests/evaluation/test_significance.py): to detect a drop of 10 accuracy points with power 0.8 at ALPHA 0.05 / 3 buckets,
when the arm only loses keys, 66 prompts a bucket at alpha 0.05 and 78 at 0.05 / 3 are needed; DEFAULT_PROMPTS = 80 (16
per depth x 5 depths) has power 0.82 there. If, besides the drop, 2 % of prompts flip each way, power at 80 falls to
0.51 (128 prompts for 0.8) — the report says which buckets are underpowered rather than claim more.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

from calib.evaluation.results import PasskeyRow, passkey_correct

ALPHA = 0.05
DETECT_DROP = 0.10          # accuracy points a default run should detect
POWER = 0.80
DEFAULT_PROMPTS = 80        # per bucket: 78 detect DETECT_DROP at ALPHA / 3 (docstring), rounded up to 16 per depth
DEPTH_COUNT = 5             # calib.evaluation.passkey.DEPTHS (kept import-free of torch)
DEFAULT_TRIALS = math.ceil(DEFAULT_PROMPTS / DEPTH_COUNT)


def binomial_tail(k: int, n: int) -> Fraction:
    """P(X >= k) for X ~ Binomial(n, 1/2), exactly."""
    if k <= 0:
        return Fraction(1)
    return Fraction(sum(math.comb(n, i) for i in range(k, n + 1)), 2 ** n)


def mcnemar_p(losses: int, gains: int, alternative: str = "drop") -> float:
    """Exact McNemar p-value from the discordant pairs. `drop`: one-sided, P(losses >= observed) under no
    difference; `two-sided`: twice the smaller tail, at most 1."""
    if losses < 0 or gains < 0:
        raise ValueError(f"losses {losses} and gains {gains} must be >= 0")
    n = losses + gains
    if alternative == "drop":
        return float(binomial_tail(losses, n))
    if alternative == "two-sided":
        return float(min(Fraction(1), 2 * binomial_tail(max(losses, gains), n)))
    raise ValueError(f"alternative {alternative!r}: choose 'drop' or 'two-sided'")


@dataclass(frozen=True)
class PairedTest:
    """One bucket (or one depth of it): prompts paired, correct answers of each run, lost / gained prompts,
    the one-sided exact p-value of the drop, and the threshold it is held to."""
    bucket: str
    depth: str | None
    prompts: int
    reference: int
    arm: int
    losses: int
    gains: int
    p: float
    alpha: float

    @property
    def significant(self) -> bool:
        return self.p < self.alpha

    @property
    def conclusive(self) -> bool:
        """Whether any outcome of this many prompts could be significant (all prompts lost)."""
        return 0.5 ** self.prompts < self.alpha

    @property
    def powered(self) -> bool:
        return self.prompts >= DEFAULT_PROMPTS

    def conclusion(self, allowed: int = 0) -> str:
        if self.losses - self.gains <= allowed:
            return "no drop"
        if self.significant:
            return "drop"
        return "within noise" if self.conclusive else "too few prompts to conclude"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "conclusive": self.conclusive, "powered": self.powered}


@dataclass(frozen=True)
class PasskeyDecision:
    """An arm's passkey against the reference: the bucket tests, the depth tests, why it fails (empty: it does
    not) and the sentences the report shows for buckets within noise or too small to conclude."""
    buckets: tuple[PairedTest, ...]
    depths: tuple[PairedTest, ...]
    failed: tuple[str, ...]
    notes: tuple[str, ...]
    allowed: int

    def to_dict(self) -> dict[str, Any]:
        return {"test": "exact McNemar, one-sided (drop), Bonferroni over buckets", "allowed_drop": self.allowed,
                "buckets": {t.bucket: {**{k: v for k, v in t.to_dict().items() if k != "depth"},
                                       "conclusion": t.conclusion(self.allowed)} for t in self.buckets},
                "depths": [{**t.to_dict(), "conclusion": t.conclusion(self.allowed)} for t in self.depths],
                "failed": list(self.failed), "notes": list(self.notes)}


def _test(bucket: str, depth: str | None, pairs: Sequence[tuple[bool, bool]], alpha: float) -> PairedTest:
    losses = sum(r and not a for r, a in pairs)
    gains = sum(a and not r for r, a in pairs)
    return PairedTest(bucket, depth, len(pairs), sum(r for r, _ in pairs), sum(a for _, a in pairs), losses, gains,
                      mcnemar_p(losses, gains), alpha)


def decide(ref_rows: Mapping[str, PasskeyRow] | None, arm_rows: Mapping[str, PasskeyRow] | None, allowed: int = 0,
           alpha: float = ALPHA) -> PasskeyDecision | None:
    """The passkey decision for an arm (typed rows per bucket, the emulation's or the engine's); None when either run
    has no passkey."""
    if not ref_rows or not arm_rows:
        return None
    common = [b for b in ref_rows if b in arm_rows]
    paired = {b: tuple([(f"{float(d):g}", bool(c)) for d, c in rows[b].outcomes] or None   # (depth, correct) a prompt
                       for rows in (ref_rows, arm_rows)) for b in common}                # None: not recorded
    if not common or any(ro is None or ao is None or [d for d, _ in ro] != [d for d, _ in ao]
                         for ro, ao in paired.values()):
        # no per-prompt outcomes to pair (an older report): the count rule over every bucket
        (rc, rt), (ac, at) = (passkey_correct(rows) for rows in (ref_rows, arm_rows))
        failed = (f"passkey {ac}/{at} < reference {rc}/{rt}",) if ac < rc - allowed else ()
        return PasskeyDecision((), (), failed, (), allowed)
    k = len(common)
    tests, depths, failed, notes = [], [], [], []
    for b, (ro, ao) in paired.items():
        t = _test(b, None, [(r, a) for (_, r), (_, a) in zip(ro, ao)], alpha / k)
        tests.append(t)
        for d in dict.fromkeys(d for d, _ in ro):
            depths.append(_test(b, d, [(r, a) for (dr, r), (_, a) in zip(ro, ao) if dr == d], alpha / k))
        verdict = t.conclusion(allowed)
        what = (f"passkey {t.arm}/{t.prompts} vs reference {t.reference}/{t.prompts} in bucket <= {b} "
                f"({t.losses} lost, {t.gains} gained; exact McNemar p = {t.p:.3g}")
        if verdict == "drop":
            failed.append(f"{what} < {t.alpha:.3g})")
        elif verdict == "within noise":
            notes.append(f"{what} >= {t.alpha:.3g}): within noise")
        elif verdict == "too few prompts to conclude":
            notes.append(f"{what}): too few prompts to conclude — even losing all {t.prompts} would not reach "
                         f"p < {t.alpha:.3g}; use --passkey-trials {DEFAULT_TRIALS} ({DEFAULT_PROMPTS} prompts a bucket)")
    return PasskeyDecision(tuple(tests), tuple(depths), tuple(failed), tuple(notes), allowed)

