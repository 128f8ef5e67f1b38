"""What `kvcalib tune` leaves in OUT: the chosen checkpoint, written exactly as `calibrate` writes it, with
the whole search beside it (tune.json: every candidate with its numbers; tune.md: the decision, its table and serve
command first, then every candidate; tune.svg: quality against KV memory saved) — or, when nothing qualifies, only
the search and the advice to keep the model's own KV dtype (BF16 for a BF16 model).

Why through `pipeline.write_outputs`: the checkpoint must be the one `calibrate` (or `export --stats` on the
same statistics) would produce for the chosen recipe — the same exporters, provenance, marker, temporary
folder and rename. The search files travel in the same atomic step (`extra_files`), so OUT never exists
without its record.
"""

from __future__ import annotations

import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calib import __version__, pipeline
from calib.engine import command
from calib.errors import KvcalibError
from calib.evaluation import formats as kv_formats
from calib.evaluation import markdown as render
from calib.evaluation import report, verdict
from calib.evaluation.capacity import CAPACITY_FLOOR
from calib.model import load as model_mod
from calib.recipe.dtypes import FP8_E4M3, MODEL_DTYPE_BYTES
from calib.safety import files as new_file, outputs
from calib.scales import fold as scales_mod
from calib.tune import choose as choose_mod
from calib.tune.search import BASELINE, Search, TuneConfig, ranking

JSON, MD, SVG = "tune.json", "tune.md", "tune.svg"
SCHEMA = "kvcalib.tune/1"          # tune.json's format: a key renamed, moved or retyped takes the next number


@dataclass(frozen=True)
class Outcome:
    out: Path
    chosen: dict[str, Any] | None
    serve: str | None
    headline: str
    doc: dict[str, Any]
    seconds: float


def _ranges(st: Any) -> dict[str, float]:
    stats = st.any().stats()
    return {"k_amax": max(float(s.k_amax.max()) for s in stats.values()),
            "v_amax": max(float(s.v_amax.max()) for s in stats.values()),
            "layers_over_448": sorted(i for i, s in stats.items() if float(max(s.k_amax.max(), s.v_amax.max())) > FP8_E4M3.qmax)}


def serve_command(target: str, out: Path, skip: list[int]) -> str:
    """The target's own serve command (calib.export) for the chosen checkpoint."""
    from calib.export import TARGETS

    return TARGETS[target].serve_command(str(out), tuple(skip))


def _pick(d: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: d[k] for k in keys}


