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
from calib.engine import verdict as honest
from calib.engine.verdict import SKIP_FLAG, decisive
from calib.evaluation import measurable, memory
from calib.evaluation import plots as plots_mod
from calib.evaluation import significance
from calib.evaluation.results import ArmMetrics, Reference, passkey_correct
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
        return out


def verdict(ref: Reference, results: Results, th: Thresholds, reference: str,
            bytes_model: "memory.Model | None" = None, geometry: tuple[int, int] | None = None) -> Verdict:
    """The decision: ship an arm, ship it with layers skipped (measured), or keep the reference KV dtype.
    Raises measurable.CannotMeasure ("cannot measure", naming the arm, where and which number) when any
    measured quantity is NaN or infinite: a comparison with NaN is false, so such an arm would "miss" nothing.
    `bytes_model` (calib.evaluation.memory): every measured skip is also weighed by the memory it gives back."""
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
    if ok:
        action, arm = "ship", ok[0]
        text = f"Ship `{arm}` ({kl(arm)}): {honest.how_to_serve(plain[arm].info)}."
        if len(ok) > 1:
            text += " Also within the threshold: " + "; ".join(f"`{n}` ({kl(n)})" for n in ok[1:]) + "."
    elif any(c for _, (c, _) in confirmed):
        best = next(n for n, (c, _) in confirmed if c)
        layers, flag, arm = _skip_trial(results, best)
        why = (f"the {results[best].info.skip_kind.replace('_', '-')} layers hold only their window, so keeping "
               "them costs little memory" if results[best].info.skip_kind else
               f"Those layers dominate the error (attention-output error {_errs(plain[arm], layers)})")
        action, text = "ship_with_skip", (
            f"Ship `{arm}` with layers {layers} kept in {reference}: serve with `{flag}` (vLLM; recipe "
            f"`skip_layers: {layers}`). {why[0].upper() + why[1:]}; measured with them unquantised: {kl(best)}, "
            "confirmed by the engine.")
    elif confirmed:
        best, (_, why) = confirmed[0]
        layers, flag, arm = _skip_trial(results, best)
        action, text = "skip_unconfirmed", (
            f"Keep {reference.upper()} KV for now: no arm is within the threshold "
            f"(best: `{best_any}`, {'; '.join(failures(plain[best_any], ref, th))}). Keeping layers {layers} in "
            f"{reference} brings `{arm}` within it ({kl(best)}; attention-output error "
            f"{_errs(plain[arm], layers)}), {why}. Before serving with `{flag}`, measure it in the engine "
            f"(`kvcalib eval --engine vllm`).")
    else:
        why = "; ".join(failures(plain[best_any], ref, th)) if best_any else "no quantised arm"
        tried = [n for n, e in results.items() if e.info.skip]
        extra = (f" Keeping layers {list(results[tried[-1]].info.skip)} unquantised was measured too and is still outside "
                 f"({kl(tried[-1])})." if tried else
                 " No small set of layers dominates the error, so no layer skip was measured (whether one helps "
                 "is unknown).")
        action, text = "keep_reference", (f"Keep {reference.upper()} KV for this model: no arm is within the threshold "
                                          f"(best: `{best_any}`, {why}).{extra}")
    noise, saturated, notes = _honest(arm, numbers, ref, results)
    notes = [*notes, *_passkey_notes(ref, results, th)]
    notes += [f"`{n}`: {honest.implausible(e)}." for n, e in results.items() if honest.implausible(e)]
    cands = memory.candidates(bytes_model, results, ref.engine, ref.sample_tokens) if bytes_model is not None else []
    notes += memory.lines(cands, bytes_model.model) if bytes_model is not None else []
    return Verdict(action, arm, tuple(layers), flag, tuple(ok), tuple(dominant), best_any, th, numbers,
                   " ".join([text, *notes]), noise, saturated, tuple(c.to_dict() for c in cands))


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

    def to_dict(self) -> dict[str, Any]:
        """report.json: the description, every arm's numbers with whether it is within the threshold and why
        not, and the verdict."""
        arms = {n: {**e.to_dict(), "within_threshold": self.within(n), "misses": self.misses(n)}
                for n, e in self.arms.items()}
        for n, e in self.arms.items():
            pk = passkey_decision(e, self.reference, self.thresholds)
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
    named = [info.skip_kind, *sorted(info.serve_skip)] if info.skip_kind else layers
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
        files.write_text(tmp / "report.md", markdown(rep, doc, made))
    return doc


