"""One validated Recipe: how scales are computed and how much data feeds them.

Why a single frozen object: a calibration run is only reproducible when every choice that shaped the
scales is written down. The recipe is that record — it is loaded from YAML (`recipes/*.yaml`), overridden
by CLI flags, validated once here, and stored verbatim in the exported `kvcalib.json`. Unknown keys are
errors, never ignored, because a misspelt `headroom` silently falling back to 1.0 would ship wrong scales.

This module imports neither torch nor transformers so the CLI stays fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from ._text import first_line

DTYPES = ("fp8_e4m3",)
GRANULARITIES = ("tensor",)
OBSERVERS = ("absmax",)
TARGETS = ("vllm",)


class RecipeError(ValueError):
    """A recipe field has a bad value; the message names the field, the value and what is accepted."""


def _doc(text: str, default: Any) -> Any:
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True)
class Recipe:
    dtype: str = _doc("KV cache dtype the scales are for: fp8_e4m3", "fp8_e4m3")
    granularity: str = _doc("scale granularity exported to the engine: tensor (one K and one V scale per layer)", "tensor")
    observer: str = _doc("how the range is measured: absmax (exact running max of |x| over all real tokens)", "absmax")
    headroom: float = _doc("multiplier on the observed range before forming the scale (>= 1 leaves room for unseen data)", 1.0)
    samples: int = _doc("number of calibration samples (sequences) to use", 128)
    seq_len: int = _doc("tokens per sample; longer samples are truncated", 512)
    min_tokens: int = _doc("samples shorter than this are skipped and counted", 16)
    batch_size: int = _doc("sequences per forward pass", 4)
    pack: bool = _doc("concatenate samples into full seq_len sequences instead of one sample per sequence", False)
    seed: int = _doc("seed for the sample order", 0)
    targets: tuple[str, ...] = _doc("engines to export for: vllm", ("vllm",))

    def __post_init__(self) -> None:
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), f.type)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("granularity", self.granularity, GRANULARITIES)
        _check_choice("observer", self.observer, OBSERVERS)
        for t in self.targets:
            _check_choice("targets", t, TARGETS)
        if not self.targets:
            raise RecipeError("recipe field 'targets' is empty; give at least one of: " + ", ".join(TARGETS))
        if not self.headroom > 0 or self.headroom != self.headroom or self.headroom == float("inf"):
            raise RecipeError(f"recipe field 'headroom' = {self.headroom!r}: must be a finite number > 0 (1.0 = none)")
        for name in ("samples", "seq_len", "min_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise RecipeError(f"recipe field '{name}' = {getattr(self, name)!r}: must be a positive integer")
        if self.min_tokens > self.seq_len:
            raise RecipeError(
                f"recipe field 'min_tokens' = {self.min_tokens} exceeds 'seq_len' = {self.seq_len}: "
                "every sample would be skipped; lower min_tokens or raise seq_len")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets)
        return d

    def replace(self, **overrides: Any) -> "Recipe":
        """A copy with the non-None overrides applied (CLI flags win over the YAML file)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return from_dict({**self.to_dict(), **given}, source="command line")

    @staticmethod
    def field_docs() -> dict[str, str]:
        return {f.name: f.metadata["doc"] for f in fields(Recipe)}


_TYPE_NAMES = {"str": str, "float": float, "int": int, "bool": bool}


def _check_type(name: str, value: Any, type_name: Any) -> None:
    type_name = str(type_name)
    if type_name.startswith("tuple"):
        ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
        want = "a list of strings"
    elif type_name == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        want = "a number"
    elif type_name == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
        want = "an integer"
    else:
        ok = isinstance(value, _TYPE_NAMES[type_name])
        want = f"a {type_name}"
    if not ok:
        raise RecipeError(f"recipe field '{name}' = {value!r} has the wrong type: expected {want}")


def _check_choice(name: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise RecipeError(f"recipe field '{name}' = {value!r} is not supported; accepted: {', '.join(accepted)}")


def from_dict(data: dict[str, Any], source: str = "recipe") -> Recipe:
    known = {f.name for f in fields(Recipe)}
    unknown = sorted(set(data) - known, key=str)  # YAML keys may be ints/bools: never compare them to str
    if unknown:
        raise RecipeError(f"{source}: unknown field(s) {', '.join(map(repr, unknown))}; known fields: {', '.join(sorted(known))}")
    data = dict(data)
    if "targets" in data:
        t = data["targets"]
        data["targets"] = tuple(t.split(",")) if isinstance(t, str) else tuple(t) if isinstance(t, list) else t
    if isinstance(data.get("headroom"), int) and not isinstance(data.get("headroom"), bool):
        try:
            data["headroom"] = float(data["headroom"])
        except OverflowError:
            raise RecipeError("recipe field 'headroom' is too large: must be a finite number > 0 (1.0 = none)") from None
    return Recipe(**data)


def load(path: str | Path | None) -> Recipe:
    """Read a recipe YAML file; None gives the defaults. Errors name the file."""
    if path is None:
        return Recipe()
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} not found; list shipped recipes with `kvcalib recipes`")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe file {path} is not valid YAML: {first_line(e)}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"recipe file {path} is not UTF-8 text") from None
    if data is None:  # an empty file means all defaults; `[]`, `0` or `false` are mistakes, not defaults
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {path} must hold a mapping of field: value, got {type(data).__name__}")
    try:
        return from_dict(data, source=f"recipe file {path}")
    except RecipeError as e:
        msg = str(e)
        raise RecipeError(msg if msg.startswith("recipe file") else f"{path}: {msg}") from None
