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

from calib.errors import KvcalibError
from calib.recipe import dtypes, granularity as granularity_mod, safeyaml, support
from calib.safety.readers import raising

# The choices come from the typed registries (calib.recipe.dtypes, calib.recipe.granularity); the recipe keeps their names
# (what YAML, the CLI and kvcalib.json spell) and hands out the values (`kv_dtype`, `scale_granularity`,
# `observer_spec`).
DTYPES = tuple(dtypes.KV_DTYPES)
GRANULARITIES = tuple(granularity_mod.GRANULARITIES)
EXPORTABLE = tuple(name for name, g in granularity_mod.GRANULARITIES.items() if g.exportable)
TARGETS = support.targets()      # the engines of the support matrix: kvcalib's targets (calib.export writes each)
SKIP_KEYWORDS = tuple(dict.fromkeys(k for kinds in support.SKIP_KINDS.values() for k in kinds))
# observer -> {parameter a recipe may set: (check, description)}; validated here (before any observer allocates)
# so the recipe never needs torch.
OBSERVERS: dict[str, dict[str, tuple[Any, str]]] = {
    name: {k: (p.check, p.want) for k, p in spec.recipe_params().items()} for name, spec in dtypes.OBSERVERS.items()}
# Upper bounds: a value past these is a typo (an extra zero), not a calibration anyone runs; it would
# otherwise surface as an allocation failure deep inside the forward pass.
LIMITS = {"samples": 10_000_000, "seq_len": 1 << 22, "min_tokens": 1 << 22, "batch_size": 65_536,
          "seed": 2**63 - 1, "headroom": 1000.0, "skip_layers": 1 << 20}


class RecipeError(KvcalibError, ValueError):
    """A recipe field has a bad value; the message names the field, the value and what is accepted."""


def _doc(text: str, default: Any) -> Any:
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"doc": text})
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True)
class Recipe:
    dtype: str = _doc("KV cache dtype the scales are for: fp8_e4m3 (scale = range/448) or int8 (range/127)", "fp8_e4m3")
    granularity: str = _doc("tensor (one K and one V scale per layer), head (one per KV head); channel and token "
                            "are statistics only (targets: [])", "tensor")
    observer: str = _doc("how the range is measured: absmax (exact max |x|), percentile (clip at p-th percentile), "
                         "mse (clip minimising quantisation MSE), rope_bound (K bound valid at every position; "
                         "V uses absmax)", "absmax")
    observer_params: dict = _doc("observer parameters: percentile {p: 99.99}; mse {grid: 100, min_ratio: 0.3}", {})
    headroom: float = _doc("multiplier on the observed range before forming the scale (>= 1 leaves room for unseen data)", 1.0)
    q_scale: bool = _doc("also observe Q (after RoPE) and export q_scale for vLLM's FP8 attention", False)
    skip_layers: tuple = _doc("layers whose KV cache stays in the model dtype: indices and/or sliding_window", ())
    samples: int = _doc("number of calibration samples (sequences) to use", 128)
    seq_len: int = _doc("tokens per sample; longer samples are truncated", 512)
    min_tokens: int = _doc("samples shorter than this are skipped and counted", 16)
    batch_size: int = _doc("sequences per forward pass", 4)
    pack: bool = _doc("concatenate samples into full seq_len sequences instead of one sample per sequence", False)
    seed: int = _doc("seed for the sample order", 0)
    targets: tuple[str, ...] = _doc(f"engines to export for: {', '.join(TARGETS)}; [] writes statistics only", ("vllm",))

    def __post_init__(self) -> None:
        for f in fields(self):
            ok, want = _TYPES[str(f.type)]
            if not ok(getattr(self, f.name)):
                raise RecipeError(f"recipe field '{f.name}' = {getattr(self, f.name)!r} has the wrong type: "
                                  f"expected {want}")
        for name, accepted in (("dtype", DTYPES), ("granularity", GRANULARITIES), ("observer", tuple(OBSERVERS))):
            _check_choice(name, getattr(self, name), accepted)
        _check_observer_params(self.observer, self.observer_params)
        for t in self.targets:
            _check_choice("targets", t, TARGETS)
        if len(set(self.targets)) != len(self.targets):
            raise RecipeError(f"recipe field 'targets' = {list(self.targets)} names an engine twice")
        for item in self.skip_layers:
            if not ((dtypes.is_int(item) and 0 <= item < LIMITS["skip_layers"]) or item in SKIP_KEYWORDS):
                raise RecipeError(f"recipe field 'skip_layers' has {item!r}: give layer indices >= 0 and/or "
                                  f"{', '.join(SKIP_KEYWORDS)}")
        self._check_combination()
        if not 0 < self.headroom <= LIMITS["headroom"]:  # NaN fails both comparisons
            raise RecipeError(f"recipe field 'headroom' = {self.headroom!r}: must be a finite number > 0 (1.0 = none) "
                              f"and at most {LIMITS['headroom']:g}")
        for name in ("samples", "seq_len", "min_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise RecipeError(f"recipe field '{name}' = {getattr(self, name)!r}: must be a positive integer")
            if getattr(self, name) > LIMITS[name]:
                raise RecipeError(f"recipe field '{name}' = {getattr(self, name)!r} is beyond {LIMITS[name]:,}; "
                                  "lower it")
        if abs(self.seed) > LIMITS["seed"]:
            raise RecipeError(f"recipe field 'seed' = {self.seed!r}: must be an integer within ±(2**63 - 1)")
        if self.min_tokens > self.seq_len:
            raise RecipeError(
                f"recipe field 'min_tokens' = {self.min_tokens} exceeds 'seq_len' = {self.seq_len}: "
                "every sample would be skipped; lower min_tokens or raise seq_len")

    @property
    def kv_dtype(self) -> dtypes.KVDtype:
        return dtypes.KV_DTYPES[self.dtype]

    @property
    def scale_granularity(self) -> granularity_mod.Granularity:
        return granularity_mod.GRANULARITIES[self.granularity]

    @property
    def observer_spec(self) -> dtypes.ObserverSpec:
        return dtypes.OBSERVERS[self.observer]

    def _check_combination(self) -> None:
        if self.targets and not self.scale_granularity.exportable:
            raise RecipeError(f"recipe field 'granularity' = {self.granularity!r} cannot be exported: no engine reads "
                              f"it; use {' or '.join(EXPORTABLE)}, or set targets: [] to keep statistics only")
        for t in self.targets:           # what each engine can read: calib.recipe.dtypes and the support matrix
            lacks = support.lacks_format(t, self.dtype)
            if lacks:
                raise RecipeError(f"recipe field 'dtype' = {self.dtype!r} with target {t}: {lacks}")
        for t in self.targets:
            lacks = self.skip_layers and support.lacks_skip(t)
            if lacks:
                raise RecipeError(f"recipe field 'skip_layers' with target {t}: {lacks}")
        readers = support.q_scale_readers()
        if self.q_scale and not set(readers) & set(self.targets):
            names = " or ".join(readers)
            titles = " and ".join(support.ENGINES[n].title for n in readers)
            raise RecipeError(f"recipe field 'q_scale' = true needs target {names} (only {titles} appl"
                              f"{'ies' if len(readers) == 1 else 'y'} a q_scale); add {names} to targets or drop "
                              "q_scale")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": list(self.targets), "skip_layers": list(self.skip_layers),
                "observer_params": dict(self.observer_params)}

    def replace(self, **overrides: Any) -> "Recipe":
        """A copy with the non-None overrides applied (CLI flags win over the YAML file)."""
        given = {k: v for k, v in overrides.items() if v is not None}
        return from_dict({**self.to_dict(), **given}, source="command line")

    @staticmethod
    def field_docs() -> dict[str, str]:
        return {f.name: f.metadata["doc"] for f in fields(Recipe)}