# ------------------------------------------------------------------------------------------- markdown

def _cell(x: Any, fmt: str = ".3g") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return "∞" if x == math.inf else format(x, fmt)
    return str(x).replace("|", "\\|").replace("\n", " ")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A GitHub markdown table; every row has exactly len(headers) cells."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"table row has {len(r)} cells for {len(headers)} columns: {r}")
        out.append("| " + " | ".join(_cell(c) for c in r) + " |")
    return out + [""]


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.3g}%"


def _passkey_cell(rows: Mapping[str, Any] | None) -> str:
    pk = passkey_correct(rows)
    return "–" if pk is None else f"{pk[0]}/{pk[1]}"


def markdown(rep: Report, doc: Mapping[str, Any], plots: Sequence[str]) -> str:
    """report.md from the typed report; `doc` (report.json's document) feeds the engine section, which
    calib/engine/report.py renders from the engine's own entries."""
    meta, ref, th, v = rep.meta, rep.reference, rep.thresholds, rep.verdict
    ref_name, quant = rep.reference_name, rep.arms
    d = meta["data"]
    held = d["held_out"]
    lines = [f"# KV-cache evaluation: `{meta['model']}`", "", "## Verdict", "", f"**{v.text}**", "",
             f"Rule: every length bucket's mean next-token KL to {ref_name} <= {th.max_kl:g} nats, perplexity "
             f"<= +{100 * th.max_ppl_increase:g}%, passkey not a significant drop of more than {th.passkey_drop} "
             f"below {ref_name}'s (exact McNemar per bucket, paired by prompt). "
             f"Dominant layers: attention-output error >= {th.dominance:g}x the median layer's.", ""]
    if v.dominant_layers:
        lines += [f"Layers dominating the error of `{v.dominant_in}`: {list(v.dominant_layers)}.", ""]
    lines += _format_lines(rep)
    if held.get("checked_against"):
        held_txt = f"{held['excluded_samples']} calibration samples of `{held['checked_against']}` left out"
        held_txt += "" if held.get("reproduced_exactly") else " (calibration stream not reproduced exactly)"
    else:
        held_txt = held.get("note", "")
    lines += [f"Data: `{d['source']}`: {d['samples']} samples, {d['tokens']} tokens; {held_txt}. "
              f"Model dtype {meta['model_dtype']} on {meta['device']}; {len(meta['layers'])} layers, "
              f"{meta['kv_heads']} KV heads x {meta['head_dim']}.", ""]
    emu = meta.get("emulation")
    if emu:
        lines += [f"Emulated engine: {emu['line']}.", ""]
    s = ref.summary
    rows = [[ref_name, "reference", ref_name, "–", s.kl, s.max_bucket_kl, _pct(s.top1), s.ppl, "–",
             _passkey_cell(ref.passkey), "reference", ref.seconds.total]]
    for n, e in quant.items():
        s = e.summary
        rows.append([n, e.info.kind, e.info.dtype or ref_name, e.info.granularity, s.kl, s.max_bucket_kl, _pct(s.top1),
                     s.ppl, _pct(s.ppl_rel), _passkey_cell(e.passkey), rep.within(n), e.seconds.total])
    lines += ["## Arms", ""] + table(
        ["arm", "kind", "dtype", "granularity", "mean KL", "worst-bucket KL", "top-1", "ppl", "Δppl", "passkey",
         "within threshold", "seconds"], rows)
    lines += engine_report.markdown(doc, table)
    lines += memory_lines(meta.get("memory"))
    lines += ["## Per layer", "", "Saturated: share of values with |x / scale| > qmax. Flushed: share of nonzero "
              "values stored as 0. SNR over real tokens. Attention error: ||o - ô|| / ||o|| of the layer's "
              "attention output with quantised K/V (same inputs).", ""]
    for n, e in quant.items():
        sc = e.info.scales
        rows = [[i, sc["k"].get(i), sc["v"].get(i), _pct(r["k_saturated"]), _pct(r["k_flushed"]), r["k_snr_db"],
                 _pct(r["v_saturated"]), _pct(r["v_flushed"]), r["v_snr_db"], r["attn_rel_error"]]
                for i, r in e.layers.items()]
        lines += [f"### `{n}`", ""] + table(["layer", "k_scale", "v_scale", "K sat", "K flushed", "K SNR dB", "V sat",
                                             "V flushed", "V SNR dB", "attn error"], rows)
    lines += ["## By context length", ""] + table(
        ["arm", "bucket <=", "samples", "tokens", "KL", "top-1", "ppl", f"{ref_name} ppl", "Δppl"],
        [[n, b, r.samples, r.tokens, r.kl, _pct(r.top1), r.ppl, r.ppl_ref, _pct(r.ppl_rel)]
         for n, e in quant.items() for b, r in e.buckets.items()])
    lines += ["## Passkey retrieval", ""]
    ref_pk = passkey_correct(ref.passkey)
    if ref_pk and ref_pk[0] == 0:
        lines += [f"{ref_name} itself retrieves no key: on this model the test cannot show KV damage.", ""]
    if ref.passkey:
        every = [(ref_name, ref.passkey), *((n, e.passkey) for n, e in quant.items())]
        lines += table(["arm", "bucket <=", "correct", "accuracy", "by depth"],
                       [[n, b, f"{r.correct}/{r.total}", _pct(r.accuracy),
                         " ".join(f"{k}:{x.correct}/{x.total}" for k, x in r.by_depth.items())]
                        for n, pk in every for b, r in (pk or {}).items()])
        lines += _significance_lines(rep)
    else:
        lines += ["Not run (see notes).", ""]
    lines += _failure_lines(rep)
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    notes = list(meta.get("notes", [])) + [f"`{n}`: {x}" for n, e in quant.items() for x in e.info.notes]
    if notes:
        lines += ["## Notes", ""] + [f"- {x}" for x in notes] + [""]
    return "\n".join(lines)


