"""The safetensors index, `model.safetensors.index.json`: which shard file holds each tensor.

Why a module of its own: the index is read by the model folder's checks before a load or an export
(calib.ckpt.integrity.scan: an error stops the run), by the written-checkpoint reader (verify, inspect, eval: a
problem to report) and written by the exporter. One parser and one writer keep them agreeing on what an
index holds. Works on parsed JSON (strict JSON reading is calib.ckpt.integrity's); imports nothing.
"""

from __future__ import annotations

from typing import Any

from calib.errors import KvcalibError


class WeightMapError(KvcalibError, ValueError):
    """An index's content is not a weight map; the message says what is wrong (the caller names the file)."""


def parse(index: Any) -> dict[str, str]:
    """The weight map (tensor name -> shard file name) of a parsed index. Shard names are returned as written:
    whether they stay inside the folder and hold their tensors is for the caller, who has the folder."""
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict) or not wmap:
        raise WeightMapError("no weight_map object naming tensors")
    bad = next(((k, v) for k, v in wmap.items() if not isinstance(v, str)), None)
    if bad is not None:
        raise WeightMapError(f"tensor {bad[0]!r} maps to {bad[1]!r}, not a file name")
    return {str(k): v for k, v in wmap.items()}


def metadata(index: dict[str, Any]) -> dict[str, Any]:
    """The index's `metadata` object ({} when absent). Loaders that read only the weight map ignore it."""
    meta = index.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise WeightMapError("'metadata' is not an object")
    return meta or {}


def document(weight_map: dict[str, str], total_size: int) -> dict[str, Any]:
    """The index as the exporter writes it: `total_size` (bytes of every mapped tensor) and the sorted map."""
    return {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
