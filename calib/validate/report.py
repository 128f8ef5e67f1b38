"""The validation report: per arm, quality (the evaluation's, in the engine) beside what the server delivered under
load — capacity, the sweep, goodput at the SLO — and the one decision (calib/load/decide.py).

Why the decision leads: the user asked "does FP8 KV raise my throughput?". The answer is an arm and a serve command,
or "keep BF16: FP8 buys nothing for this workload", decided per bucket and over the user's mix of lengths (each
bucket weighted by its share of the held-out prompts). Nothing is "go" that was not measured: an arm whose sweep
did not run says why and is never recommended. CPU numbers are labelled CPU: they rank arms on that host only.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from calib.engine.metrics import EngineNumbers
from calib.evaluation import markdown as render
from calib.evaluation import report as eval_report
from calib.evaluation import verdict as eval_verdict
from calib.evaluation.numbers import decisive
from calib.load import decide
from calib.load.spec import LoadSpec
from calib.safety import files

SCHEMA = "kvcalib.validate/2"
PLOT = "validate.png"
RECOMMENDED, DOMINATED, NO_GAIN, QUALITY, NOT_MEASURED = (
    "recommended", "dominated", "no gain", "fails the quality bar", decide.NOT_MEASURED)


def _quality(entry: Any, ref: Any, th: eval_verdict.Thresholds, is_ref: bool) -> dict[str, Any]:
    nums = decisive(entry)
    why = [] if is_ref else eval_verdict.failures(entry, ref, th)
    return {"source": nums.source, "ok": not why, "failures": why,
            "buckets": {b: {"kl": r.kl, "ppl": r.ppl, "ppl_rel": r.ppl_rel, "top1": r.top1, "samples": r.samples}
                        for b, r in nums.buckets.items()},
            "summary": {"kl": nums.summary.kl, "ppl": nums.summary.ppl,
                        "ppl_rel": 0.0 if is_ref else nums.summary.ppl_rel, "top1": nums.summary.top1}}


def _bucket_arm(name: str, quality: dict[str, Any], sw: Mapping[str, Any] | None, engine: EngineNumbers | None,
                is_ref: bool) -> decide.Arm:
    if engine is None or not engine.ok:
        why = f"not served by the engine: {(engine and engine.reason) or 'no engine run'}"
        return decide.Arm(name, quality["ok"], quality["summary"]["ppl_rel"], None, None, 0.0, is_ref, why)
    if sw is None or sw.get("best") is None:
        why = f"the sweep did not run: {(sw or {}).get('error') or 'no serve configuration'}"
        return decide.Arm(name, quality["ok"], quality["summary"]["ppl_rel"], None, None, 0.0, is_ref, why)
    return decide.Arm(name, quality["ok"], quality["summary"]["ppl_rel"], (sw.get("capacity") or {}).get("requests_fit"),
                      sw["best"]["goodput"], sw.get("noise") or 0.0, is_ref)


def _bytes_fit(result: Any, entry: Any, sw: Mapping[str, Any] | None) -> int | None:
    """Requests of the bucket's longest length the pool holds by kvcalib's bytes model (per layer min(length, window)
    tokens x KV heads x head_dim x 2 x bytes), shown beside the engine's own count: the two differ by the engine's
    page padding and its sliding-window reservation for the tokens in flight (docs/design.md §6)."""
    model, gib = getattr(result, "bytes_model", None), (result.report.get("engine") or {}).get("kv_gib")
    if model is None or not gib or not sw:
        return None
    per_gib = model.requests_per_gib(getattr(entry, "info", None), int(sw["max_model_len"]))
    return None if per_gib is None else int(gib * per_gib)


def shares(samples: Sequence[Any]) -> dict[str, float]:
    """Each bucket's share of the held-out prompts: the user's mix of lengths."""
    count = Counter(str(s.bucket) for s in samples)
    total = sum(count.values()) or 1
    return {b: n / total for b, n in sorted(count.items(), key=lambda kv: int(kv[0]))}


def _label(name: str, arm: decide.Arm, overall: decide.Decision) -> tuple[str, str]:
    if arm.goodput is None:
        return NOT_MEASURED, arm.why_not or "not measured"
    if not arm.quality_ok and not arm.reference:
        return QUALITY, "quality outside the bar"
    if overall.recommended == name:
        return RECOMMENDED, overall.why
    if name in overall.dominated:
        return DOMINATED, f"`{overall.dominated[name]}` is as good or better on quality, capacity and goodput together"
    return NO_GAIN, f"goodput {decide.ratio_text(overall.ratios.get(name))} the reference's" if not arm.reference else \
        "the reference; another arm delivers more within the bar"


def build(result: Any, thresholds: eval_verdict.Thresholds, load: LoadSpec,
          sweeps: Sequence[tuple[Any, Sequence[str], dict[str, Any]]], device: str) -> dict[str, Any]:
    """validate.json's document from a finished evaluation and the sweeps of its serve configurations."""
    ref_name = result.report["reference"]
    entries = {ref_name: result.reference, **result.arms}
    config_of = {n: j for j, (_, names, _) in enumerate(sweeps) for n in names}
    swept = {n: sweeps[j][2]["buckets"] for n, j in config_of.items()}       # an arm's sweep per bucket
    mix = shares(result.samples)
    buckets = list(mix)
    quality = {n: _quality(e, result.reference, thresholds, n == ref_name) for n, e in entries.items()}
    per_bucket = {b: [_bucket_arm(n, quality[n], swept.get(n, {}).get(b), e.engine, n == ref_name)
                      for n, e in entries.items()] for b in buckets}
    decisions = {b: decide.decide(arms, load.noise) for b, arms in per_bucket.items()}
    overall_arms = decide.mix([per_bucket[b] for b in buckets], [mix[b] for b in buckets]) if buckets else []
    overall = decide.decide(overall_arms, load.noise) if overall_arms else \
        decide.Decision(None, f"{decide.NOT_MEASURED}: no held-out prompt to serve", {}, {}, {})
    arms: dict[str, Any] = {}
    for k, (n, e) in enumerate(entries.items()):
        label, why = _label(n, overall_arms[k], overall) if overall_arms else (NOT_MEASURED, overall.why)
        j = config_of.get(n)
        stopped = [f"<= {b}: {x['error']}" for b, x in swept.get(n, {}).items() if x.get("error") and x.get("best")]
        if stopped:          # measured up to the level that failed: said beside the decision, never hidden
            why += f" (its sweep stopped early: {'; '.join(stopped)})"
        arms[n] = {"quality": quality[n], "config": j, "serve_command": sweeps[j][0].command() if j is not None else None,
                   "shares_sweep_of": sweeps[j][1][0] if j is not None and sweeps[j][1][0] != n else None,
                   "decision": label, "why": why,
                   "buckets": {b: {"capacity": per_bucket[b][k].capacity,
                                   "capacity_bytes_model": _bytes_fit(result, e, swept.get(n, {}).get(b)),
                                   "goodput": per_bucket[b][k].goodput, "noise": per_bucket[b][k].noise,
                                   "vs_reference": decisions[b].ratios.get(n)} for b in buckets}}
    eng = result.report.get("engine") or {}
    return {"schema": SCHEMA, "producer": "kvcalib validate", "model": result.report["model"], "reference": ref_name,
            "serving_dtype": result.report.get("serving_dtype"),
            "engine": {"name": eng.get("name"), "version": eng.get("version"), "kv_gib": eng.get("kv_gib")},
            "device": device, "load": {"output_tokens": load.output_tokens, "concurrency": list(load.concurrency)
                                       or "auto", "max_concurrency": load.max_concurrency,
                                       "requests_per_level": load.requests_per_level,
                                       "prefix_caching": load.prefix_caching},
            "slo": {"ttft_ms": load.slo_ttft_ms, "tpot_ms": load.slo_tpot_ms}, "noise_floor": load.noise,
            "buckets": [int(b) for b in buckets], "shares": mix,
            "decision": {"overall": overall.to_dict(), "per_bucket": {b: d.to_dict() for b, d in decisions.items()}},
            "recommended_command": arms[overall.recommended]["serve_command"] if overall.recommended else None,
            "configs": [{"command": c.command(), "flags": c.flags(), "model": c.model, "kv_cache_dtype": c.kv_cache_dtype,
                         "skip_layers": list(c.skip_layers), "arms": list(names), **sw}
                        for c, names, sw in sweeps],
            "arms": arms, "thresholds": thresholds.to_dict(), "rule": decide.RULE,
            "verdict": result.verdict.text, "eval_report": "eval/report.md"}


