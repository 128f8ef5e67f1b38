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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..engine import report as engine_report
from ..engine import verdict as honest
from ..engine.verdict import SKIP_FLAG, decisive
from .results import ArmMetrics, Reference, passkey_correct

PLOTS = ("scales.png", "layer_error.png", "kl_by_bucket.png")


@dataclass(frozen=True)
class Thresholds:
    """When an arm is good enough to ship (defaults; the CLI can override each):
    mean next-token KL to the reference <= max_kl nats in *every* length bucket; perplexity at most
    max_ppl_increase (relative, 0.01 = +1%) above the reference's; passkey answers correct at least the
    reference's count minus passkey_drop. A layer dominates when its attention-output error is at least
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
    nums = decisive(entry)
    ref_pk = passkey_correct(ref.engine.get("passkey") if nums.source == honest.ENGINE and honest.engine_ok(ref)
                             else ref.passkey)
    why = [f"KL {row.kl:.3g} > {th.max_kl:g} in bucket <= {b}" for b, row in nums.buckets.items()
           if row.kl > th.max_kl]
    if nums.summary.ppl_rel > th.max_ppl_increase:
        why.append(f"perplexity +{100 * nums.summary.ppl_rel:.2f}% > +{100 * th.max_ppl_increase:g}%")
    arm_pk = nums.passkey
    if arm_pk and ref_pk and arm_pk[0] < ref_pk[0] - th.passkey_drop:
        why.append(f"passkey {arm_pk[0]}/{arm_pk[1]} < reference {ref_pk[0]}/{ref_pk[1]}")
    return why


def dominant_layers(entry: ArmMetrics, th: Thresholds) -> list[int]:
    """Layers whose attention-output error is >= `dominance` x the median layer's, worst first (<= max_skip)."""
    errs = {int(i): row["attn_rel_error"] for i, row in entry.layers.items()}
    if not errs:
        return []
    median = statistics.median(errs.values())
    top = sorted((i for i, e in errs.items() if e > 0 and e >= th.dominance * median), key=lambda i: -errs[i])
    return top[: th.max_skip] if len(top) < len(errs) else []


def _plain(results: Results) -> dict[str, ArmMetrics]:
    return {n: e for n, e in results.items() if e.info.shippable and not e.info.skip}


def skip_plan(ref: Reference, results: Results, th: Thresholds) -> list[tuple[str, list[int]]]:
    """[(arm, dominant layers)] to re-measure unquantised, when no shippable arm is within the threshold."""
    plain = _plain(results)
    if not plain or any(not failures(e, ref, th) for e in plain.values()):
        return []
    best = min(plain, key=lambda n: _kl(plain[n]))
    layers = dominant_layers(plain[best], th)
    return [(best, layers)] if layers else []


def _kl(entry: ArmMetrics) -> float:
    return decisive(entry).summary.kl


