"""Evaluation: how far does an FP8 (or INT8) KV cache with given scales drift from the model's own dtype?

The K/V are fake-quantised where the engine's cache would store them (`calib/fakequant.py` says why there
and defines the arms); this module runs the evaluation around that hook: held-out data, length buckets,
the measuring passes, passkey retrieval, skip trials and the report.

Arms are compared in one pass over held-out samples: for each batch the reference (no quantisation)
runs once, then every arm; nothing but per-bucket sums is kept, so memory does not grow with the data.
Logits are formed from the final hidden states a chunk of positions at a time, so no [seq, vocab]
tensor of a whole batch ever exists (checked once against the model's own forward; models whose head
does more fall back to full logits). Report and verdict: `calib/report.py`.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import data as data_mod
from . import emulate
from . import model as model_mod
from . import observe, options, outputs, passkey, report
from .progress import SILENT, Progress, Stage
from .ckpt.kvinfo import read_kv_info
from .fakequant import (  # noqa: F401  (re-exported: part of this module's API)
    TOKEN, Arm, EvalError, FakeQuantKV, Geometry, Meter, arms_for, cache_codes, checkpoint_arms, default_arm, fake_quant_kv,
    fake_quant_terms, read_stats, reference_arm, stats_arms)

OVERLAP_WINDOW = 16        # tokens compared to recognise a calibration sample among the eval samples
FAILURE_CONTEXT = 24       # tokens of text shown before a failure position
Log = Callable[[str], Any]


@dataclass(frozen=True)
class EvalConfig:
    """One `kvcalib eval` run. `scales`: checkpoint directories (any tool's layout); `stats`: a kvcalib
    statistics-only output (directory or its stats.safetensors) for per-tensor/head/channel/token arms.
    `emulate`: whose FP8 arithmetic the quantised arms follow (`calib/emulate.py`; default vLLM's CPU build)."""
    model: str
    data: str
    out: Path
    scales: tuple[str, ...] = ()
    stats: str | None = None
    dtype: str = "fp8_e4m3"
    emulate: str = emulate.DEFAULT
    buckets: tuple[int, ...] = (512, 2048, 8192)
    samples: int = 64
    min_tokens: int = 16
    pack: bool = False                # concatenate records into samples that fill every bucket
    batch_size: int = 4
    seed: int = 0
    passkey_trials: int = 1           # prompts per depth per bucket; 0 turns passkey off
    failures: int = 3                 # worst samples (by KL) kept per arm
    plots: bool = True
    thresholds: report.Thresholds = field(default_factory=report.Thresholds)
    device: str | None = None
    cpu_dtype: str | None = "float32"  # model dtype on CPU (model.Placement; None: the checkpoint's own)
    trust_remote_code: bool = False
    force: bool = False
    engine: Any = None                # calib.engine.driver.EngineSpec: also measure every arm in that engine


# ------------------------------------------------------------------------------------------- logits

class _Head:
    """Next-token log-probabilities from final hidden states, a chunk of positions at a time."""

    def __init__(self, lm: torch.nn.Module) -> None:
        cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        self.lm, self.full = lm, False
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.multiply = getattr(cfg, "logit_scale", None)       # Cohere
        self.divide = getattr(cfg, "logits_scaling", None)       # Granite
        self.rows = max(1, 2 ** 24 // int(cfg.vocab_size))

    def features(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.full:
            return self.lm(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return self.lm.base_model(input_ids=ids, attention_mask=mask, use_cache=False)[0]

    def log_probs(self, h: torch.Tensor) -> torch.Tensor:
        z = h.float() if self.full else self.lm.get_output_embeddings()(h).float()
        if not self.full:
            z = z * self.multiply if self.multiply else z
            z = z / self.divide if self.divide else z
            z = torch.tanh(z / self.softcap) * self.softcap if self.softcap else z
        return torch.log_softmax(z, dim=-1)

    def verify(self, ids: Sequence[int]) -> str | None:
        """Compare with the model's own logits once; fall back to full logits on a mismatch."""
        x = torch.tensor([list(ids[:32])], device=next(self.lm.parameters()).device)
        want = torch.log_softmax(self.lm(input_ids=x, use_cache=False).logits.float(), dim=-1)
        if torch.allclose(self.log_probs(self.features(x, None)), want, rtol=1e-3, atol=1e-3):
            return None
        self.full = True
        return "the model's head does more than a linear layer here: logits are computed in full per batch"


# ------------------------------------------------------------------------------------------- samples

@dataclass(frozen=True)
class Sample:
    index: int
    ids: tuple[int, ...]
    bucket: int          # the smallest bucket (token length) >= len(ids)


def usable_buckets(requested: Iterable[int], max_positions: int | None) -> tuple[tuple[int, ...], list[int]]:
    """(buckets within the model's context, dropped ones); the context itself when none fits."""
    req = sorted(set(int(b) for b in requested))
    if any(b < 2 for b in req):
        raise EvalError(f"buckets {req}: every bucket must be at least 2 tokens")
    kept = [b for b in req if not max_positions or b <= max_positions]
    return tuple(kept or [int(max_positions)]), [b for b in req if b not in kept]


def _same_source(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.resolve() == pb.resolve() if pa.exists() and pb.exists() else a == b


def calibration_windows(provenances: Sequence[tuple[str, dict | None]], data_src: str, tokenizer: Any,
                        vocab: int | None) -> tuple[set[int] | None, dict[str, Any]]:
    """Hashes of every OVERLAP_WINDOW-token window of the calibration samples of the first kvcalib output
    that calibrated on `data_src` (its recipe replays the same deterministic stream), and what was found."""
    for where, prov in provenances:
        src, recipe = (prov or {}).get("data", {}).get("source"), (prov or {}).get("recipe")
        if not src or not recipe or not _same_source(str(src), data_src):
            continue
        rep = data_mod.DataReport()
        seqs = list(data_mod.samples(src, tokenizer, seq_len=recipe["seq_len"], max_samples=recipe["samples"],
                                     min_tokens=recipe["min_tokens"], pack=recipe["pack"], seed=recipe["seed"],
                                     vocab_size=vocab, report=rep))
        flat = [t for s in seqs for t in s]
        windows = {hash(tuple(flat[i:i + OVERLAP_WINDOW])) for i in range(len(flat) - OVERLAP_WINDOW + 1)}
        exact = f"sha256:{rep.fingerprint}" == prov["data"].get("fingerprint")
        return windows, {"checked_against": where, "calibration_samples": len(seqs), "reproduced_exactly": exact}
    return None, {"checked_against": None, "note": "no kvcalib output calibrated on this DATA was given: eval "
                  "samples are not checked against calibration samples"}


def select_samples(cfg: EvalConfig, tokenizer: Any, vocab: int | None, buckets: Sequence[int],
                   windows: set[int] | None) -> tuple[list[Sample], data_mod.DataReport, int]:
    """Held-out samples (records whose first tokens appear in the calibration stream are left out), cut to the
    largest bucket or, with `pack`, concatenated into samples cycling through every bucket's length."""
    read = data_mod.DataReport()
    stream = data_mod.samples(cfg.data, tokenizer, seq_len=2 ** 31 if cfg.pack else max(buckets), max_samples=2 ** 31,
                              min_tokens=cfg.min_tokens, pack=False, seed=cfg.seed, vocab_size=vocab, report=read)
    excluded = 0

    def held_out() -> Iterator[list[int]]:
        nonlocal excluded
        for ids in stream:
            if windows and len(ids) >= OVERLAP_WINDOW and hash(tuple(ids[:OVERLAP_WINDOW])) in windows:
                excluded += 1
                continue
            yield ids

    seqs: Iterator[list[int]] = held_out()
    if cfg.pack:
        seqs = _pack(seqs, buckets)
    used, out = data_mod.DataReport(), []
    with model_mod.quiet_transformers():      # packing tokenizes whole records, beyond the model's length on purpose
        for ids in itertools.islice(seqs, cfg.samples):
            used.add(ids)
            out.append(Sample(len(out), tuple(ids), next(b for b in sorted(buckets) if b >= len(ids))))
    used.column, used.skipped_short = read.column, read.skipped_short
    if not out:
        raise EvalError(f"DATA {cfg.data}: no held-out samples left ({excluded} were calibration samples)")
    return out, used, excluded


def _pack(seqs: Iterable[list[int]], lengths: Sequence[int]) -> Iterator[list[int]]:
    buf: list[int] = []
    cycle = itertools.cycle(sorted(lengths))
    want = next(cycle)
    for s in seqs:
        buf.extend(s)
        while len(buf) >= want:
            yield buf[:want]
            buf, want = buf[want:], next(cycle)


# ------------------------------------------------------------------------------------------- measuring

@dataclass(frozen=True)
class Session:
    """Everything a measuring pass needs; the hook stays installed for the whole evaluation."""
    lm: torch.nn.Module
    hook: FakeQuantKV
    head: _Head
    tokenizer: Any
    samples: tuple[Sample, ...]
    buckets: tuple[int, ...]
    batch_size: int = 4
    pad_id: int = 0
    failures: int = 3

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device


def open_session(lm: torch.nn.Module, hook: FakeQuantKV, tokenizer: Any, samples: Sequence[Sample],
                 buckets: Sequence[int], batch_size: int = 4, failures: int = 3) -> tuple[Session, str | None]:
    """A measuring session inside `fake_quant_kv(lm)` (the LM head checked once against the model's own
    logits) and the note when it had to fall back to full logits."""
    head = _Head(lm)
    note = head.verify(samples[0].ids)
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    return Session(lm, hook, head, tokenizer, tuple(samples), tuple(buckets), batch_size, pad, failures), note


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _chunked(head: _Head, h_ref: torch.Tensor, h_arm: torch.Tensor | None, tgt: torch.Tensor) -> list[torch.Tensor]:
    """Reference only: [nll, top1]; with an arm: [kl(ref || arm), top1 agrees, nll, arm top1]."""
    parts = []
    for a in range(0, tgt.numel(), head.rows):
        sl = slice(a, a + head.rows)
        lr = head.log_probs(h_ref[sl])
        if h_arm is None:
            parts.append((-lr.gather(-1, tgt[sl, None])[:, 0], lr.argmax(-1)))
            continue
        la = head.log_probs(h_arm[sl])
        top = la.argmax(-1)
        parts.append(((lr.exp() * (lr - la)).sum(-1).clamp_min(0), top == lr.argmax(-1),
                      -la.gather(-1, tgt[sl, None])[:, 0], top))
    return [torch.cat(p) for p in zip(*parts)]


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids)) if tokenizer is not None else " ".join(map(str, ids))


class _Acc:
    """Running sums of one arm: per bucket [tokens, KL, top-1 agreements, NLL], per layer (Meter), the worst samples."""

    def __init__(self, buckets: int, device: torch.device, samples: int = 0) -> None:
        self.sums = torch.zeros(4, buckets, dtype=torch.float64, device=device)
        self.sample_nll = torch.zeros(samples, dtype=torch.float64, device=device)   # per sample (noise estimates)
        self.sample_kl = torch.zeros(samples, dtype=torch.float64, device=device)
        self.meter, self.worst, self.seconds = Meter(), [], 0.0

    def track(self, s: Session, group: Sequence[Sample], valid: torch.Tensor, kl: torch.Tensor,
              ref_top: torch.Tensor, arm_top: torch.Tensor) -> None:
        if s.failures <= 0:
            return
        dense = torch.zeros(valid.shape, dtype=kl.dtype, device=kl.device).masked_scatter_(valid, kl)
        counts = valid.sum(1).tolist()
        means = (dense.sum(1) / valid.sum(1).clamp_min(1)).tolist()
        tops = [torch.zeros(valid.shape, dtype=torch.long, device=kl.device).masked_scatter_(valid, t)
                for t in (ref_top, arm_top)]
        for r, sample in enumerate(group):
            floor = self.worst[-1]["mean_kl"] if len(self.worst) >= s.failures else -1.0
            if counts[r] == 0 or means[r] <= floor:
                continue
            worst = dense[r].topk(min(2, counts[r])).indices.tolist()
            ids = sample.ids
            self.worst.append({"sample": sample.index, "tokens": len(ids), "bucket": sample.bucket, "mean_kl": means[r],
                               "positions": [{"position": p, "kl": float(dense[r, p]),
                                              "context": _decode(s.tokenizer, ids[max(0, p - FAILURE_CONTEXT):p + 1]),
                                              "next": _decode(s.tokenizer, ids[p + 1:p + 2]),
                                              "reference_predicts": _decode(s.tokenizer, [int(tops[0][r, p])]),
                                              "arm_predicts": _decode(s.tokenizer, [int(tops[1][r, p])])}
                                             for p in worst]})
            self.worst.sort(key=lambda w: -w["mean_kl"])
            del self.worst[s.failures:]


def _bucket_table(s: Session, sums: torch.Tensor, ref_nll: torch.Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per bucket and overall: tokens, KL, top-1 agreement, perplexity and its change against the reference."""
    def row(t, kl, agree, nll, rnll, n_samples):
        t = max(t, 1e-300)
        ppl, ppl_ref = math.exp(nll / t), math.exp(rnll / t)
        return {"samples": n_samples, "tokens": int(t), "kl": kl / t, "top1": agree / t, "ppl": ppl,
                "ppl_ref": ppl_ref, "ppl_delta": ppl - ppl_ref, "ppl_rel": ppl / ppl_ref - 1}
    per = sums.tolist()
    counts = [sum(1 for x in s.samples if x.bucket == b) for b in s.buckets]
    table = {str(b): row(per[0][j], per[1][j], per[2][j], per[3][j], float(ref_nll[j]), counts[j])
             for j, b in enumerate(s.buckets) if per[0][j] > 0}
    total = row(*(sum(x) for x in per), float(ref_nll.sum()), len(s.samples))
    total["max_bucket_kl"] = max(r["kl"] for r in table.values())
    return table, total


def measure(s: Session, arms: Sequence[Arm], ranges: bool = False,
            stage: Stage | None = None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """One pass over the samples: per batch the reference once, then every arm. Returns (reference entry,
    {arm name: entry}) with per-bucket, overall, per-layer numbers, the worst samples and the seconds spent.
    `stage` (optional) is advanced after every forward pass: tokens, samples done, arms done in the batch."""
    from .batching import pad

    dev, nb = s.device, len(s.buckets)
    arms = [a.to(dev) for a in arms]
    accs = {a.name: _Acc(nb, dev, len(s.samples)) for a in arms}
    ref_sums = torch.zeros(2, nb, dtype=torch.float64, device=dev)      # tokens, nll
    ref_sample_nll = torch.zeros(len(s.samples), dtype=torch.float64, device=dev)
    recorded: dict[int, tuple[observe.AbsMaxObserver, observe.AbsMaxObserver]] = {}
    ref_seconds = 0.0
    order = sorted(s.samples, key=lambda x: len(x.ids))
    groups = [order[i:i + s.batch_size] for i in range(0, len(order), s.batch_size)]
    done = 0
    for group in groups:
        t0 = _clock(dev)
        n_tok, label = sum(len(x.ids) for x in group), {"bucket": f"bucket <= {group[-1].bucket}"}
        ids, mask = pad([list(x.ids) for x in group], s.pad_id)
        ids, mask = ids.to(dev), mask.to(dev)
        valid = (mask[:, 1:] * mask[:, :-1]).bool()
        rows = valid.nonzero()[:, 0]
        where = torch.tensor([s.buckets.index(x.bucket) for x in group], device=dev)[rows]
        which = torch.tensor([x.index for x in group], device=dev)[rows]
        tgt = ids[:, 1:][valid]
        s.hook.arm, s.hook.meter, s.hook.token_mask = None, None, mask.bool()
        s.hook.ranges = recorded if ranges else None
        h_ref = s.head.features(ids, mask)[:, :-1][valid]
        s.hook.ranges = None
        ref_nll, ref_top = _chunked(s.head, h_ref, None, tgt)
        ref_sums.index_add_(1, where, torch.stack([torch.ones_like(ref_nll), ref_nll]).double())
        ref_sample_nll.index_add_(0, which, ref_nll.double())
        ref_seconds += _clock(dev) - t0
        if stage is not None:
            stage.advance(n_tok, label, samples=done, arms=1)
        for j, arm in enumerate(arms):
            t0, acc = _clock(dev), accs[arm.name]
            s.hook.arm, s.hook.meter = arm, acc.meter
            kl, agree, nll, top = _chunked(s.head, h_ref, s.head.features(ids, mask)[:, :-1][valid], tgt)
            acc.sums.index_add_(1, where, torch.stack([torch.ones_like(kl), kl, agree.to(kl.dtype), nll]).double())
            acc.sample_nll.index_add_(0, which, nll.double())
            acc.sample_kl.index_add_(0, which, kl.double())
            acc.track(s, group, valid, kl, ref_top, top)
            acc.seconds += _clock(dev) - t0
            if stage is not None:
                stage.advance(n_tok, label, samples=done + (len(group) if j == len(arms) - 1 else 0), arms=j + 2)
        done += len(group)
    s.hook.arm = s.hook.meter = s.hook.token_mask = None
    zero = torch.zeros_like(ref_sums[0])   # the reference against itself: KL 0, top-1 agreement 1
    ref_table, ref_total = _bucket_table(s, torch.stack([ref_sums[0], zero, ref_sums[0], ref_sums[1]]), ref_sums[1])
    ref = {"buckets": ref_table, "summary": ref_total, "seconds": {"metrics": ref_seconds},
           "sample_nll": ref_sample_nll.tolist(), "sample_tokens": [len(x.ids) - 1 for x in s.samples],
           "ranges": {str(i): {"k_amax": o[0].amax().tolist(), "v_amax": o[1].amax().tolist()}
                      for i, o in sorted(recorded.items())}}
    out = {}
    for arm in arms:
        acc = accs[arm.name]
        table, total = _bucket_table(s, acc.sums, ref_sums[1])
        out[arm.name] = {**arm.describe(), "buckets": table, "summary": total, "sample_nll": acc.sample_nll.tolist(),
                         "sample_kl": acc.sample_kl.tolist(),
                         "layers": acc.meter.read(),
                         "failures": acc.worst, "seconds": {"metrics": acc.seconds}}
    return ref, out


def run_passkey(s: Session, arm: Arm | None, prompts: Sequence[passkey.Prompt],
                stage: Stage | None = None) -> tuple[dict[str, Any], float]:
    """Passkey accuracy per bucket under `arm` (None: the reference) and the seconds it took; `stage` is
    advanced after every prompt."""
    t0 = _clock(s.device)
    s.hook.arm, s.hook.meter, s.hook.token_mask = (arm.to(s.device) if arm else None), None, None
    on_done = None if stage is None else (lambda p: stage.advance(len(p.ids) + passkey.MAX_NEW_TOKENS,
                                                                 prompts=stage.counters["prompts"][0] + 1))
    try:
        outcomes = passkey.run(s.lm, s.tokenizer, prompts, on_done=on_done)
    finally:
        s.hook.arm = None
    return passkey.summarize(outcomes), _clock(s.device) - t0


# ------------------------------------------------------------------------------------------- the run

def load_causal_lm(source: str, device: str | None = None, trust_remote_code: bool = False,
                   cpu_dtype: str | None = "float32") -> model_mod.LoadedModel:
    """`model.load` with the LM head: evaluation needs logits. `LoadedModel.model` is the causal LM."""
    return model_mod.load(source, placement=model_mod.Placement(device=device, cpu_dtype=cpu_dtype),
                          trust_remote_code=trust_remote_code, lm_head=True)


@dataclass(frozen=True)
class EvalResult:
    out: Path
    verdict: dict[str, Any]
    report: dict[str, Any]
    seconds: float


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


def check_eval(cfg: EvalConfig) -> None:
    """Everything checkable before the model loads: options, the report folder (never an input, never a
    folder of someone else's files), the data source."""
    options.evaluation(cfg)
    inputs = [("the model folder", cfg.model), ("the data", cfg.data), ("the statistics output", cfg.stats),
              *(("a --scales checkpoint", p) for p in cfg.scales)]
    outputs.check_folder(Path(cfg.out), force=cfg.force, inputs=inputs)
    outputs.check_room(Path(cfg.out))
    try:
        emulate.by_name(cfg.emulate)
    except ValueError as e:
        raise EvalError(f"--emulate: {e}") from None
    data_mod.check_source(cfg.data)


def run_eval(cfg: EvalConfig, log: Log = lambda _m: None, progress: Progress = SILENT) -> EvalResult:
    """Evaluate every arm against the reference on held-out samples and write the report to `cfg.out`;
    `progress` receives a stage per measuring pass (calib/progress.py). Checks first, then the report
    folder's lock (a second run into it refuses), then the work."""
    t_start = time.perf_counter()
    check_eval(cfg)
    with outputs.lock(Path(cfg.out)):
        check_eval(cfg)          # again under the lock: taking it may have put back an output a killed run moved aside
        return _run_eval(cfg, log, progress, t_start)


def _run_eval(cfg: EvalConfig, log: Log, progress: Progress, t_start: float) -> EvalResult:
    emulation = emulate.by_name(cfg.emulate)     # checked by check_eval
    engine_version = _engine_check(cfg)
    loaded = load_causal_lm(cfg.model, cfg.device, cfg.trust_remote_code, cfg.cpu_dtype)
    lm, tok, config = loaded.model, loaded.tokenizer, loaded.config
    geo = Geometry.of(config, loaded.attention_layers)
    arms = arms_for(geo, cfg.dtype, cfg.scales, cfg.stats, emulation.per_head_kv)
    vocab = getattr(config, "vocab_size", None)
    buckets, dropped = usable_buckets(cfg.buckets, getattr(config, "max_position_embeddings", None))
    notes = [f"buckets {dropped} exceed the model's context ({config.max_position_embeddings} tokens): dropped"] if dropped else []
    windows, held_out = calibration_windows(_provenances(cfg), cfg.data, tok, vocab)
    samples, used, excluded = select_samples(cfg, tok, vocab, buckets, windows)
    held_out["excluded_samples"] = excluded
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
    ref_arm = reference_arm(loaded.dtype)
    log(f"eval: emulating {emulation.line()}")
    with fake_quant_kv(lm, emulation) as hook, torch.inference_mode():
        s, note = open_session(lm, hook, tok, samples, buckets, cfg.batch_size, cfg.failures)
        notes += [note] if note else []
        with _metrics_stage(progress, "emulation", samples, len(arms) + 1) as stage:
            ref, results = measure(s, arms, ranges=True, stage=stage)
        by_name_ = {a.name: a for a in arms}
        if prompts:
            with _passkey_stage(progress, "emulation passkey", prompts, len(arms) + 1) as stage:
                stage.labels = {"arm": f"arm 1/{len(arms) + 1}"}
                ref["passkey"], ref["seconds"]["passkey"] = run_passkey(s, None, prompts, stage)
                for j, a in enumerate(arms):
                    stage.labels = {"arm": f"arm {j + 2}/{len(arms) + 1}"}
                    results[a.name]["passkey"], results[a.name]["seconds"]["passkey"] = run_passkey(s, a, prompts, stage)
        engine = None
        if cfg.engine is not None:
            from .engine.run import EngineRun

            engine = EngineRun(cfg.engine, engine_version, str(cfg.model), str(loaded.dtype).removeprefix("torch."),
                               samples, buckets, prompts, tok, getattr(config, "max_position_embeddings", None),
                               progress)
            for name, entry in engine.measure(ref_arm, arms).items():
                (ref if name == ref_arm.name else results[name])["engine"] = entry
        for name, layers in report.skip_plan(ref, results, cfg.thresholds):
            for k in range(1, len(layers) + 1):      # smallest prefix of the dominant layers that passes
                trial = by_name_[name].skipping(layers[:k])
                log(f"eval: measuring {trial.name}")
                with _metrics_stage(progress, f"emulation `{trial.name}`", samples, 2) as stage:
                    _, r = measure(s, [trial], stage=stage)
                if prompts:
                    with _passkey_stage(progress, f"emulation passkey `{trial.name}`", prompts, 1) as stage:
                        r[trial.name]["passkey"], r[trial.name]["seconds"]["passkey"] = run_passkey(s, trial, prompts,
                                                                                                      stage)
                if engine is not None:
                    r[trial.name]["engine"] = engine.measure(ref_arm, [trial])[trial.name]
                results.update(r)
                if not report.failures(r[trial.name], ref, cfg.thresholds):
                    break
    meta = {"model": str(cfg.model), "model_dtype": str(loaded.dtype).removeprefix("torch."),
            "device": str(loaded.device), "layers": list(geo.layers), "kv_heads": geo.kv_heads,
            "head_dim": geo.head_dim, "data": {"source": str(cfg.data), **used.to_dict(), "held_out": held_out},
            "buckets": list(buckets), "config": _config_dict(cfg), "notes": notes, "reference": ref_arm.name,
            "emulation": emulation.describe(),
            "seconds": time.perf_counter() - t_start}
    if cfg.engine is not None:
        meta["engine"] = {"name": cfg.engine.name, "version": engine_version, "top_k": cfg.engine.top_k,
                          "kv_gib": cfg.engine.kv_gib, "continuation_tokens": cfg.engine.continuation_tokens}
    doc = report.document(meta, ref, results, cfg.thresholds)
    report.write(Path(cfg.out), doc, force=cfg.force, plots=cfg.plots)
    return EvalResult(Path(cfg.out), doc["verdict"], doc, time.perf_counter() - t_start)


def _metrics_stage(progress: Progress, name: str, samples: Sequence[Sample], passes: int) -> Stage:
    """A stage of `passes` forward passes (reference + arms) over every sample."""
    return progress.stage(name, passes * sum(len(x.ids) for x in samples), samples=len(samples), arms=passes)


def _passkey_stage(progress: Progress, name: str, prompts: Sequence[passkey.Prompt], arms: int) -> Stage:
    """A stage of every passkey prompt under `arms` arms (prompt tokens plus the generated ones)."""
    per_arm = sum(len(p.ids) + passkey.MAX_NEW_TOKENS for p in prompts)
    return progress.stage(name, arms * per_arm, prompts=arms * len(prompts))


def _engine_check(cfg: EvalConfig) -> str | None:
    """The engine's version, checked before any long work; an unusable engine is an EvalError (one line)."""
    if cfg.engine is None:
        return None
    from .engine import driver

    try:
        return driver.check(cfg.engine)
    except driver.EngineError as e:
        raise EvalError(str(e)) from None


def _config_dict(cfg: EvalConfig) -> dict[str, Any]:
    d = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
    if cfg.engine is not None:
        d["engine"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(cfg.engine).items()}
    d.update(out=str(cfg.out), scales=list(cfg.scales), buckets=list(cfg.buckets), thresholds=cfg.thresholds.to_dict())
    return d
