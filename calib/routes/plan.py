"""One decision per route — FP8 KV with calibrated or default scales, FP8 with layers kept in BF16, or BF16 —
with the exact `vllm serve` command and a plan.json a router reads.

Why on top of `kvcalib eval`: the evaluation already decides, per arm, on the engine's numbers where it ran
(calib/evaluation/numbers.py) and measures skip trials; a route only adds its own data, lengths and bar. So each
route is one `run_eval` with the route's data, buckets and thresholds and the same arms (the model's FP8 at
scale 1.0 and every --scales checkpoint); the plan takes its verdict, applies the bar's passkey floor, and
falls back to BF16 when nothing passes or when a skip was not confirmed by the engine.

With `--serve` (and the engine) each route's arms are also served under load with `vllm serve` and swept with
`vllm bench serve` on the route's prompts (calib/validate/run.py `serve`), and the route takes the arm with the
best goodput at the SLO within its bar (calib/load/decide.py), BF16 where FP8 buys nothing for that route.

Output (one folder, written whole or not at all): <route>/report.{md,json} per route (and <route>/validate.{md,json}
with --serve), plan.json, plan.md.
plan.json: {"schema": "kvcalib.plan/1", "model", "routes": {name: {"decision": "fp8" | "fp8_skip" | "bf16", "arm",
"serve_model", "kv_cache_dtype", "skip_layers", "max_model_len", "serve", "serve_argv", "numbers", "why",
"route", "report"}}, "servers": [{"serve", "routes"}]} — servers groups routes one engine instance can serve.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calib.engine import command
from calib.errors import KvcalibError
from calib.evaluation import markdown as render
from calib.evaluation import numbers as honest
from calib.evaluation.config import EvalConfig
from calib.evaluation.verdict import Thresholds
from calib.progress import SILENT, Progress
from calib.recipe import dtypes, support
from calib.routes import spec
from calib.routes.spec import Route, Routes, RoutesError

FP8, FP8_SKIP, BF16 = "fp8", "fp8_skip", "bf16"
SCHEMA = "kvcalib.plan/1"          # plan.json's format: a key renamed, moved or retyped takes the next number
VLLM_KV = {k: command.KV_FLAG["vllm"][k] for k in ("fp8_e4m3", "fp8_e5m2")}   # the static formats a route serves
Log = Callable[[str], Any]


@dataclass(frozen=True)
class Decision:
    """A route's decision and how to serve it: `serve_model` is what vLLM loads (the checkpoint holding the
    chosen scales, or the model), `kv_cache_dtype` "auto" for BF16 (the model's dtype)."""
    route: str
    decision: str
    arm: str | None
    serve_model: str
    kv_cache_dtype: str
    skip_layers: tuple[int, ...]
    max_model_len: int
    numbers: str | None
    why: str

    @property
    def serve_argv(self) -> list[str]:
        """From the one serve-command builder calibrate, eval and tune print too (calib.engine.command)."""
        kv = None if self.kv_cache_dtype == "auto" else dtypes.kv_format(self.kv_cache_dtype, "vllm").name
        return command.argv("vllm", self.serve_model, kv, self.skip_layers, self.max_model_len)

    @property
    def serve(self) -> str:
        return shlex.join(self.serve_argv)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "route"}
        return {**d, "skip_layers": list(self.skip_layers), "serve": self.serve, "serve_argv": self.serve_argv}


def passkey_floor(entry: Any, min_passkey: float | None) -> str | None:
    """Why the arm misses the route's passkey floor in some bucket (on its deciding numbers), or None."""
    if min_passkey is None:
        return None
    rows = entry.engine.passkey if honest.decisive(entry).source == honest.ENGINE else entry.passkey
    if not rows:
        return f"passkey floor {min_passkey:g} set but no passkey was run (the model has no tokenizer or trials are 0)"
    for b, r in rows.items():
        if r.total and r.correct / r.total < min_passkey:
            return f"passkey {r.correct}/{r.total} < {min_passkey:g} in bucket <= {b}"
    return None


