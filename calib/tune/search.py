"""The search: statistics once, every candidate scored on held-out text, layer skips by measured sensitivity.

Order of work (each step only where the previous one needs it):
1. checks that need no weights (options, output paths, data), then OUT's lock;
2. statistics: one pass over CAL with every observer (calib/tune/stats.py), or the `--stats` files;
3. candidates (calib/tune/space.py) as arms (calib/tune/score.py); arms that store the cache identically
   under the chosen emulation are measured once and share the numbers (pruning that is exact, not a guess);
   the default scale 1.0 arm rides along as the baseline every candidate is compared with;
4. sensitivity of every layer of the best full candidate (KL when only that layer is quantised, measured),
   then that candidate with the top 1..max_skip layers skipped (vLLM only: TensorRT-LLM cannot skip);
5. with `engine`, the short list again in the real engine (calib/engine/), whose numbers then decide;
6. the choice (`choose`) and OUT (calib/tune/output.py); calib/tune/run.py runs the steps in this order.
`--budget-minutes` bounds the run with the evaluation's plan (calib/evaluation/plan.py: a probe, its cost model,
drops in a fixed order, each said): before the first measuring pass the time left is planned and printed, dropping
the layer skips, the sliding-window skip, engine confirmations (one at a time), then candidates (last first) until
it fits. Why this order: the engine's short list is drawn from the emulated scores, and an engine arm costs a start
(20-66 s) on top of its scoring. The plan is then kept: a pass starts only when its estimate (scaled up by how far
the passes so far ran over theirs) ends before the budget less the engine's planned share. Loading, statistics and
OUT are not in the plan (the plan gets the time they leave; eval's plan covers its measuring passes alike).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from calib import resources
from calib.data import sources as data_mod
from calib.engine.metrics import EngineNumbers
from calib.errors import KvcalibError
from calib.evaluation import emulate, verdict
from calib.evaluation import plan as plan_mod
from calib.evaluation.arms import Geometry, default_arm, format_arms
from calib.evaluation.config import EvalConfig, check_buckets
from calib.evaluation.fakequant import fake_quant_kv
from calib.evaluation.measure import measure
from calib.evaluation.results import ArmMetrics, Reference
from calib.evaluation.run import probe
from calib.evaluation.samples import calibration_windows, select_samples, usable_buckets
from calib.evaluation.session import Session, open_session
from calib.model import context
from calib.progress import SILENT, Progress, duration
from calib.recipe.dtypes import FP8_E4M3
from calib.recipe.recipe import Recipe
from calib.safety import options, outputs, readers
from calib.tune import score, space
from calib.tune import stats as stats_mod

Log = Callable[[str], Any]
MAX_SKIP = 64
DEFAULT_EMULATION = {"vllm": "vllm-cpu", "trtllm": "trtllm"}
BASELINE = "default (scale 1.0)"


class TuneError(KvcalibError, ValueError):
    """The search cannot run as asked; the message names the option and what to change."""


@dataclass(frozen=True)
class TuneConfig:
    """One `kvcalib tune` run. `base` carries the calibration data settings (samples, seq_len, seed, ...);
    held-out settings mirror `kvcalib eval`'s. `observers` None: every observer (or what `stats` holds)."""
    model: str
    data: str | None
    eval_data: str
    out: Path
    target: str = "vllm"
    emulate: str | None = None
    observers: tuple[str, ...] | None = None
    headrooms: tuple[float, ...] = space.HEADROOMS
    stats: tuple[str, ...] = ()
    stats_out: Path | None = None
    base: Recipe = field(default_factory=Recipe)
    eval_samples: int = 32
    buckets: tuple[int, ...] = (512, 2048)
    pack: bool = True
    min_tokens: int = 16
    batch_size: int = 4
    sensitivity_samples: int | None = None      # held-out samples the per-layer sensitivity runs on (None: all)
    max_skip: int | None = None                 # None: 2 for vLLM, 0 for TensorRT-LLM
    max_kl: float = 0.01
    max_ppl_increase: float = 0.01
    budget_minutes: float | None = None
    chunk: int = 8                              # arms per measuring pass (the reference runs once per pass)
    plots: bool = True
    force: bool = False
    device: str | None = None
    cpu_dtype: str | None = "float32"
    device_map: str | None = None               # as EvalConfig: a model larger than one device
    max_memory: dict[str, str] | None = None
    offload_folder: str | None = None
    trust_remote_code: bool = False
    engine: Any = None                          # calib.engine.driver.EngineSpec: confirm the short list there
    engine_version: str | None = None           # the target's version or build the checkpoint is written for
    confirm: int = 3
    formats: tuple[str, ...] = ()               # the engine's own KV formats, emulated next to the candidates
    fit_buckets: bool = False                   # default buckets: drop those beyond the model's context (given: refuse)

    @property
    def emulation(self) -> str:
        return self.emulate or DEFAULT_EMULATION.get(self.target, emulate.DEFAULT)

    @property
    def skips(self) -> int:
        return (2 if self.target == "vllm" else 0) if self.max_skip is None else self.max_skip

    @property
    def thresholds(self) -> verdict.Thresholds:
        return verdict.Thresholds(max_kl=self.max_kl, max_ppl_increase=self.max_ppl_increase, max_skip=self.skips)

    def eval_config(self) -> EvalConfig:
        return EvalConfig(model=self.model, data=self.eval_data, out=self.out, emulate=self.emulation,
                          buckets=self.buckets, samples=self.eval_samples, min_tokens=self.min_tokens,
                          pack=self.pack, batch_size=self.batch_size, passkey_trials=0, failures=0,
                          thresholds=self.thresholds, device=self.device, cpu_dtype=self.cpu_dtype,
                          device_map=self.device_map, max_memory=self.max_memory,
                          offload_folder=self.offload_folder, trust_remote_code=self.trust_remote_code)