def verdict(ref: Reference, results: Results, th: Thresholds, reference: str) -> dict[str, Any]:
    """The decision: ship an arm, ship it with layers skipped (measured), or keep the reference KV dtype."""
    plain = _plain(results)
    ok = sorted((n for n in plain if not failures(plain[n], ref, th)), key=lambda n: _kl(plain[n]))
    skipped = sorted((n for n, e in results.items() if e.info.skip and not failures(e, ref, th)),
                     key=lambda n: (len(results[n].info.skip), _kl(results[n])))
    best_any = min(plain, key=lambda n: _kl(plain[n])) if plain else None
    dominant = dominant_layers(plain[best_any], th) if best_any else []
    numbers = {n: decisive(e).source for n, e in results.items()}
    out = {"action": "keep_reference", "arm": None, "skip_layers": [], "flag": None, "within_threshold": ok,
           "dominant_layers": dominant, "dominant_in": best_any, "thresholds": th.to_dict(), "numbers": numbers}

    def kl(n):
        nums = decisive(results[n])
        return f"{nums.label}: worst-bucket KL {nums.summary.max_bucket_kl:.3g}, ppl {100 * nums.summary.ppl_rel:+.2f}%"

    confirmed = [(n, honest.skip_confirmed(results[n], results[n.rsplit(" skip ", 1)[0]])) for n in skipped]
    if ok:
        best = ok[0]
        text = f"Ship `{best}` ({kl(best)}): {honest.how_to_serve(plain[best].info)}."
        if len(ok) > 1:
            text += " Also within the threshold: " + "; ".join(f"`{n}` ({kl(n)})" for n in ok[1:]) + "."
        out.update(action="ship", arm=best, text=text)
    elif any(c for _, (c, _) in confirmed):
        best = next(n for n, (c, _) in confirmed if c)
        layers, flag, base = _skip_trial(results, best)
        out.update(action="ship_with_skip", arm=base, skip_layers=layers, flag=flag, text=(
            f"Ship `{base}` with layers {layers} kept in {reference}: serve with `{flag}` (vLLM; recipe "
            f"`skip_layers: {layers}`). Those layers dominate the error (attention-output error "
            f"{_errs(plain[base], layers)}); measured with them unquantised: {kl(best)}, confirmed by the engine."))
    elif confirmed:
        best, (_, why) = confirmed[0]
        layers, flag, base = _skip_trial(results, best)
        out.update(action="skip_unconfirmed", arm=base, skip_layers=layers, flag=flag, text=(
            f"Keep {reference.upper()} KV for now: no arm is within the threshold "
            f"(best: `{best_any}`, {'; '.join(failures(plain[best_any], ref, th))}). Keeping layers {layers} in "
            f"{reference} brings `{base}` within it ({kl(best)}; attention-output error "
            f"{_errs(plain[base], layers)}), {why}. Before serving with `{flag}`, measure it in the engine "
            f"(`kvcalib eval --engine vllm`)."))
    else:
        why = "; ".join(failures(plain[best_any], ref, th)) if best_any else "no quantised arm"
        tried = [n for n, e in results.items() if e.info.skip]
        extra = (f" Keeping layers {list(results[tried[-1]].info.skip)} unquantised was measured too and is still outside "
                 f"({kl(tried[-1])})." if tried else
                 " No small set of layers dominates the error, so skipping layers would not help.")
        out["text"] = (f"Keep {reference.upper()} KV for this model: no arm is within the threshold "
                       f"(best: `{best_any}`, {why}).{extra}")
    return _honest(out, ref, results)


def _honest(out: dict[str, Any], ref: Reference, results: Results) -> dict[str, Any]:
    """Add what the numbers do not say by themselves: calibration within noise (and why), saturating layers,
    and which numbers decided."""
    extra = []
    noise = honest.scales_within_noise(ref, results, ref.sample_tokens)
    if noise:
        out["scales_within_noise"] = noise
        extra.append(noise["text"])
    out["saturated"] = {}
    for name in dict.fromkeys(n for n in ("default", out["arm"]) if n in results):
        text = honest.saturation_text(name, results[name], ref)
        if text:
            out["saturated"][name] = honest.saturated_layers(results[name])
            extra.append(text)
    used = sorted(set(out["numbers"].values()))
    if used == [honest.ENGINE]:
        extra.append("Decided on the engine's numbers.")
    elif honest.ENGINE in used:
        emu = [n for n, s in out["numbers"].items() if s == honest.EMULATION]
        extra.append(f"Decided on the engine's numbers where it ran; emulated numbers for {', '.join(f'`{n}`' for n in emu)} "
                     "(engine: not run, see the engine table).")
    elif any(e.engine is not None for e in results.values()):
        extra.append("Decided on emulated numbers: the engine ran no quantised arm (see the engine table).")
    else:
        extra.append("Decided on emulated numbers (no engine run; `--engine vllm` measures the real engine).")
    out["text"] = " ".join([out["text"], *extra])
    return out


