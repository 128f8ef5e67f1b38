"""`run_eval`: the evaluation from a config to a written report.

Order of work: every check that needs no weights, the report folder's lock, then `prepare` (model, arms, held-out
samples, passkey prompts), the measuring passes inside one installed hook (`measure_arms`: metrics, passkey, the engine;
then `skip_trials`), the verdict (`calib/evaluation/verdict.py`) and the report (`calib/evaluation/report.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from calib.ckpt.kvinfo import read_kv_info
from calib.data import sources as data_mod
from calib.evaluation import emulate, markdown, measurable, memory, passkey, report, served
from calib.evaluation import plan as plan_mod
from calib.evaluation import verdict as verdict_mod
from calib.evaluation.arms import (Arm, EvalError, Geometry, arms_for, format_arms, read_stats, reference_arm,
                                   sliding_skip_arms)
from calib.evaluation.config import EvalConfig, check_buckets, check_eval
from calib.evaluation.fakequant import fake_quant_kv
from calib.evaluation.measure import measure
from calib.evaluation.results import ArmMetrics, Reference, with_passkey
from calib.evaluation.passkey import passkey_stage, run_passkey, score_engine
from calib.evaluation.samples import Sample, calibration_windows, pack_warning, select_samples, usable_buckets
from calib.evaluation.session import Session, clock, open_session
from calib.model import context as model_context
from calib.model import layer_kinds
from calib.model import load as model_mod
from calib.model.geometry import GeometryError
from calib.progress import SILENT, Progress, Stage, duration
from calib.recipe import support
from calib.safety import outputs
from calib.safety.readers import raising

Log = Callable[[str], Any]


def load_causal_lm(source: str, placement: model_mod.Placement | str | None = None,
                   trust_remote_code: bool = False) -> model_mod.LoadedModel:
    """`model.load` with the LM head: evaluation needs logits. `LoadedModel.model` is the causal LM. `placement`:
    where the weights go (a bare device name: that device, float32 on CPU)."""
    if not isinstance(placement, model_mod.Placement):
        placement = model_mod.Placement(device=placement)
    return model_mod.load(source, placement=placement, trust_remote_code=trust_remote_code, lm_head=True)


@dataclass(frozen=True)
class EvalResult:
    """A finished evaluation: where its report is, the typed numbers and verdict, report.json's document."""
    out: Path
    reference: Reference
    arms: dict[str, ArmMetrics]
    verdict: verdict_mod.Verdict
    report: dict[str, Any]
    seconds: float
    samples: tuple[Sample, ...] = ()       # the held-out samples measured (validate serves them as prompts)
    tokenizer: Any = None
    context: int | None = None             # the model's context in tokens, where known
    bytes_model: Any = None                # calib.evaluation.memory.Model: validate sets it beside the engine's count


@dataclass(frozen=True)
class Prepared:
    """What an evaluation measures, settled before the first measuring pass."""
    loaded: model_mod.LoadedModel
    emulation: emulate.Emulation
    engine_version: str | None
    geo: Geometry
    arms: tuple[Arm, ...]
    reference: Arm
    buckets: tuple[int, ...]
    samples: tuple[Sample, ...]
    used: data_mod.DataReport
    held_out: dict[str, Any]
    prompts: tuple[passkey.Prompt, ...]
    notes: tuple[str, ...]
    kinds: layer_kinds.Layers | None = None     # each layer's attention kind (calib.model.layer_kinds)


