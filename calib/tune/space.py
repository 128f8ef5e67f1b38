"""The search space of `kvcalib tune`: the recipes a target engine can load, and what each one costs and buys.

Why per engine: a candidate the engine cannot load is not a choice. What each engine is searched over is its
support-matrix entry's (calib.recipe.support: `Engine.tune`, the granularities and q_scale choices) times the
static formats it has (calib.recipe.dtypes): vLLM FP8 per tensor or per KV head, with and without q_scale;
TensorRT-LLM FP8 and INT8 per layer (its FP8 path runs at scale 1.0 whatever the checkpoint holds, docs/design.md
§5). Observers and headroom values multiply those.

A candidate is a frozen value that names one recipe (`recipe()` gives the exact `Recipe` calibrate would
run) plus the layers it keeps in the model dtype. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from calib.errors import KvcalibError
from calib.recipe import dtypes, recipe as recipe_mod, support

# the engines tune searches (those whose support-matrix entry has a tune space), in the targets' order
TARGETS = tuple(n for n, e in support.ENGINES.items() if e.tune is not None)
OBSERVERS = tuple(recipe_mod.OBSERVERS)  # every observer the recipe vocabulary has, in its order
HEADROOMS = (1.0, 1.25)
MAX_HEADROOMS = 8


class SpaceError(KvcalibError, ValueError):
    """The search space asked for cannot be built; the message names the option and the fix."""


@dataclass(frozen=True)
class Candidate:
    """One recipe the target engine can load, plus the layers kept in the model dtype (`skip`)."""
    target: str
    dtype: str = "fp8_e4m3"
    granularity: str = "tensor"
    observer: str = "absmax"
    headroom: float = 1.0
    q_scale: bool = False
    skip: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        parts = [dtypes.kv_dtype(self.dtype).short, self.granularity, self.observer, f"h{self.headroom:g}"]
        name = "/".join(parts) + ("+q" if self.q_scale else "")
        return name + (f" skip {','.join(map(str, self.skip))}" if self.skip else "")

    def skipping(self, layers: Sequence[int]) -> "Candidate":
        return replace(self, skip=tuple(sorted(set(layers))))

    def recipe(self, base: recipe_mod.Recipe) -> recipe_mod.Recipe:
        """The recipe `calibrate` would run for this candidate (data settings from `base`)."""
        return base.replace(dtype=self.dtype, granularity=self.granularity, observer=self.observer,
                            observer_params={}, headroom=self.headroom, q_scale=self.q_scale,
                            skip_layers=",".join(map(str, self.skip)), targets=self.target)

    def support(self) -> str:
        """What the target engine does with this candidate (the support matrix, calib.recipe.support)."""
        cal = support.Calibrated(self.dtype, self.granularity, self.q_scale, tuple(self.skip))
        return support.outcome(self.target, cal).summary() + ("; --kv-cache-dtype-skip-layers" if self.skip else "")

    def breadth(self) -> int:
        """2: every backend of the engine applies it as written; 1: only one backend reads all of it."""
        return 1 if (self.granularity == "head" or self.q_scale) else 2

    def simplicity(self) -> tuple[int, float]:
        """Tie-break among candidates within noise of each other: simpler observer, then less headroom."""
        return (OBSERVERS.index(self.observer) if self.observer in OBSERVERS else len(OBSERVERS), self.headroom)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **asdict(self), "skip": list(self.skip), "support": self.support()}


def generate(target: str, observers: Sequence[str] = OBSERVERS, headrooms: Sequence[float] = HEADROOMS) -> list[Candidate]:
    """Every recipe `target` can load (module docstring), each with every observer and headroom. Layer skips are
    added later, from measured sensitivity (calib/tune/search.py)."""
    if target not in TARGETS:
        raise SpaceError(f"--target {target!r} is not an engine tune knows; accepted: {', '.join(TARGETS)}")
    check_observers(observers)
    check_headrooms(headrooms)
    space = support.ENGINES[target].tune
    shapes = [(d.name, g, q) for d in dtypes.for_engine(target) for g in space.granularities for q in space.q_scale]
    return [Candidate(target, d, g, o, float(h), q) for d, g, q in shapes for o in observers for h in headrooms]


def check_observers(observers: Sequence[str]) -> None:
    if not observers:
        raise SpaceError("--observers is empty: give at least one of " + ", ".join(recipe_mod.OBSERVERS))
    bad = [o for o in observers if o not in recipe_mod.OBSERVERS]
    if bad:
        raise SpaceError(f"--observers: unknown observer {bad[0]!r}; accepted: {', '.join(recipe_mod.OBSERVERS)}")
    if len(set(observers)) != len(observers):
        raise SpaceError(f"--observers {','.join(observers)} names an observer twice")


def check_headrooms(headrooms: Sequence[float]) -> None:
    if not headrooms or len(headrooms) > MAX_HEADROOMS:
        raise SpaceError(f"--headrooms: give 1 to {MAX_HEADROOMS} values, e.g. 1.0,1.25")
    for h in headrooms:
        if not (isinstance(h, (int, float)) and 1.0 <= h <= recipe_mod.LIMITS["headroom"]):
            raise SpaceError(f"--headrooms: {h!r} must be a number >= 1 (1.0 = none) and at most "
                             f"{recipe_mod.LIMITS['headroom']:g}")
    if len(set(headrooms)) != len(headrooms):
        raise SpaceError("--headrooms names a value twice")


def parse_list(text: str, option: str, kind: type = str) -> tuple:
    """A comma list from the command line; one-line error naming the option."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    try:
        return tuple(kind(x) for x in items)
    except ValueError:
        raise SpaceError(f"{option} {text!r}: give a comma list of {'numbers' if kind is float else 'names'}") from None


def memory_saved(candidate: Candidate | None, layers: int, ref_bytes: int) -> float:
    """Share of the model-dtype KV cache this candidate saves (None: the reference, 0): its format's bytes per value
    (calib.recipe.dtypes; FP8 and INT8 one) against `ref_bytes`; skipped layers keep `ref_bytes`."""
    if candidate is None:
        return 0.0
    return (layers - len(candidate.skip)) / layers * (1 - dtypes.kv_dtype(candidate.dtype).element_bytes / ref_bytes)
