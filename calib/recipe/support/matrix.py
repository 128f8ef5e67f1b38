"""The matrix itself: every engine's cells in one tuple, the lookups that find exactly one cell, the format lists,
the engines' skip rules, and the README's table.

Why derived here: the format lists come from calib.recipe.dtypes and the cells from each engine's module
(calib.recipe.support.engines), plus the cells nobody writes by hand (a format an engine has no name for is
refused there). A lookup that matches no cell or two is an error, so a gap or an overlap shows up in the tests,
not as a silent answer. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from calib.errors import KvcalibError
from calib.recipe import dtypes
from calib.recipe.support.base import ASPECTS, Cell, Effect, Engine, Evidence, Version, lacking_cells
from calib.recipe.support.engines import modules

_MODULES = modules()
ENGINES: dict[str, Engine] = {m.ENGINE.name: m.ENGINE for m in _MODULES}
CELLS: tuple[Cell, ...] = tuple(c for m in _MODULES for c in (*m.CELLS, *lacking_cells(m.ENGINE)))
NOTES: tuple[tuple[str, Evidence], ...] = tuple(n for m in _MODULES for n in getattr(m, "NOTES", ()))

KV_FORMATS = tuple(dtypes.KV_FORMATS)
STATIC_FORMATS = tuple(dtypes.KV_DTYPES)       # formats whose scales come from a checkpoint (kvcalib's dtypes)
DYNAMIC_FORMATS = tuple(n for n, d in dtypes.KV_FORMATS.items() if d.dynamic)


class SupportError(KvcalibError, LookupError):
    """A lookup outside the matrix: unknown engine, backend, format or aspect (the message names the choices)."""


def targets() -> tuple[str, ...]:
    """Every engine's name, in order: kvcalib's targets (one folder each in a multi-target output)."""
    return tuple(ENGINES)


def engine(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise SupportError(f"unknown engine {name!r}; the support matrix knows {sorted(ENGINES)}") from None


def version_of(name: str, version: str | Version | None) -> Version:
    """`version` parsed (None: the newest version read for that engine)."""
    e = engine(name)
    if version is None:
        return e.current
    return version if isinstance(version, Version) else Version.parse(version, default=e.current)


def cell(engine_name: str, version: str | Version | None, backend: str, kv_format: str, aspect: str,
         model: str | None = None) -> Cell:
    """The one cell for this engine version, backend, KV format, aspect and model architecture (None: any); a
    build-specific cell wins over the others, then a model-specific one."""
    e = engine(engine_name)
    for what, value, choices in (("backend", backend, e.backends), ("KV format", kv_format, KV_FORMATS),
                                 ("granularity", aspect, ASPECTS)):
        if value not in choices:
            raise SupportError(f"{e.title}: unknown {what} {value!r}; the matrix knows {list(choices)}")
    v = version_of(engine_name, version)
    found = [c for c in CELLS if c.engine == engine_name and c.covers(v, backend, kv_format, aspect, model)]
    found = [c for c in found if c.build] or found
    found = [c for c in found if c.models] or found
    if len(found) != 1:
        raise SupportError(f"{e.title} {v} {backend} {kv_format} {aspect}: {len(found)} cells match (the matrix "
                           "must have exactly one)")
    return found[0]


def effect(engine_name: str, version: str | Version | None, backend: str, kv_format: str, aspect: str,
           model: str | None = None) -> Effect:
    """What `engine_name` at `version` on `backend` does with `aspect` scales of a `kv_format` cache."""
    return cell(engine_name, version, backend, kv_format, aspect, model).effect


def applies(engine_name: str, aspect: str, kv_format: str = dtypes.FP8_E4M3.name) -> bool:
    """Whether some backend of the engine's newest version read applies `aspect` of `kv_format` (skip_layers:
    keeps layers in the model dtype; q_scale: reads a q_scale)."""
    return any(effect(engine_name, None, b, kv_format, aspect) is Effect.APPLIED for b in engine(engine_name).backends)


def builds(engine_name: str, kv_format: str, aspect: str | None = None) -> list[str]:
    """The build labels (e.g. pr18953) with which `engine_name` applies `kv_format` scales (of `aspect`: any)."""
    return sorted({c.build for c in CELLS if c.engine == engine_name and c.build and kv_format in c.formats
                   and (aspect is None or aspect in c.aspects)
                   and c.effect in (Effect.APPLIED, Effect.MAX_OVER_HEADS, Effect.SHARED_KV)})


def lacks_format(engine_name: str, kv_format: str) -> str | None:
    """None when `engine_name` has a `kv_format` cache; else the one line saying it has none and what to use (the
    engine's names are calib.recipe.dtypes': "vLLM has no static INT8 KV cache" is said here only)."""
    e, d = engine(engine_name), dtypes.kv_format(kv_format)
    if d.served(engine_name) is not None:
        return None
    kind = "static " if d.scaling == dtypes.STATIC else ""
    use = " or ".join(x.name for x in dtypes.for_engine(engine_name, dtypes.KV_DTYPES if kind else dtypes.KV_FORMATS))
    label = d.short.upper() if kind and d.short else d.name
    return f"{e.title} has no {kind}{label} KV cache ({e.lacks}); use dtype {use}"


def lacks_skip(engine_name: str) -> str | None:
    """None when `engine_name` keeps layers in the model dtype (its newest version's skip_layers cell); else the
    one line saying it cannot, and what to do instead."""
    if applies(engine_name, "skip_layers"):
        return None
    e = engine(engine_name)
    c = cell(engine_name, None, next(iter(e.backends)), dtypes.FP8_E4M3.name, "skip_layers")
    others = [x.title for n, x in ENGINES.items() if n != engine_name and applies(n, "skip_layers")]
    return (f"{e.title} cannot skip layers ({c.note}); drop skip_layers or the {engine_name} target"
            + (f", or serve the skipping variant with {' or '.join(others)}" if others else ""))


def q_scale_readers() -> tuple[str, ...]:
    """The engines some backend of which applies a q_scale (their newest versions read)."""
    return tuple(n for n in ENGINES if applies(n, "q_scale"))


# ------------------------------------------------------------------------------------------ skipping layers

SKIP_KINDS = {name: e.skip_kinds for name, e in ENGINES.items() if e.skip_kinds}


def skip_order(items: Iterable[int | str]) -> list[int | str]:
    """A skip list in one order whatever order it was built in: layer numbers ascending, then kind names. The flag
    takes both, and Python cannot sort a number against a name; a list that names a kind and numbers layers (a
    checkpoint's own skips on a hybrid model) must still give one key, one engine start and one flag per set."""
    seen = set(items)
    names = sorted(i for i in seen if isinstance(i, str))
    return [*sorted(i for i in seen if not isinstance(i, str)), *names]


def skip_by_kind(engine_name: str, kind: str = "sliding_window") -> str | None:
    """None when `engine_name` keeps layers of `kind` at the model dtype by name; else the one line saying it
    cannot, and what it can do instead (from the skip_layers cell of the support matrix)."""
    e = engine(engine_name)
    if kind in e.skip_kinds:
        return None
    c = cell(engine_name, None, next(iter(e.backends)), "fp8_e4m3", "skip_layers")
    if c.effect is Effect.APPLIED:
        return (f"{e.title} cannot name {kind} layers in its skip option; they are exported as layer indices "
                f"({c.note})")
    return f"{e.title} cannot keep {kind.replace('_', '-')} layers at the model dtype: {c.note}"


# ------------------------------------------------------------------------------------------ the README table

def markdown() -> str:
    """The matrix as a markdown table, one row per cell, its sources numbered in a list under the table."""
    def names(keys: frozenset[str] | None, order: Sequence[str], label: dict[str, str] | None = None) -> str:
        if keys is None or len(keys) == len(order):
            return "all"
        return ", ".join((label or {}).get(k, k) for k in order if k in keys)

    refs: dict[Evidence, int] = {}
    rows = ["| engine | versions | backend | KV format | scales | model | effect | what happens | source |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in CELLS:
        e = ENGINES[c.engine]
        nums = " ".join(f"[{refs.setdefault(x, len(refs) + 1)}]" for x in c.evidence)
        model = "all" if c.models is None else ", ".join(sorted(c.models))
        rows.append(f"| {e.title} | {c.versions()} | {names(c.backends, list(e.backends), dict(e.backends))} "
                    f"| {names(c.formats, KV_FORMATS)} | {names(c.aspects, ASPECTS)} | {model} "
                    f"| **{c.effect.value}** | {c.note.replace('|', '/')} | {nums} |")
    notes = [f"- {text} [{refs.setdefault(x, len(refs) + 1)}]" for text, x in NOTES]
    read = "; ".join(f"{e.title}: {e.read}" for e in ENGINES.values())
    cites = [f"{n}. {x.cite()}" for x, n in refs.items()]
    return "\n".join([*rows, "", *(["Read, not a cell:", "", *notes, ""] if notes else []), f"Read from: {read}.", "",
                      *cites]) + "\n"
