"""The recipe's typed vocabulary, torch-free: KV-cache dtypes and range observers as registered values.

Why one module without torch: the recipe validates against these registries before anything heavy is
imported (the CLI's `--help` and choices come from them too), and the stages that do import torch —
capture (calib.capture.spec, calib.capture.observers), scales, export, emulation — look the same values up instead of
comparing strings. Granularities are the third registry (calib.recipe.granularity, also torch-free).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------- KV-cache dtypes


@dataclass(frozen=True)
class KVDtype:
    """A KV-cache storage type: its name and the largest magnitude it represents."""
    name: str
    qmax: float


FP8_E4M3 = KVDtype("fp8_e4m3", 448.0)
INT8 = KVDtype("int8", 127.0)
KV_DTYPES: dict[str, KVDtype] = {d.name: d for d in (FP8_E4M3, INT8)}


def kv_dtype(name: str) -> KVDtype:
    """The KV dtype called `name`; ValueError naming the accepted ones otherwise."""
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown KV dtype {name!r}; accepted: {sorted(KV_DTYPES)}") from None


# ---------------------------------------------------------------- observers


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


MSE_GRID_MAX = 4096          # candidate clips per head: the search holds [grid, bins] values at once
HISTOGRAM_BINS = 2048        # the histogram observers' resolution (calib.capture.observers)


@dataclass(frozen=True)
class Param:
    """One observer parameter: its type, the values accepted, and whether a recipe may set it."""
    kind: type                                   # int or float (ints are accepted for floats)
    check: Callable[[Any], bool]
    want: str                                    # what `check` accepts, for error messages
    recipe: bool = True                          # False: the observer takes it, a recipe may not (see why_fixed)
    why_fixed: str = ""


# A recipe never sets the histogram's bin count: statistics files merge (and resume) only at one resolution,
# and the recorded recipe is what identifies them; tests and tools may build observers at another.
_BINS = Param(int, lambda v: _is_int(v) and 256 <= v <= 1 << 15 and not v & (v - 1),
              "a power of two in [256, 32768]", recipe=False,
              why_fixed=f"the histogram resolution is fixed at {HISTOGRAM_BINS} bins so that statistics files merge")


@dataclass(frozen=True)
class ObserverSpec:
    """A range observer as a recipe names it: its parameters, and what it needs from the capture."""
    name: str
    params: dict[str, Param] = field(default_factory=dict)
    exact: bool = False          # the exact max |x| (every capture records it anyway: no observer object needed)
    k_only: bool = False         # applies to K only (V keeps the exact max); needs the model's rotary layout

    def recipe_params(self) -> dict[str, Param]:
        return {k: p for k, p in self.params.items() if p.recipe}


OBSERVERS: dict[str, ObserverSpec] = {s.name: s for s in (
    ObserverSpec("absmax", exact=True),
    ObserverSpec("percentile", {"p": Param(float, lambda v: _is_num(v) and 0 < v <= 100, "a number in (0, 100]"),
                                "bins": _BINS}),
    ObserverSpec("mse", {"grid": Param(int, lambda v: _is_int(v) and 2 <= v <= MSE_GRID_MAX,
                                       f"an integer in [2, {MSE_GRID_MAX}]"),
                         "min_ratio": Param(float, lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
                         "bins": _BINS}),
    ObserverSpec("rope_bound", k_only=True),
)}


def observer(name: str) -> ObserverSpec:
    """The observer called `name`; ValueError naming the accepted ones otherwise."""
    try:
        return OBSERVERS[name]
    except KeyError:
        raise ValueError(f"unknown observer {name!r}; accepted: {sorted(OBSERVERS)}") from None
