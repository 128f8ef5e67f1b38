"""Checks both engines' rules share: scale dtypes and the first bad value (the configs' readers are calib.ckpt's)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from calib.ckpt.reader import CheckpointFiles, Problem, ScaleTensor

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


# the smallest normal float32: below it a scale is subnormal (or zero), dividing K/V by it overflows, every value
# saturates at the format's largest and dequantises to about nothing (k_scale 1e-45 holds 448 x 1e-45)
SMALLEST_SCALE = float(np.finfo(np.float32).tiny)


def subnormal(vals: np.ndarray) -> str | None:
    """The first positive scale below the smallest normal float32, as the message's clause; None when none is."""
    low = vals[(vals > 0) & (vals < SMALLEST_SCALE)]
    if not low.size:
        return None
    return (f"holds {float(low[0])!r}, below the smallest normal float32 ({SMALLEST_SCALE:.3g}): dividing K/V by "
            "it overflows and every value saturates; recalibrate or remove the scale")


def scalar_problems(engine: str, ck: CheckpointFiles, scales: Iterable[ScaleTensor], *, shape_why: str,
                    nonfinite_why: str, nonpositive_why: str) -> Iterator[Problem]:
    """The rules of an engine that reads one finite, positive scalar per scale (TensorRT-LLM, SGLang): the shape,
    the dtype, then the values; each `*_why` is the engine's consequence, appended to the problem's text."""
    scales = list(scales)
    for s in scales:
        if s.tensor.numel != 1:
            yield Problem(engine, s.tensor.name, f"shape {list(s.tensor.shape)}{shape_why}", code=f"{engine}.shape")
    yield from dtype_problems(engine, scales)
    yield from value_problems(engine, ck, scales, nonfinite_why, nonpositive_why)


def value_problems(engine: str, ck: CheckpointFiles, scales: Iterable[ScaleTensor], nonfinite_why: str,
                   nonpositive_why: str) -> Iterator[Problem]:
    """The first non-finite, non-positive or subnormal value of each scale, with the engine's consequence."""
    for s in scales:
        vals = ck.values(s.tensor)
        if vals is None or vals.size == 0:
            continue
        if not np.isfinite(vals).all():
            bad = float(vals[~np.isfinite(vals)][0])
            yield Problem(engine, s.tensor.name, f"holds a non-finite value ({bad!r}){nonfinite_why}",
                          code=f"{engine}.value")
        elif (vals <= 0).any():
            yield Problem(engine, s.tensor.name, f"holds {float(vals[vals <= 0][0])!r}{nonpositive_why}",
                          code=f"{engine}.value")
        elif subnormal(vals):
            yield Problem(engine, s.tensor.name, subnormal(vals), code=f"{engine}.value")


def where_qc(source: str | None, key: str = "") -> str:
    """A quantization config's key as a problem names it: `config.json:quantization_config.KEY` or `FILE.KEY`."""
    base = f"{source}:quantization_config" if source == "config.json" else str(source or "config.json")
    return f"{base}.{key}" if key else base


def unmapped_problems(engine: str, ck: CheckpointFiles, files, *, never_read: str, cannot_check: str
                      ) -> Iterator[Problem]:
    """Scale names `engine` maps to no attention layer (calib.ckpt.reader: CheckpointFiles.unmapped): an error
    where kvcalib knows the layout (`never_read`: what the engine does then), a warning where it does not
    (`cannot_check`: what kvcalib cannot confirm)."""
    for u in ck.unmapped(files):
        if u.known:
            yield Problem(engine, u.tensor.name, f"{u.why}: {never_read}", code=f"{engine}.unmapped-name")
        else:
            yield Problem(engine, u.tensor.name, f"{u.why}; its module holds weights, but kvcalib does not know "
                          f"this layout and cannot check that {cannot_check}", "warning", f"{engine}.unverified-name")
