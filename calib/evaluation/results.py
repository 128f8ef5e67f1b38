"""The evaluation's results as typed values: what `measure` returns, what the verdict reads, what report.json holds.

Why typed: the same numbers are read by the verdict (calib/evaluation/verdict.py), the capacity rule and
`kvcalib tune`; a named field makes a misspelt or missing number an error where it is read. `to_dict` gives
report.json's form: its keys and their order are the file format (tests/evaluation/test_run.py pins them). The
engine's own numbers (`engine`) are typed where the engine returns them (calib.engine.metrics.EngineNumbers), in
the same rows (BucketRow, Summary); `calib.evaluation.numbers.decisive` picks the engine's or the emulation's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from calib.engine.metrics import BucketRow, EngineNumbers, Summary


def bucket_of(length: int, buckets: Iterable[int]) -> int:
    """A sample's bucket, the `b` of every "bucket <= b" row: the smallest bucket >= its length in tokens
    (samples are cut to the largest)."""
    return min(b for b in buckets if b >= length)


def table(rows: Mapping[str, BucketRow]) -> dict[str, dict[str, Any]]:
    return {b: r.to_dict() for b, r in rows.items()}


@dataclass(frozen=True)
class Count:
    correct: int
    total: int


@dataclass(frozen=True)
class PasskeyRow:
    """Passkey retrieval in one bucket: answers correct of prompts, overall and per needle depth."""
    correct: int
    total: int
    by_depth: Mapping[str, Count]
    accuracy: float
    outcomes: tuple[tuple[float, bool], ...] = ()     # (depth, correct) per prompt, in prompt order

    def to_dict(self) -> dict[str, Any]:
        return {"correct": self.correct, "total": self.total,
                "by_depth": {d: asdict(c) for d, c in self.by_depth.items()}, "accuracy": self.accuracy,
                "outcomes": [{"depth": d, "correct": c} for d, c in self.outcomes]}


def passkey_rows(summary: Mapping[str, Mapping[str, Any]]) -> dict[str, PasskeyRow]:
    """`calib.evaluation.passkey.summarize`'s table as typed rows."""
    return {b: PasskeyRow(r["correct"], r["total"], {d: Count(c["correct"], c["total"]) for d, c in r["by_depth"].items()},
                          r["accuracy"], tuple((float(o["depth"]), bool(o["correct"])) for o in r.get("outcomes", ())))
            for b, r in summary.items()}


def passkey_correct(rows: Mapping[str, PasskeyRow] | None) -> tuple[int, int] | None:
    """(correct, total) over every bucket (the emulation's rows or the engine's); None when not run."""
    return (sum(r.correct for r in rows.values()), sum(r.total for r in rows.values())) if rows else None


@dataclass(frozen=True)
class Seconds:
    metrics: float
    passkey: float | None = None

    def to_dict(self) -> dict[str, float]:
        return {"metrics": self.metrics, **({} if self.passkey is None else {"passkey": self.passkey})}

    @property
    def total(self) -> float:
        return sum(self.to_dict().values())


@dataclass(frozen=True)
class Position:
    """One scored position of a failure sample: its KL, the text before it and what each side predicted."""
    position: int
    kl: float
    context: str
    next: str
    reference_predicts: str
    arm_predicts: str


@dataclass(frozen=True)
class Failure:
    """One of an arm's worst samples (largest mean KL) and its two worst positions."""
    sample: int
    tokens: int
    bucket: int
    mean_kl: float
    positions: tuple[Position, ...]

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "positions"},
                "positions": [asdict(p) for p in self.positions]}


@dataclass(frozen=True)
class ArmInfo:
    """What an arm is, as the report and the advice name it (`Arm.info()`): kind, KV dtype, granularity,
    whether an engine serves it, where its scales came from, the layers it leaves unquantised, its scales
    (max over heads) per layer."""
    kind: str
    dtype: str | None
    granularity: str
    shippable: bool
    source: str | None
    skip: tuple[int, ...]
    serve_skip: tuple[int, ...]
    notes: tuple[str, ...]
    scales: Mapping[str, Mapping[str, float | None]]
    skip_kind: str | None = None      # the skip names a layer kind ("sliding_window"), served by that name

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "dtype": self.dtype, "granularity": self.granularity, "shippable": self.shippable,
                "source": self.source, "skip": list(self.skip), "serve_skip": list(self.serve_skip),
                "notes": list(self.notes), "scales": {k: dict(v) for k, v in self.scales.items()},
                **({"skip_kind": self.skip_kind} if self.skip_kind else {})}


@dataclass(frozen=True)
class KVRange:
    """Per KV head max |K| and |V| of one layer over the reference pass."""
    k_amax: tuple[float, ...]
    v_amax: tuple[float, ...]


@dataclass(frozen=True)
class Reference:
    """The reference pass (model-dtype KV): per-bucket and overall NLL, per-sample NLL and token counts (the
    noise estimates pair arms by sample), the K/V ranges, passkey, and the engine's run of it."""
    buckets: Mapping[str, BucketRow]
    summary: Summary
    seconds: Seconds
    sample_nll: tuple[float, ...]
    sample_tokens: tuple[int, ...]
    ranges: Mapping[str, KVRange]
    passkey: Mapping[str, PasskeyRow] | None = None
    engine: EngineNumbers | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"buckets": table(self.buckets), "summary": self.summary.to_dict(), "seconds": self.seconds.to_dict(),
               "sample_nll": list(self.sample_nll), "sample_tokens": list(self.sample_tokens),
               "ranges": {i: {"k_amax": list(r.k_amax), "v_amax": list(r.v_amax)} for i, r in self.ranges.items()}}
        return _extras(out, self)


@dataclass(frozen=True)
class ArmMetrics:
    """One arm's emulated numbers against the reference: per bucket and overall, per sample, per layer
    (`fakequant.Meter` rows), its worst samples, the seconds spent; passkey and the engine's entry when run."""
    info: ArmInfo
    buckets: Mapping[str, BucketRow]
    summary: Summary
    sample_nll: tuple[float, ...]
    sample_kl: tuple[float, ...]
    layers: Mapping[str, Mapping[str, float]]
    failures: tuple[Failure, ...]
    seconds: Seconds
    passkey: Mapping[str, PasskeyRow] | None = None
    engine: EngineNumbers | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {**self.info.to_dict(), "buckets": table(self.buckets), "summary": self.summary.to_dict(),
               "sample_nll": list(self.sample_nll), "sample_kl": list(self.sample_kl),
               "layers": {i: dict(r) for i, r in self.layers.items()}, "failures": [f.to_dict() for f in self.failures],
               "seconds": self.seconds.to_dict()}
        return _extras(out, self)


def _extras(out: dict[str, Any], e: Reference | ArmMetrics) -> dict[str, Any]:
    if e.passkey is not None:
        out["passkey"] = {b: r.to_dict() for b, r in e.passkey.items()}
    if e.engine is not None:
        out["engine"] = e.engine.to_dict()
    return out


def with_passkey(e: Any, rows: Mapping[str, PasskeyRow], seconds: float) -> Any:
    """`e` (Reference or ArmMetrics) with its passkey rows and their seconds."""
    return replace(e, passkey=rows, seconds=replace(e.seconds, passkey=seconds))