def memory_lines(mem: Mapping[str, Any] | None) -> list[str]:
    """The KV memory table (calib.evaluation.memory.table): per arm and length, the bytes model's tokens per GiB and
    share of the reference's bytes saved, next to the engine's own capacity figure."""
    if not mem:
        return []
    lengths = list(next(iter(mem["rows"].values()))["model"])
    def check(c: Mapping[str, Any] | None) -> str:
        if not c:
            return "–"
        engine = "not reported" if c["engine"] is None else f"{c['engine']:,}"
        if c["problems"]:
            return f"{engine} ({'; '.join(c['problems'])})"
        return f"{engine} vs {c['bytes_model']:,} at {c['max_model_len']:,}"
    rows = [[n, *(f"{r['model'][L]['tokens_per_gib']:,.0f} ({_pct(r['model'][L]['saving'])})" for L in lengths),
             _cell(r.get("engine_tokens_per_gib"), ",.0f"), check(r.get("engine_check"))]
            for n, r in mem["rows"].items()]
    return (["## KV memory", "", f"Layer kinds: {mem['layer_kinds']}. Tokens per GiB at each length (share of the "
             f"reference's bytes saved); {mem['note']}. Engine capacity: the engine's own count (vLLM: requests of "
             "max_model_len the pool holds x max_model_len, a sliding layer reserving its window plus the tokens in "
             "flight) vs the bytes model's in that definition.", ""]
            + table(["arm", *(f"tokens/GiB at {L}" for L in lengths), "engine tokens/GiB (blocks)",
                     "engine capacity vs bytes model"], rows))


