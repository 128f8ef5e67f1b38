"""The evaluation's verdict and report: what to ship, where it breaks, and the numbers behind it.

Why a verdict and not just tables: the person running `eval` has to decide between three actions — ship
FP8 KV with some scales, ship it with a few layers kept in the model dtype, or keep the model-dtype KV
cache — and the tables only help once they know which numbers decide. The rule (thresholds below) is
written into every report so the decision can be checked and re-argued.

A skip recommendation is never a guess: `skip_plan` names the layers whose attention-output error
dominates, the evaluation re-measures the arm with those layers unquantised, and only that measurement
can turn into "ship with --kv-cache-dtype-skip-layers ...".

Outputs (written to a temporary sibling directory, renamed into place when complete): report.json (every
number; non-finite values such as the SNR of an exact arm are null), report.md (tables and verdict) and PNG
plots (matplotlib, Agg backend; skipped with a note when matplotlib is missing).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from calib.engine import formats as kv_formats
from calib.engine import report as engine_report
from calib.engine import support
from calib.engine import verdict as honest
from calib.engine.verdict import SKIP_FLAG, decisive
from calib.evaluation import markdown as render
from calib.evaluation import measurable, memory
from calib.evaluation import plots as plots_mod
from calib.evaluation import significance
from calib.evaluation.results import ArmMetrics, Reference
from calib.safety import files

PLOTS = plots_mod.PLOTS


@dataclass(frozen=True)
class Thresholds:
    """When an arm is good enough to ship (defaults; the CLI can override each):
    mean next-token KL to the reference <= max_kl nats in *every* length bucket; perplexity at most
    max_ppl_increase (relative, 0.01 = +1%) above the reference's; passkey answers correct at least the
    reference's count minus passkey_drop, or the drop not significant (calib/evaluation/significance.py:
    exact McNemar on the prompts paired with the reference's). A layer dominates when its attention-output error is at least
    `dominance` times the median layer's; at most `max_skip` layers are tried unquantised."""
    max_kl: float = 0.01
    max_ppl_increase: float = 0.01
    passkey_drop: int = 0
    dominance: float = 3.0
    max_skip: int = 3

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Results = Mapping[str, ArmMetrics]


def failures(entry: ArmMetrics, ref: Reference, th: Thresholds) -> list[str]:
    """Why `entry` misses the threshold (empty: it is within), on the engine's numbers when the engine
    measured the arm, the emulation's otherwise (calib/engine/verdict.py)."""
    odd = honest.implausible(entry)
    if odd:
        return [odd]
    nums = decisive(entry)
    why = [f"KL {row.kl:.3g} > {th.max_kl:g} in bucket <= {b}" for b, row in nums.buckets.items()
           if row.kl > th.max_kl]
    if nums.summary.ppl_rel > th.max_ppl_increase:
        why.append(f"perplexity +{100 * nums.summary.ppl_rel:.2f}% > +{100 * th.max_ppl_increase:g}%")
    pk = passkey_decision(entry, ref, th)
    return why + list(pk.failed if pk else ())


def passkey_decision(entry: ArmMetrics, ref: Reference, th: Thresholds) -> significance.PasskeyDecision | None:
    """The arm's passkey against the reference's, on the same numbers as the rest of its decision (the
    engine's where it ran the arm)."""
    if decisive(entry).source == honest.ENGINE and honest.engine_ok(ref):
        return significance.decide(ref.engine.get("passkey"), entry.engine.get("passkey"), th.passkey_drop)
    return significance.decide(ref.passkey, entry.passkey, th.passkey_drop)


def _passkey_notes(ref: Reference, results: Results, th: Thresholds) -> list[str]:
    """Sentences for arms whose passkey is lower than the reference's but within noise, or too few to conclude."""
    out = []
    for n, e in _plain(results).items():
        pk = passkey_decision(e, ref, th)
        if pk and pk.notes:
            out.append(f"`{n}` " + "; ".join(pk.notes) + ".")
    return out