def _errs(entry: ArmMetrics, layers: Sequence[int]) -> str:
    rows = entry.layers
    med = statistics.median(r["attn_rel_error"] for r in rows.values())
    return ", ".join(f"layer {i}: {rows[str(i)]['attn_rel_error']:.3g}" for i in layers) + f" vs median {med:.3g}"


def document(meta: dict[str, Any], ref: Reference, results: Results, th: Thresholds) -> dict[str, Any]:
    """The full report as one JSON-ready value (report.json): the run's description, every arm's numbers with
    whether it is within the threshold and why not, and the verdict."""
    def judged(e: ArmMetrics) -> dict[str, Any]:
        misses = failures(e, ref, th)
        return {**e.to_dict(), "within_threshold": e.info.shippable and not misses, "misses": misses}
    return {"kvcalib_eval": 1, **meta, "thresholds": th.to_dict(),
            "arms": {meta["reference"]: ref.to_dict(), **{n: judged(e) for n, e in results.items()}},
            "verdict": verdict(ref, results, th, meta["reference"])}


def _skip_trial(results: Results, name: str) -> tuple[list[int], str, str]:
    """A skip trial's layers kept unquantised, the engine flag that serves them, and the arm it was cut from."""
    layers = sorted(set(results[name].info.skip) | set(results[name].info.serve_skip))
    return layers, f"{SKIP_FLAG} {' '.join(map(str, layers))}", name.rsplit(" skip ", 1)[0]