# ------------------------------------------------------------------------------------------- markdown

def _ms(d: Mapping[str, Any] | None, q: str = "p50") -> str:
    v = (d or {}).get(q)
    return "–" if v is None else f"{1000 * v:.4g}"


def _n(x: Any, fmt: str = ".3g") -> str:
    return "–" if x is None else format(x, fmt)


def _dtype(doc: Mapping[str, Any]) -> str:
    """The model's own KV dtype as the report names it (BF16): what keeping the reference serves."""
    return render.dtype_title(doc.get("serving_dtype") or doc["reference"])


def headline(doc: Mapping[str, Any]) -> str:
    """The decision in one line: the arm to serve, or the model's own KV dtype to keep (BF16 for a BF16 model)."""
    d, keep = doc["decision"]["overall"], _dtype(doc)
    if d["recommended"] is None:
        return f"**No recommendation**: {d['why']}"
    if d["recommended"] == doc["reference"]:
        return f"**Keep {keep} KV**: {d['why']}"
    return f"**Serve `{d['recommended']}`**: {d['why']}"


def decision_table(doc: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): per arm, the recommended first, its decision, quality against the bar (the engine's numbers
    where it ran), KV capacity at the longest bucket (the engine's own count, else the bytes model's: said which)
    and goodput at the SLO over the user's mix of lengths, both against the reference."""
    th, ref, dtype = doc["thresholds"], doc["reference"], _dtype(doc)
    longest = str(doc["buckets"][-1]) if doc["buckets"] else None
    speed = doc["decision"]["overall"].get("goodput_vs_reference") or {}
    headers = ["arm", "decision", render.quality_header(th["max_kl"], th["max_ppl_increase"]),
               f"KV capacity vs {dtype}" + (f" at <= {longest} tokens" if longest else ""),
               f"speed (goodput at the SLO vs {dtype})"]
    rows = []
    for n, a in doc["arms"].items():
        q = a["quality"]
        if n == ref:
            quality = "reference"
        else:
            worst = max((b["kl"] for b in q["buckets"].values()), default=q["summary"]["kl"])
            other = [f for f in q["failures"] if not f.startswith(("KL ", "perplexity "))]
            quality = render.quality_cell(worst, q["summary"]["ppl_rel"], th["max_kl"], th["max_ppl_increase"],
                                          "engine" if q["source"] == "engine" else "emulated")
            quality += f"; {'; '.join(other)}" if other else ""
        ratio = speed.get(n)
        rows.append([f"{dtype} KV (reference)" if n == ref else f"`{n}`",
                     f"**{a['decision']}**" if a["decision"] == RECOMMENDED else a["decision"], quality,
                     _capacity(doc, n, longest), decide.NOT_MEASURED if ratio is None else decide.ratio_text(ratio)])
    return headers, sorted(rows, key=lambda r: r[1] != f"**{RECOMMENDED}**")