def dominant_layers(entry: ArmMetrics, th: Thresholds) -> list[int]:
    """Layers whose attention-output error is >= `dominance` x the median layer's, worst first (<= max_skip)."""
    errs = {int(i): row["attn_rel_error"] for i, row in entry.layers.items()}
    if not errs:
        return []
    median = statistics.median(errs.values())
    top = sorted((i for i, e in errs.items() if e > 0 and e >= th.dominance * median), key=lambda i: -errs[i])
    return top[: th.max_skip] if len(top) < len(errs) else []


def _plain(results: Results) -> dict[str, ArmMetrics]:
    """The arms a verdict ranks: shippable, no skip trial, and no engine output implausible for their format."""
    return {n: e for n, e in results.items() if e.info.shippable and not e.info.skip and not honest.implausible(e)}


def skip_plan(ref: Reference, results: Results, th: Thresholds) -> list[tuple[str, list[int]]]:
    """[(arm, dominant layers)] to re-measure unquantised, when no shippable arm is within the threshold."""
    plain = _plain(results)
    if measurable.problems(ref, results) or not plain or any(not failures(e, ref, th) for e in plain.values()):
        return []
    best = min(plain, key=lambda n: _kl(plain[n]))
    layers = dominant_layers(plain[best], th)
    return [(best, layers)] if layers else []


def _kl(entry: ArmMetrics) -> float:
    return decisive(entry).summary.kl


@dataclass(frozen=True)
class Verdict:
    """The decision and its reasons. `action`: ship | ship_with_skip | skip_unconfirmed | keep_reference; `arm`
    the arm to serve (or cut the skip from); `numbers`: per arm, whose numbers decided (engine | emulation);
    `saturated`: per arm named in the text, the layers whose K/V leave the dtype's range."""
    action: str
    arm: str | None
    skip_layers: tuple[int, ...]
    flag: str | None
    within_threshold: tuple[str, ...]
    dominant_layers: tuple[int, ...]
    dominant_in: str | None
    thresholds: Thresholds
    numbers: Mapping[str, str]
    text: str
    scales_within_noise: Mapping[str, Any] | None
    saturated: Mapping[str, Mapping[str, Mapping[str, float]]]
    skips_by_memory: tuple[Mapping[str, Any], ...] = ()    # memory.Candidate.to_dict(), best first
    capacity: honest.CapacityDecision | None = None         # the capacity rule's ranking (calib.engine.verdict)

    def to_dict(self) -> dict[str, Any]:
        """As report.json holds it (`scales_within_noise` only when found)."""
        out = {"action": self.action, "arm": self.arm, "skip_layers": list(self.skip_layers), "flag": self.flag,
               "within_threshold": list(self.within_threshold), "dominant_layers": list(self.dominant_layers),
               "dominant_in": self.dominant_in, "thresholds": self.thresholds.to_dict(), "numbers": dict(self.numbers),
               "text": self.text}
        if self.scales_within_noise is not None:
            out["scales_within_noise"] = self.scales_within_noise
        out["saturated"] = {n: dict(v) for n, v in self.saturated.items()}
        if self.skips_by_memory:
            out["skips_by_memory"] = [dict(c) for c in self.skips_by_memory]
        if self.capacity is not None:
            out["capacity"] = self.capacity.to_dict()
        return out