def check(cfg: TuneConfig) -> None:
    """Everything checkable before a model loads, in the order a user fixes them."""
    if cfg.target not in space.TARGETS:
        raise TuneError(f"--target {cfg.target!r}: tune searches the recipes of one engine: "
                        f"{' or '.join(space.TARGETS)}")
    if cfg.observers is not None:
        space.check_observers(cfg.observers)
    space.check_headrooms(cfg.headrooms)
    options.whole("--eval-samples", cfg.eval_samples, 1, options.MAX_COUNT)   # eval's own check names it --samples
    options.evaluation(cfg.eval_config())
    options.whole("--max-skip", cfg.max_skip, 0)
    if cfg.skips > MAX_SKIP:
        raise TuneError(f"--max-skip {cfg.skips}: give 0 to {MAX_SKIP} (and fewer than the model's layers)")
    if cfg.skips and cfg.target == "trtllm":
        raise TuneError(f"--max-skip {cfg.skips} with --target trtllm: TensorRT-LLM applies one KV dtype to every "
                        "layer and cannot skip any; use --max-skip 0")
    options.whole("--sensitivity-samples", cfg.sensitivity_samples, 1, options.MAX_COUNT)
    options.whole("--confirm", cfg.confirm, 1, options.MAX_COUNT)
    options.whole("--chunk", cfg.chunk, 1)
    options.budget(cfg.budget_minutes)
    try:
        emulation = emulate.by_name(cfg.emulation)
    except ValueError as e:
        raise TuneError(f"--emulate: {e}") from None
    if cfg.target == "trtllm" and emulation.name.startswith("vllm"):
        raise TuneError(f"--emulate {emulation.name} with --target trtllm: score TensorRT-LLM candidates with "
                        "--emulate trtllm (or kv-only)")
    if not cfg.stats and not cfg.data:
        raise TuneError("give --data (calibration text) or --stats (statistics of an earlier pass)")
    if cfg.stats and cfg.stats_out:
        raise TuneError("--stats-dir with --stats: the statistics already exist; drop --stats-dir")
    inputs = [("the model folder", cfg.model or None), ("the data", cfg.data), ("the held-out data", cfg.eval_data),
              *(("a statistics input", s) for s in cfg.stats)]
    outputs.check_folder(Path(cfg.out), force=cfg.force, inputs=inputs)
    if cfg.stats_out:
        outputs.check_folder(Path(cfg.stats_out), force=cfg.force, inputs=[*inputs, ("the --out folder", cfg.out)],
                             option="--stats-dir")
        outputs.check_folder(Path(cfg.out), force=cfg.force, inputs=[("the --stats-dir folder", cfg.stats_out)])
    if cfg.data and cfg.eval_data and options.same_file(cfg.data, cfg.eval_data) and \
            not options.same_file(cfg.eval_data, resources.default_data()):
        raise TuneError(f"--eval-data {cfg.eval_data} is the calibration --data {cfg.data}: candidates scored on the "
                        "text they were calibrated on would look better than they are; give held-out text")
    for src in (cfg.data, cfg.eval_data):
        if src:
            data_mod.check_source(src)
    if cfg.model and not cfg.fit_buckets:     # as eval, plan and validate: a given bucket is never dropped unsaid
        check_buckets(cfg.buckets, context.of_directory(cfg.model), cfg.model)
    if cfg.stats:
        stats_mod.stats_files(cfg.stats)


