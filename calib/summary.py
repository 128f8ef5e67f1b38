"""One JSON summary per command, the same shape for calibrate, eval, validate, tune and plan: summary.json in the
output folder, beside the command's own report.

Why: a pipeline that gates on kvcalib needs the decision, the command to serve with and a few numbers, not four
report formats (report.json, validate.json, tune.json, plan.json each answer in their own words). The exit code
carries the go / no-go (calib/errors.py); this file says what to run and why:

    {"schema": "kvcalib.summary/1", "command": "eval", "decision": "ship" | "keep_reference" | "none" | null,
     "serve_command": "vllm serve ..." | null, "headline": {...}, "outputs": {"folder": ..., ...}}

`decision`: `ship` (serve the quantized KV cache: exit 0), `keep_reference` (serve the model's own KV dtype,
BF16 on a GPU: exit 3), `none` (nothing could be recommended, e.g. no arm was measured: exit 3), null for
calibrate, which does not decide. `serve_command`: the whole command for that decision (the reference's too).
`headline`: the command's few deciding numbers. `outputs`: paths relative to `folder`. A key renamed, moved or
retyped takes the next schema number.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from calib.errors import NO_GO

SCHEMA = "kvcalib.summary/1"
FILE = "summary.json"
SHIP, KEEP, NONE = "ship", "keep_reference", "none"
_SHIPPING_ACTIONS = ("ship", "ship_with_skip")       # eval's verdict actions that serve a quantized cache


def document(command: str, decision: str | None, serve_command: str | None, headline: Mapping[str, Any],
             outputs: Mapping[str, Any]) -> dict[str, Any]:
    return {"schema": SCHEMA, "command": command, "decision": decision, "serve_command": serve_command,
            "headline": dict(headline), "outputs": dict(outputs)}


def conclude(doc: Mapping[str, Any], folder: Path) -> None:
    """Write `doc` as summary.json into the finished output `folder` (atomically, listed as ours:
    calib.safety.outputs.add_file), then end the command with its decision's exit code: 0 (returns normally) for
    ship and for calibrate, which does not decide; 3 (no-go) otherwise."""
    import click

    from calib.safety import outputs

    outputs.add_file(Path(folder), FILE, json.dumps(doc, indent=2, allow_nan=False) + "\n")
    if doc["decision"] not in (SHIP, None):
        click.get_current_context().exit(NO_GO)


def _num(x: Any) -> float | None:
    """A headline number: None where it is missing or not finite (strict JSON)."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


# ------------------------------------------------------------------------------------- per command

def of_eval(result: Any, cfg: Any) -> dict[str, Any]:
    """eval: the verdict's action; its arm's deciding numbers (the engine's where it measured the arm)."""
    from calib.evaluation.report import serve_argv

    v, doc = result.verdict, result.report
    decision = SHIP if v.action in _SHIPPING_ACTIONS and v.arm is not None else KEEP
    argv = serve_argv(v, result.arms, str(cfg.model), cfg.target)       # report.md's command, the same builder
    serve = shlex.join(argv) if argv else None
    numbers: dict[str, Any] = {}
    if decision == SHIP:
        entry = doc["arms"][v.arm]
        eng = entry.get("engine") or {}
        source = v.numbers.get(v.arm, "emulation")
        summ = eng.get("summary") if source == "engine" and eng.get("summary") else entry["summary"]
        numbers = {"numbers": source, "max_bucket_kl": _num(summ.get("max_bucket_kl")),
                   "ppl_rel": _num(summ.get("ppl_rel"))}
    headline = {"action": v.action, "arm": v.arm, "reference": doc.get("reference"), "skip_layers": list(v.skip_layers),
                **numbers, "within_threshold": list(v.within_threshold), "seconds": _num(result.seconds)}
    return document("eval", decision, serve, headline,
                    {"folder": str(result.out), "report": "report.md", "json": "report.json"})


