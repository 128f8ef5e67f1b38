"""A YAML reader for small hand-written settings files (recipes) that refuses what YAML can hide.

Why not plain `yaml.safe_load`: it is safe from code execution but not from surprises.
  - Anchors and aliases let 441 bytes expand into billions of nodes (the "billion laughs" bomb); a recipe
    never needs them, so the first anchor, alias or merge key (`<<`) is an error — before any expansion.
  - A duplicate key silently keeps the last value: `headroom: 2` … `headroom: 1` ships the wrong scales.
  - Nesting and size are bounded (MAX_DEPTH collections deep, MAX_BYTES bytes) before parsing continues.
Errors are one line: the file, the line and what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from calib.errors import KvcalibError

MAX_BYTES = 64 * 1024
MAX_DEPTH = 16
_MERGE_TAG = "tag:yaml.org,2002:merge"


class SafeYAMLError(KvcalibError, ValueError):
    """The file is not a plain YAML document we accept; the message names the file, line and fix."""


class _Refused(KvcalibError, yaml.YAMLError):
    def __init__(self, mark: Any, message: str) -> None:
        super().__init__(f"line {mark.line + 1}: {message}" if mark is not None else message)


class _Loader(yaml.SafeLoader):
    """SafeLoader without anchors/aliases/merge keys, with unique keys and a nesting limit."""

    max_depth = MAX_DEPTH

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if getattr(event, "anchor", None):
            what = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise _Refused(event.start_mark, f"{what}{event.anchor}: anchors and aliases are not allowed; write the "
                                             "value out")
        nested = isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent))
        if nested:
            self._depth += 1
            if self._depth > self.max_depth:
                raise _Refused(event.start_mark, f"nested deeper than {self.max_depth} levels")
        try:
            return super().compose_node(parent, index)
        finally:
            if nested:
                self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                raise _Refused(key_node.start_mark, "merge key '<<' is not allowed; write the fields out")
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base constructor says so
                continue
            if first is not key_node.start_mark:
                raise _Refused(key_node.start_mark, f"duplicate key {key!r} (first on line {first.line + 1}); "
                                                    "keep one")
        return super().construct_mapping(node, deep=deep)


def loads(text: str, where: str) -> Any:
    """Parse one YAML document from `text`; errors start with `where` (the file's name)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise SafeYAMLError(f"{where} is larger than {MAX_BYTES // 1024} KiB; a settings file is a few lines")
    loader = None
    try:
        loader = _Loader(text)  # the reader already refuses control characters here
        return loader.get_single_data()
    except RecursionError:
        raise SafeYAMLError(f"{where} is nested too deeply") from None
    except yaml.YAMLError as e:
        raise SafeYAMLError(f"{where} is not valid YAML: {_one_line(e)}") from None
    finally:
        if loader is not None:
            loader.dispose()


def load(path: str | Path, where: str | None = None) -> Any:
    """Read and parse a YAML file (at most MAX_BYTES, UTF-8)."""
    path = Path(path)
    where = where or str(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise SafeYAMLError(f"{where} cannot be read ({e.strerror or type(e).__name__})") from None
    if len(raw) > MAX_BYTES:
        raise SafeYAMLError(f"{where} is larger than {MAX_BYTES // 1024} KiB; a settings file is a few lines")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SafeYAMLError(f"{where} is not UTF-8 text") from None
    return loads(text, where)


def _one_line(e: yaml.YAMLError) -> str:
    if isinstance(e, _Refused):
        return str(e)
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or getattr(e, "context", None)
    if problem:
        where = f"line {mark.line + 1}: " if mark is not None else ""
        return f"{where}{problem}"[:200]
    text = str(e).strip().splitlines()
    return text[0][:200] if text else type(e).__name__