def verdict(ref: Reference, results: Results, th: Thresholds, reference: str,
            bytes_model: "memory.Model | None" = None, geometry: tuple[int, int] | None = None,
            target: str | None = None) -> Verdict:
    """The decision: ship an arm, ship it with layers skipped (measured), or keep the reference KV dtype.
    Raises measurable.CannotMeasure ("cannot measure", naming the arm, where and which number) when any
    measured quantity is NaN or infinite: a comparison with NaN is false, so such an arm would "miss" nothing.
    `bytes_model` (calib.evaluation.memory): on a hybrid model every measured skip is also weighed by the memory it
    gives back; the arms within the threshold are ranked by KV capacity (`calib.engine.verdict.by_capacity`: the
    engine's count where it ran the arm, else the bytes model's; eval measures no speed, and the text says so);
    `target` (eval --target): the engine whose serve flags the advice names (None: vLLM)."""
    measurable.check(ref, results, reference)
    plain = _plain(results)
    ok = sorted((n for n in plain if not failures(plain[n], ref, th)), key=lambda n: _kl(plain[n]))
    if geometry and any(plain[n].info.kind == "format" for n in ok):
        # whole KV formats compete: the fewest bytes per token within the bar first (calib/engine/formats.py)
        first = [r.arm for r in kv_formats.order(kv_formats.rows({n: plain[n] for n in ok}, lambda e: [], *geometry))]
        ok = first + [n for n in ok if n not in first]
    skipped = sorted((n for n, e in results.items() if e.info.skip and not failures(e, ref, th)),
                     key=lambda n: (len(results[n].info.skip), _kl(results[n])))
    best_any = min(plain, key=lambda n: _kl(plain[n])) if plain else None
    dominant = dominant_layers(plain[best_any], th) if best_any else []
    numbers = {n: decisive(e).source for n, e in results.items()}
    arm, layers, flag = None, [], None

    def kl(n):
        nums = decisive(results[n])
        return f"{nums.label}: worst-bucket KL {nums.summary.max_bucket_kl:.3g}, ppl {100 * nums.summary.ppl_rel:+.2f}%"

    confirmed = [(n, honest.skip_confirmed(results[n], results[n.rsplit(" skip ", 1)[0]])) for n in skipped]
    shippable_skips = [n for n, (c, _) in confirmed if c]
    length = _longest(ref, bytes_model)
    rows = capacity_rows(ref, results, reference, plain, ok, shippable_skips, bytes_model, length)
    cap = honest.by_capacity(rows, length)
    ref_row = rows[0]
    candidates = [*ok, *shippable_skips]
    win = cap.recommended if cap.recommended is not None else (candidates[0] if candidates else None)
    capacity_notes = _capacity_notes(cap, reference, candidates) if candidates else []
    if win in ok:
        action, arm = "ship", win
        ok = [win, *(n for n in ok if n != win)]
        text = f"Ship `{arm}` ({kl(arm)}): {honest.how_to_serve(plain[arm].info, target)}."
        if len(ok) > 1:
            text += " Also within the threshold: " + "; ".join(f"`{n}` ({kl(n)})" for n in ok[1:]) + "."
    elif win in shippable_skips:
        best = win
        layers, flag, arm = _skip_trial(results, best)
        why = (f"the {results[best].info.skip_kind.replace('_', '-')} layers hold only their window, so keeping "
               "them costs little memory" if results[best].info.skip_kind else
               f"Those layers dominate the error (attention-output error {_errs(plain[arm], layers)})")
        action, text = "ship_with_skip", (
            f"Ship `{arm}` with layers {layers} kept in {reference}: serve with `{flag}` (vLLM; recipe "
            f"`skip_layers: {layers}`). {why[0].upper() + why[1:]}; measured with them unquantised: {kl(best)}, "
            "confirmed by the engine.")
    elif candidates:            # within the bar, but none holds more requests than the reference beyond noise
        action, text = "keep_reference", (
            f"Keep {reference.upper()} KV: no arm within the threshold has a capacity gain over it beyond noise "
            f"({'; '.join(f'`{n}` {_capacity(cap, n)}' for n in candidates)}), so FP8 KV buys no room for more "
            "requests here.")
    elif confirmed:
        best, (_, why) = confirmed[0]
        layers, flag, arm = _skip_trial(results, best)
        row = capacity_row(ref, results[best], best, True, bytes_model, length)
        ratio, source = honest.capacity_ratio(row, ref_row)
        brings = (f"Keeping layers {layers} in {reference} brings `{arm}` within it ({kl(best)}; attention-output "
                  f"error {_errs(plain[arm], layers)}), {why}")
        failed = f"(best: `{best_any}`, {'; '.join(failures(plain[best_any], ref, th))})"
        if ratio is None or honest.capacity_gain(row, ref_row):
            action, text = "skip_unconfirmed", (
                f"Keep {reference.upper()} KV for now: no arm is within the threshold {failed}. {brings}. Before "
                f"serving with `{flag}`, measure it in the engine (`kvcalib eval --engine vllm`).")
        else:
            action, text = "keep_reference", (
                f"Keep {reference.upper()} KV: no arm is within the threshold {failed}. {brings}, but it has no "
                f"capacity gain over {reference.upper()} ({ratio:.2f}x its capacity at {length:,} tokens, "
                f"{_source_words(source)}), so serving it buys nothing.")
            layers, flag, arm = [], None, None
    else:
        why = "; ".join(failures(plain[best_any], ref, th)) if best_any else "no quantised arm"
        tried = [n for n, e in results.items() if e.info.skip]
        extra = (f" Keeping layers {list(results[tried[-1]].info.skip)} unquantised was measured too and is still outside "
                 f"({kl(tried[-1])})." if tried else
                 " No small set of layers dominates the error, so no layer skip was measured (whether one helps "
                 "is unknown).")
        action, text = "keep_reference", (f"Keep {reference.upper()} KV for this model: no arm is within the threshold "
                                          f"(best: `{best_any}`, {why}).{extra}")
    text = " ".join([text, *capacity_notes])
    noise, saturated, notes = _honest(arm, numbers, ref, results)
    notes = [*notes, *_passkey_notes(ref, results, th)]
    notes += [f"`{n}`: {honest.implausible(e)}." for n, e in results.items() if honest.implausible(e)]
    hybrid = bytes_model is not None and bytes_model.layers.hybrid       # skips weighed by memory: hybrid models
    cands = memory.candidates(bytes_model, results, ref.engine, ref.sample_tokens) if hybrid else []
    cands = [replace(c, capacity_gain=_gains(capacity_row(ref, results[c.arm], c.arm, True, bytes_model, length),
                                             ref_row)) for c in cands]
    notes += memory.lines(cands, bytes_model.model) if hybrid else []
    return Verdict(action, arm, tuple(layers), flag, tuple(ok), tuple(dominant), best_any, th, numbers,
                   " ".join([text, *notes]), noise, saturated, tuple(c.to_dict() for c in cands), cap)


