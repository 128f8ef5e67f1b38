"""The run's record: one typed, frozen value from which every file that says where scales came from is derived.

Why one value: kvcalib.json (beside every checkpoint), the statistics file header (`--stats-out`, merge) and
the resume header (`--checkpoint-every`) all describe the same run — model, recipe, data, rotary_dim,
versions. Built as three dicts and extended by `{**prov, ...}` in several places, a field added to one was
missing from another and every reader looked keys up by string. Here each field is declared once, with the
files it goes into (`FILES` in its metadata); `to_dict` writes one file's shape and `from_dict` reads any
of them back, checking each field's kind, so readers get attributes. The keys are the ones kvcalib has
always written: files written before load unchanged.

Adding a field: declare it on `Provenance` with `record_field(default, RECORD, STATS, ..., check=...)`, naming the
files it belongs in and how a value read back is checked. Nothing else changes: `to_dict` writes it into
those files, `from_dict` reads it (files written before it existed read as the default).

What a writer adds (which engine's variant, how the weights travelled, the engine's own notes) is a
`Written`, attached with `Provenance.written_as`; it appears in kvcalib.json only.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from calib.errors import KvcalibError

RECORD, STATS, RESUME = "record", "stats", "resume"   # kvcalib.json, statistics header, resume header
PRODUCER = "kvcalib"
VERSIONED = ("kvcalib", "torch", "transformers", "compressed-tensors", "safetensors")


class ProvenanceError(KvcalibError, ValueError):
    """A run record's field has the wrong kind; the message names the file and the field."""


def versions() -> dict[str, str]:
    """The installed versions of the packages that decide the numbers."""
    import importlib.metadata as md

    out = {}
    for pkg in VERSIONED:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _check(ok: Callable[[Any], bool], what: str, keep: Callable[[Any], Any] = lambda v: v,
           typed: bool = False) -> Callable[[Any, str], Any]:
    """A field's check: `keep(value)` where `ok(value)`, else ProvenanceError "<where> must be <what>" (`typed`:
    naming the value's type)."""
    def check(value: Any, where: str) -> Any:
        if ok(value):
            return keep(value)
        raise ProvenanceError(f"{where} must be {what}" + (f", not {type(value).__name__}" if typed else ""))
    return check


def _index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