def run_eval(cfg: EvalConfig, log: Log = lambda _m: None, progress: Progress = SILENT) -> EvalResult:
    """Evaluate every arm against the reference on held-out samples and write the report to `cfg.out`;
    `progress` receives a stage per measuring pass (calib/progress.py). Checks first, then the report
    folder's lock (a second run into it refuses), then the work."""
    t_start = time.perf_counter()
    check_eval(cfg)
    with outputs.lock(Path(cfg.out)):
        check_eval(cfg)          # again under the lock: taking it may have put back an output a killed run moved aside
        p = prepare(cfg, log)
        lm = p.loaded.model
        with fake_quant_kv(lm, p.emulation) as hook, torch.inference_mode():
            s, note = open_session(lm, hook, p.loaded.tokenizer, p.samples, p.buckets, cfg.batch_size, cfg.failures)
            planned = time_plan(cfg, p, s, log)
            t_plan = time.perf_counter()
            ref, results, engine = measure_arms(cfg, p, s, progress, planned.parts)
            measurable.check(ref, results, p.reference.name)     # before skip trials are planned on the numbers
            trials = skip_trials(cfg, p, s, ref, results, engine, log, progress, planned.parts)
            results.update(trials)
        serving = report.declared_dtype(cfg.model) or str(p.loaded.dtype).removeprefix("torch.")   # report.md's
        # the KV bytes model at the evaluation's lengths, reference KV and skipped layers in the serving dtype: the
        # verdict ranks by its capacity where the engine did not count
        bm = None if p.kinds is None else memory.Model(p.kinds, p.geo.kv_heads, p.geo.head_dim, serving,
                                                       tuple(p.buckets), str(cfg.model))
        decided = verdict_mod.verdict(ref, results, cfg.thresholds, p.reference.name, bm,
                                      (p.geo.kv_heads, p.geo.head_dim), cfg.target, markdown.dtype_title(serving))
        seconds = time.perf_counter() - t_start
        ran = "" if not planned.parts.skip_trials else \
            f"; {duration(planned.with_trials(len(trials)))} for the {len(trials)} skip trial(s) that ran"
        # like with like: the plan covers the measuring passes after it, not loading, the probe or the report
        log(f"eval: done in {duration(seconds)}; the measuring passes took {duration(time.perf_counter() - t_plan)} "
            f"(planned {duration(planned.total)}{ran})")
        meta = _meta(cfg, p, ([note] if note else []) + plan_notes(planned, p.buckets, cfg.engine is not None), seconds)
        if bm is not None and bm.layers.hybrid:
            meta["memory"] = memory.table(bm, p.reference.name, results, ref.engine)
        doc = report.write(Path(cfg.out), report.Report(meta, ref, results, cfg.thresholds, decided), force=cfg.force,
                           plots=cfg.plots)
    ctx = model_context.of_loaded(p.loaded.config, p.loaded.tokenizer)
    return EvalResult(Path(cfg.out), ref, results, decided, doc, time.perf_counter() - t_start, p.samples,
                      p.loaded.tokenizer, ctx.tokens if ctx else None, bm)


def prepare(cfg: EvalConfig, log: Log) -> Prepared:
    """The engine check, the model, its arms, the held-out samples and the passkey prompts, with notes."""
    emulation = emulate.by_name(cfg.emulate)     # checked by check_eval
    engine_version = None
    if cfg.engine is not None:          # the engine's version, checked before any long work
        from calib.engine import driver

        with raising(EvalError, driver.EngineError):
            engine_version = driver.check(cfg.engine)
    loaded = load_causal_lm(cfg.model, cfg.placement(), cfg.trust_remote_code)
    tok, config = loaded.tokenizer, loaded.config
    geo = Geometry.of(config, loaded.attention_layers)
    arms, served_note = served.as_served(arms_for(geo, cfg.dtype, cfg.scales, cfg.stats, emulation.per_head_kv),
                                         cfg.target, cfg.engine_version, emulation.name)
    with raising(EvalError, GeometryError):        # an inconsistent config: one line naming the field
        kinds = layer_kinds.layer_kinds(config, f"MODEL {cfg.model}/config.json")
    cannot = support.skip_by_kind(cfg.target) if cfg.target else None
    # every layer sliding (Mistral-style): skipping them all is the reference again, not an experiment
    sliding = kinds.sliding if kinds and not cannot and len(kinds.sliding) < len(kinds.kinds) else ()
    arms = [*arms, *sliding_skip_arms(arms, sliding)]
    arms += served.formats_as_served(format_arms(geo, cfg.formats), cfg.target, cfg.engine_version, emulation.name)
    vocab = getattr(config, "vocab_size", None)
    ctx = model_context.of_loaded(config, tok)
    if not cfg.fit_buckets:
        check_buckets(cfg.buckets, ctx, cfg.model)      # again: a hub model's config is read only now
    buckets, dropped = usable_buckets(cfg.buckets, ctx.tokens if ctx else None)
    notes = [f"buckets {dropped} exceed the model's context ({ctx.tokens} tokens: {ctx.why}): dropped"] if dropped else []
    notes += [served_note] if served_note else []
    if kinds and kinds.hybrid:
        notes.append(f"layer kinds: {kinds.describe()}"
                     + ("; sliding-window skip arms added (served with --kv-cache-dtype-skip-layers sliding_window)"
                        if sliding else ""))
    if cannot and kinds and kinds.sliding:
        log(f"eval: {cannot}")
        notes.append(f"{cannot}; no sliding-window skip arm for this target")
    windows, held_out = calibration_windows(_provenances(cfg), cfg.data, tok, vocab)
    samples, used, excluded = select_samples(cfg, tok, vocab, buckets, windows, ctx.tokens if ctx else None)
    hint = pack_warning(cfg, samples, buckets)
    if hint:
        log(hint)
    prompts: list[passkey.Prompt] = []
    if tok is None:
        notes.append("passkey retrieval skipped: the model has no tokenizer")
    elif cfg.passkey_trials > 0:
        with model_mod.quiet_transformers():   # sizing tries prompts past the model's length on purpose
            prompts, pk_notes = passkey.prompts(tok, buckets, cfg.passkey_trials, cfg.seed)
        notes += pk_notes
    else:
        notes.append("passkey retrieval off (passkey_trials = 0)")
    log(f"eval: {len(samples)} samples / {used.tokens} tokens, {len(arms)} arms + reference, "
        f"{len(prompts)} passkey prompts per arm")
    log(f"eval: emulating {emulation.line()}")
    return Prepared(loaded, emulation, engine_version, geo, tuple(arms), reference_arm(loaded.dtype), buckets,
                    tuple(samples), used, {**held_out, "excluded_samples": excluded}, tuple(prompts), tuple(notes),
                    kinds)