def of_validate(res: Any) -> dict[str, Any]:
    """validate: the arm recommended by goodput at the SLO within the quality bar (the reference: keep it)."""
    doc = res.doc
    overall, ref = doc["decision"]["overall"], doc["reference"]
    rec = overall.get("recommended")
    decision = NONE if rec is None else KEEP if rec == ref else SHIP
    headline = {"recommended": rec, "reference": ref, "why": overall.get("why"),
                "goodput_vs_reference": _num((overall.get("goodput_vs_reference") or {}).get(rec)) if rec else None,
                "device": doc.get("device"), "arms": {n: a.get("decision") for n, a in doc["arms"].items()}}
    return document("validate", decision, doc.get("recommended_command"), headline,
                    {"folder": str(res.out), "report": "validate.md", "json": "validate.json",
                     "eval_report": "eval/report.md"})


def of_tune(result: Any, cfg: Any) -> dict[str, Any]:
    """tune: the chosen candidate (none: keep the reference), its numbers and how many were scored."""
    from calib.tune.output import serve_line

    doc, row = result.doc, result.chosen
    decision = SHIP if doc["choice"]["candidate"] else KEEP
    summ = (row or {}).get("summary") or {}
    headline = {"candidate": doc["choice"]["candidate"], "target": cfg.target,
                "numbers": (row or {}).get("numbers"), "max_bucket_kl": _num(summ.get("max_bucket_kl")),
                "ppl_rel": _num(summ.get("ppl_rel")), "memory_saved": _num((row or {}).get("memory_saved")),
                "candidates": len(doc["candidates"]), "scored": sum(1 for r in doc["candidates"] if r.get("scored")),
                "seconds": _num(result.seconds)}
    outputs = {"folder": str(result.out), "report": "tune.md", "json": "tune.json",
               "checkpoint": "." if decision == SHIP else None}
    return document("tune", decision, serve_line(doc), headline, outputs)    # tune.md's command


def of_plan(doc: Mapping[str, Any], out: Path) -> dict[str, Any]:
    """plan: ship where any route serves a quantized cache; the serve command where one server serves them all."""
    from calib.routes.plan import BF16

    routes = doc["routes"]
    decision = SHIP if any(r["decision"] != BF16 for r in routes.values()) else KEEP
    servers = doc["servers"]
    headline = {"routes": {n: {"decision": r["decision"], "arm": r["arm"], "serve": r["serve"]} for n, r in routes.items()},
                "servers": len(servers)}
    return document("plan", decision, servers[0]["serve"] if len(servers) == 1 else None, headline,
                    {"folder": str(out), "report": "plan.md", "json": "plan.json",
                     **{f"route {n}": f"{n}/report.md" for n in routes}})


def of_calibrate(result: Any, recipe: Any, stats_out: Path | None) -> dict[str, Any]:
    """calibrate: what was written and each target's serve command (no decision: eval, validate or tune decide)."""
    from calib.export import TARGETS

    targets = list(recipe.targets)
    multi = len(targets) > 1
    skip = tuple(result.skipped)
    serve = {t: TARGETS[t].serve_command(str(result.out / t if multi else result.out), skip, recipe.dtype)
             for t in targets}
    d = result.data
    headline = {"targets": targets, "kv_cache_dtype": recipe.dtype, "granularity": recipe.granularity,
                "observer": recipe.observer, "samples": d.used, "tokens": d.tokens, "skipped_layers": list(skip),
                "layers": len(result.scales), "serve": serve, "seconds": _num(result.seconds)}
    outputs = {"folder": str(result.out), "checkpoint": ({t: t for t in targets} if multi else "." if targets else None),
               "provenance": "kvcalib.json" if not multi else {t: f"{t}/kvcalib.json" for t in targets},
               "statistics": str(stats_out) if stats_out else ("stats.safetensors" if not targets else None)}
    return document("calibrate", None, serve[targets[0]] if len(targets) == 1 else None, headline, outputs)