# a field's annotation -> (what a value of it passes, what the error says is expected)
_TYPES = {"tuple": (lambda v: isinstance(v, tuple), "a list"),
          "dict": (lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v), "a mapping of name: value"),
          "tuple[str, ...]": (lambda v: isinstance(v, tuple) and all(isinstance(x, str) for x in v),
                              "a list of strings"),
          "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
          "int": (dtypes.is_int, "an integer"), "str": (lambda v: isinstance(v, str), "a str"),
          "bool": (lambda v: isinstance(v, bool), "a bool")}


def _check_observer_params(observer: str, params: dict) -> None:
    spec = dtypes.OBSERVERS[observer]
    accepted = spec.recipe_params()
    names = ", ".join(accepted) or "none"
    for key, value in params.items():
        if key in spec.params and key not in accepted:
            raise RecipeError(f"recipe field 'observer_params' has {key!r}, which a recipe does not set "
                              f"({spec.params[key].why_fixed}); accepted: {names}")
        if key not in accepted:
            raise RecipeError(f"recipe field 'observer_params' has {key!r}, which observer {observer!r} does not "
                              f"take; accepted: {names}")
        if not accepted[key].check(value):
            raise RecipeError(f"recipe field 'observer_params.{key}' = {value!r}: must be {accepted[key].want}")


def _check_choice(name: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise RecipeError(f"recipe field '{name}' = {value!r} is not supported; accepted: {', '.join(accepted)}")


def from_dict(data: dict[str, Any], source: str = "recipe") -> Recipe:
    known = {f.name for f in fields(Recipe)}
    unknown = sorted(set(data) - known, key=str)  # YAML keys may be ints/bools: never compare them to str
    if unknown:
        raise RecipeError(f"{source}: unknown field(s) {', '.join(map(repr, unknown))}; known fields: {', '.join(sorted(known))}")
    data = dict(data)
    for key, item in (("targets", str), ("skip_layers", _int_or_str)):   # a list, or comma-separated (the CLI)
        t = data.get(key)
        if isinstance(t, (str, list)):
            data[key] = tuple(item(x) for x in t.split(",") if x) if isinstance(t, str) else tuple(t)
    if data.get("observer_params") is None and "observer_params" in data:
        data["observer_params"] = {}
    if isinstance(data.get("headroom"), int) and not isinstance(data.get("headroom"), bool):
        try:
            data["headroom"] = float(data["headroom"])
        except OverflowError:
            raise RecipeError("recipe field 'headroom' is too large: must be a finite number > 0 (1.0 = none)") from None
    return Recipe(**data)


def _int_or_str(x: str) -> int | str:
    x = x.strip()
    return int(x) if x.isascii() and x.isdigit() else x   # "²".isdigit() is True, int("²") fails


def load(path: str | Path | None) -> Recipe:
    """Read a recipe YAML file; None gives the defaults. Errors name the file."""
    if path is None:
        return Recipe()
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} not found; list shipped recipes with `kvcalib recipes`")
    with raising(RecipeError, safeyaml.SafeYAMLError):
        data = safeyaml.load(path, where=f"recipe file {path}")
    if data is None:  # an empty file means all defaults; `[]`, `0` or `false` are mistakes, not defaults
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe file {path} must hold a mapping of field: value, got {type(data).__name__}")
    try:
        return from_dict(data, source=f"recipe file {path}")
    except RecipeError as e:
        raise RecipeError(str(e) if str(e).startswith("recipe file") else f"{path}: {e}") from None