def decide(route: Route, model: str, result: Any) -> Decision:
    """The route's decision from its evaluation (`calib.evaluation.run.EvalResult`)."""
    v, arms = result.verdict, result.arms
    length = max(route.buckets)
    misses: list[str] = []

    def chosen(name: str, entry: Any, kind: str, layers: tuple[int, ...]) -> Decision | None:
        why = passkey_floor(entry, route.bar.min_passkey)
        if why:
            misses.append(f"`{name}`: {why}")
            return None
        source = entry.info.source if entry.info.kind == "checkpoint" else model
        summ = honest.decisive(entry).summary
        return Decision(route.name, kind, name, str(source), VLLM_KV[entry.info.dtype], layers, length,
                        honest.decisive(entry).source,
                        f"worst-bucket KL {summ.max_bucket_kl:.3g} <= {route.bar.max_kl:g}, ppl "
                        f"{100 * summ.ppl_rel:+.2f}% <= +{100 * route.bar.max_ppl_increase:g}%"
                        + (f", passkey >= {route.bar.min_passkey:g}" if route.bar.min_passkey is not None else ""))

    if v.action == "ship":       # a checkpoint's own skipped layers are served as it was measured
        tries = [(n, FP8, tuple(support.skip_order(arms[n].info.serve_skip))) for n in v.within_threshold]
    elif v.action == "ship_with_skip":
        layers = tuple(v.skip_layers)
        tries = [(n, FP8_SKIP, layers) for n, e in arms.items() if n.startswith(f"{v.arm} skip ")
                 and sorted(set(e.info.skip) | set(e.info.serve_skip)) == list(layers)]
    else:
        tries = []
    for name, kind, skips in tries:
        e = arms[name]
        if e.info.dtype in VLLM_KV and e.info.kind in ("default", "checkpoint") and (d := chosen(name, e, kind, skips)):
            return d
    why = "; ".join(misses) if misses else v.text.split(". ")[0].rstrip(".")
    return Decision(route.name, BF16, None, model, "auto", (), length, None, f"BF16 KV: {why}")


def decide_served(route: Route, model: str, result: Any, served: Mapping[str, Any]) -> Decision:
    """The route's decision from its evaluation and its sweep under load (`served`: validate.json's document,
    calib/validate/report.py): the arm validate recommends by goodput at the SLO within the route's bar, if it also
    meets the route's passkey floor; BF16 otherwise, and BF16 with the reason where the serving was not measured."""
    overall, length = served["decision"]["overall"], max(route.buckets)
    rec = overall["recommended"]
    if rec is None or rec == served["reference"]:
        return Decision(route.name, BF16, None, model, "auto", (), length, "engine under load" if rec else None,
                        f"BF16 KV: {overall['why']}")
    entry = result.arms[rec]
    miss = passkey_floor(entry, route.bar.min_passkey)
    if miss:
        return Decision(route.name, BF16, None, model, "auto", (), length, None,
                        f"BF16 KV: `{rec}` serves best within the bar but {miss}")
    cfg = served["configs"][served["arms"][rec]["config"]]
    skips = tuple(cfg["skip_layers"])
    source = entry.info.source if entry.info.kind == "checkpoint" else model
    return Decision(route.name, FP8_SKIP if skips and entry.info.kind != "checkpoint" else FP8, rec, str(source),
                    cfg["kv_cache_dtype"], skips, length, "engine under load", overall["why"])


def eval_config(route: Route, base: EvalConfig, out: Path) -> EvalConfig:
    """The route's evaluation: its data, buckets, samples and bar on the common settings."""
    th = Thresholds(max_kl=route.bar.max_kl, max_ppl_increase=route.bar.max_ppl_increase,
                    passkey_drop=base.thresholds.passkey_drop, dominance=base.thresholds.dominance,
                    max_skip=base.thresholds.max_skip)
    return dataclasses.replace(base, data=str(route.data), buckets=route.buckets, samples=route.samples,
                               pack=route.pack, thresholds=th, out=out, fit_buckets=False)


def inputs(routes: Routes, base: EvalConfig) -> list[tuple[str, str | Path | None]]:
    """Everything the plan reads: the routes file, the model, every --scales checkpoint and every route's data.
    The plan folder may be none of them, hold none and lie inside none (calib/safety/outputs.py)."""
    return [("the routes file", routes.source), ("the model folder", base.model or None),
            *(("a --scales checkpoint", s) for s in base.scales),
            *((f"route '{r.name}' data", r.data) for r in routes.routes)]