@dataclass
class Search:
    """What the search measured: the reference, every entry by arm name, and the bookkeeping around it."""
    candidates: list[space.Candidate]
    entries: dict[str, ArmMetrics] = field(default_factory=dict)          # measured arm name -> its numbers
    measured_as: dict[str, str] = field(default_factory=dict)              # candidate name -> measured arm name
    ref: Reference | None = None
    sensitivity: dict[int, float] = field(default_factory=dict)
    sensitivity_base: str | None = None
    engine: dict[str, EngineNumbers] = field(default_factory=dict)         # candidate name -> engine entry
    not_scored: list[str] = field(default_factory=list)
    stopped: str | None = None
    passes: int = 0

    def entry(self, name: str) -> ArmMetrics | None:
        """The candidate's numbers: emulated (shared by candidates that store the cache identically), plus
        its own checkpoint's engine numbers where the engine confirmed it."""
        e = self.entries.get(self.measured_as.get(name, name))
        return e if e is None or name not in self.engine else replace(e, engine=self.engine[name])


now = time.perf_counter       # the run's clock (a test sets a fake one)


@dataclass(frozen=True)
class Parts:
    """What tune's plan keeps: the first `arms` measured arms (the default scale 1.0 first), the layer skips,
    the sliding-window skip, and how many candidates the engine confirms."""
    arms: int
    skips: bool
    sliding: bool
    confirm: int


