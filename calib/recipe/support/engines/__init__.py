"""One module per serving engine, each defining `ENGINE` (calib.recipe.support.base.Engine) and `CELLS`: what that
engine does with a checkpoint's KV scales, every cell citing where it was read.

Why one module each: adding an engine (and kvcalib's target of the same name) is one new module here, plus its
names for the KV formats it has (calib.recipe.dtypes) and its writer (calib.export): the matrix, the recipe's
target names, the serve commands and `inspect` find it. Torch-free.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from calib.recipe.support.base import Engine


def modules(path: list[str] | None = None, package: str = __name__) -> list[ModuleType]:
    """The engine modules of this package (or of `package` at `path`), in their engines' `order`."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__ if path is None else path))
    found = [importlib.import_module(f"{package}.{n}") for n in names]
    found = [m for m in found if isinstance(getattr(m, "ENGINE", None), Engine)]
    return sorted(found, key=lambda m: (m.ENGINE.order, m.ENGINE.name))
