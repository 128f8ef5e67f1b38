"""The evaluation's results as typed values: what `measure` returns, what the verdict reads, what report.json holds.

Why typed: the same numbers are read by the verdict (calib/evaluation/verdict.py), the capacity rule and
`kvcalib tune`; a named field makes a misspelt or missing number an error where it is read. `to_dict` gives
report.json's form: its keys and their order are the file format (tests/evaluation/test_run.py pins them). The
engine's own numbers (`engine`) are typed where the engine returns them (calib.engine.metrics.EngineNumbers), in
the same rows (BucketRow, Summary); `calib.evaluation.numbers.decisive` picks the engine's or the emulation's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from calib.engine.metrics import BucketRow, EngineNumbers, Summary


def bucket_of(length: int, buckets: Iterable[int]) -> int:
    """A sample's bucket, the `b` of every "bucket <= b" row: the smallest bucket >= its length in tokens
    (samples are cut to the largest)."""
    return min(b for b in buckets if b >= length)


def plain(x: Any) -> Any:
    """A value as report.json holds it: its `to_dict`, a dataclass's `record`, mappings as dicts, tuples as lists."""
    if hasattr(x, "to_dict"):
        return x.to_dict()
    if is_dataclass(x):
        return record(x)
    if isinstance(x, Mapping):
        return {k: plain(v) for k, v in x.items()}
    return [plain(v) for v in x] if isinstance(x, (list, tuple)) else x


def record(obj: Any, omit: Iterable[str] = ()) -> dict[str, Any]:
    """A dataclass's fields in order, each `plain`; those named in `omit` left out where None or empty."""
    return {f.name: plain(getattr(obj, f.name)) for f in fields(obj)
            if f.name not in omit or getattr(obj, f.name) not in (None, (), "")}


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
        return {"correct": self.correct, "total": self.total, "by_depth": plain(self.by_depth),
                "accuracy": self.accuracy, "outcomes": [{"depth": d, "correct": c} for d, c in self.outcomes]}


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
        return record(self, omit=("passkey",))

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
        return record(self, omit=("skip_kind",))


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
        return record(self, omit=("passkey", "engine"))


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
        out = record(self, omit=("passkey", "engine"))
        return {**out.pop("info"), **out}


def with_passkey(e: Any, rows: Mapping[str, PasskeyRow], seconds: float) -> Any:
    """`e` (Reference or ArmMetrics) with its passkey rows and their seconds."""
    return replace(e, passkey=rows, seconds=replace(e.seconds, passkey=seconds))