@dataclass(frozen=True)
class Planner:
    """Tune's work in the evaluation's cost model: passes of at most `chunk` arms (the reference once per pass)
    over held-out samples of `lengths` tokens, the engine phase as eval's. `groups`: the candidates (or formats)
    each measured arm scores, in the order measured."""
    cost: plan_mod.Cost
    rates: plan_mod.Rates
    lengths: tuple[int, ...]
    sens: tuple[int, ...]          # the sensitivity samples' lengths
    chunk: int
    layers: int                    # layers whose sensitivity is measured (0: no layer skips)
    skips: int
    engine: bool
    groups: tuple[tuple[str, ...], ...]

    def passes(self, arms: int, lengths: Sequence[int]) -> float:
        return sum(plan_mod.measuring(lengths, min(self.chunk, arms - a), self.cost, self.rates)
                   for a in range(0, arms, self.chunk))

    def phases(self, p: Parts) -> tuple[tuple[str, float], ...]:
        kept, total = (sum(len(g) for g in self.groups[:n]) for n in (p.arms, len(self.groups)))
        return ((f"candidates: {kept} of {total} ({p.arms} measured arm(s) with the default scale 1.0)",
                 self.passes(p.arms, self.lengths)),
                (f"layer skips: sensitivity of {self.layers} layers, skips of 1..{self.skips}",
                 self.passes(self.layers, self.sens) + self.passes(self.skips, self.lengths) if p.skips else 0.0),
                ("the sliding-window skip", self.passes(1, self.lengths) if p.sliding else 0.0),
                (f"engine: {p.confirm} candidate(s), the default scale 1.0 and the reference",
                 plan_mod.engine_seconds(self.lengths, (), p.confirm + 1, p.confirm + 2, self.cost, self.rates)
                 if self.engine and p.confirm else 0.0))

    def fit(self, full: Parts, budget_s: float | None) -> plan_mod.Plan:
        """`full` reduced in the module's order until it fits `budget_s` (None: as asked), the drops named."""
        steps: list[tuple[str, Any]] = []
        if full.skips:
            steps.append((f"layer skips (sensitivity of {self.layers} layers, skips of 1..{self.skips})",
                          lambda p: replace(p, skips=False)))
        if full.sliding:
            steps.append(("the sliding-window skip", lambda p: replace(p, sliding=False)))
        steps += [("", lambda p, n=n: replace(p, confirm=n)) for n in reversed(range(full.confirm))]
        steps += [("", lambda p, k=k: replace(p, arms=k)) for k in reversed(range(full.arms)) if k != 1]
        parts, dropped = (full, []) if budget_s is None else plan_mod.reduce(
            full, steps, lambda p: sum(x for _, x in self.phases(p)), budget_s)
        dropped = [d for d in dropped if d]
        if parts.confirm < full.confirm:
            dropped.append(f"engine confirmation {full.confirm} -> {parts.confirm} candidate(s)")
        gone = [n for g in self.groups[parts.arms:] for n in g]
        if gone:
            dropped.append(f"{len(gone)} candidate(s) not scored: {', '.join(gone)}")
        return plan_mod.Plan(parts, self.phases(parts), tuple(dropped), budget_s)


@dataclass
class Kept:
    """The plan as the search keeps it: a pass starts only when its estimate, scaled up by how far the passes so
    far ran over theirs (never down), ends by `end` (the budget's end less the engine's planned share)."""
    planner: Planner
    plan: plan_mod.Plan
    end: float | None
    estimated: float = 0.0
    measured: float = 0.0

    def need(self, lengths: Sequence[int], arms: int) -> tuple[float, float]:
        """(the plan's estimate of a pass, what it is expected to take now)."""
        est = plan_mod.measuring(lengths, arms, self.planner.cost, self.planner.rates)
        return est, est * max(1.0, self.measured / self.estimated if self.estimated else 1.0)


def _measure(s: Session, arms: Sequence[Any], found: Search, kept: Kept, chunk: int, stage: Any,
             what: str) -> dict[str, ArmMetrics]:
    """Measure `arms` a chunk at a time (the reference once per chunk); stop before a pass that would overrun."""
    out: dict[str, ArmMetrics] = {}
    lengths = [len(x.ids) for x in s.samples]
    # measure's per-batch progress reaches the tune stage as tokens only (its counters are per pass)
    tokens = SimpleNamespace(advance=lambda n=0, labels=None, **_counters: stage.advance(n))
    for a in range(0, len(arms), chunk):
        est, need = kept.need(lengths, len(arms[a:a + chunk]))
        if kept.end is not None and now() + need > kept.end:
            found.stopped = (f"--budget-minutes: {what} stopped before a pass of ~{need:.0f} s that would overrun "
                             f"the plan ({max(0.0, kept.end - now()):.0f} s left)")
            break
        stage.advance(0, labels={"what": what})
        t0 = now()
        ref, res = measure(s, arms[a:a + chunk], stage=tokens)
        kept.estimated, kept.measured = kept.estimated + est, kept.measured + now() - t0
        found.passes += 1 + len(arms[a:a + chunk])
        found.ref = found.ref or ref
        out.update(res)
        stage.advance(0, arms=stage.counters["arms"][0] + len(res))
    return out