def _config(cfg: TuneConfig) -> dict[str, Any]:
    out = {k: (v.to_dict() if hasattr(v, "to_dict") else str(v) if isinstance(v, Path)
               else list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()}     # every field, in order
    if cfg.engine is not None:
        out["engine"] = {k: str(x) if isinstance(x, Path) else x for k, x in vars(cfg.engine).items()}
    out.update(emulate=cfg.emulation, max_skip=cfg.skips)
    return out


def document(cfg: TuneConfig, loaded: Any, source: Path, found: Search, st: Any, held: dict[str, Any],
             seconds: float) -> dict[str, Any]:
    th, layers = cfg.thresholds, len(loaded.attention_layers)
    serving = report.declared_dtype(source) or "bfloat16"     # served without KV quantization; BF16: none declared
    table = choose_mod.rows(found, th, layers, MODEL_DTYPE_BYTES.get(serving, 2), BASELINE)
    decision = choose_mod.decide(found, table)
    chosen, base = decision.row, found.entries.get(BASELINE)
    return {
        "schema": SCHEMA, "producer": "kvcalib tune", "version": __version__, "argv": sys.argv[1:],
        "config": _config(cfg), "model": str(cfg.model), "model_dtype": str(loaded.dtype).removeprefix("torch."),
        "layers": layers, "serving_dtype": serving, "kv_bytes_reference": MODEL_DTYPE_BYTES.get(serving, 2),
        "target": cfg.target, "statistics": {**st.origin, "files": {
            k: {"recipe": dict(sf.provenance.recipe), "data": dict(sf.provenance.data)} for k, sf in st.files.items()}},
        "held_out": held, "thresholds": th.to_dict(),
        "rule": choose_mod.__doc__.split("The rule", 1)[1].split("\n", 1)[1].strip(),
        "reference": None if found.ref is None else _pick(found.ref.to_dict(), ("buckets", "summary", "sample_tokens")),
        "baseline": None if base is None else {"name": BASELINE, **_pick(base.to_dict(), (
            "summary", "buckets", "sample_nll", "sample_kl")), "failures": verdict.failures(base, found.ref, th)},
        "candidates": table,
        "sensitivity": {"base": found.sensitivity_base, "kl_only_this_layer": {
            str(i): v for i, v in found.sensitivity.items()}, "ranking": ranking(found.sensitivity),
            "samples": cfg.sensitivity_samples},
        "scales_matter": choose_mod.scales_matter(found, table, _ranges(st), BASELINE), "capacity": decision.to_dict(),
        "choice": {"candidate": chosen and chosen["name"], "action": "ship" if chosen else "keep_reference",
                   "serve": serve_command(cfg.target, Path(cfg.out), chosen["skip"]) if chosen else None},
        "budget": {"minutes": cfg.budget_minutes, "stopped": found.stopped, "not_scored": found.not_scored},
        "measuring_passes": found.passes, "seconds": seconds,
        **formats(cfg, loaded, found, chosen),
    }


def formats(cfg: TuneConfig, loaded: Any, found: Search, chosen: dict[str, Any] | None) -> dict[str, Any]:
    """{"formats": the KV format with the fewest bytes per token within the bar (calib/evaluation/formats.py) among the
    engine's own formats (`--formats`), the chosen recipe and the default scale 1.0}; {} without --formats."""
    if not cfg.formats or found.ref is None:
        return {}
    from calib.evaluation.arms import Geometry, reference_arm

    geo = Geometry.of(loaded.config, loaded.attention_layers)
    names = [*cfg.formats, BASELINE, *([chosen["name"]] if chosen is not None else [])]
    entries = {n: e for n in names if (e := found.entry(n)) is not None}
    choice = kv_formats.choose(entries, lambda e: verdict.failures(e, found.ref, cfg.thresholds),
                               str(loaded.dtype).removeprefix("torch."), geo.kv_heads, geo.head_dim,
                               reference_arm(loaded.dtype).name, len(geo.layers))
    return {"formats": {**choice.to_dict(), "not_scored": [n for n in cfg.formats if n not in found.entries]}}


def _dtype(doc: dict[str, Any]) -> str:
    """The model's own KV dtype as the reports name it (BF16): what keeping the reference serves."""
    return render.dtype_title(doc.get("serving_dtype") or "bfloat16")


def _keep_why(doc: dict[str, Any]) -> str | None:
    """Why the reference KV dtype is kept; None where a candidate was chosen."""
    c = doc["choice"]
    within = [r for r in doc["candidates"] if r.get("scored") and not r.get("failures")]
    if c["candidate"] is None and within and all((r.get("capacity") or {}).get("gain") is False for r in within):
        return ("every candidate within the quality bar has no capacity gain over it at "
                f"{within[0]['capacity']['length']:,} tokens (within {CAPACITY_FLOOR:.0%} or one request; speed was "
                "not measured: `kvcalib validate` measures goodput under load)")
    if c["candidate"] is None:
        why = "nothing qualifies under the quality bar" if doc["candidates"] else "no candidate"
        return f"{why} (max KL {doc['thresholds']['max_kl']:g}, ppl +{100 * doc['thresholds']['max_ppl_increase']:g}%)"
    return None


def _chosen(doc: dict[str, Any]) -> dict[str, Any] | None:
    return next((r for r in doc["candidates"] if r["name"] == doc["choice"]["candidate"]), None)


def _chosen_words(doc: dict[str, Any], row: dict[str, Any]) -> str:
    """The chosen candidate's numbers, and its capacity where an engine counted the reference's (no speed)."""
    cap = row.get("capacity") or {}
    return (f"{row['support']}; KV memory saved {100 * row['memory_saved']:.1f}%, worst-bucket KL "
            f"{row['summary']['max_bucket_kl']:.3g}, ppl {100 * row['summary']['ppl_rel']:+.2f}% ({row['numbers']})"
            + ("" if cap.get("vs_reference") is None else f"; {cap['vs_reference']:.2f}x {_dtype(doc)}'s KV capacity "
               f"at {cap['length']:,} tokens ({cap['source']}); speed was not measured (`kvcalib validate` measures "
               "goodput under load)"))


def headline(doc: dict[str, Any]) -> str:
    """The decision in one line, as the command prints it."""
    why, row = _keep_why(doc), _chosen(doc)
    if why is not None or row is None:
        return f"keep {_dtype(doc)} KV: {why}"
    return f"chosen: {row['name']} — {_chosen_words(doc, row)}"


def _cell(x: Any, fmt: str = ".3g") -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def serve_line(doc: dict[str, Any]) -> str | None:
    """The whole command that serves the decision: the chosen checkpoint's (tune.json's `choice.serve`, from the
    target's builder), else the model as it is on the target's engine (calib.engine.command)."""
    if doc["choice"]["serve"]:
        return doc["choice"]["serve"]
    try:
        return command.line(doc["target"], doc["model"])
    except KvcalibError:
        return None


def decision_table(doc: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): the chosen candidate (none: the reference) first, the reference, scale 1.0, and where nothing
    was chosen the best scored candidate; quality against the bar, KV capacity over the reference's (the engine's
    count where it counted, else the bytes model's) and speed, which tune does not measure."""
    th, dtype, row = doc["thresholds"], _dtype(doc), _chosen(doc)
    counted = next((r["capacity"] for r in doc["candidates"] if (r.get("capacity") or {}).get("length")), None)
    headers = ["arm", "decision", render.quality_header(th["max_kl"], th["max_ppl_increase"]),
               f"KV capacity vs {dtype}" + (f" at {counted['length']:,} tokens" if counted else ""), "speed"]

    def quality(r: dict[str, Any]) -> str:
        s = r["summary"]
        return render.quality_cell(s["max_bucket_kl"], s["ppl_rel"], th["max_kl"], th["max_ppl_increase"],
                                   "engine" if r.get("numbers") == "engine" else "emulated")

    def capacity(r: dict[str, Any]) -> str:
        cap = r.get("capacity") or {}
        if cap.get("vs_reference") is not None:
            words = "engine's count" if cap["source"] == "engine" else "bytes model"
            return f"{cap['vs_reference']:.2f}x ({words})"
        return f"{1 / (1 - r['memory_saved']):.2f}x (bytes model)" if r["memory_saved"] < 1 else "–"

    def label(r: dict[str, Any]) -> str:
        if r.get("failures"):
            return "fails the quality bar"
        return "no capacity gain" if (r.get("capacity") or {}).get("gain") is False else "within the bar"

    rows = [[f"`{row['name']}`", "**recommended**", quality(row), capacity(row), "not measured"]] if row else []
    rows.append([f"{dtype} KV (reference)", "reference" if row else "**recommended**", "reference", "1.00x",
                 "not measured"])
    base = doc["baseline"]
    if base:
        saved = 1 - 1 / doc["kv_bytes_reference"]
        rows.append([f"`{BASELINE}`", "fails the quality bar" if base["failures"] else "within the bar",
                     quality(base), capacity({"memory_saved": saved}), "not measured"])
    scored = [r for r in doc["candidates"] if r.get("scored")]
    if row is None and scored:
        best = min(scored, key=lambda r: r["summary"]["max_bucket_kl"])
        rows.append([f"`{best['name']}` (best scored)", label(best), quality(best), capacity(best), "not measured"])
    return headers, rows


def markdown(doc: dict[str, Any]) -> str:
    """tune.md: the decision, its table and serve command (calib.evaluation.markdown.lead), then why, every candidate,
    the layer sensitivity, the KV formats and the rule; paths relative to the user's folder."""
    buckets = doc["held_out"]["buckets"]
    why, row = _keep_why(doc), _chosen(doc)
    head = (f"**Keep {_dtype(doc)} KV**: {why}." if why is not None or row is None else
            f"**Ship `{row['name']}`**: {_chosen_words(doc, row)}.")
    lines = [f"# kvcalib tune: {doc['model']} for {doc['target']}", ""]
    lines += render.lead(head, *decision_table(doc), serve_line(doc))
    lines += [doc["scales_matter"]["text"], ""]
    if doc.get("capacity"):
        lines += [doc["capacity"]["text"], ""]
    if doc["budget"]["stopped"]:
        lines += [f"Stopped early: {doc['budget']['stopped']}; not scored: {len(doc['budget']['not_scored'])}.", ""]
    head = ["candidate", "support", "KV saved", "worst KL", "ppl", "top-1",
            *(f"KL <= {b}" for b in buckets), "vs scale 1.0 (nats/token, ± noise)", "verdict"]
    lines += ["## Candidates", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(name: str, support: str, saved: float, r: dict[str, Any], vs: str) -> str:
        s = r["summary"]
        return "| " + " | ".join([name, support, f"{100 * saved:.1f}%", _cell(s["max_bucket_kl"]),
                                  f"{100 * s['ppl_rel']:+.2f}%", _cell(s["top1"]),
                                  *(_cell(r["buckets"].get(str(b), {}).get("kl")) for b in buckets), vs,
                                  "; ".join(r["failures"]) or "within bar"]) + " |"
    if doc["baseline"]:
        lines.append(row(BASELINE, "any FP8 KV engine", 1 - 1 / doc["kv_bytes_reference"], doc["baseline"], "—"))
    for r in doc["candidates"]:
        if not r["scored"]:
            lines.append(f"| {r['name']} | {r['support']} | {100 * r['memory_saved']:.1f}% | not scored |" +
                         " |" * (len(head) - 4))
            continue
        vs = r.get("vs_default")
        vs_cell = "—" if vs is None else (f"KL {vs['kl']['delta_per_token']:+.2g} ± {vs['kl']['noise']:.2g}, "
                                          f"NLL {vs['nll']['delta_per_token']:+.2g} ± {vs['nll']['noise']:.2g}")
        mark = " **(chosen)**" if r["name"] == doc["choice"]["candidate"] else ""
        if r["measured_as"] and r["measured_as"] != r["name"]:
            mark += f" (stores the cache as {r['measured_as']}: same numbers)"
        lines.append(row(r["name"] + mark, r["support"], r["memory_saved"], r, vs_cell))
    sens = doc["sensitivity"]
    if sens["kl_only_this_layer"]:
        top = sens["ranking"][:8]
        lines += ["", f"Layer sensitivity (KL with only that layer quantised, recipe {sens['base']}): " +
                  ", ".join(f"{i}: {sens['kl_only_this_layer'][str(i)]:.3g}" for i in top)]
    lines += [*format_lines(doc), "", "Rule:", "", doc["rule"], ""]
    return render.relative("\n".join(lines)) + "\n"


def format_lines(doc: dict[str, Any]) -> list[str]:
    """tune.md's KV-format part: the fewest bytes within the bar, and static calibration against the dynamic caches."""
    fm = doc.get("formats")
    if not fm:
        return []
    lines = ["", "KV formats (`--formats`, emulated; the chosen recipe and scale 1.0 included): " + fm["text"]]
    lines += [fm["static_vs_dynamic"]] if fm["static_vs_dynamic"] else []
    lines += [f"Not scored (budget): {', '.join(fm['not_scored'])}."] if fm["not_scored"] else []
    lines += [f"- {r['arm']}: {r['format']}, {r['bytes_per_token']:g} bytes/token/layer, ppl {100 * r['ppl_rel']:+.2f}%, "
              + ("within the bar" if r["passes"] else "; ".join(r["misses"])) for r in fm["rows"]]
    return lines


def plot_svg(doc: dict[str, Any]) -> str | None:
    """Quality (worst-bucket KL) against KV memory saved, one point per scored candidate; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = [r for r in doc["candidates"] if r["scored"]]
    floor = 1e-6
    for ok, color, label in ((True, "tab:green", "within bar"), (False, "tab:red", "misses bar")):
        sel = [r for r in pts if (not r["failures"]) == ok]
        ax.scatter([100 * r["memory_saved"] for r in sel], [max(r["summary"]["max_bucket_kl"], floor) for r in sel],
                   c=color, label=label, alpha=0.7, marker="o")
    if doc["baseline"]:
        saved = 100 * (1 - 1 / doc["kv_bytes_reference"])
        ax.scatter([saved], [max(doc["baseline"]["summary"]["max_bucket_kl"], floor)], c="black", marker="x",
                   label=BASELINE)
    chosen = next((r for r in pts if r["name"] == doc["choice"]["candidate"]), None)
    if chosen:
        ax.scatter([100 * chosen["memory_saved"]], [max(chosen["summary"]["max_bucket_kl"], floor)], s=160,
                   facecolors="none", edgecolors="tab:blue", label="chosen")
    ax.axhline(doc["thresholds"]["max_kl"], color="gray", linestyle="--", label="--max-kl")
    ax.set(yscale="log", xlabel="KV-cache memory saved vs the model dtype (%)",
           ylabel="worst-bucket KL to the reference (nats)", title=f"kvcalib tune: {doc['target']} candidates")
    ax.legend(fontsize=8)
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def finish(cfg: TuneConfig, loaded: Any, source: Path, found: Search, st: Any, held: dict[str, Any], seconds: float,
           log: Any) -> Outcome:
    doc = document(cfg, loaded, source, found, st, held, seconds)
    files = {JSON: json.dumps(report.finite(doc), indent=1) + "\n", MD: markdown(doc)}
    if cfg.plots and (svg := plot_svg(doc)):
        files[SVG] = svg
    out, row = Path(cfg.out), _chosen(doc)
    if row is None:
        with outputs.atomic_dir(out, cfg.force, kind="tune report") as tmp:
            for name, text in files.items():
                new_file.write_text(tmp / name, text)
        return Outcome(out, None, None, headline(doc), doc, seconds)
    write_checkpoint(cfg, loaded, source, st, next(c for c in found.candidates if c.name == row["name"]), files)
    log(f"tune: wrote {out}")
    return Outcome(out, row, doc["choice"]["serve"], headline(doc), doc, seconds)


def write_checkpoint(cfg: TuneConfig, loaded: Any, source: Path, st: Any, cand: Any, files: dict[str, str],
                     out: Path | None = None) -> Path:
    """A candidate's checkpoint (at `out`, default OUT), as `calibrate` writes it, with `files` beside it."""
    recipe = cand.recipe(cfg.base)
    sf = st.any()
    stats = st.stats_for(cand, cfg.base)
    scales = scales_mod.compute(stats, dtype=recipe.dtype, granularity=recipe.granularity, headroom=recipe.headroom)
    skipped = model_mod.resolve_skip_layers(recipe.skip_layers, loaded.config, loaded.attention_layers)
    dtype = str(loaded.dtype).removeprefix("torch.")
    recorded = sf.provenance
    prov = pipeline.provenance(recipe, str(cfg.model), dict(recorded.data), stats, scales, skipped, dtype,
                               rotary_dim=recorded.rotary_dim, model_config_sha256=recorded.model_config_sha256,
                               model_weights_sha256=recorded.model_weights_sha256, selected_by={"tool": "kvcalib tune", "record": JSON, "candidate": cand.name})
    return pipeline.write_outputs(source, Path(out or cfg.out), recipe, sf.capture, scales, prov,
                                  force=cfg.force and out is None, extra_files=files,
                                  engine_versions={cfg.target: cfg.engine_version} if cfg.engine_version else None)
