"""The decision of `kvcalib tune`, and the plain statement of whether scales mattered at all.

The rule (written into tune.json and tune.md so it can be checked and re-argued):
1. a candidate qualifies when it is within the quality bar in every length bucket (`report.failures`:
   worst-bucket KL <= --max-kl, perplexity rise <= --max-ppl-increase; on the engine's numbers where the
   engine measured it);
2. among qualifying candidates, the fewest skipped layers (the most KV memory saved: every FP8/INT8 layer
   stores one byte per value);
3. among those, the candidates whose perplexity is within noise of the lowest-KL one (paired over held-out
   samples, calib/tune/score.py) are ties; a tie goes to the recipe every backend applies as written
   (per-tensor, no q_scale), then the simplest observer, then the least headroom, then the lowest KL;
4. nothing qualifies: keep the model-dtype ("BF16") KV cache.
With an engine (`--engine vllm`) that counted the reference's KV capacity, tune follows eval's capacity rule
(calib.engine.verdict.by_capacity): it measures no speed, and a candidate whose capacity gain over the reference at
the longest length is within noise (`capacity_gain`: within 5 % or one request; the engine's count where it ran the
candidate, else the share of memory it saves) buys a server nothing, so it does not qualify in step 1.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from calib.engine import verdict as honest
from calib.engine.verdict import ENGINE, decisive
from calib.evaluation import measurable, report
from calib.evaluation.results import ArmMetrics
from calib.tune import score, space


def check_measurable(found: Any, reference: str = "reference") -> None:
    """Raise measurable.CannotMeasure when the reference, a scored entry (with the engine's numbers where it
    confirmed a candidate) or a layer's sensitivity is NaN or infinite: tune decides nothing on such numbers."""
    if found.ref is None:
        return
    entries = dict(found.entries)
    entries.update({c.name: e for c in found.candidates if c.name in found.engine
                    and (e := found.entry(c.name)) is not None})
    bad = measurable.problems(found.ref, entries, reference)
    bad += [measurable.Unmeasured("sensitivity", f"layer {i} alone", "kl", v)
            for i, v in found.sensitivity.items() if not math.isfinite(v)]
    if bad:
        raise measurable.CannotMeasure(measurable.text(bad, "no recipe can be chosen and nothing was written"))


def kl(entry: ArmMetrics) -> float:
    return decisive(entry).summary.max_bucket_kl


def rows(found: Any, th: report.Thresholds, layers: int, ref_bytes: int, baseline: str) -> list[dict[str, Any]]:
    """One row per candidate: its recipe, memory saved, numbers, why it misses the bar, and vs the default."""
    ref, base = found.ref, found.entries.get(baseline)
    tokens = ref.sample_tokens if ref else ()
    out = []
    for c in found.candidates:
        e = found.entry(c.name)
        row = {**c.to_dict(), "memory_saved": space.memory_saved(c, layers, ref_bytes),
               "measured_as": found.measured_as.get(c.name), "scored": e is not None}
        if e is not None:
            source = decisive(e).source
            shown = e.engine if source == ENGINE else e.to_dict()     # the engine's rows keep their extra numbers
            row.update(numbers=source, summary=shown["summary"], buckets=shown["buckets"],
                       emulated=score.slim(e), failures=report.failures(e, ref, th))
            if base is not None:
                row["vs_default"] = score.compare(e, base, tokens)
            cap = capacity(found, c.name, e, row["memory_saved"])
            if cap is not None:
                row["capacity"] = cap
        out.append(row)
    return out


def capacity(found: Any, name: str, entry: ArmMetrics, saved: float) -> dict[str, Any] | None:
    """With an engine that counted the reference's KV capacity: the candidate's capacity over the reference's at the
    longest length (the engine's count where it ran the candidate, else 1 / (1 - the share of memory it saves)) and
    whether that is a gain beyond noise (calib.engine.verdict.capacity_gain); None without such an engine."""
    ref = found.ref
    lengths = [int(b) for b in ref.buckets] + [int(b) for b in ((ref.engine or {}).get("buckets") or {})]
    length = max(lengths, default=0)
    ref_row = honest.CapacityRow("reference", True, 0.0, honest.engine_requests(ref.engine, length), 1.0, True)
    if ref_row.requests is None:
        return None
    row = honest.CapacityRow(name, True, kl(entry), honest.engine_requests(entry.engine, length),
                             1 / (1 - saved) if saved < 1 else None)
    ratio, source = honest.capacity_ratio(row, ref_row)
    return {"length": length, "requests": row.requests, "reference_requests": ref_row.requests,
            "vs_reference": ratio, "source": source, "gain": honest.capacity_gain(row, ref_row)}