def time_plan(cfg: EvalConfig, p: Prepared, s: Session, log: Log) -> plan_mod.Plan:
    """The probe, the plan of what this run does (fitted to --budget-minutes), printed before the work."""
    limit = plan_mod.emulation_limit(cfg.emulate_up_to, p.buckets, cfg.engine is not None)
    depths = tuple(sorted({x.depth for x in p.prompts})) or plan_mod.DEPTH_STEPS[0]
    parts = plan_mod.Parts(limit, depths, cfg.thresholds.max_skip if p.arms else 0, True)
    cost = plan_mod.Cost.of(p.loaded.config, sum(t.numel() for t in s.lm.parameters()))
    rates = probe(s, p.arms[0] if p.arms else None, cost, p.prompts)
    starts = None
    if cfg.engine is not None:
        from calib.engine.run import starts as engine_starts

        starts = engine_starts(p.arms, str(cfg.model))
    work = plan_mod.Work(tuple((len(x.ids), x.bucket) for x in p.samples),
                         tuple((len(x.ids), x.bucket, x.depth) for x in p.prompts), len(p.arms), cfg.engine is not None,
                         starts, s.batch_size)
    budget = None if cfg.budget_minutes is None else 60 * cfg.budget_minutes
    planned = plan_mod.fit(work, parts, cost, rates, budget)
    for line in planned.lines(rates):
        log(line)
    return planned


PROBE_TOKENS = 16384     # the probe's batch holds at most this many tokens (one sample at least)