def _longest(ref: Reference, bytes_model: "memory.Model | None") -> int:
    """The longest length the evaluation asked for: the capacity rule's length (the longest requests bind)."""
    asked = [int(b) for b in ref.buckets] + [int(b) for b in ((ref.engine or {}).get("buckets") or {})]
    asked += list(bytes_model.lengths) if bytes_model is not None else []
    return max(asked, default=0)


def capacity_row(ref: Reference, entry: ArmMetrics | None, name: str, candidate: bool,
                 bytes_model: "memory.Model | None", length: int) -> honest.CapacityRow:
    """One arm (`entry` None: the reference) as the capacity rule reads it: the engine's count of requests of
    `length` tokens where it ran the arm, the bytes model's per GiB, and its KL as the quality key."""
    run = ref.engine if entry is None else entry.engine
    model = bytes_model.requests_per_gib(None if entry is None else entry.info, length) if bytes_model else None
    quality = 0.0 if entry is None else _kl(entry)
    return honest.CapacityRow(name, candidate, quality, honest.engine_requests(run, length), model, entry is None)


def capacity_rows(ref: Reference, results: Results, reference: str, plain: Mapping[str, ArmMetrics],
                  ok: Sequence[str], skips: Sequence[str], bytes_model: "memory.Model | None",
                  length: int) -> list[honest.CapacityRow]:
    """The reference first, then every plain arm (a candidate when within the threshold) and every skip the engine
    confirmed within it (a candidate)."""
    rows = [capacity_row(ref, None, reference, True, bytes_model, length)]
    rows += [capacity_row(ref, e, n, n in ok, bytes_model, length) for n, e in plain.items()]
    rows += [capacity_row(ref, results[n], n, True, bytes_model, length) for n in skips]
    return rows