def check(routes: Routes, base: EvalConfig, force: bool = False) -> None:
    """Every route's evaluation checked before the first one runs (the plan folder against every input, options,
    data, buckets within the model's context): a bad route stops the plan before any model loads."""
    from calib.data import sources as data_mod
    from calib.evaluation import served
    from calib.evaluation.config import check_buckets
    from calib.model import context
    from calib.safety import options, outputs

    outputs.check_folder(Path(base.out), force=force, inputs=inputs(routes, base))
    outputs.check_room(Path(base.out))
    served.stated(base.target, base.engine_version)
    ctx = context.of_directory(base.model) if base.model else None    # "": the default model, not built yet
    for r in routes.routes:
        cfg = eval_config(r, base, Path(base.out) / r.name)
        try:
            options.evaluation(cfg)
            data_mod.check_source(cfg.data)
            check_buckets(cfg.buckets, ctx, cfg.model)
        except KvcalibError as e:
            raise RoutesError(f"{routes.source}: route '{r.name}': {e}") from None


def check_samples(routes: Routes, base: EvalConfig) -> None:
    """Every route's held-out samples drawn (tokenized, cut and packed as its evaluation will) before the first route
    is evaluated, so route data that yields no usable sample stops the plan before any route's work, not after the
    routes before it were measured. Needs the model's tokenizer and config.json only, no weights; a hub id the
    plan has not downloaded yet is checked when its route runs. (Samples are not yet told apart from the
    calibration data here: a route whose every record was a calibration sample is still found at its turn.)"""
    from calib.evaluation.samples import select_samples
    from calib.model import context
    from calib.model import load as model_mod

    src = Path(base.model)
    if not (src / "config.json").is_file():
        return
    try:
        tok = model_mod.load_tokenizer(src, base.trust_remote_code)
        vocab = model_mod.read_config(src).get("vocab_size")
    except KvcalibError as e:
        raise RoutesError(f"{routes.source}: {e}") from None
    ctx = context.of_directory(src)
    for r in routes.routes:
        cfg = eval_config(r, base, Path(base.out) / r.name)
        try:
            select_samples(cfg, tok, vocab, cfg.buckets, None, ctx.tokens if ctx else None)
        except KvcalibError as e:
            raise RoutesError(f"{routes.source}: route '{r.name}': {e}") from None


def plan_doc(model: str, routes: Routes, decisions: list[Decision]) -> dict[str, Any]:
    by_route = {r.name: r for r in routes.routes}
    servers: dict[str, list[str]] = {}
    for d in decisions:
        servers.setdefault(d.serve, []).append(d.route)
    return {"schema": SCHEMA, "model": model, "routes_file": str(routes.source),
            "routes": {d.route: {**d.to_dict(), "route": by_route[d.route].to_dict(), "report": f"{d.route}/report.md"}
                       for d in decisions},
            "servers": [{"serve": s, "routes": names} for s, names in servers.items()]}


