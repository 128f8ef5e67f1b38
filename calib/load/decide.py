"""Which KV arm to serve, from what the engine delivered: quality, capacity and goodput at the user's SLO.

Why a rule of its own, pure and small: FP8 KV raises throughput only where the KV cache limits the batch (long
context, many requests in flight); at short context or light load its quantize / dequantize work can make it
slower, and a layer kept in BF16 can be the fastest arm on one workload and the slowest on another
(docs/design.md §12: a sliding-window skip measured 1.55x BF16's latency at light load and eager, and 1.21x
BF16's throughput served at saturation with CUDA graphs). So the decision reads only measured numbers:

1. candidates: arms within the quality bar whose sweep was measured (the BF16 reference always is one);
2. an arm that another arm beats or equals on quality (engine Δppl), capacity (requests of this length the
   engine holds) and speed (best goodput over the sweep, equal within the run-to-run noise) together is
   dominated and never recommended; where two arms tie on all three, the earlier one (reference first, then
   the arms in the order given) stands;
3. among the undominated candidates, the one with the highest goodput that beats BF16's by more than the
   noise; where none does, BF16 — FP8 buys nothing for this workload, and the decision says so, unless an arm
   within the bar was never served (its server failed, the budget ran out): then BF16 is kept and the decision
   names that arm instead of claiming FP8 buys nothing.

Goodput is requests per second that meet both SLO bounds (calib/load/records.py). The noise of one arm is the
relative spread of its best level measured twice; a comparison uses the larger of the stated floor and the two
arms' spreads added. Without a served reference nothing is recommended ("not measured", with the reason).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NOT_MEASURED = "not measured"
RULE = ("Among arms within the quality bar, serve the one with the highest goodput at the SLO, if it beats the BF16 "
        "reference's by more than the run-to-run noise; an arm that another beats or equals on quality, capacity "
        "and goodput together is never recommended; otherwise keep BF16 KV.")


@dataclass(frozen=True)
class Arm:
    """One arm at one load shape. `ppl_rel`: the engine's perplexity rise over BF16 (0 for the reference);
    `capacity`: requests of the shape's length the engine's KV pool holds at once, by its own count;
    `goodput`: the best requests/s meeting the SLO over the sweep; `noise`: that goodput's relative repeat spread."""
    name: str
    quality_ok: bool
    ppl_rel: float | None
    capacity: int | None
    goodput: float | None
    noise: float = 0.0
    reference: bool = False
    why_not: str | None = None          # why the arm has no goodput (not served, failed, out of memory)


@dataclass(frozen=True)
class Decision:
    recommended: str | None             # None: nothing measured to decide on
    why: str
    dominated: dict[str, str]           # arm -> the arm that dominates it
    ratios: dict[str, float | None]     # arm -> best goodput over the reference's
    tolerance: dict[str, float]         # arm -> the relative margin it had to beat the reference by

    def to_dict(self) -> dict[str, object]:
        return {"recommended": self.recommended, "why": self.why, "dominated": dict(self.dominated),
                "goodput_vs_reference": dict(self.ratios), "tolerance": dict(self.tolerance)}


def tolerance(a: Arm, b: Arm, floor: float) -> float:
    """The relative goodput difference between `a` and `b` that is within their run-to-run noise."""
    return max(floor, a.noise + b.noise)


def _speed_cmp(a: Arm, b: Arm, floor: float) -> int:
    """+1 when a's goodput beats b's beyond the noise, -1 when b's beats a's, 0 within noise."""
    ga, gb, tol = a.goodput or 0.0, b.goodput or 0.0, tolerance(a, b, floor)
    if ga > gb * (1 + tol) or (gb == 0 and ga > 0):
        return 1
    return -1 if gb > ga * (1 + tol) or (ga == 0 and gb > 0) else 0


def _cmp(x: float | None, y: float | None, lower_is_better: bool = False) -> int | None:
    if x is None or y is None:
        return None
    if x == y:
        return 0
    return (1 if x < y else -1) if lower_is_better else (1 if x > y else -1)


def dominates(b: Arm, a: Arm, floor: float, b_first: bool) -> bool:
    """True when `b` beats or equals `a` on quality, capacity and speed together, and is strictly better on one
    of them (or ties on all three and comes first). An unknown number never dominates."""
    parts = [_cmp(b.ppl_rel, a.ppl_rel, lower_is_better=True), _cmp(b.capacity, a.capacity), _speed_cmp(b, a, floor)]
    return not any(p is None or p < 0 for p in parts) and (any(p > 0 for p in parts) or b_first)