def _gains(row: honest.CapacityRow, ref: honest.CapacityRow) -> bool | None:
    """Whether `row` gains capacity over the reference beyond noise; None where neither count knows both."""
    return None if honest.capacity_ratio(row, ref)[0] is None else honest.capacity_gain(row, ref)


def _source_words(source: str | None) -> str:
    return {honest.ENGINE: "the engine's own count", honest.BYTES_MODEL: "kvcalib's bytes model, not the engine's "
            "count"}.get(source or "", "not known")


def _capacity(cap: honest.CapacityDecision, name: str) -> str:
    x = cap.ratios.get(name)
    return "capacity not known" if x is None else f"{x:.2f}x"


def _capacity_notes(cap: honest.CapacityDecision, reference: str, candidates: Sequence[str]) -> list[str]:
    """The verdict's sentences on capacity and speed: what the ranking read, the arms within the threshold that gain
    nothing, and that speed was not measured."""
    ref = reference.upper()
    if cap.recommended is None:
        how = ("KV capacity was not counted (the engine did not run the reference and no bytes model applies), so "
               "the arms within the threshold are ranked by quality alone")
    else:
        used = sorted({_source_words(cap.sources.get(n)) for n in candidates if cap.ratios.get(n) is not None})
        how = (f"Arms within the threshold are ranked by KV capacity at {cap.length:,} tokens (requests the KV pool "
               f"holds at once, over {ref}'s; {' and '.join(used) or 'not known'}), and an arm whose gain over "
               f"{ref} is within {honest.CAPACITY_FLOOR:.0%} or {honest.CAPACITY_REQUESTS} request is not "
               "recommended")
        where = [n for n in candidates if cap.labels.get(n) == honest.RECOMMENDED]
        if where:
            how += f"; `{where[0]}`: {cap.why[where[0]]}"
        none = [n for n in candidates if cap.labels.get(n) == honest.NO_CAPACITY_GAIN]
        if none:
            how += "; no capacity gain: " + ", ".join(f"`{n}` ({_capacity(cap, n)})" for n in none)
    return [how + ".", "Speed was not measured: capacity is what FP8 KV buys a server, not measured throughput; "
            "`kvcalib validate` serves the arms under load and decides by goodput at your SLO."]


def _honest(arm: str | None, numbers: Mapping[str, str], ref: Reference,
            results: Results) -> tuple[dict[str, Any] | None, dict[str, Any], list[str]]:
    """What the numbers do not say by themselves: calibration within noise (and why), saturating layers, and
    which numbers decided; (the noise finding, the saturated layers per arm, the sentences saying so)."""
    extra = []
    noise = honest.scales_within_noise(ref, results, ref.sample_tokens)
    if noise:
        extra.append(noise["text"])
    saturated = {}
    for name in dict.fromkeys(n for n in ("default", arm) if n in results):
        text = honest.saturation_text(name, results[name], ref)
        if text:
            saturated[name] = honest.saturated_layers(results[name])
            extra.append(text)
    used = sorted(set(numbers.values()))
    if used == [honest.ENGINE]:
        extra.append("Decided on the engine's numbers.")
    elif honest.ENGINE in used:
        emu = [n for n, s in numbers.items() if s == honest.EMULATION]
        extra.append(f"Decided on the engine's numbers where it ran; emulated numbers for {', '.join(f'`{n}`' for n in emu)} "
                     "(engine: not run, see the engine table).")
    elif any(e.engine is not None for e in results.values()):
        extra.append("Decided on emulated numbers: the engine ran no quantised arm (see the engine table).")
    else:
        extra.append("Decided on emulated numbers (no engine run; `--engine vllm` measures the real engine).")
    return noise, saturated, extra