def probe(s: Session, arm: Arm | None, cost: plan_mod.Cost,
          prompts: Sequence[passkey.Prompt] = ()) -> plan_mod.Rates:
    """Seconds per unit of work of the reference and of one emulated arm: one batch of the smallest bucket's
    longest samples (the run's batch size, at most PROBE_TOKENS tokens), measured twice (the first run compiles
    kernels and fills caches; the second is timed). With passkey prompts, also the seconds per greedy decode
    step of each (`decode_step`)."""
    smallest = min(x.bucket for x in s.samples)
    same = sorted((x for x in s.samples if x.bucket == smallest), key=lambda x: -len(x.ids))
    # one batch as the run batches (a GPU runs a batch of 4 in about the time of one at short lengths), capped
    batch = same[:max(1, min(s.batch_size, PROBE_TOKENS // max(1, len(same[0].ids))))]
    sub = replace(s, samples=tuple(replace(x, index=i) for i, x in enumerate(batch)), failures=0)
    arms = [arm] if arm is not None else []
    measure(sub, arms)
    ref, res = measure(sub, arms)
    work = sum(cost.work(len(x.ids)) for x in batch)
    per_ref = ref.seconds.metrics / work
    per_arm = res[arm.name].seconds.metrics / work if arm is not None else per_ref
    steps = (0.0, 0.0)
    if prompts:
        first = min(prompts, key=lambda x: (x.bucket, len(x.ids)))
        step_ref = decode_step(s, None, first.ids)
        steps = (step_ref, decode_step(s, arm, first.ids) if arm is not None else step_ref)
    return replace(plan_mod.default_rates(s.device.type, per_ref, per_arm, len(batch[0].ids), *steps),
                   probed_batch=len(batch))


def decode_step(s: Session, arm: Arm | None, ids: Sequence[int]) -> float:
    """Seconds per greedy decode step after the prompt `ids` under `arm` (None: the reference), as the passkey
    phase runs it: MAX_NEW_TOKENS tokens less one (the prefill's), after an untimed run (compiles, tunes). On a
    small model a step costs its kernel launches, not its FLOPs, so it is measured rather than extrapolated."""
    with s.hook.applying(arm.to(s.device) if arm is not None else None):
        passkey.greedy(s.lm, ids)
        t0 = clock(s.device)
        passkey.greedy(s.lm, ids, max_new_tokens=1)
        t1 = clock(s.device)
        passkey.greedy(s.lm, ids)
        t2 = clock(s.device)
    return max(0.0, ((t2 - t1) - (t1 - t0)) / (passkey.MAX_NEW_TOKENS - 1))


def plan_notes(planned: plan_mod.Plan, buckets: Sequence[int], engine: bool) -> list[str]:
    """What the report says about the plan: its estimate, what the budget dropped, what was not emulated."""
    notes = [f"time plan before the measuring passes: {duration(planned.total)}"
             + (f" for a budget of {duration(planned.budget_s)}" if planned.budget_s else "")]
    if planned.dropped:
        notes.append("dropped to fit --budget-minutes: " + "; ".join(planned.dropped))
    limit = planned.parts.emulate_up_to
    if limit is not None:
        longer = [b for b in buckets if b > limit]
        notes.append(f"emulation (per-layer diagnostics, emulated KL/perplexity/passkey) covers buckets <= {limit}; "
                     f"buckets {longer} are " + ("measured in the engine only" if engine else "not measured"))
    return notes


def _emulated(p: Prepared, parts: plan_mod.Parts) -> tuple[list[Sample], list[passkey.Prompt]]:
    """The held-out samples and passkey prompts the emulation measures, as far as `parts` (the plan) says."""
    up_to = parts.emulate_up_to
    return ([x for x in p.samples if up_to is None or x.bucket <= up_to],
            [x for x in p.prompts if x.depth in parts.depths and (up_to is None or x.bucket <= up_to)])


def measure_arms(cfg: EvalConfig, p: Prepared, s: Session, progress: Progress,
                 parts: plan_mod.Parts = plan_mod.Parts()) -> tuple[Reference, dict[str, ArmMetrics], Any]:
    """(the reference's numbers, {arm: its numbers}, the engine run or None): metrics, passkey and the
    engine's numbers of the reference and every arm, as far as `parts` (the plan) says."""
    n = len(p.arms) + 1
    emulated, prompts = _emulated(p, parts)
    with _metrics_stage(progress, "emulation", emulated, n) as stage:
        ref, results = measure(s, p.arms, ranges=True, stage=stage, up_to=parts.emulate_up_to)
    if prompts:
        with passkey_stage(progress, "emulation passkey", prompts, n) as stage:
            stage.labels = {"arm": f"arm 1/{n}"}
            ref = with_passkey(ref, *run_passkey(s, None, prompts, stage))
            for j, a in enumerate(p.arms):
                stage.labels = {"arm": f"arm {j + 2}/{n}"}
                results[a.name] = with_passkey(results[a.name], *run_passkey(s, a, prompts, stage))
    engine = None
    if cfg.engine is not None:
        from calib.engine.run import EngineRun

        ctx = model_context.of_loaded(p.loaded.config, p.loaded.tokenizer)
        engine_prompts = [x for x in p.prompts if x.depth in parts.depths] if parts.engine_passkey else []
        engine = EngineRun(cfg.engine, p.engine_version, str(cfg.model), str(p.loaded.dtype).removeprefix("torch."),
                           p.samples, p.buckets, engine_prompts, passkey.MAX_NEW_TOKENS, p.loaded.tokenizer,
                           ctx.tokens if ctx else None, progress)
        measured = score_engine(engine.measure(p.reference, p.arms), engine_prompts, p.loaded.tokenizer)
        ref = replace(ref, engine=measured[p.reference.name]) if p.reference.name in measured else ref
        results.update({n: replace(results[n], engine=g) for n, g in measured.items() if n != p.reference.name})
    return ref, results, engine


def skip_trials(cfg: EvalConfig, p: Prepared, s: Session, ref: Reference, results: dict[str, ArmMetrics],
                engine: Any, log: Log, progress: Progress,
                parts: plan_mod.Parts | None = None) -> dict[str, ArmMetrics]:
    """The arms `verdict_mod.skip_plan` names, re-measured with the smallest prefix of their dominant layers
    unquantised that passes (every prefix tried until one does); none when the plan dropped them."""
    parts = parts or plan_mod.Parts(skip_trials=cfg.thresholds.max_skip)
    if not parts.skip_trials:
        return {}
    by_name = {a.name: a for a in p.arms}
    emulated, prompts = _emulated(p, parts)
    out: dict[str, ArmMetrics] = {}
    candidates = verdict_mod.skip_plan(ref, results, cfg.thresholds)
    log("eval: skip trials: " + ("none needed (an arm passes, or no small set of layers dominates the error)"
                                 if not candidates else
                                 "; ".join(f"up to {len(ls)} on `{n}` (layers {list(ls)})" for n, ls in candidates)))
    for name, layers in candidates:
        for k in range(1, len(layers) + 1):
            trial = by_name[name].skipping(layers[:k])
            log(f"eval: measuring {trial.name}")
            with _metrics_stage(progress, f"emulation `{trial.name}`", emulated, 2) as stage:
                _, r = measure(s, [trial], stage=stage, up_to=parts.emulate_up_to)
            entry = r[trial.name]
            if prompts:
                with passkey_stage(progress, f"emulation passkey `{trial.name}`", prompts, 1) as stage:
                    entry = with_passkey(entry, *run_passkey(s, trial, prompts, stage))
            if engine is not None:
                measured = score_engine(engine.measure(p.reference, [trial]), engine.prompts, engine.tokenizer)
                entry = replace(entry, engine=measured[trial.name])
            out[trial.name] = entry
            if not verdict_mod.failures(entry, ref, cfg.thresholds):
                break
    return out


def _meta(cfg: EvalConfig, p: Prepared, notes: list[str], seconds: float) -> dict[str, Any]:
    """report.json's description of the run: model, data, buckets, settings, notes, emulation, engine."""
    loaded, geo = p.loaded, p.geo
    meta = {"model": str(cfg.model), "model_dtype": str(loaded.dtype).removeprefix("torch."),
            "device": str(loaded.device), "layers": list(geo.layers), "kv_heads": geo.kv_heads,
            "head_dim": geo.head_dim, "data": {"source": str(cfg.data), **p.used.to_dict(), "held_out": p.held_out},
            "buckets": list(p.buckets), "config": cfg.to_dict(), "notes": [*p.notes, *notes],
            "reference": p.reference.name, "emulation": p.emulation.describe(), "seconds": seconds}
    if cfg.engine is not None:
        meta["engine"] = {"name": cfg.engine.name, "version": p.engine_version, "top_k": cfg.engine.top_k,
                          "kv_gib": cfg.engine.kv_gib, "continuation_tokens": cfg.engine.continuation_tokens}
    return meta


def _provenances(cfg: EvalConfig) -> list[tuple[str, dict | None]]:
    out: list[tuple[str, dict | None]] = []
    for p in cfg.scales:
        try:
            out.append((p, read_kv_info(p).provenance))
        except (FileNotFoundError, ValueError) as e:
            raise EvalError(f"--scales {p}: {e}") from None
    if cfg.stats:
        out.append((cfg.stats, read_stats(cfg.stats)[1]))
    return out


def _metrics_stage(progress: Progress, name: str, samples: Sequence[Sample], passes: int) -> Stage:
    """A stage of `passes` forward passes (reference + arms) over every sample."""
    return progress.stage(name, passes * sum(len(x.ids) for x in samples), samples=len(samples), arms=passes)
