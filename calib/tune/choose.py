"""The decision of `kvcalib tune`, and the plain statement of whether scales mattered at all.

The rule (written into tune.json and tune.md so it can be checked and re-argued):
1. a candidate qualifies when it is within the quality bar in every length bucket (`verdict.failures`:
   worst-bucket KL <= --max-kl, perplexity rise <= --max-ppl-increase; on the engine's numbers where the
   engine measured it);
2. among qualifying candidates, the fewest skipped layers (the most KV memory saved: every FP8/INT8 layer
   stores one byte per value);
3. among those, the candidates whose perplexity is within noise of the lowest-KL one (paired over held-out
   samples, calib/tune/score.py) are ties; a tie goes to the recipe every backend applies as written
   (per-tensor, no q_scale), then the simplest observer, then the least headroom, then the lowest KL;
4. nothing qualifies: keep the model-dtype ("BF16") KV cache.
With an engine (`--engine vllm`) that counted the reference's KV capacity, steps 2 and 4 are eval's capacity rule
(calib.evaluation.capacity.by_capacity, CAPACITY_RULE) instead: tune measures no speed (`kvcalib validate` measures
goodput under load), so among qualifying candidates it serves the one whose KV pool holds the most requests of the
longest length measured, if that is more than 5 % above the reference's and, where the engine counted both, more
than one request more; otherwise it keeps BF16.
A candidate with fewer skipped layers but no such gain loses to one with a real gain. Capacity is the engine's count
(`verdict.engine_requests`) for each KV layout it ran (KV dtype and skipped layers: scales do not change the pool),
else the share of memory the candidate saves (kvcalib's bytes model, said so). Candidates of one layout hold the same
capacity, so step 3 picks the one of each layout that by_capacity ranks; by_capacity's own choice is tune's.
Without that count (no `--engine`, or the engine did not count the reference) the rule above stands, and tune.json
and tune.md say that capacity was not counted by the engine.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from calib.evaluation import capacity as rule
from calib.evaluation import measurable, verdict
from calib.evaluation.numbers import ENGINE, decisive
from calib.evaluation.results import ArmMetrics
from calib.recipe.dtypes import FP8_E4M3
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


def rows(found: Any, th: verdict.Thresholds, layers: int, ref_bytes: int, baseline: str) -> list[dict[str, Any]]:
    """One row per candidate: its recipe, memory saved, numbers, why it misses the bar, and vs the default."""
    ref, base = found.ref, found.entries.get(baseline)
    tokens = ref.sample_tokens if ref else ()
    counts = engine_counts(found, baseline)
    out = []
    for c in found.candidates:
        e = found.entry(c.name)
        row = {**c.to_dict(), "memory_saved": space.memory_saved(c, layers, ref_bytes),
               "measured_as": found.measured_as.get(c.name), "scored": e is not None}
        if e is not None:
            source = decisive(e).source
            shown = (e.engine if source == ENGINE else e).to_dict()     # the engine's rows keep their extra numbers
            row.update(numbers=source, summary=shown["summary"], buckets=shown["buckets"],
                       emulated=score.slim(e), failures=verdict.failures(e, ref, th))
            if base is not None:
                row["vs_default"] = score.compare(e, base, tokens)
            if (cap := capacity(found, c, e, row["memory_saved"], counts)) is not None:
                row["capacity"] = cap
        out.append(row)
    return out


def layout(c: Any) -> tuple[str, tuple[int, ...]]:
    """What sets a candidate's KV pool: its cache dtype and the layers kept in the model dtype (not its scales)."""
    return (c.dtype, tuple(sorted(c.skip)))


def engine_counts(found: Any, baseline: str) -> dict[tuple[str, tuple[int, ...]], tuple[Any, str]]:
    """{layout: (the engine's entry, the arm it ran)} for every KV layout the engine ran: the candidates it confirmed
    and the default scale 1.0 (FP8, no skip); the first such arm of a layout counts for the layout."""
    out: dict[tuple[str, tuple[int, ...]], tuple[Any, str]] = {}
    base = found.entries.get(baseline) if found.ref is not None else None
    if base is not None and base.engine is not None and base.engine.ok:
        out[("fp8_e4m3", ())] = (base.engine, baseline)
    for c in found.candidates:
        run = found.engine.get(c.name)
        if run is not None and run.ok:
            out.setdefault(layout(c), (run, c.name))
    return out


def capacity(found: Any, cand: Any, entry: ArmMetrics, saved: float,
             counts: dict[tuple[str, tuple[int, ...]], tuple[Any, str]] | None = None) -> dict[str, Any] | None:
    """The candidate's capacity over the reference's at the longest length (the engine's count for its layout,
    `counted_on` this or another candidate of that layout, else the bytes model's) and whether that is a gain beyond
    noise (calib.evaluation.capacity.capacity_gain); None unless the engine counted the reference's capacity."""
    length = rule.longest(found.ref)
    ref_row = rule.CapacityRow("reference", True, 0.0, rule.engine_requests(found.ref.engine, length), 1.0, True)
    if ref_row.requests is None:
        return None
    own = rule.engine_requests(entry.engine, length)
    run, on = (counts or {}).get(layout(cand), (None, None))
    requests, counted_on = (own, cand.name) if own is not None else (rule.engine_requests(run, length), on)
    row = rule.CapacityRow(cand.name, True, kl(entry), requests, 1 / (1 - saved) if saved < 1 else None)
    ratio, source = rule.capacity_ratio(row, ref_row)
    return {"length": length, "requests": row.requests, "reference_requests": ref_row.requests,
            "vs_reference": ratio, "source": source, "gain": rule.capacity_gain(row, ref_row),
            "counted_on": counted_on if source == ENGINE else None}