def finite(x: Any) -> Any:
    """JSON without NaN/Infinity (strict readers refuse them): non-finite numbers become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def write(out: Path, doc: dict[str, Any], *, force: bool, plots: bool = True) -> Path:
    """report.json, report.md and the plots into `out`, atomically (refuses an existing `out` unless force)."""
    from ..outputs import atomic_dir

    with atomic_dir(out, force, kind="eval report") as tmp:
        made, note = plot_all(doc, tmp) if plots else ([], "plots not requested")
        extra = engine_report.plot(doc, tmp) if plots and made else None
        made = [*made, extra] if extra else made
        if note:
            doc["notes"] = [*doc.get("notes", []), note]
        (tmp / "report.json").write_text(json.dumps(finite(doc), indent=2, allow_nan=False) + "\n")
        (tmp / "report.md").write_text(markdown(doc, made))
    return out


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


def _passkey_cell(e: dict[str, Any]) -> str:
    pk = passkey_correct(e.get("passkey"))
    return "–" if pk is None else f"{pk[0]}/{pk[1]}"


def markdown(doc: dict[str, Any], plots: Sequence[str]) -> str:
    ref_name, th, v = doc["reference"], doc["thresholds"], doc["verdict"]
    arms = doc["arms"]
    quant = {n: e for n, e in arms.items() if n != ref_name}
    d = doc["data"]
    held = d["held_out"]
    lines = [f"# KV-cache evaluation: `{doc['model']}`", "", "## Verdict", "", f"**{v['text']}**", "",
             f"Rule: every length bucket's mean next-token KL to {ref_name} <= {th['max_kl']:g} nats, perplexity "
             f"<= +{100 * th['max_ppl_increase']:g}%, passkey correct >= {ref_name}'s - {th['passkey_drop']}. "
             f"Dominant layers: attention-output error >= {th['dominance']:g}x the median layer's.", ""]
    if v["dominant_layers"]:
        lines += [f"Layers dominating the error of `{v['dominant_in']}`: {v['dominant_layers']}.", ""]
    if held.get("checked_against"):
        held_txt = f"{held['excluded_samples']} calibration samples of `{held['checked_against']}` left out"
        held_txt += "" if held.get("reproduced_exactly") else " (calibration stream not reproduced exactly)"
    else:
        held_txt = held.get("note", "")
    lines += [f"Data: `{d['source']}`: {d['samples']} samples, {d['tokens']} tokens; {held_txt}. "
              f"Model dtype {doc['model_dtype']} on {doc['device']}; {len(doc['layers'])} layers, "
              f"{doc['kv_heads']} KV heads x {doc['head_dim']}.", ""]
    emu = doc.get("emulation")
    if emu:
        lines += [f"Emulated engine: {emu['line']}.", ""]
    lines += ["## Arms", ""] + table(
        ["arm", "kind", "dtype", "granularity", "mean KL", "worst-bucket KL", "top-1", "ppl", "Δppl", "passkey",
         "within threshold", "seconds"],
        [[n, e.get("kind", "reference"), e.get("dtype") or ref_name, e.get("granularity", "–"), e["summary"]["kl"],
          e["summary"]["max_bucket_kl"], _pct(e["summary"]["top1"]), e["summary"]["ppl"],
          _pct(e["summary"]["ppl_rel"]) if n != ref_name else "–", _passkey_cell(e),
          e.get("within_threshold", "reference"), sum(e["seconds"].values())] for n, e in arms.items()])
    lines += engine_report.markdown(doc, table)
    lines += ["## Per layer", "", "Saturated: share of values with |x / scale| > qmax. Flushed: share of nonzero "
              "values stored as 0. SNR over real tokens. Attention error: ||o - ô|| / ||o|| of the layer's "
              "attention output with quantised K/V (same inputs).", ""]
    for n, e in quant.items():
        rows = [[i, e["scales"]["k"].get(i), e["scales"]["v"].get(i), _pct(r["k_saturated"]), _pct(r["k_flushed"]),
                 r["k_snr_db"], _pct(r["v_saturated"]), _pct(r["v_flushed"]), r["v_snr_db"], r["attn_rel_error"]]
                for i, r in e["layers"].items()]
        lines += [f"### `{n}`", ""] + table(["layer", "k_scale", "v_scale", "K sat", "K flushed", "K SNR dB", "V sat",
                                             "V flushed", "V SNR dB", "attn error"], rows)
    lines += ["## By context length", ""] + table(
        ["arm", "bucket <=", "samples", "tokens", "KL", "top-1", "ppl", f"{ref_name} ppl", "Δppl"],
        [[n, b, r["samples"], r["tokens"], r["kl"], _pct(r["top1"]), r["ppl"], r["ppl_ref"], _pct(r["ppl_rel"])]
         for n, e in quant.items() for b, r in e["buckets"].items()])
    lines += ["## Passkey retrieval", ""]
    ref_pk = passkey_correct(arms[ref_name].get("passkey"))
    if ref_pk and ref_pk[0] == 0:
        lines += [f"{ref_name} itself retrieves no key: on this model the test cannot show KV damage.", ""]
    if arms[ref_name].get("passkey"):
        lines += table(["arm", "bucket <=", "correct", "accuracy", "by depth"],
                       [[n, b, f"{r['correct']}/{r['total']}", _pct(r["accuracy"]),
                         " ".join(f"{k}:{x['correct']}/{x['total']}" for k, x in r["by_depth"].items())]
                        for n, e in arms.items() for b, r in e.get("passkey", {}).items()])
    else:
        lines += ["Not run (see notes).", ""]
    lines += _failure_lines(doc, quant)
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    notes = list(doc.get("notes", [])) + [f"`{n}`: {x}" for n, e in quant.items() for x in e.get("notes", [])]
    if notes:
        lines += ["## Notes", ""] + [f"- {x}" for x in notes] + [""]
    return "\n".join(lines)


def _failure_lines(doc: dict[str, Any], quant: dict[str, dict[str, Any]]) -> list[str]:
    """The worst samples (largest mean KL) of the verdict's arm (or the best one) and of the default arm."""
    v = doc["verdict"]
    names = [n for n in dict.fromkeys([v["arm"] or v["dominant_in"], "default"]) if n in quant]
    out = ["## Failure samples", ""]
    for n in names:
        out += [f"### `{n}`", ""]
        for f in quant[n]["failures"]:
            out.append(f"- sample {f['sample']} ({f['tokens']} tokens, bucket <= {f['bucket']}): "
                       f"mean KL {f['mean_kl']:.3g}")
            for p in f["positions"]:
                text = p["context"].replace("```", "'''").replace("\n", "\n    ")
                out += [f"  - position {p['position']}, KL {p['kl']:.3g}: next is {p['next']!r}, "
                        f"{doc['reference']} predicts {p['reference_predicts']!r}, this arm {p['arm_predicts']!r}; "
                        "text before:", "", "    ```", f"    {text}", "    ```", ""]
        out.append("")
    return out


