"""The support matrix's vocabulary: what can happen to a checkpoint's scales (`Effect`), where a fact was read
(`Source`) or measured (`Measurement`), engine versions (`Version`), what an engine is (`Engine`) and one fact
over a range of versions, backends, formats, aspects and model architectures (`Cell`).

Why apart from the cells: each engine's module (calib.recipe.support.engines) builds its `Engine` and its cells
from these types alone, so adding an engine is one module there and nothing here. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from calib.recipe import dtypes


class Effect(Enum):
    """What an engine does with the scales of one cell."""
    APPLIED = "applied"
    MAX_OVER_HEADS = "applied as max over heads"
    SHARED_KV = "applied as one max(k, v)"
    IGNORED = "ignored: runs at 1.0"
    UNQUANTIZED = "not quantized"
    BROKEN = "accepted but broken"
    REFUSED = "refused"
    UNREAD = "not read"


# What a cell is about: a checkpoint's per-tensor or per-head k/v scales, its q_scale, what Q gets when the
# checkpoint has no q_scale, and layers kept in the model dtype.
ASPECTS = ("tensor", "head", "q_scale", "q_absent", "skip_layers")
EVERY_FORMAT = tuple(dtypes.KV_FORMATS)      # every format kvcalib knows, whether the engine has it or not


@dataclass(frozen=True)
class Source:
    """A fact read from an engine's source: repository, file, function, and the version or commit read."""
    repo: str
    file: str
    function: str
    version: str

    def cite(self) -> str:
        return f"{self.repo} `{self.file}` `{self.function}` ({self.version})"


@dataclass(frozen=True)
class Measurement:
    """A fact found by running the engine: what was measured, and when."""
    what: str
    date: str

    def cite(self) -> str:
        return f"measured {self.date}: {self.what}"


Evidence = Source | Measurement


def source_maker(repo: str, version: str, prefix: str = ""):
    """`s(file, function, version=version)`: a Source in `repo`, `file` a path under `prefix`."""
    return lambda file, function, read=version: Source(repo, prefix + file, function, read)

# numbers, then at most a PEP 440 pre/post/dev tag (0.11.0rc1, 0.5.18.post1), nothing else: "0.5.18garbage" is a typo
_NUM = re.compile(r"^v?(\d+(?:\.\d+)*)(?:[.-]?(?:a|b|rc|post|dev)\d*)*$")


@dataclass(frozen=True, order=True)
class Version:
    """An engine version: numbers, plus build labels after `+` (e.g. `1.2+pr18953`, a build with that pull
    request). A bare label (`pr18953`) means the engine's current version with that build."""
    numbers: tuple[int, ...]
    builds: frozenset[str] = field(default=frozenset(), compare=False)

    @classmethod
    def parse(cls, text: str, default: Version | None = None) -> Version:
        text = str(text).strip().lower()
        base, _, labels = text.partition("+")
        builds = frozenset(x for x in re.split(r"[.+,]", labels) if x)
        m = _NUM.match(base)
        if m:
            nums = tuple(int(x) for x in m.group(1).split("."))
        elif base and default is not None and re.fullmatch(r"[a-z][a-z0-9_-]*", base):
            nums, builds = default.numbers, builds | {base}
        else:
            raise ValueError(f"engine version {text!r}: give numbers like 0.34.0, optionally +BUILD (e.g. 1.2+pr18953)")
        while len(nums) > 1 and nums[-1] == 0:
            nums = nums[:-1]
        return cls(nums, builds)

    def __str__(self) -> str:
        return ".".join(map(str, self.numbers)) + ("+" + "+".join(sorted(self.builds)) if self.builds else "")


def v(text: str | None) -> Version | None:
    return None if text is None else Version.parse(text)


@dataclass(frozen=True)
class TuneSpace:
    """What `kvcalib tune` searches on an engine by default, besides its static formats: the granularities and
    the q_scale choices."""
    granularities: tuple[str, ...] = ("tensor",)
    q_scale: tuple[bool, ...] = (False,)


