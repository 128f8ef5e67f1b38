"""What an engine does with one calibrated result: the cells it reads, whether the served result differs from what
was calibrated, and whether a command must refuse to hand the user the file for that engine.

Why apart from the lookups: the matrix says what happens to scales; this turns that into the decision every
command prints (calibrate, export, verify, eval, tune), with one line per thing that differs. Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from calib.recipe.support.base import Cell, Effect as E, Version
from calib.recipe.support.matrix import DYNAMIC_FORMATS, ENGINES, builds, cell, engine, version_of

SAME, DIFFERS, REFUSE = "same", "differs", "refuse"
_RANK = {SAME: 0, DIFFERS: 1, REFUSE: 2}


@dataclass(frozen=True)
class Calibrated:
    """What kvcalib calibrated: KV dtype, granularity (tensor | head), q_scale, skipped layers, the largest
    amax / qmax over layers (> 1: some K or V value lies past the format's range at scale 1.0; None: not known),
    and the model's architecture (config.json `architectures[0]`; None: not known), which decides some engines'
    loading."""
    dtype: str
    granularity: str = "tensor"
    q_scale: bool = False
    skip_layers: tuple[int | str, ...] = ()
    amax_ratio: float | None = None
    architecture: str | None = None


@dataclass(frozen=True)
class Consequence:
    """What one engine (version, backend) does with a calibrated result: the cells read, the severity
    (`same` as calibrated, `differs`, or `refuse`: a command must not hand the user this file for this
    engine) and one line per thing that differs."""
    engine: str
    version: Version
    backend: str
    cells: tuple[Cell, ...]
    severity: str
    lines: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    """A calibrated result on one engine version over the backends asked (all when none was named)."""
    engine: str
    version: Version
    per_backend: tuple[Consequence, ...]
    calibrated: Calibrated

    @property
    def refused(self) -> bool:
        """Refuse only when no backend serves the result as calibrated or close enough."""
        return all(c.severity == REFUSE for c in self.per_backend)

    @property
    def severity(self) -> str:
        return REFUSE if self.refused else max((c.severity for c in self.per_backend if c.severity != REFUSE),
                                               key=_RANK.__getitem__, default=SAME)

    def lines(self) -> list[str]:
        """One line per distinct consequence, naming the backends it holds on (when the engine has several)."""
        e = ENGINES[self.engine]
        groups: dict[str, list[str]] = {}
        for c in self.per_backend:
            for line in c.lines:
                groups.setdefault(line, []).append(c.backend)
        out = []
        for line, backends in groups.items():
            where = "" if len(e.backends) == 1 or len(backends) == len(e.backends) else \
                " (" + ", ".join(e.backends[b] for b in backends) + ")"
            out.append(f"{e.title} {self.version}{where}: {line}")
        return out

    def summary(self) -> str:
        """One line: what the engine does with the file, for a serve command or a decision."""
        lines = self.lines()
        if lines:
            return "; ".join(lines)
        return f"{ENGINES[self.engine].title} {self.version}: the scales are applied as calibrated"

    def refusal(self, what_instead: str = "") -> str:
        """The one-line refusal: engine, version, why, and what to do instead."""
        why = "; ".join(dict.fromkeys(line for c in self.per_backend for line in c.lines))
        return f"{ENGINES[self.engine].title} {self.version} would not serve these scales: {why}" + (
            f". {what_instead}" if what_instead else "")


def _kv_line(kv: Cell, cal: Calibrated) -> tuple[str | None, str]:
    """The line and severity for what happens to the k/v scales themselves."""
    what = f"{cal.dtype} {cal.granularity} scales"
    if kv.effect in (E.REFUSED, E.BROKEN):
        return f"{what} {kv.effect.value} ({kv.note})", REFUSE
    if kv.effect is E.IGNORED:
        if cal.dtype in DYNAMIC_FORMATS:
            return f"{what} unused ({kv.note})", DIFFERS
        if cal.dtype == "int8":
            return (f"{what} ignored, INT8 runs at scale 1.0 ({kv.note}): every K/V value is rounded to an integer",
                    REFUSE)
        if cal.amax_ratio is not None and cal.amax_ratio > 1:
            return (f"{what} ignored, the cache runs at scale 1.0 ({kv.note}) and K/V values up to "
                    f"{cal.amax_ratio:.3g}x the {cal.dtype} range saturate", REFUSE)
        inside = ("; no K/V value lies past the range, so it behaves like the default scale"
                  if cal.amax_ratio is not None else "")
        return f"{what} ignored, the cache runs at scale 1.0 ({kv.note}){inside}", DIFFERS
    differs = {E.MAX_OVER_HEADS: f"{what} applied as one max over heads per layer",
               E.SHARED_KV: f"{what} applied as one scale shared by K and V per layer",
               E.UNREAD: f"what happens to {what} was not read"}
    return (f"{differs[kv.effect]} ({kv.note})", DIFFERS) if kv.effect in differs else (None, SAME)


def _consequence(name: str, v: Version, backend: str, cal: Calibrated) -> Consequence:
    kv = cell(name, v, backend, cal.dtype, cal.granularity, cal.architecture)
    line, sev = _kv_line(kv, cal)
    cells, lines = [kv], [line] if line else []
    served = kv.effect not in (E.REFUSED, E.BROKEN)
    skips = f"skip_layers {list(cal.skip_layers)}"
    for aspect, label, severity in (("q_scale", cal.q_scale and "q_scale", DIFFERS),
                                    ("skip_layers", cal.skip_layers and skips, REFUSE)):
        if label:
            c = cell(name, v, backend, cal.dtype, aspect, cal.architecture)
            cells.append(c)
            if c.effect is not E.APPLIED and served:
                lines.append(f"{label} {c.effect.value} ({c.note})")
                sev = max(sev, severity, key=_RANK.__getitem__)
    return Consequence(name, v, backend, tuple(cells), sev, tuple(lines))


def outcome(engine_name: str, cal: Calibrated, version: str | Version | None = None,
            backend: str | Sequence[str] | None = None) -> Outcome:
    """What `engine_name` (at `version`; None: the newest read) does with `cal`, on `backend` (None: each)."""
    e = engine(engine_name)
    v = version_of(engine_name, version)
    backends = list(e.backends) if backend is None else [backend] if isinstance(backend, str) else list(backend)
    return Outcome(engine_name, v, tuple(_consequence(engine_name, v, b, cal) for b in backends), cal)


def who_serves(kv_format: str, granularity: str = "tensor") -> str:
    """One sentence: which engines (newest versions read) serve calibrated `kv_format` scales as calibrated, which
    run them differently, and which refuse — for advice that must not name an engine that ignores the scales."""
    groups: dict[str, list[str]] = {}
    for name, e in ENGINES.items():
        o = outcome(name, Calibrated(kv_format, granularity))
        at_one = any(c.cells[0].effect is E.IGNORED for c in o.per_backend)
        key = "applied" if o.severity == SAME else ("at_one" if at_one else "refused") if o.refused else "differs"
        groups.setdefault(key, []).append(f"{e.title} {o.version}")
    labels = (("applied", "applied as calibrated by"), ("differs", "served differently by"),
              ("at_one", "run at scale 1.0 by"), ("refused", "not served by"))
    parts = [f"{label} {', '.join(groups[key])}" for key, label in labels if groups.get(key)]
    built = [f"{ENGINES[n].title} +{b}" for n in ENGINES for b in builds(n, kv_format, granularity)]
    text = f"calibrated {kv_format} KV scales are " + "; ".join(parts)
    return text + (f" (applied by a build: {', '.join(built)})" if built else "")