def decide(arms: Sequence[Arm], floor: float = 0.03) -> Decision:
    """The recommendation among `arms` (one of them the reference) by the rule in this module's docstring."""
    ref = next((a for a in arms if a.reference), None)
    if ref is None or ref.goodput is None:
        why = (ref.why_not if ref and ref.why_not else "the BF16 reference was not served") if ref else "no reference arm"
        return Decision(None, f"{NOT_MEASURED}: {why}; nothing is recommended without it", {}, {}, {})
    ratios = {a.name: (a.goodput / ref.goodput if a.goodput is not None and ref.goodput else
                       (None if a.goodput is None else (float("inf") if a.goodput > 0 else 1.0)))
              for a in arms}
    cands = sorted((a for a in arms if a.goodput is not None and (a.quality_ok or a.reference)),
                   key=lambda a: not a.reference)          # the reference first: it stands on a tie
    dominated: dict[str, str] = {}
    for j, a in enumerate(cands):
        for k, b in enumerate(cands):
            if b is not a and dominates(b, a, floor, b_first=k < j):
                dominated[a.name] = b.name
                break
    tol = {a.name: tolerance(a, ref, floor) for a in cands if not a.reference}
    faster = [a for a in cands if not a.reference and a.name not in dominated and _speed_cmp(a, ref, floor) > 0]
    unserved = [a for a in arms if not a.reference and a.goodput is None and a.quality_ok]
    missing = "; ".join(f"`{a.name}` {NOT_MEASURED}" + (f" ({a.why_not})" if a.why_not else "") for a in unserved)
    if not faster:
        best = max((a for a in cands if not a.reference), key=lambda a: a.goodput or 0.0, default=None)
        if not any(not a.reference for a in cands) and not unserved:
            why = "BF16 KV kept: no FP8 arm is within the quality bar, so its speed does not count"
        elif unserved:     # an arm within the bar that was never served may be the faster one: say so, claim nothing
            why = (f"BF16 KV kept: no measured arm within the quality bar beats the reference's goodput by more than "
                   f"the run-to-run noise, but {missing}: this does not show that FP8 KV buys nothing")
        else:
            why = ("FP8 KV buys nothing for this workload: no arm within the quality bar beats the reference's "
                   "goodput by more than the run-to-run noise")
        if best is not None:
            why += f" (best: `{best.name}` at {ratio_text(ratios[best.name])} the reference's, margin {tol[best.name]:.0%})"
        return Decision(ref.name, why, dominated, ratios, tol)
    win = max(faster, key=lambda a: (a.goodput or 0.0, -cands.index(a)))
    why = (f"`{win.name}`: {ratio_text(ratios[win.name])} the reference's goodput (beyond the {tol[win.name]:.0%} noise), "
           f"quality within the bar ({pct(win.ppl_rel)} ppl)" + (f"; {missing}" if unserved else ""))
    return Decision(win.name, why, dominated, ratios, tol)


def ratio_text(x: float | None) -> str:
    return "–" if x is None else ("inf x" if x == float("inf") else f"{x:.2f}x")


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:+.2f} %"


def mix(per_bucket: Sequence[Sequence[Arm]], shares: Sequence[float]) -> list[Arm]:
    """The arms over the user's mix of lengths: bucket b's requests are `shares[b]` of all, so serving the mix at
    each bucket's best load takes sum(share / goodput) seconds a request and the mix's goodput is the harmonic
    mean weighted by share; capacity is the smallest over the buckets (the longest requests bind); noise the
    largest; quality the first bucket's view (the caller passes each arm's overall Δppl in every bucket)."""
    out = []
    for j, first in enumerate(per_bucket[0]):
        rows = [bucket[j] for bucket in per_bucket]
        goodputs = [r.goodput for r in rows]
        if any(g is None for g in goodputs):
            g = None
        elif any(g == 0 for g in goodputs):
            g = 0.0
        else:
            g = 1.0 / sum(s / x for s, x in zip(shares, goodputs))
        caps = [r.capacity for r in rows]
        out.append(Arm(first.name, all(r.quality_ok for r in rows), first.ppl_rel,
                       None if any(c is None for c in caps) else min(caps), g, max(r.noise for r in rows),
                       first.reference, next((r.why_not for r in rows if r.why_not), None)))
    return out