@dataclass(frozen=True)
class Engine:
    """One engine (and kvcalib's target of the same name): how messages name it and its backends, the newest
    version read (the default), how it is served, and how it refuses a KV format it has no name for
    (calib.recipe.dtypes: a format whose `engines` lacks this engine).

    `serve`: the serve command's head, `{model}` where the model goes; `context_flag`: the option setting the
    context length; `kv_flag`: the option naming the KV format (None: the checkpoint says it); `backend_flag`: the
    option choosing the attention backend a format needs; `skip_flag`: the option keeping layers in the model
    dtype (None: none), `skip_kinds`: the layer kinds it names there; `span`: the versions its cells cover (the
    others are the module's own cells); `tune`: what tune searches on it (None: tune does not)."""
    name: str
    title: str
    order: int
    backends: Mapping[str, str]
    current: Version
    read: str
    serve: tuple[str, ...]
    context_flag: str
    option: str                                  # what names a KV format there, for "not a ... before VERSION"
    lacks: str                                   # why a format the engine has no name for is refused
    lacks_evidence: tuple[Evidence, ...]
    kv_flag: str | None = None
    backend_flag: str | None = None
    skip_flag: str | None = None
    skip_kinds: tuple[str, ...] = ()
    span: tuple[str | None, str | None] = (None, None)
    tune: TuneSpace | None = None


@dataclass(frozen=True)
class Cell:
    """One fact: over versions [since, until) of `engine` (`build`: only builds carrying that label), on
    `backends`, for KV `formats` and `aspects` (`models`: only these architectures, config.json `architectures`;
    None: any), the scales get `effect`; `note` says how, in one clause."""
    engine: str
    backends: frozenset[str]
    formats: frozenset[str]
    aspects: frozenset[str]
    effect: Effect
    note: str
    evidence: tuple[Evidence, ...]
    since: Version | None = None
    until: Version | None = None
    build: str | None = None
    models: frozenset[str] | None = None

    def covers(self, version: Version, backend: str, kv_format: str, aspect: str, model: str | None = None) -> bool:
        return (backend in self.backends and kv_format in self.formats and aspect in self.aspects
                and (self.since is None or version >= self.since) and (self.until is None or version < self.until)
                and (self.build is None or self.build in version.builds)
                and (self.models is None or model in self.models))

    def versions(self) -> str:
        lo, hi = self.since, self.until
        text = ("all" if lo is None and hi is None else f">= {lo}" if hi is None else f"< {hi}" if lo is None
                else f"{lo} – <{hi}")
        return text + (f" +{self.build}" if self.build else "")


def cell_maker(engine: Engine):
    """`c(backends, formats, aspects, effect, note, *evidence, since=, until=, build=, models=)` for `engine`'s
    cells; "*" stands for every backend, every format the engine has (calib.recipe.dtypes), every aspect."""
    have = tuple(d.name for d in dtypes.for_engine(engine.name, dtypes.KV_FORMATS))

    def fs(x: Iterable[str] | str, every: Iterable[str]) -> frozenset[str]:
        return frozenset(every) if x == "*" else frozenset([x] if isinstance(x, str) else x)

    def c(backends: Iterable[str] | str, formats: Iterable[str] | str, aspects: Iterable[str] | str, effect: Effect,
          note: str, *evidence: Evidence, since: str | None = None, until: str | None = None,
          build: str | None = None, models: Iterable[str] | None = None) -> Cell:
        return Cell(engine.name, fs(backends, engine.backends), fs(formats, have), fs(aspects, ASPECTS), effect, note,
                    tuple(evidence), v(since), v(until), build, None if models is None else frozenset(models))
    return c


def lacking_cells(engine: Engine) -> tuple[Cell, ...]:
    """The cells no engine module writes: a format the engine has no name for is refused (every backend and
    aspect, over the engine's span), and one it gained in a later version is refused before it."""
    lo, hi = engine.span
    out = []
    for d in dtypes.KV_FORMATS.values():
        served = d.served(engine.name)
        if served is None or served.since is not None:
            note, until = (engine.lacks, hi) if served is None else (f"not a {engine.option} before {served.since}",
                                                                     served.since)
            out.append(Cell(engine.name, frozenset(engine.backends), frozenset([d.name]), frozenset(ASPECTS),
                            Effect.REFUSED, note, engine.lacks_evidence, v(lo), v(until)))
    return tuple(out)
