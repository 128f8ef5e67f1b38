"""Helpers both engines' rules need: reading ModelOpt / compressed-tensors config shapes, dtype and value checks.

The ModelOpt readers are also what `calib.trtllm` (the exporter) uses; they live here because this
package must never import torch and that module does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ._checkpoint import Problem, _Scale

_EXACT_DTYPES = ("F32", "F64")
_ROUNDING_DTYPES = ("BF16", "F16")


def _is_modelopt(qc: Any) -> bool:
    """tensorrt_llm/quantization/modelopt_config.py: is_modelopt_quant_config."""
    return isinstance(qc, dict) and (str(qc.get("quant_method", "")).lower().startswith("modelopt")
                                     or producer_name(qc) == "modelopt")


def producer_name(qc: dict[str, Any]) -> Any:
    """`producer.name` of a config, None when `producer` is not an object."""
    producer = qc.get("producer")
    return producer.get("name") if isinstance(producer, dict) else None


def _modelopt_flat(qc: dict[str, Any]) -> dict[str, Any]:
    """ModelOpt's flat shape as a legacy `quantization` dict, less `kv_cache_quant_algo` (callers read
    `kv_cache_scheme` themselves): `ignore` becomes `exclude_modules`, the marker keys go."""
    inner = {k: v for k, v in qc.items() if k not in ("producer", "quant_method", "ignore", "kv_cache_scheme",
                                                     "config_groups")}
    if "ignore" in qc:
        inner["exclude_modules"] = qc["ignore"]
    return inner


def _modelopt_inner(qc: dict[str, Any]) -> dict[str, Any] | None:
    """The legacy `quantization` dict from either ModelOpt shape; None when neither shape fits.

    tensorrt_llm/quantization/modelopt_config.py: read_modelopt_quant_config (legacy wrapper
    `quantization`, or the flat shape with `ignore` and a `kv_cache_scheme` dict).
    """
    if "quantization" in qc:
        return qc["quantization"] if isinstance(qc["quantization"], dict) else None
    if not _is_modelopt(qc):
        return None
    inner = _modelopt_flat(qc)
    scheme = qc.get("kv_cache_scheme")
    if isinstance(scheme, str):
        inner["kv_cache_quant_algo"] = scheme.upper()
    elif isinstance(scheme, dict):
        inner["kv_cache_quant_algo"] = {("float", 8): "FP8", ("float", 4): "NVFP4", ("int", 8): "INT8"}.get(
            (scheme.get("type"), scheme.get("num_bits")))
    return inner


def _ct(qc: dict[str, Any]) -> bool:
    return str(qc.get("quant_method", "")).lower().replace("_", "-") == "compressed-tensors"


def _dtype_problems(engine: str, scales: Iterable[_Scale]) -> Iterator[Problem]:
    for s in scales:
        t = s.tensor
        if t.dtype in _ROUNDING_DTYPES:
            yield Problem(engine, t.name, f"dtype {t.dtype}: the engine widens it to float32, but the stored "
                          "scale keeps only ~3 significant digits; store float32", "warning", f"{engine}.dtype")
        elif t.dtype not in _EXACT_DTYPES:
            yield Problem(engine, t.name, f"dtype {t.dtype}: a scale must be a float32 value", code=f"{engine}.dtype")


def _first_bad(vals: np.ndarray) -> str:
    bad = vals[~np.isfinite(vals)]
    return repr(float(bad[0])) if bad.size else "?"