def _format_lines(rep: Report) -> list[str]:
    """The '## KV formats' section: each format arm's bytes per token, the choice and static vs dynamic."""
    fmt = rep.formats()
    if fmt is None:
        return []
    rows = [[r.arm, r.format, r.bytes_per_token, "–" if r.engine_bytes_per_token is None else
             f"{r.engine_bytes_per_token:.4g}", r.served_by, _pct(r.ppl_rel), r.kl, r.numbers,
             "yes" if r.passes else "; ".join(r.misses)] for r in fmt.rows]
    lines = ["## KV formats", "", f"**{fmt.text}**", ""]
    lines += [fmt.static_vs_dynamic, ""] if fmt.static_vs_dynamic else []
    lines += ["Bytes per token per layer: K and V of every KV head plus the per-token float32 scales of the dynamic "
              "formats; engine: its pool over the tokens it fits, per layer (block rounding included). Served by: engine backends that serve "
              "the format (the support matrix). Rule: the fewest bytes within the bar, ties to the format more "
              "backends serve, then the lower KL.", ""]
    return lines + table(["arm", "format", "bytes/token/layer", "engine bytes/token/layer", "served by", "Δppl", "mean KL",
                          "numbers", "within the bar"], rows)


def _significance_lines(rep: Report) -> list[str]:
    """Each arm's passkey paired with the reference's, per bucket: the exact McNemar test and what it concludes."""
    rows = []
    for n, e in rep.arms.items():
        pk = passkey_decision(e, rep.reference, rep.thresholds)
        for t in pk.buckets if pk else ():
            depth = " ".join(f"{d.depth}:{d.losses}-/{d.gains}+" for d in pk.depths if d.bucket == t.bucket)
            rows.append([n, t.bucket, t.prompts, t.reference, t.arm, t.losses, t.gains, f"{t.p:.3g}",
                         f"{t.alpha:.3g}", t.conclusion(pk.allowed) + ("" if t.powered else " (underpowered)"), depth])
    if not rows:
        return []
    return ["### Paired with the reference", "",
            f"Exact McNemar test on the prompts each run answered (lost: reference right, arm wrong; gained: the "
            f"reverse); one-sided p of the drop against alpha {significance.ALPHA:g} / buckets. Underpowered: fewer "
            f"than {significance.DEFAULT_PROMPTS} prompts, the number that detects a "
            f"{100 * significance.DETECT_DROP:g}-point drop with power {significance.POWER:g}.", ""] + table(
        ["arm", "bucket <=", "prompts", "reference correct", "arm correct", "lost", "gained", "p (drop)", "alpha",
         "conclusion", "by depth (lost-/gained+)"], rows)


def _failure_lines(rep: Report) -> list[str]:
    """The worst samples (largest mean KL) of the verdict's arm (or the best one) and of the default arm."""
    v = rep.verdict
    names = [n for n in dict.fromkeys([v.arm or v.dominant_in, "default"]) if n in rep.arms]
    out = ["## Failure samples", ""]
    for n in names:
        out += [f"### `{n}`", ""]
        for f in rep.arms[n].failures:
            out.append(f"- sample {f.sample} ({f.tokens} tokens, bucket <= {f.bucket}): mean KL {f.mean_kl:.3g}")
            for p in f.positions:
                text = p.context.replace("```", "'''").replace("\n", "\n    ")
                out += [f"  - position {p.position}, KL {p.kl:.3g}: next is {p.next!r}, "
                        f"{rep.reference_name} predicts {p.reference_predicts!r}, this arm {p.arm_predicts!r}; "
                        "text before:", "", "    ```", f"    {text}", "    ```", ""]
        out.append("")
    return out