def _stats(cfg: TuneConfig, loaded: Any, source: Path, candidates: list[space.Candidate], log: Log) -> Any:
    if cfg.stats:
        return stats_mod.load(cfg.stats, source)
    st = stats_mod.collect(loaded, cfg.data, cfg.base, stats_mod.needed_keys(candidates), cfg.target,
                           str(cfg.model), log)
    if cfg.stats_out:
        stats_mod.save(st, cfg.stats_out, cfg.force)
        st.origin["saved_to"] = str(cfg.stats_out)
        log(f"tune: statistics written to {cfg.stats_out} (reuse them with --stats {cfg.stats_out})")
    return st


def _candidates(cfg: TuneConfig, st: Any = None) -> list[space.Candidate]:
    observers = cfg.observers
    if observers is None and st is not None:      # what the --stats files hold
        have = {sf.recipe.observer for sf in st.files.values()}
        observers = tuple(o for o in space.OBSERVERS if o == "absmax" or o in have)
    cands = space.generate(cfg.target, observers or space.OBSERVERS, cfg.headrooms)
    if st is not None:
        missing = sorted({stats_mod.stats_key(c.observer, c.dtype) for c in cands if not st.has(c)})
        if missing:
            raise TuneError(f"--stats holds no {', '.join(missing)} statistics; drop those observers from "
                            "--observers or record them (tune --data ... --stats-dir DIR)")
    return cands


@dataclass(frozen=True)
class HeldOut:
    """The held-out samples every candidate was scored on, and what the report says about them."""
    samples: tuple[Any, ...]
    buckets: tuple[int, ...]
    info: dict[str, Any]


