"""Typed readers for JSON another process wrote: one value checked (type, range, size) or one line naming it.

Why one module: an engine runner's answer (calib/engine/answer.py) and a load generator's records
(calib/load/records.py) are untrusted input, and each used to carry its own "whole number / finite / list"
checks with its own wording. Here each check is written once, with one error grammar,
`<where> = <value>: expected <what>` (a list's length: `<where> holds <n> entries: expected <what>`), and a
caller turns `ReadError` into its own error class with `raising`. Standard library only, no pydantic: the
bounds depend on the request (a list as long as the prompt asked), which a schema would state in validators
anyway, and kvcalib does not depend on pydantic itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from calib.errors import KvcalibError

MAX_TEXT = 400                # characters kept of a text (a reason, a version, a dtype name)


class ReadError(KvcalibError, ValueError):
    """A value that is not what its field holds; the message names the field."""


@contextmanager
def raising(error: Callable[[str], Exception], *catch: type[Exception]) -> Iterator[None]:
    """Every ReadError (or each of `catch`) inside as `error(message)`: a caller keeps its error class or wrapper."""
    try:
        yield
    except catch or ReadError as e:
        raise error(str(e)) from None


def clean_text(value: str, limit: int = MAX_TEXT) -> str:
    """One printable line: control characters become spaces, lone surrogates U+FFFD, cut to `limit`."""
    out = "".join(" " if ord(c) < 32 or ord(c) == 127 else "\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c
                  for c in value[:limit * 2])
    return " ".join(out.split())[:limit]


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def fail(where: str, value: Any, what: str) -> NoReturn:
    raise ReadError(f"{where} = {show(value)}: expected {what}")


def _span(lo: float | None, hi: float | None, above: bool = False) -> str:
    """The bounds in words, exactly (2147483648, never 2.14748e+09)."""
    lo_, hi_ = (None if x is None else str(x) if isinstance(x, int) else f"{x:.12g}" for x in (lo, hi))
    if lo_ and hi_ and not above:
        return f" in [{lo_}, {hi_}]"
    parts = [f"{'>' if above else '>='} {lo_}"] * (lo is not None) + [f"<= {hi_}"] * (hi is not None)
    return " " + " and ".join(parts) if parts else ""


def whole(value: Any, where: str, lo: int = 0, hi: int | None = None, *, null: bool = False) -> int | None:
    """An int (never a bool) in [lo, hi]; None passes where `null`."""
    if value is None and null:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        fail(where, value, "a whole number" + _span(lo, hi))
    return value


def number(value: Any, where: str, lo: float | None = None, hi: float | None = None, *, above: bool = False,
           null: bool = False) -> float | None:
    """A finite number (never a bool) >= lo (> lo where `above`) and <= hi, as a float; None passes where `null`."""
    if value is None and null:
        return None
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (lo is not None and (value <= lo if above else value < lo)) or (hi is not None and value > hi):
        fail(where, value, "a finite number" + _span(lo, hi, above))
    return float(value)


def text(value: Any, where: str, limit: int = MAX_TEXT, *, null: bool = False) -> str | None:
    """A string, cleaned to one printable line of at most `limit` characters; None passes where `null`."""
    if value is None and null:
        return None
    if not isinstance(value, str):
        fail(where, value, "a string")
    return clean_text(value, limit)


def items(value: Any, where: str, n: int | None = None, *, lo: int = 0, hi: int | None = None) -> list:
    """A list of exactly `n` entries, else of lo to hi."""
    if not isinstance(value, list):
        fail(where, value, "a list")
    lo, hi = (n, n) if n is not None else (lo, hi)
    if len(value) < lo or (hi is not None and len(value) > hi):
        want = f"{lo}" if lo == hi else f"at most {hi}" if not lo else f"{lo} to {hi}" if hi is not None else f"{lo}+"
        raise ReadError(f"{where} holds {len(value)} entries: expected {want}")
    return value


def fields(doc: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """An object holding every `required` field and nothing beyond `optional`."""
    if not isinstance(doc, dict):
        raise ReadError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    if missing := [f for f in required if f not in doc]:
        raise ReadError(f"{where}: missing field(s) {', '.join(missing)}")
    if extra := sorted(str(f) for f in doc if f not in required + optional):
        raise ReadError(f"{where}: unknown field(s) {clean_text(', '.join(extra), 80)}")
    return doc
