"""Checks both engines' rules share: scale dtypes and the first bad value (the configs' readers are calib.ckpt's)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from calib.ckpt.reader import Problem, ScaleTensor

_EXACT_DTYPES = ("F32", "F64")
_ROUNDING_DTYPES = ("BF16", "F16")


def dtype_problems(engine: str, scales: Iterable[ScaleTensor]) -> Iterator[Problem]:
    for s in scales:
        t = s.tensor
        if t.dtype in _ROUNDING_DTYPES:
            yield Problem(engine, t.name, f"dtype {t.dtype}: the engine widens it to float32, but the stored "
                          "scale keeps only ~3 significant digits; store float32", "warning", f"{engine}.dtype")
        elif t.dtype not in _EXACT_DTYPES:
            yield Problem(engine, t.name, f"dtype {t.dtype}: a scale must be a float32 value", code=f"{engine}.dtype")


def first_bad(vals: np.ndarray) -> str:
    bad = vals[~np.isfinite(vals)]
    return repr(float(bad[0])) if bad.size else "?"