# ------------------------------------------------------------------------------------------- plots

def _pos(x: float | None) -> float:
    """For log axes: NaN for missing/non-finite values, tiny values for zero."""
    return math.nan if x is None or not math.isfinite(x) else max(x, 1e-12)


def plot_all(doc: dict[str, Any], out: Path) -> tuple[list[str], str | None]:
    """Write the PNG plots into `out`; returns (file names, a note when plots could not be made)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install matplotlib)"
    ref_name = doc["reference"]
    quant = {n: e for n, e in doc["arms"].items() if n != ref_name}
    layers = [str(i) for i in doc["layers"]]

    def save(fig: Any, name: str) -> None:
        FigureCanvasAgg(fig)
        fig.savefig(out / name, dpi=90, format="png")

    fig = Figure(figsize=(12, 8), layout="constrained")
    for j, kind in enumerate(("k", "v")):
        ax = fig.add_subplot(2, 2, 1 + j)
        for n, e in quant.items():
            ys = [_pos(e["scales"][kind].get(i)) for i in layers]
            if any(math.isfinite(y) for y in ys):
                ax.plot([int(i) for i in layers], ys, marker="o", label=n)
        ax.set(yscale="log", xlabel="layer", ylabel=f"{kind}_scale (max over heads)", title=f"{kind.upper()} scales")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=6)
        amax = [doc["arms"][ref_name]["ranges"][i][f"{kind}_amax"] for i in layers]
        ax = fig.add_subplot(2, 2, 3 + j)
        im = ax.imshow(amax, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set(xlabel="KV head", ylabel="layer", title=f"max |{kind.upper()}| per head ({ref_name} pass)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(im, ax=ax)
    save(fig, PLOTS[0])

    fig = Figure(figsize=(12, 4), layout="constrained")
    for j, (key, label) in enumerate((("attn_rel_error", "attention output rel. error"), ("k_snr_db", "K SNR (dB)"),
                                      ("v_snr_db", "V SNR (dB)"))):
        ax = fig.add_subplot(1, 3, 1 + j)
        for n, e in quant.items():
            ys = [e["layers"][i][key] for i in e["layers"]]
            ys = [_pos(y) if j == 0 else (y if y is not None and math.isfinite(y) else math.nan) for y in ys]
            ax.plot([int(i) for i in e["layers"]], ys, marker="o", label=n)
        ax.set(xlabel="layer", title=label, yscale="log" if j == 0 else "linear")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=6)
    save(fig, PLOTS[1])

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    buckets = [str(b) for b in doc["buckets"]]
    for n, e in quant.items():
        ax.plot(range(len(buckets)), [_pos(e["buckets"].get(b, {}).get("kl")) for b in buckets], marker="o", label=n)
    ax.axhline(doc["thresholds"]["max_kl"], color="red", linestyle="--", label="threshold")
    ax.set(xticks=range(len(buckets)), xticklabels=[f"<= {b}" for b in buckets], yscale="log",
           xlabel="context length (tokens)", ylabel=f"mean KL to {ref_name} (nats)", title="KL by length bucket")
    ax.legend(fontsize=6)
    save(fig, PLOTS[2])
    return list(PLOTS), None
