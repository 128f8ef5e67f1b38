"""routes.yaml: named routes, each with its held-out data, length buckets and quality bar.

Why strict: the file decides where a service keeps BF16, so a typo (`max_kl: 0.1` meant as 0.01 is a value, but
`max_k1:` is a key) must be an error, not a default. Read with the project's safe YAML reader; every error is one
line naming the file, the route and the field. Data paths are relative to the file's folder; a route whose data
is missing or empty is an error naming it, before any model loads.

    routes:
      chat:                          # a name: letters, digits, . _ -
        data: chat.jsonl             # held-out records of this traffic (any format `kvcalib eval --data` reads)
        buckets: [512, 2048]         # context lengths (tokens)
        samples: 32                  # optional (default 64); pack: true fills every bucket with long text
        bar: {max_kl: 0.01, max_ppl_increase: 0.01, min_passkey: 0.8}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from calib.errors import KvcalibError
from calib.recipe import safeyaml
from calib.safety import readers
from calib.safety.files import expand_user

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_ROUTES = 64
# the plan folder's own files beside the route folders (calib/routes/plan.py writes them): a route of that name
# would collide with them after every route was evaluated
PLAN_FILES = ("plan.json", "plan.md")


class RoutesError(KvcalibError, ValueError):
    """The routes file is not usable; the message names the file, the route and the field."""


@dataclass(frozen=True)
class Bar:
    """When FP8 KV is good enough for a route: mean KL <= max_kl nats in every bucket, perplexity at most
    max_ppl_increase above BF16's (0.01 = +1 %), and (when set) passkey accuracy >= min_passkey in every bucket."""
    max_kl: float = 0.01
    max_ppl_increase: float = 0.01
    min_passkey: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Route:
    name: str
    data: Path
    buckets: tuple[int, ...]
    bar: Bar = Bar()
    samples: int = 64
    pack: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"data": str(self.data), "buckets": list(self.buckets), "bar": self.bar.to_dict(),
                "samples": self.samples, "pack": self.pack}


@dataclass(frozen=True)
class Routes:
    source: Path
    routes: tuple[Route, ...]


def _mapping(v: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise RoutesError(f"{where} must be a mapping of field: value, got {type(v).__name__}")
    if unknown := [k for k in v if k not in allowed]:
        raise RoutesError(f"{where}: unknown field {str(unknown[0])!r} (fields: {', '.join(allowed)})")
    return v


def _bar(v: Any, where: str) -> Bar:
    d = _mapping({} if v is None else v, f"{where} field 'bar'", tuple(f.name for f in fields(Bar)))
    with readers.raising(RoutesError):       # min_passkey: an accuracy, 0.8 = 80 %
        return Bar(**{k: readers.number(x, f"{where} field 'bar.{k}'", 0, 1 if k == "min_passkey" else None,
                                        null=k == "min_passkey") for k, x in d.items()})


def _data(v: Any, base: Path, where: str) -> Path:
    """The route's data as an absolute path (`~` expanded, relative to the routes file's folder), present and
    not empty: checked on a few bytes, never by reading a file whole (route data may be larger than memory)."""
    if not isinstance(v, str) or not v.strip():
        raise RoutesError(f"{where} field 'data' = {v!r}: give the path of the route's held-out data")
    with readers.raising(RoutesError, KvcalibError):
        path = expand_user(v, f"{where} field 'data':")
    path = path if path.is_absolute() else base / path
    if not path.exists():
        raise RoutesError(f"{where} field 'data': {path} not found; each route needs its own held-out data")
    if not (path.is_dir() or path.is_file()):
        return path          # a pipe: checked by the data reader (calib.data.sources), never read here
    files = [path] if path.is_file() else (p for p in sorted(path.rglob("*")) if p.is_file())
    if not any(_holds_text(f) for f in files):
        raise RoutesError(f"{where} field 'data': {path} is empty; give the route held-out records")
    return path


def _holds_text(path: Path, chunk: int = 1 << 16) -> bool:
    """Whether the file holds anything but whitespace, read a chunk at a time up to the first byte that is not."""
    try:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                if block.strip():
                    return True
    except OSError:
        return True          # unreadable: the data reader names the file and the reason
    return False


def _route(name: Any, v: Any, base: Path, where: str) -> Route:
    if not isinstance(name, str) or not NAME.match(name):
        raise RoutesError(f"{where}: route name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)")
    at = f"{where} route '{name}'"
    d = _mapping(v, at, tuple(f.name for f in fields(Route) if f.name != "name"))
    for key in ("data", "buckets"):
        if key not in d:
            raise RoutesError(f"{at}: field '{key}' is missing")
    b = d["buckets"]
    if (not isinstance(b, list) or not b
            or not all(isinstance(x, int) and not isinstance(x, bool) and 2 <= x <= 1 << 24 for x in b)):
        raise RoutesError(f"{at} field 'buckets' = {b!r}: give a list of token lengths >= 2, e.g. [512, 2048]")
    with readers.raising(RoutesError):
        samples = readers.whole(d.get("samples", 64), f"{at} field 'samples'", 1, 1_000_000)
    pack = d.get("pack", False)
    if not isinstance(pack, bool):
        raise RoutesError(f"{at} field 'pack' = {pack!r}: give true or false")
    return Route(name, _data(d["data"], base, at), tuple(sorted(set(b))), _bar(d.get("bar"), at), samples, pack)


def load(path: str | Path) -> Routes:
    """Read and check a routes file (every route's data included); RoutesError names what is wrong."""
    path = Path(path)
    where = f"routes file {path}"
    if not path.is_file():
        raise RoutesError(f"{where} not found")
    with readers.raising(RoutesError, safeyaml.SafeYAMLError):
        doc = safeyaml.load(path, where=where)
    doc = _mapping({} if doc is None else doc, where, ("routes",))
    routes = doc.get("routes")
    if not isinstance(routes, dict) or not routes:
        raise RoutesError(f"{where}: field 'routes' must map route names to their data, buckets and bar")
    if len(routes) > MAX_ROUTES:
        raise RoutesError(f"{where}: {len(routes)} routes; at most {MAX_ROUTES}")
    _names(routes, where)
    base = path.resolve().parent
    return Routes(path, tuple(_route(n, v, base, where) for n, v in routes.items()))


def _names(routes: dict[Any, Any], where: str) -> None:
    """No route named like the plan's own files, and no two routes whose folders are one folder on a file system
    that ignores case (macOS, Windows): both are checked before any route is read or evaluated."""
    seen: dict[str, Any] = {}
    for name in routes:
        key = str(name).lower()
        if key in PLAN_FILES:
            raise RoutesError(f"{where}: route name {name!r} is the plan's own file {key}; rename the route")
        if key in seen:
            raise RoutesError(f"{where}: routes {seen[key]!r} and {name!r} differ only in case (one folder on many "
                              "file systems); rename one")
        seen[key] = name