text_or_none = _check(lambda v: v is None or isinstance(v, str), "text or null", typed=True)
_strings = _check(lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings", tuple)
_layer_list = _check(lambda v: isinstance(v, list) and all(map(_index, v)), "a list of layer indices", tuple)
_object = _check(lambda v: isinstance(v, Mapping), "a JSON object", dict, typed=True)
_optional_object = _check(lambda v: v is None or isinstance(v, Mapping), "a JSON object",
                          lambda v: None if v is None else dict(v), typed=True)
_rotary = _check(lambda v: v is None or (_index(v) and v >= 0), "a non-negative integer or null")


def record_field(default: Any, *files: str, check: Callable[[Any, str], Any], omit_none: bool = False,
           factory: Callable[[], Any] | None = None) -> Any:
    """A Provenance field: its default, the files it is written into, how `from_dict` checks a value read
    back (returns the value to keep, raises ProvenanceError), and whether a None is left out of the files."""
    meta = {"files": files, "check": check, "omit_none": omit_none}
    return field(default=default, metadata=meta) if factory is None else field(default_factory=factory, metadata=meta)


@dataclass(frozen=True)
class Written:
    """What a writer adds to kvcalib.json: the engine variant (None: statistics only), how the weight files
    travelled (`link`, `copy`, ...), and the engine's own notes (TensorRT-LLM: kv_cache_quant_algo and its
    saturation report or INT8 layer scales), as top-level keys."""
    target: str | None
    weights: tuple[str, ...] | None = None
    engine: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Provenance:
    """One calibration run (or an export from its statistics), complete when built."""
    producer: str | None = record_field(PRODUCER, RECORD, STATS, check=text_or_none)
    created: str | None = record_field(None, RECORD, check=text_or_none, factory=now)
    model: str | None = record_field(None, RECORD, STATS, check=text_or_none)
    model_config_sha256: str | None = record_field(None, STATS, RESUME, check=text_or_none, omit_none=True)
    # calib.ckpt.fingerprint: the model's weights, read in part; binds statistics, resume files, records to them
    model_weights_sha256: str | None = record_field(None, RECORD, STATS, RESUME, check=text_or_none, omit_none=True)
    data: Mapping[str, Any] = record_field(None, RECORD, STATS, check=_object, factory=dict)  # source, what was used
    recipe: Mapping[str, Any] = record_field(None, RECORD, STATS, RESUME, check=_object, factory=dict)  # to_dict()
    skipped_layers: tuple[int, ...] = record_field((), RECORD, check=_layer_list)
    calibration_dtype: str | None = record_field(None, RECORD, check=text_or_none)
    versions: Mapping[str, str] = record_field(None, RECORD, STATS, check=_object, factory=versions)
    layers: Mapping[str, Mapping[str, Any]] = record_field(None, RECORD, check=_object, factory=dict)  # ranges, scales
    rotary_dim: int | None = record_field(None, RECORD, STATS, RESUME, check=_rotary)
    into: str | None = record_field(None, RECORD, check=text_or_none, omit_none=True)
    selected_by: Mapping[str, Any] | None = record_field(None, RECORD, check=_optional_object, omit_none=True)
    written: Written | None = None      # kvcalib.json only: the output it describes

    @property
    def data_source(self) -> str | None:
        """Where the data came from (the resume header's `data_source`)."""
        return None if self.data.get("source") is None else str(self.data["source"])

    def replace(self, **changes: Any) -> Provenance:
        return dataclasses.replace(self, **changes)

    def written_as(self, target: str | None, **engine: Any) -> Provenance:
        """This record as the output of `target` (None: statistics only) describes it; engine notes as keywords."""
        return self.replace(written=Written(target, None, dict(engine)))

    def with_weights(self, how: list[str] | tuple[str, ...]) -> Provenance:
        """... and how its weight files travelled (the one writer, calib.export.write, knows)."""
        w = self.written or Written(None)
        return self.replace(written=Written(w.target, tuple(how), w.engine))

    def to_dict(self, file: str = RECORD) -> dict[str, Any]:
        """The JSON object `file` (RECORD: kvcalib.json, STATS: statistics header, RESUME: resume header) holds."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if file in f.metadata.get("files", ()) and not (value is None and f.metadata["omit_none"]):
                out[f.name] = _plain(value)
        if file == RESUME:
            out["data_source"] = self.data_source
        if file == RECORD and self.written is not None:
            out["target"] = self.written.target
            out.update({k: _plain(v) for k, v in self.written.engine.items()})
            if self.written.weights is not None:
                out["weights"] = list(self.written.weights)
        return out

    def stats_header(self) -> dict[str, Any]:
        return self.to_dict(STATS)

    def resume_header(self, batches_done: int | None = None, stream_sha256: str | None = None) -> dict[str, Any]:
        """The resume header after `batches_done` batches whose token ids and masks hash to `stream_sha256`
        (what a resumed run replays must hash alike: the same data, batching and tokenizer)."""
        extra = {"batches_done": batches_done, "stream_sha256": stream_sha256}
        return {**self.to_dict(RESUME), **{k: v for k, v in extra.items() if v is not None}}

    @classmethod
    def from_dict(cls, doc: Any, where: str = "run record", file: str = RECORD) -> Provenance:
        """`file`'s shape back: its fields (other keys stay out, or in kvcalib.json, beside a `target`, become
        the engine's notes); a field of the wrong kind is a ProvenanceError naming `where` and the field."""
        if not isinstance(doc, Mapping):
            raise ProvenanceError(f"{where} is not a JSON object")
        fields = [f for f in dataclasses.fields(cls) if "files" in f.metadata]
        known = {f.name for f in fields}
        values: dict[str, Any] = {}
        for f in fields:
            if file in f.metadata["files"] and f.name in doc:
                values[f.name] = f.metadata["check"](doc[f.name], f"{where}: field {f.name!r}")
            elif f.default is dataclasses.MISSING:   # read back, a missing field is empty, never made up now
                values[f.name] = None if f.name == "created" else {}
        if file == RESUME and "data_source" in doc:          # a resume header names only the data's source
            values["data"] = {"source": text_or_none(doc["data_source"], f"{where}: field 'data_source'")}
        written = None
        if file == RECORD and "target" in doc:
            target = text_or_none(doc["target"], f"{where}: field 'target'")
            weights = None if doc.get("weights") is None else _strings(doc["weights"], f"{where}: field 'weights'")
            engine = {k: v for k, v in doc.items() if k not in known | {"target", "weights", "data_source"}}
            written = Written(target, weights, engine)
        return cls(**values, written=written)  # type: ignore[arg-type]


def as_provenance(value: Provenance | Mapping[str, Any], where: str = "provenance") -> Provenance:
    """A Provenance as it is; a mapping (a library caller's dict) read by `Provenance.from_dict`."""
    return value if isinstance(value, Provenance) else Provenance.from_dict(value, where)


def _plain(value: Any) -> Any:
    """JSON-ready: tuples as lists, mappings as dicts (recursively)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