REFERENCE = "reference"
ENGINE_COUNTED, NOT_COUNTED = "capacity (eval's rule)", "fewest skipped layers"


@dataclass(frozen=True)
class Choice:
    """tune's decision: the row chosen (None: keep the model-dtype KV cache), which rule chose (ENGINE_COUNTED or
    NOT_COUNTED), and, under the capacity rule, the rows by_capacity ranked and its decision."""
    row: dict[str, Any] | None
    rule: str
    rows: tuple[rule.CapacityRow, ...] = ()
    decision: rule.CapacityDecision | None = None

    def to_dict(self) -> dict[str, Any]:
        """tune.json's `capacity`: which rule chose, in words, and the capacity decision where there is one."""
        out: dict[str, Any] = {"rule": self.rule, "counted_by_engine": self.decision is not None,
                               "speed": SPEED, "text": words(self)}
        if self.decision is not None:
            out["decision"] = self.decision.to_dict()
        return out


SPEED = "not measured: `kvcalib validate` serves the arms under load and decides by goodput at the SLO"


def words(choice: Choice) -> str:
    """One paragraph for tune.md and tune.json: which rule chose, on whose count, and that speed was not measured."""
    if choice.decision is None:
        return ("KV capacity was not counted by the engine (no `--engine vllm`, or the engine did not count the "
                "reference's pool): the choice is the fewest skipped layers within the bar (most KV memory saved, "
                f"kvcalib's bytes model). Speed was {SPEED}.")
    d = choice.decision
    used = sorted({d.sources[r.name] for r in choice.rows if not r.reference and d.sources.get(r.name)})
    text = (f"Chosen by eval's capacity rule (calib.evaluation.capacity.by_capacity): {rule.CAPACITY_RULE} Capacity at "
            f"{d.length:,} tokens: {' and '.join(used) or 'not known'}.")
    named = [r.name for r in choice.rows if not r.reference]
    if named:
        text += " Ranked (one candidate per KV layout): " + "; ".join(
            f"`{n}` {d.labels[n]} ({d.why[n]})" for n in named) + "."
    return text


def decide(found: Any, table: list[dict[str, Any]]) -> Choice:
    """tune's choice (module docstring): eval's capacity rule where the engine counted the reference's capacity
    (every scored row then has `capacity`), else the fewest skipped layers."""
    ok = [r for r in table if r["scored"] and not r["failures"]]
    if found.ref is None or not any("capacity" in r for r in table if r["scored"]):      # not counted
        return Choice(_settle(found, _fewest(ok)) if ok else None, NOT_COUNTED)
    groups: dict[tuple[str, tuple[int, ...]], list[dict[str, Any]]] = {}
    by_name = {c.name: c for c in found.candidates}
    for r in ok:
        groups.setdefault(layout(by_name[r["name"]]), []).append(r)
    reps = {_settle(found, g)["name"] for g in groups.values()}
    first = next(r for r in table if "capacity" in r)["capacity"]
    ref_row = rule.CapacityRow(REFERENCE, True, 0.0, first["reference_requests"], 1.0, True)
    cap_rows = (ref_row, *(capacity_row(r) for r in ok if r["name"] in reps))
    d = rule.by_capacity(cap_rows, first["length"])
    return Choice(next((r for r in ok if r["name"] == d.recommended), None), ENGINE_COUNTED, cap_rows, d)


def capacity_row(r: dict[str, Any]) -> rule.CapacityRow:
    """A table row as the capacity rule reads it: its requests (the engine's count for its layout, or None) and the
    bytes model's 1 / (1 - memory saved), its worst-bucket KL as the quality key."""
    cap = r["capacity"]
    model = 1 / (1 - r["memory_saved"]) if r["memory_saved"] < 1 else None
    requests = cap["requests"] if cap["source"] == ENGINE else None
    return rule.CapacityRow(r["name"], not r["failures"], r["summary"]["max_bucket_kl"], requests, model)


def _fewest(ok: list[dict[str, Any]]) -> list[dict[str, Any]]:
    fewest = min(len(r["skip"]) for r in ok)
    return [r for r in ok if len(r["skip"]) == fewest]


def _settle(found: Any, group: list[dict[str, Any]]) -> dict[str, Any]:
    """Step 3: among `group`, the lowest-KL row and those within noise of it are ties, won by the broadest support,
    then the simplest observer and least headroom, then the lowest KL."""
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
    inside = ranges["k_amax"] <= FP8_E4M3.qmax and ranges["v_amax"] <= FP8_E4M3.qmax
    fact = (f"max |K| = {ranges['k_amax']:.4g}, max |V| = {ranges['v_amax']:.4g} over the calibration data; FP8 "
            f"e4m3 holds +-{FP8_E4M3.qmax:g}, and inside its normal range the rounding error does not depend on the "
            "scale")
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