def _errs(entry: ArmMetrics, layers: Sequence[int]) -> str:
    rows = entry.layers
    med = statistics.median(r["attn_rel_error"] for r in rows.values())
    return ", ".join(f"layer {i}: {rows[str(i)]['attn_rel_error']:.3g}" for i in layers) + f" vs median {med:.3g}"


@dataclass(frozen=True)
class Report:
    """What report.json and report.md show: the run's description (`meta`: model, data, buckets, settings,
    notes, emulation, engine), the reference's and every arm's numbers, the thresholds and the verdict."""
    meta: Mapping[str, Any]
    reference: Reference
    arms: Mapping[str, ArmMetrics]
    thresholds: Thresholds
    verdict: Verdict

    @property
    def reference_name(self) -> str:
        return self.meta["reference"]

    def misses(self, name: str) -> list[str]:
        return failures(self.arms[name], self.reference, self.thresholds)

    def within(self, name: str) -> bool:
        return self.arms[name].info.shippable and not self.misses(name)

    def formats(self) -> kv_formats.FormatChoice | None:
        """The KV format to serve by bytes per token (calib/engine/formats.py), when the run has whole-format
        arms (`--formats`); None otherwise."""
        if not any(e.info.kind == "format" for e in self.arms.values()):
            return None
        m = self.meta
        return kv_formats.choose(self.arms, lambda e: failures(e, self.reference, self.thresholds),
                                 m["model_dtype"], m["kv_heads"], m["head_dim"], self.reference_name, len(m["layers"]))

    def passkey(self, name: str) -> significance.PasskeyDecision | None:
        """Arm `name`'s passkey against the reference's (`passkey_decision`)."""
        return passkey_decision(self.arms[name], self.reference, self.thresholds)

    def to_dict(self) -> dict[str, Any]:
        """report.json: the description, every arm's numbers with whether it is within the threshold and why
        not, and the verdict."""
        arms = {n: {**e.to_dict(), "within_threshold": self.within(n), "misses": self.misses(n)}
                for n, e in self.arms.items()}
        for n, e in self.arms.items():
            pk = self.passkey(n)
            if pk is not None:
                arms[n]["passkey_significance"] = pk.to_dict()
        out = {"kvcalib_eval": 1, **self.meta, "thresholds": self.thresholds.to_dict(),
               "arms": {self.reference_name: self.reference.to_dict(), **arms}, "verdict": self.verdict.to_dict()}
        fmt = self.formats()
        return {**out, "formats": fmt.to_dict()} if fmt else out


def _skip_trial(results: Results, name: str) -> tuple[list[int], str, str]:
    """A skip trial's layers kept unquantised, the engine flag that serves them, and the arm it was cut from."""
    info = results[name].info
    layers = sorted(set(info.skip) | set(info.serve_skip))
    named = support.skip_order([info.skip_kind, *info.serve_skip]) if info.skip_kind else layers
    return layers, f"{SKIP_FLAG} {' '.join(map(str, named))}", name.rsplit(" skip ", 1)[0]


def finite(x: Any) -> Any:
    """JSON without NaN/Infinity (strict readers refuse them): non-finite numbers become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def write(out: Path, rep: Report, *, force: bool, plots: bool = True) -> dict[str, Any]:
    """report.json, report.md and the plots into `out`, atomically (refuses an existing `out` unless force);
    returns report.json's document."""
    from calib.safety.outputs import atomic_dir

    with atomic_dir(out, force, kind="eval report") as tmp:
        made, note = plots_mod.plot_all(rep, tmp) if plots else ([], "plots not requested")
        if note:
            rep = replace(rep, meta={**rep.meta, "notes": [*rep.meta.get("notes", []), note]})
        doc = rep.to_dict()
        extra = engine_report.plot(doc, tmp) if plots and made else None
        made = [*made, extra] if extra else made
        files.write_text(tmp / "report.json", json.dumps(finite(doc), indent=2, allow_nan=False) + "\n")
        files.write_text(tmp / "report.md", render.markdown(rep, doc, made))
    return doc