def _capacity(doc: Mapping[str, Any], name: str, bucket: str | None) -> str:
    """Requests of the bucket's longest length the pool holds over the reference's: the engine's count, else the
    bytes model's."""
    if bucket is None:
        return "–"
    mine, ref = doc["arms"][name]["buckets"][bucket], doc["arms"][doc["reference"]]["buckets"][bucket]
    for key, words in (("capacity", "engine's count"), ("capacity_bytes_model", "bytes model")):
        if mine.get(key) is not None and ref.get(key):
            return f"{mine[key] / ref[key]:.2f}x ({mine[key]:,} requests, {words})"
    return "–"


def markdown(doc: Mapping[str, Any]) -> str:
    """validate.md: the decision, its table and the serve command first (calib.evaluation.markdown.lead), then how
    it was measured, the decision per bucket and each sweep; paths relative to the user's folder."""
    table = render.table
    slo, load = doc["slo"], doc["load"]
    out = [f"# kvcalib validate: {doc['model']}", ""]
    out += render.lead(headline(doc), *decision_table(doc), doc.get("recommended_command"))
    out += [f"Measured with a KV pool of {doc['engine']['kv_gib']} GiB per server: FP8's gain comes from the requests "
            "the pool holds, so it holds for a deployment whose pool is that size (vLLM logs its own as 'KV cache "
            "size' at start-up); rerun with `--engine-kv-gib` set to yours before reading the ratio as your gain.", ""]
    out += [f"Served by {doc['engine']['name']} {doc['engine']['version']} on **{doc['device']}** with `vllm serve` "
            f"(its defaults: CUDA graphs where the device has them, continuous batching; prefix caching "
            f"{'on' if load['prefix_caching'] else 'off'}), KV pool {doc['engine']['kv_gib']} GiB, measured with "
            f"`vllm bench serve`: {load['output_tokens']} output tokens a request, concurrency "
            f"{load['concurrency'] if load['concurrency'] != 'auto' else 'doubling from 1 until saturated and past the batch the pool holds (at most ' + str(load['max_concurrency']) + ')'}. "
            f"Goodput: requests/s meeting TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms. "
            f"Mix of lengths: " + ", ".join(f"<= {b}: {100 * s:.0f} %" for b, s in doc["shares"].items()) + "."
            + (" CPU numbers: they rank arms on this host, not on a GPU." if "CPU" in doc["device"] else ""),
            "", f"**Rule.** {doc['rule']}", "", "## Decision per arm and bucket", ""]
    rows = []
    for n, a in doc["arms"].items():
        cells = [f"{_n(x['goodput'])} ({decide.ratio_text(x['vs_reference'])}), fits {_n(x['capacity'], 'd')}"
                 f" (bytes model {_n(x.get('capacity_bytes_model'), 'd')})"
                 for x in (a["buckets"][str(b)] for b in doc["buckets"])]
        rows.append([f"`{n}`", f"**{a['decision']}**", decide.pct(a["quality"]["summary"]["ppl_rel"]), *cells,
                     a["why"]])
    out += table(["arm", "decision", "Δppl (" + "engine" + ")",
                  *[f"<= {b}: goodput req/s (vs ref), requests fit" for b in doc["buckets"]], "why"], rows)
    out += ["", "Requests fit: requests of the bucket's longest length (prompt + output) the engine's KV pool holds at "
            "once, as the engine itself logged it at start-up (its KV cache groups, page padding and sliding-window "
            "reservations counted); the decision reads this count. Beside it kvcalib's bytes model (per layer "
            "min(length, window) tokens), which has no page padding and no reservation for the tokens in flight.", ""]
    for b, dec in doc["decision"]["per_bucket"].items():
        out.append(f"- bucket <= {b}: {'`' + dec['recommended'] + '`' if dec['recommended'] else 'none'} — {dec['why']}")
    out += ["", "## The sweep per serve configuration", ""]
    for c in doc["configs"]:
        out += [f"### `{c['command']}` ({', '.join('`' + a + '`' for a in c['arms'])})", ""]
        for b, e in c["buckets"].items():
            cap = e.get("capacity") or {}
            out.append(f"Bucket <= {b}: max_model_len {e['max_model_len']:,}; engine KV cache "
                       f"{_n(cap.get('kv_cache_tokens'), ',d')} tokens, {_n(cap.get('max_concurrency'), '.2f')}x "
                       f"requests of max_model_len; started in {_n(e.get('start_s'), '.0f')} s"
                       + (f"; **{e['error']}**" if e.get("error") else "")
                       + (f"; best goodput {e['best']['goodput']:.3g} req/s at concurrency {e['best']['level']}"
                          f" (repeat spread {_n(e.get('noise'), '.1%')})" if e.get("best") else ""))
            out.append("")
            out += table(["concurrency", "req/s", "goodput", "out tok/s", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms",
                          "ITL p50 ms", "E2E p50 ms", "max running / waiting", "KV usage", "preemptions", "peak GiB"],
                         [_level_row(r) for r in e["levels"]])
            out.append("")
    out += ["## The evaluation's verdict (quality only)", "", doc["verdict"], "",
            f"Every quality number, per layer and per sample: [{doc['eval_report']}]({doc['eval_report']}).", ""]
    return render.relative("\n".join(out))