def search(cfg: TuneConfig, loaded: Any, source: Path, end: float | None, log: Log,
           progress: Progress = SILENT) -> tuple[Search, Any, HeldOut, Kept]:
    """Statistics, candidates, the plan, scores, sensitivity and skips (steps 2-4 above) on a loaded causal LM;
    `end`: when --budget-minutes is spent (`now()`'s time; None: no budget)."""
    emulation = emulate.by_name(cfg.emulation)
    st = _stats(cfg, loaded, source, _candidates(cfg) if not cfg.stats else [], log)
    candidates = _candidates(cfg, st)
    geo = Geometry.of(loaded.config, loaded.attention_layers)
    ecfg = cfg.eval_config()
    vocab = getattr(loaded.config, "vocab_size", None)
    ctx = context.of_loaded(loaded.config, loaded.tokenizer)
    if not cfg.fit_buckets:
        check_buckets(cfg.buckets, ctx, cfg.model)      # again: a hub model's config is read only now
    buckets, dropped = usable_buckets(ecfg.buckets, ctx.tokens if ctx else None)
    if dropped:
        log(f"tune: default buckets {dropped} exceed the model's context ({ctx.tokens} tokens: {ctx.why}): dropped")
    recorded = st.any().provenance
    cal = [("the calibration pass", {"data": dict(recorded.data), "recipe": dict(recorded.recipe)})]
    windows, held_out = calibration_windows(cal, cfg.eval_data, loaded.tokenizer, vocab)
    samples, used, excluded = select_samples(ecfg, loaded.tokenizer, vocab, buckets, windows)
    held = {"source": cfg.eval_data, **used.to_dict(), "held_out": {**held_out, "excluded_samples": excluded},
            "buckets": list(buckets), "dropped_buckets": dropped, "emulation": emulation.describe()}
    found = Search(candidates)
    arms, first = [replace(default_arm(geo, FP8_E4M3), name=BASELINE)], {}
    for c in candidates:
        arm = score.arm_for(c, st.stats_for(c, cfg.base), geo, emulation)
        key = score.arm_key(arm)
        if key in first:
            found.measured_as[c.name] = first[key]
        else:
            first[key] = found.measured_as[c.name] = c.name
            arms.append(arm)
    arms += format_arms(geo, cfg.formats)       # entries under the format's name (calib/tune/output.py `formats`)
    sens_n = min(cfg.sensitivity_samples or len(samples), len(samples))
    n_tok = sum(len(x.ids) for x in samples)
    sens_tok = sum(len(x.ids) for x in samples[:sens_n])
    chunks = math.ceil(len(arms) / cfg.chunk)
    layers = len(geo.layers) if cfg.skips else 0
    plan = (chunks + len(arms) + cfg.skips + math.ceil(cfg.skips / cfg.chunk)) * n_tok \
        + (layers + math.ceil(layers / cfg.chunk)) * sens_tok
    log(f"tune: {len(candidates)} candidates for {cfg.target} ({len(arms) - 1} distinct under emulation "
        f"{emulation.name}) + the default scale 1.0; {len(samples)} held-out samples / {used.tokens} tokens"
        + (f"; sensitivity of {layers} layers on {sens_n} samples, then skips of 1..{cfg.skips}" if layers else ""))
    sliding = sliding_layers(cfg, loaded)
    with fake_quant_kv(loaded.model, emulation) as hook, torch.inference_mode():
        sess, note = open_session(loaded.model, hook, loaded.tokenizer, samples, buckets, cfg.batch_size, 0)
        held["notes"] = [note] if note else []
        kept = _plan(cfg, loaded, sess, arms, found, [len(x.ids) for x in samples], sens_n, layers, sliding, end,
                     log)
        arms = arms[:kept.plan.parts.arms]
        with progress.stage("tune", plan, arms=len(arms) + layers + cfg.skips) as stage:
            # counts measured arms: the candidates (+ the default scale 1.0), one per layer, the skips
            found.entries.update(_measure(sess, arms, found, kept, cfg.chunk, stage, "candidates"))
            if kept.plan.parts.skips and not found.stopped:
                _skips(cfg, found, st, geo, emulation, sess, samples[:sens_n], kept, stage)
            if kept.plan.parts.sliding and not found.stopped:
                _sliding_skip(cfg, found, st, geo, emulation, sess, sliding, kept, stage)
    if kept.plan.dropped and not found.stopped:
        found.stopped = "--budget-minutes: the plan dropped " + "; ".join(kept.plan.dropped)
    found.not_scored = [c.name for c in found.candidates if found.entry(c.name) is None]
    return found, st, HeldOut(tuple(samples), tuple(buckets), held), kept


def _plan(cfg: TuneConfig, loaded: Any, sess: Session, arms: list[Any], found: Search, lengths: Sequence[int],
          sens_n: int, layers: int, sliding: Sequence[int], end: float | None, log: Log) -> Kept:
    """The probe and the plan of the search (fitted to the time left of --budget-minutes), printed before it."""
    cost = plan_mod.Cost.of(loaded.config, sum(t.numel() for t in sess.lm.parameters()))
    rates = probe(sess, arms[1] if len(arms) > 1 else None, cost)
    groups = tuple(tuple(c.name for c in found.candidates if found.measured_as[c.name] == a.name)
                   or ((a.name,) if a.name != BASELINE else ()) for a in arms)
    planner = Planner(cost, rates, tuple(lengths), tuple(lengths[:sens_n]), cfg.chunk, layers, cfg.skips,
                      cfg.engine is not None, groups)
    extra = (cfg.skips if layers else 0) + (1 if sliding else 0)       # the skip candidates the search adds
    confirm = min(cfg.confirm, len(found.candidates) + extra) if cfg.engine is not None else 0
    budget = None if end is None else max(0.0, end - now())
    planned = planner.fit(Parts(len(arms), bool(layers), bool(sliding), confirm), budget)
    title = "tune plan" if budget is None else \
        f"tune plan of the {duration(budget)} --budget-minutes leaves after loading and statistics"
    for line in planned.lines(rates, title):
        log(line)
    return Kept(planner, planned, None if end is None else end - planned.phases[-1][1])