def markdown(doc: Mapping[str, Any], reports: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """plan.md: the plan in one line, one table (per route: decision, arm, quality against its bar, KV capacity and
    speed over the reference's) and each server's serve command. `reports`: per route {"eval": its report.json
    document, "validate": its validate.json document or None}, where capacity and speed are read."""
    reports = reports or {}
    dtype = render.dtype_title(next((x["eval"].get("serving_dtype") for x in reports.values() if x.get("eval")),
                                    None) or "bfloat16")
    words = {FP8: "FP8 KV", FP8_SKIP: "FP8 KV", BF16: f"keep {dtype} KV"}
    rows, said = [], []
    for name, r in doc["routes"].items():
        bar, rep = r["route"]["bar"], reports.get(name, {})
        decision = words[r["decision"]] + (f", layers {', '.join(map(str, r['skip_layers']))} in {dtype}"
                                           if r["decision"] == FP8_SKIP else "")
        said.append(f"{name} → {decision}" + (f" (`{r['arm']}`)" if r["arm"] else ""))
        quality = "reference" if r["arm"] is None else _quality(rep.get("eval"), r, bar)
        passkey = f", passkey >= {bar['min_passkey']:g}" if bar["min_passkey"] is not None else ""
        rows.append([name, f"**{decision}**", f"`{r['arm']}`" if r["arm"] else f"{dtype} KV (reference)",
                     quality + passkey, _capacity(rep.get("eval"), r["arm"]), _speed(rep.get("validate"), r["arm"]),
                     ", ".join(map(str, r["route"]["buckets"])), r["why"]])
    servers = doc["servers"]
    head = f"**{'; '.join(said)}**: {len(servers)} server{'s' if len(servers) > 1 else ''}, the whole command below."
    lines = [f"# Serving plan: `{doc['model']}`", ""]
    lines += render.lead(head, ["route", "decision", "arm", "quality (worst-bucket KL, Δppl vs the route's bar)",
                                f"KV capacity vs {dtype}", f"speed (goodput at the SLO vs {dtype})", "buckets", "why"],
                         rows, servers[0]["serve"] if len(servers) == 1 else None)
    if len(servers) > 1:
        for srv in servers:
            lines += [f"Routes {', '.join(srv['routes'])}:", "", "```", srv["serve"], "```", ""]
    served = any(x.get("validate") for x in reports.values())
    lines += [f"Routes file: `{doc['routes_file']}`. Each route's evaluation: `<route>/report.md`"
              + (" and its serving under load `<route>/validate.md`." if served else "."), ""]
    return render.relative("\n".join(lines))


def _quality(report: Mapping[str, Any] | None, r: Mapping[str, Any], bar: Mapping[str, Any]) -> str:
    """The route's arm's worst-bucket KL and perplexity change against the route's bar (its deciding numbers)."""
    entry = (report or {}).get("arms", {}).get(r["arm"])
    if entry is None:
        return "–"
    engine = (entry.get("engine") or {}).get("summary")
    summ = engine if r["numbers"] in ("engine", "engine under load") and engine else entry["summary"]
    return render.quality_cell(summ["max_bucket_kl"], summ["ppl_rel"], bar["max_kl"], bar["max_ppl_increase"],
                               "engine" if summ is engine else "emulated")


def _capacity(report: Mapping[str, Any] | None, arm: str | None) -> str:
    """The arm's KV capacity over the reference's as the route's verdict ranked it (the engine's count where it
    ran, else the bytes model's), at the route's longest length."""
    cap = ((report or {}).get("verdict") or {}).get("capacity") or {}
    name = arm if arm is not None else (report or {}).get("reference")
    row = next((a for a in cap.get("arms", ()) if a["arm"] == name), None)
    if row is None or row["vs_reference"] is None or row["source"] is None:
        return "–"
    words = "engine's count" if row["source"] == "engine" else "bytes model"
    return f"{row['vs_reference']:.2f}x ({words}) at {cap['length']:,} tokens"


def _speed(served: Mapping[str, Any] | None, arm: str | None) -> str:
    """Goodput at the SLO over the reference's, where the route was served under load (`--serve`)."""
    if not served:
        return "not measured"
    ratios = served["decision"]["overall"].get("goodput_vs_reference") or {}
    ratio = ratios.get(arm if arm is not None else served["reference"])
    return "not measured" if ratio is None else f"{ratio:.2f}x"


def run_plan(routes: Routes, base: EvalConfig, *, force: bool = False, log: Log = lambda _m: None,
             progress: Progress = SILENT, load: Any = None) -> dict[str, Any]:
    """Evaluate every route and write the plan into `base.out`, whole or not at all; returns plan.json's document.
    With `load` (calib.load.spec.LoadSpec) each route is also served under load, as `kvcalib validate`."""
    from calib.evaluation.run import run_eval
    from calib.safety.outputs import atomic_dir
    from calib.validate import report as vreport
    from calib.validate import run as vrun

    out = Path(base.out)
    check(routes, base, force)
    check_samples(routes, base)          # every route's data usable before the first route's work
    decisions, reports = [], {}
    with atomic_dir(out, force, kind="serving plan", inputs=inputs(routes, base)) as tmp:
        try:
            for r in routes.routes:
                log(f"plan: route `{r.name}` ({r.data}, buckets {list(r.buckets)})")
                cfg = eval_config(r, base, tmp / r.name)
                result = run_eval(cfg, log=log, progress=progress)
                served = None if load is None else vrun.serve(result, cfg, load, log)
                if served is not None:
                    vreport.write(tmp / r.name, served, base.plots)
                decisions.append(decide(r, base.model, result) if served is None else
                                 decide_served(r, base.model, result, served))
                reports[r.name] = {"eval": result.report, "validate": served}
                log(f"plan: route `{r.name}`: {decisions[-1].decision} ({decisions[-1].why})")
        except KvcalibError as e:     # which route failed (atomic_dir names the user's --out, not its folder)
            raise RoutesError(f"route '{r.name}': {e}") from None
        doc = plan_doc(base.model, routes, decisions)
        (tmp / spec.PLAN_FILES[0]).write_text(json.dumps(doc, indent=2) + "\n")
        (tmp / spec.PLAN_FILES[1]).write_text(markdown(doc, reports))
    return doc