def _level_row(r: Mapping[str, Any]) -> list[str]:
    if r.get("status") != "ok":
        return [str(r["level"]), f"failed: {r.get('error')}", *[""] * 10]
    s = r.get("server") or {}
    mem = s.get("peak_memory_bytes")
    return [str(r["level"]), _n(r["request_throughput"]), _n(r["goodput"]), _n(r["output_throughput"], ".4g"),
            f"{_ms(r['ttft_s'])} / {_ms(r['ttft_s'], 'p99')}", f"{_ms(r['tpot_s'])} / {_ms(r['tpot_s'], 'p99')}",
            _ms(r["itl_s"]), _ms(r["e2e_s"]), f"{_n(s.get('max_running'), '.0f')} / {_n(s.get('max_waiting'), '.0f')}",
            _n(s.get("max_kv_usage"), ".0%"), _n(s.get("preemptions"), ".0f"),
            "–" if mem is None else f"{mem / 2 ** 30:.2f}"]


# ------------------------------------------------------------------------------------------- plot

def plot(doc: Mapping[str, Any], out: Path) -> str | None:
    """validate.png: goodput (solid) and request throughput (dotted) against concurrency, one panel per bucket,
    one line per serve configuration; None when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    buckets = [str(b) for b in doc["buckets"]]
    if not buckets:
        return None
    fig = Figure(figsize=(5 * len(buckets), 4), layout="constrained")
    for j, b in enumerate(buckets):
        ax = fig.add_subplot(1, len(buckets), 1 + j)
        for c in doc["configs"]:
            rows = [r for r in (c["buckets"].get(b) or {}).get("levels", []) if r.get("status") == "ok"]
            if not rows:
                continue
            x = [r["level"] for r in rows]
            line, = ax.plot(x, [r["goodput"] for r in rows], marker="o", label=", ".join(c["arms"])[:60])
            ax.plot(x, [r["request_throughput"] for r in rows], ls=":", color=line.get_color())
        ax.set(xscale="log", xlabel="requests in flight", ylabel="req/s",
               title=f"<= {b} tokens: goodput (solid), throughput (dotted) [{doc['device']}]")
        ax.legend(fontsize=6)
    FigureCanvasAgg(fig)
    with files.open_new(out / PLOT, "wb") as f:
        fig.savefig(f, dpi=90, format="png")
    return PLOT


def write(folder: Path, doc: dict[str, Any], plots: bool) -> list[str]:
    """validate.json, validate.md and (with plots) validate.png into `folder`; the file names written."""
    made = [PLOT] if plots and plot(doc, folder) else []
    files.write_text(folder / "validate.json", json.dumps(eval_report.finite(doc), indent=2, allow_nan=False) + "\n")
    files.write_text(folder / "validate.md", markdown(doc) + (f"\n![goodput against load]({PLOT})\n" if made else ""))
    return ["validate.json", "validate.md", *made]
