"""Finding the modules of a package that declare one thing: an engine's export target, an engine's checks.

Why a module of its own: adding an engine should be adding a file. calib.export and calib.verify list no
engine by name; each asks its own modules for one attribute of one type. Imports nothing of calib and no
torch.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def collect(path: Iterable[str], package: str, attr: str, kind: type[T]) -> list[T]:
    """The `attr` of every module of `package` (found at `path`) where it is a `kind`, by module name."""
    found = []
    for m in sorted(pkgutil.iter_modules(list(path)), key=lambda m: m.name):
        value = getattr(importlib.import_module(f"{package}.{m.name}"), attr, None)
        if isinstance(value, kind):
            found.append(value)
    return found