def choose(found: Any, table: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row the rule picks, or None (keep the model-dtype KV cache)."""
    ok = [r for r in table if r["scored"] and not r["failures"] and (r.get("capacity") or {}).get("gain") is not False]
    if not ok:
        return None
    fewest = min(len(r["skip"]) for r in ok)
    group = [r for r in ok if len(r["skip"]) == fewest]
    best = min(group, key=lambda r: r["summary"]["max_bucket_kl"])
    tokens = found.ref.sample_tokens
    best_entry = found.entry(best["name"])

    def tied(r: dict[str, Any]) -> bool:
        return r is best or not score.compare(found.entry(r["name"]), best_entry, tokens)["measurable"]

    by_name = {c.name: c for c in found.candidates}
    return min((r for r in group if tied(r)),
               key=lambda r: (-by_name[r["name"]].breadth(), by_name[r["name"]].simplicity(),
                              r["summary"]["max_bucket_kl"]))


def scales_matter(found: Any, table: list[dict[str, Any]], ranges: dict[str, float], baseline: str) -> dict[str, Any]:
    """Whether any calibrated recipe (no skips) differs measurably from the default scale 1.0, and why."""
    full = [r for r in table if r["scored"] and not r["skip"] and "vs_default" in r]
    base = found.entries.get(baseline)
    n = found.ref and len(found.ref.sample_tokens)
    inside = ranges["k_amax"] <= 448 and ranges["v_amax"] <= 448
    fact = (f"max |K| = {ranges['k_amax']:.4g}, max |V| = {ranges['v_amax']:.4g} over the calibration data; FP8 "
            f"e4m3 holds +-448, and inside its normal range the rounding error does not depend on the scale")
    if not full or base is None:
        return {"measurable": None, "text": "not measured (the budget ran out before the candidates were scored)",
                **ranges}
    # many recipes against one baseline: some cross 2 standard errors by chance, so the claim that scales matter
    # needs the family-wise bound (Bonferroni over the distinct recipes and the two metrics, 5 % two-sided)
    k = 2 * len({r["measured_as"] for r in full})
    z = statistics.NormalDist().inv_cdf(1 - 0.025 / k)

    def beyond(r: dict[str, Any], sign: int) -> bool:
        return any(sign * r["vs_default"][m]["delta_per_token"] > r["vs_default"][m]["noise"] / score.NOISE_SE * z
                   for m in ("kl", "nll"))
    better = [r for r in full if beyond(r, -1)]
    worse = [r for r in full if beyond(r, 1)]
    kl_noise = max(r["vs_default"]["kl"]["noise"] for r in full) / score.NOISE_SE * z
    nll_noise = max(r["vs_default"]["nll"]["noise"] for r in full) / score.NOISE_SE * z
    how = (f"paired over {n} held-out samples, {z:.2f} standard errors (Bonferroni over {k // 2} distinct recipes "
           f"x KL and NLL): up to {kl_noise:.2g} nats/token of KL and {nll_noise:.2g} of NLL")
    if not better:
        text = (f"scales make no measurable difference here: no calibrated recipe beats the default scale 1.0 by "
                f"more than the noise ({how}); {fact}" + (" — these values stay inside it." if inside else "."))
        if worse:
            text += f" {len(worse)} recipe(s) are measurably worse than 1.0 (e.g. {worse[0]['name']})."
    else:
        top = min(better, key=lambda r: r["vs_default"]["kl"]["delta_per_token"])
        d = top["vs_default"]["kl"]
        text = (f"calibrated scales matter: {top['name']} has {-d['delta_per_token']:.3g} nats/token less KL than the "
                f"default scale 1.0 ({len(better)} of {len(full)} recipes measurably better; {how}); {fact}" + (" — values beyond it saturate at scale 1.0." if not inside else "."))
    return {"measurable": bool(better), "better": [r["name"] for r in better], "worse": [r["name"] for r in worse],
            "z": z, "text": text, **ranges}
