"""The validation report: per arm, quality (from the evaluation, unchanged) next to serving speed, and go / no-go.

Why one rule stated in the report: a team turning FP8 KV on needs one answer per arm it can act on. Quality
passes when the evaluation's verdict finds the arm within the bar (`calib.evaluation.report.failures`, on the
engine's numbers where the engine ran the arm); speed passes when the engine served every request with every
token asked at the stated concurrency, with no preemption and no out-of-memory (`calib.engine.serving.speed_ok`).
Speed is measured once per serve configuration (KV dtype, skip layers): arms that differ only in scale values
share it and the report says whose measurement they show. CPU numbers are labelled CPU: they rank nothing on a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from calib.engine import report as engine_report
from calib.engine import serving
from calib.engine import verdict as honest
from calib.evaluation import markdown as render
from calib.evaluation import report as eval_report
from calib.safety import files

PLOT = "validate.png"
GO, NO_GO, NOT_RUN = "go", "no-go", "not run"
RULE = ("go = quality within the bar (the evaluation's verdict: max KL per bucket, perplexity rise, passkey by "
        "significance; the engine's numbers where it ran the arm) AND speed: every request served with every "
        "output token asked at the stated concurrency, no preemption and no out-of-memory. The BF16-KV reference "
        "passes quality by definition. Speed is measured once per serve configuration (KV dtype, skip layers): "
        "scale values do not change the kernels.")


def _quality(entry: Any, ref: Any, th: eval_report.Thresholds, is_ref: bool) -> dict[str, Any]:
    nums = honest.decisive(entry)
    why = [] if is_ref else eval_report.failures(entry, ref, th)
    return {"source": nums.source, "ok": not why, "failures": why,
            "buckets": {b: {"kl": r.kl, "ppl": r.ppl, "ppl_rel": r.ppl_rel, "top1": r.top1, "samples": r.samples}
                        for b, r in nums.buckets.items()},
            "summary": {"kl": nums.summary.kl, "max_bucket_kl": nums.summary.max_bucket_kl, "ppl": nums.summary.ppl,
                        "ppl_rel": nums.summary.ppl_rel, "top1": nums.summary.top1}}


def _decide(quality: dict[str, Any], engine: Mapping[str, Any] | None, speed: dict[str, Any]) -> tuple[str, str]:
    if not engine or engine.get("status") != "ok":
        return NOT_RUN, f"not served by the engine: {(engine or {}).get('reason') or 'no engine run'}"
    q = "quality within the bar" if quality["ok"] else f"quality: {'; '.join(quality['failures'])}"
    s = f"speed: {speed['why']}" if speed["ok"] is not None else f"speed: {speed['why']} (no go without it)"
    return (GO if quality["ok"] and speed["ok"] is True else NO_GO), f"{q}; {s}"


def build(result: Any, thresholds: eval_report.Thresholds, spec: serving.ServingSpec) -> dict[str, Any]:
    """validate.json's document from a finished evaluation (calib.evaluation.run.EvalResult) whose engine also
    served (EngineSpec.serving)."""
    doc_arms = result.report["arms"]
    ref_name = result.report["reference"]
    entries = {ref_name: result.reference, **result.arms}
    measured = {}
    for name, e in entries.items():
        s = (e.engine or {}).get("serving")
        if s and s.get("status") != "shared":
            measured[name] = s
    arms: dict[str, Any] = {}
    for name, e in entries.items():
        is_ref = name == ref_name
        quality = _quality(e, result.reference, thresholds, is_ref)
        s = (e.engine or {}).get("serving")
        shown = measured.get(s["shared_with"]) if s and s.get("status") == "shared" else s
        ok, why = serving.speed_ok(shown)
        if s and s.get("status") == "shared":
            why += f" (measurement of `{s['shared_with']}`: same {s['config']})"
        decision, because = _decide(quality, e.engine, {"ok": ok, "why": why})
        arms[name] = {"quality": quality, "serving": s, "serving_shown": shown, "speed": {"ok": ok, "why": why},
                      "decision": decision, "why": because,
                      "failures": [] if is_ref else (doc_arms.get(name) or {}).get("failures", [])}
    for a in arms.values():
        a["vs_reference"] = vs_reference(arms[ref_name]["serving_shown"], a["serving_shown"], result.report["buckets"])
    labels = sorted({m.get("label") for m in measured.values() if m.get("label")})
    eng = result.report.get("engine") or {}
    return {"producer": "kvcalib validate", "model": result.report["model"], "reference": ref_name,
            "engine": {"name": eng.get("name"), "version": eng.get("version"), "kv_gib": eng.get("kv_gib")},
            "device": labels[0] if len(labels) == 1 else "/".join(labels) or "none",
            "concurrency": spec.concurrency, "output_tokens": spec.output_tokens,
            "buckets": result.report["buckets"], "thresholds": thresholds.to_dict(), "rule": RULE,
            "verdict": result.verdict.text, "eval_report": "eval/report.md", "arms": arms}


SLOW = 1.5      # a go arm this many times slower than the reference (TTFT or TPOT p50) is named in the report


def vs_reference(ref: Mapping[str, Any] | None, arm: Mapping[str, Any] | None,
                 buckets: Sequence[int]) -> dict[str, Any] | None:
    """The arm's TTFT and TPOT p50 over the reference's, at the longest bucket both served (the one the
    pre-launch question is about): a KV format can pass the quality bar and still serve several times slower
    (vLLM 0.24's per-token-head caches need its Triton attention: 7.7x FlashAttention-3's TTFT at 32K on an
    H200, bench/RESULTS.md). None where either was not served."""
    for b in sorted(buckets, reverse=True):
        r, a = ((ref or {}).get("buckets") or {}).get(str(b)), ((arm or {}).get("buckets") or {}).get(str(b))
        if not r or not a:
            continue
        ratio = {}
        for key, name in (("ttft_s", "ttft"), ("tpot_s", "tpot")):
            num, den = (a.get(key) or {}).get("p50"), (r.get(key) or {}).get("p50")
            ratio[name] = num / den if num is not None and den else None
        return {"bucket": b, **ratio}
    return None


def slow_lines(doc: Mapping[str, Any]) -> list[str]:
    """One line per go arm that serves at least SLOW times the reference's TTFT or TPOT."""
    out = []
    for n, a in doc["arms"].items():
        v = a.get("vs_reference") or {}
        worst = [(k, v[k]) for k in ("ttft", "tpot") if v.get(k) is not None and v[k] >= SLOW]
        if a["decision"] == GO and n != doc["reference"] and worst:
            parts = " and ".join(f"{x:.1f}x the reference's {k.upper()} (p50)" for k, x in worst)
            out.append(f"- `{n}` is within the bar but serves at {parts} at <= {v['bucket']} tokens.")
    return out