def _skips(cfg: TuneConfig, found: Search, st: Any, geo: Geometry, emulation: Any, sess: Session,
           sens_samples: Sequence[Any], kept: Kept, stage: Any) -> None:
    """Per-layer sensitivity of the best full candidate, then it with the top 1..max_skip layers skipped."""
    base = _best(found, [c for c in found.candidates if found.entry(c.name) is not None])
    if base is None:
        return
    found.sensitivity_base = base.name
    base_arm = score.arm_for(base, st.stats_for(base, cfg.base), geo, emulation)
    sub = replace(sess, samples=tuple(sens_samples))
    res = _measure(sub, [score.only_layer(base_arm, i) for i in geo.layers], found, kept, cfg.chunk, stage,
                   "sensitivity")
    if len(res) < len(geo.layers):
        return
    found.sensitivity = {i: res[f"only layer {i}"].summary.kl for i in geo.layers}
    top = ranking(found.sensitivity)
    skipped = [base.skipping(top[:k]) for k in range(1, cfg.skips + 1)]
    found.candidates += skipped
    arms = [score.arm_for(c, st.stats_for(c, cfg.base), geo, emulation) for c in skipped]
    found.measured_as.update((c.name, c.name) for c in skipped)
    found.entries.update(_measure(sess, arms, found, kept, cfg.chunk, stage, "layer skips"))


def sliding_layers(cfg: TuneConfig, loaded: Any) -> tuple[int, ...]:
    """The sliding-window layers of a hybrid model (calib.model.layer_kinds), for a target that can keep them at
    the model dtype (vLLM); () otherwise. Inconsistent layer kinds are a TuneError naming the field."""
    from calib.model import layer_kinds
    from calib.model.geometry import GeometryError

    if cfg.target != "vllm":
        return ()
    with readers.raising(TuneError, GeometryError):
        sliding = layer_kinds.layer_kinds(loaded.config, "MODEL config.json").sliding
    return sliding if len(sliding) < len(loaded.attention_layers) else ()


def _sliding_skip(cfg: TuneConfig, found: Search, st: Any, geo: Geometry, emulation: Any, sess: Session,
                  sliding: Sequence[int], kept: Kept, stage: Any) -> None:
    """The best full candidate with the sliding-window layers kept at the model dtype (a hybrid model's standard
    experiment: vLLM serves it with --kv-cache-dtype-skip-layers sliding_window), measured on every sample."""
    base = _best(found, [c for c in found.candidates if found.entry(c.name) is not None and not c.skip])
    cand = base.skipping(sliding) if sliding and base is not None else None
    if cand is None or cand.name in found.measured_as:
        return
    found.candidates.append(cand)
    found.measured_as[cand.name] = cand.name
    arm = score.arm_for(cand, st.stats_for(cand, cfg.base), geo, emulation)
    found.entries.update(_measure(sess, [arm], found, kept, cfg.chunk, stage, "sliding-window skip"))


def _best(found: Search, full: list[space.Candidate]) -> space.Candidate | None:
    """The best scored candidate: the lowest KL, then the broadest support, then the simplest recipe."""
    return min(full, key=lambda c: (found.entry(c.name).summary.kl, -c.breadth(), c.simplicity()), default=None)


def ranking(sensitivity: dict[int, float]) -> list[int]:
    """Layers, most sensitive first (ties: lower index first)."""
    return sorted(sensitivity, key=lambda i: (-sensitivity[i], i))
