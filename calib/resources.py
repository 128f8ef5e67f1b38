"""Where the shipped recipes, the sample data and the build cache live — one lookup for all of them.

Why a module: kvcalib runs from a source checkout (`make calibrate`) and from a plain `pip install .`
anywhere on disk. In a checkout the files sit in the repository's `recipes/` and `data/` folders; in an
installed wheel the same folders travel as package data (`calib.recipes`, `calib.sample_data`, mapped in
pyproject.toml). Code asks this module instead of walking up from `__file__`, so both layouts work and
`KVCALIB_HOME` can point all three at one folder (e.g. a shared read-only copy plus a writable cache).

Build cache (the embedded default model): the checkout's `build/`, else `$KVCALIB_CACHE`, else
`~/.cache/kvcalib` — never inside site-packages.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent


def _is_checkout(root: Path) -> bool:
    """True when `root` is this project's source tree (its pyproject names the kvcalib project)."""
    try:
        return 'name = "kvcalib"' in (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False


def _locate(folder: str, package: str) -> Path:
    if home := os.environ.get("KVCALIB_HOME"):
        return Path(home) / folder
    if _is_checkout(_CHECKOUT):
        return _CHECKOUT / folder
    spec = importlib.util.find_spec(package)   # a data-only (namespace) package: its folder is the first location
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"kvcalib's {folder}/ is not installed; set KVCALIB_HOME to a folder holding {folder}/")
    return Path(next(iter(spec.submodule_search_locations)))


def recipes_dir() -> Path:
    """The shipped recipes (`NAME.yaml`)."""
    return _locate("recipes", "calib.recipes")


def default_data() -> Path:
    """The calibration text used when no --data is given (from the sample data the project wrote)."""
    return _locate("data", "calib.sample_data") / "sample_text.jsonl"


def build_dir() -> Path:
    """Writable cache for what kvcalib builds on first use (the embedded default model)."""
    if os.environ.get("KVCALIB_CACHE"):
        return Path(os.environ["KVCALIB_CACHE"])
    if os.environ.get("KVCALIB_HOME"):
        return Path(os.environ["KVCALIB_HOME"]) / "build"
    if _is_checkout(_CHECKOUT):
        return _CHECKOUT / "build"
    return Path.home() / ".cache" / "kvcalib"


def shipped_recipe(name: str) -> Path:
    """Path of the shipped recipe NAME (it may not exist; the recipe loader says so)."""
    return recipes_dir() / f"{name}.yaml"


def shipped_recipes() -> list[Path]:
    return sorted(recipes_dir().glob("*.yaml"))
