"""Numbers checked before a decision: a NaN or an infinity in a measured quantity decides nothing.

Why: every threshold test is a comparison, and a comparison with NaN is false, so an arm whose KL is NaN
"misses no threshold" and a verdict built on it ships it (a model whose logits overflow was once told "Ship
`default` (KL nan, ppl +nan%)"). So before eval's verdict or tune's choice reads a number, every measured
quantity of the reference and of every arm — per bucket and overall KL, top-1, perplexity and its change,
per-sample NLL and KL, passkey accuracy, per-layer saturation, flush, SNR and attention error, the
reference's K/V ranges, and the engine's own numbers where it measured the arm — is checked here; one that
is not finite makes the result "cannot measure", which the caller turns into one error and a non-zero exit.
One exception is a fact, not a failure: an SNR of +inf means the arm stored that layer exactly (no noise).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from calib.errors import KvcalibError

_BUCKET = ("kl", "top1", "ppl", "ppl_ref", "ppl_delta", "ppl_rel", "kl_unresolved_mass")     # the last: engine rows
_SUMMARY = (*_BUCKET, "max_bucket_kl")


class CannotMeasure(KvcalibError, ValueError):
    """A measured quantity is NaN or infinite: no verdict can be drawn from it."""


@dataclass(frozen=True)
class Unmeasured:
    """One quantity that is not a finite number: whose (arm), where (bucket, layer, sample), which, its value."""
    arm: str
    where: str
    quantity: str
    value: float
    reference: bool = False

    @property
    def who(self) -> str:
        return f"`{self.arm}`" + (" (the reference)" if self.reference else "")


def _bad(x: Any) -> bool:
    return isinstance(x, float) and not math.isfinite(x)


def _rows(arm: str, buckets: Mapping[str, Any], summary: Any, prefix: str = "") -> Iterator[Unmeasured]:
    for where, row, names in [*((f"bucket <= {b}", r, _BUCKET) for b, r in buckets.items()),
                              ("all buckets", summary, _SUMMARY)]:
        yield from (Unmeasured(arm, prefix + where, q, v) for q in names if _bad(v := getattr(row, q, None)))


def _problems(name: str, e: Any, prefix: str = "") -> Iterator[Unmeasured]:
    """One run's numbers (the reference's, an arm's, or the engine's where it measured the run: an entry that says
    "not run" holds none): per bucket and overall, per sample, the reference's K/V ranges or the arm's per-layer
    rows, passkey."""
    yield from _rows(name, e.buckets, e.summary, prefix)
    for quantity, values in (("nll", e.sample_nll), ("kl", getattr(e, "sample_kl", ()))):
        yield from (Unmeasured(name, f"{prefix}sample {j}", quantity, v) for j, v in enumerate(values) if _bad(v))
    for i, r in getattr(e, "ranges", {}).items():
        for kind, values in (("max |K|", r.k_amax), ("max |V|", r.v_amax)):
            bad = [v for v in values if _bad(v)]
            if bad:
                yield Unmeasured(name, f"layer {i}", kind, bad[0])
    for i, row in getattr(e, "layers", {}).items():
        for q, v in row.items():
            if _bad(v) and not (q.endswith("_snr_db") and v == math.inf):
                yield Unmeasured(name, f"layer {i}", q, v)
    for b, r in (e.passkey or {}).items():
        if _bad(r.accuracy):
            yield Unmeasured(name, f"{prefix}passkey bucket <= {b}", "accuracy", r.accuracy)
    g = None if prefix else e.engine
    if g is not None and g.ok:
        yield from _problems(name, g, f"({g.engine}) ")


def problems(ref: Any, results: Mapping[str, Any], reference: str = "reference") -> list[Unmeasured]:
    """Every quantity that is not finite, the reference's first, then the arms' in order."""
    out = [replace(u, reference=True) for u in (_problems(reference, ref) if ref is not None else ())]
    for name, e in results.items():
        out.extend(_problems(name, e))
    return out


def text(found: list[Unmeasured], what: str = "no arm can be recommended") -> str:
    """One line: the quantities that are not finite, grouped by arm and place (the first three places), how
    many more, and what that means."""
    places: dict[tuple[str, str], list[str]] = {}
    for u in found:
        places.setdefault((u.who, u.where), []).append(f"{u.quantity} {u.value}")
    shown = "; ".join(f"{who} {where}: {', '.join(qs)}" for (who, where), qs in list(places.items())[:3])
    more = f" (and {len(places) - 3} more places)" if len(places) > 3 else ""
    return (f"cannot measure: {shown}{more}; a number that is not finite decides nothing, so {what} (check the "
            "model's weights: its logits or K/V overflow)")


def check(ref: Any, results: Mapping[str, Any], reference: str = "reference",
          what: str = "no arm can be recommended") -> None:
    """Raise CannotMeasure naming the arm, where and which quantity when any measured number is not finite."""
    found = problems(ref, results, reference)
    if found:
        raise CannotMeasure(text(found, what))