# ------------------------------------------------------------------------------------------- markdown

def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1000 * x:.3g}"


def _n(x: float | None, fmt: str = ".3g") -> str:
    return "–" if x is None else format(x, fmt)


def _gib(x: int | None) -> str:
    return "–" if x is None else f"{x / 2 ** 30:.2f}"


def _capacity(s: Mapping[str, Any]) -> str:
    """The pool in tokens, and the engine's own context capacity beside it where the two differ (hybrid models)."""
    pool, ctx = s.get("kv_capacity_tokens"), s.get("kv_context_tokens")
    if ctx is None or ctx == pool or not s.get("kv_context_max_model_len"):
        return _n(pool, ",d")
    groups = {"size_tokens": ctx, "max_model_len": s["kv_context_max_model_len"]}
    return f"{engine_report.context_capacity(groups)} (pool {_n(pool, ',d')}: one group's blocks)"


def markdown(doc: Mapping[str, Any]) -> str:
    table = render.table
    label = doc["device"]
    out = [f"# kvcalib validate: {doc['model']}", "",
           f"Engine {doc['engine']['name']} {doc['engine']['version']}, KV pool {doc['engine']['kv_gib']} GiB, "
           f"concurrency {doc['concurrency']} (closed loop), {doc['output_tokens']} output tokens a request, "
           f"buckets {doc['buckets']}. Speed measured on **{label}**"
           + (" — CPU numbers: they show the pipeline works and how arms compare on this host, not GPU speed."
              if "CPU" in label else "."), "", f"**Rule.** {doc['rule']}", "", "## Decision per arm", ""]
    out += table(["arm", "decision", "why"], [[f"`{n}`", f"**{a['decision']}**", a["why"]]
                                            for n, a in doc["arms"].items()])
    out += ["", "## Quality and speed per bucket", "",
            f"Times in ms ({label}); TPOT excludes each request's first token; ITL is every gap between two tokens "
            "of a request; throughput over the bucket's wall time; largest batch: requests of the bucket's length "
            "the KV pool holds at once, by the engine's own count where it reported its cache groups (vLLM's maximum "
            "concurrency: a sliding-window layer counted at its window plus the tokens in flight, as at a prefill; "
            "once decoding it keeps about its window).", ""]
    rows = []
    for n, a in doc["arms"].items():
        s = a["serving_shown"] or {}
        for b in doc["buckets"]:
            q = a["quality"]["buckets"].get(str(b), {})
            g = (s.get("buckets") or {}).get(str(b), {})
            if not q and not g:            # no held-out sample fell in this bucket
                continue
            rows.append([f"`{n}`", f"<= {b}", _n(q.get("kl")), "–" if q.get("ppl_rel") is None
                         else f"{100 * q['ppl_rel']:+.2f}%",
                         *(f"{_ms((g.get(k) or {}).get('p50'))} / {_ms((g.get(k) or {}).get('p90'))} / "
                           f"{_ms((g.get(k) or {}).get('p99'))}" for k in ("ttft_s", "tpot_s", "itl_s")),
                         _ms((g.get("e2e_s") or {}).get("p50")), _n(g.get("request_throughput")),
                         _n(g.get("output_throughput")), _n(g.get("max_running"), "d"),
                         _n(g.get("largest_batch_fits"), ",d")])
    out += table(["arm", "bucket", "KL", "Δppl", "TTFT p50/p90/p99", "TPOT p50/p90/p99", "ITL p50/p90/p99",
                  "E2E p50", "req/s", "out tok/s", "max running", "largest batch fits"], rows)
    out += ["", "## Speed against the reference", "",
            f"TTFT and TPOT p50 over the reference's (`{doc['reference']}`) at the longest bucket both served.", ""]
    out += table(["arm", "bucket", "TTFT", "TPOT"],
                 [[f"`{n}`", f"<= {v['bucket']}",
                   *("–" if v.get(k) is None else f"{v[k]:.2f}x" for k in ("ttft", "tpot"))]
                  for n, a in doc["arms"].items() if (v := a.get("vs_reference"))])
    slow = slow_lines(doc)
    out += ["", *slow] if slow else []
    out += ["", "## Serving per engine configuration", ""]
    rows = []
    for n, a in doc["arms"].items():
        s = a["serving"]
        if not s:
            continue
        if s.get("status") == "shared":
            rows.append([f"`{n}`", s["config"], f"shares `{s['shared_with']}`'s measurement", "", "", "", ""])
            continue
        rows.append([f"`{n}`", s.get("config"), s.get("status"), _capacity(s),
                     f"{_gib(s.get('peak_memory_bytes'))} ({s.get('memory_kind') or 'n/a'})",
                     f"{_n(s.get('preemptions'), 'd')} ({s.get('preemptions_source')})",
                     "yes: " + str(s.get("error")) if s.get("oom") else (s.get("error") or "no")])
    out += table(["arm", "serve config", "status", "KV capacity (tokens)", "peak memory GiB", "preemptions",
                  "OOM / error"], rows)
    out += ["", "## Failure samples (worst KL, from the evaluation)", ""]
    for n, a in doc["arms"].items():
        if a["decision"] == GO or not a["failures"]:
            continue
        out += [f"### `{n}`", ""]
        for f in a["failures"]:
            out.append(f"- sample {f['sample']} ({f['tokens']} tokens, bucket <= {f['bucket']}): mean KL {f['mean_kl']:.3g}")
            for p in f["positions"][:1]:
                text = str(p["context"]).replace("```", "'''").replace("\n", "\n    ")
                out += [f"  - position {p['position']}: next is {p['next']!r}, reference predicts "
                        f"{p['reference_predicts']!r}, this arm {p['arm_predicts']!r}; text before:", "", "    ```",
                        f"    {text}", "    ```", ""]
    out += ["", "## The evaluation's verdict", "", doc["verdict"], "",
            f"Every quality number, per layer and per sample: [{doc['eval_report']}]({doc['eval_report']}).", ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- plot

def plot(doc: Mapping[str, Any], out: Path) -> str | None:
    """validate.png: per bucket, KL (quality) beside TTFT p50, TPOT p50 and output throughput (speed); None
    when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    buckets = [str(b) for b in doc["buckets"]]
    fig = Figure(figsize=(14, 4), layout="constrained")
    panels = (("KL to reference (nats)", lambda a, b: a["quality"]["buckets"].get(b, {}).get("kl")),
              ("TTFT p50 (ms)", lambda a, b: _pick(a, b, "ttft_s", 1000)),
              ("TPOT p50 (ms)", lambda a, b: _pick(a, b, "tpot_s", 1000)),
              ("output tokens/s", lambda a, b: ((a["serving_shown"] or {}).get("buckets") or {}).get(b, {})
               .get("output_throughput")))
    for j, (title, get) in enumerate(panels):
        ax = fig.add_subplot(1, 4, 1 + j)
        for n, a in doc["arms"].items():
            ys = [get(a, b) for b in buckets]
            ax.plot(range(len(buckets)), [float("nan") if y is None else y for y in ys], marker="o", label=n)
        ax.set(xticks=range(len(buckets)), xticklabels=[f"<= {b}" for b in buckets], xlabel="bucket (tokens)",
               title=title + (f" [{doc['device']}]" if j else ""))
        ax.legend(fontsize=6)
    FigureCanvasAgg(fig)
    with files.open_new(out / PLOT, "wb") as f:
        fig.savefig(f, dpi=90, format="png")
    return PLOT


def _pick(a: Mapping[str, Any], b: str, key: str, scale: float) -> float | None:
    g = ((a["serving_shown"] or {}).get("buckets") or {}).get(b, {})
    v = (g.get(key) or {}).get("p50")
    return None if v is None else v * scale


def write(folder: Path, doc: dict[str, Any], plots: bool) -> list[str]:
    """validate.json, validate.md and (with plots) validate.png into `folder`; the file names written."""
    made = [PLOT] if plots and plot(doc, folder) else []
    files.write_text(folder / "validate.json", json.dumps(eval_report.finite(doc), indent=2, allow_nan=False) + "\n")
    files.write_text(folder / "validate.md", markdown(doc) + (f"\n![quality and speed per bucket]({PLOT})\n"
                                                              if made else ""))
    return ["validate.json", "validate.md", *made]
