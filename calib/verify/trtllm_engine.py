"""TensorRT-LLM's TensorRT-engine backend: the rules its checkpoint loader applies to a converted checkpoint's KV
scales (the `trtllm-engine` target, calib/export/trtllm_engine.py).

The checkpoint is TensorRT-LLM's own, not a Hugging Face folder: its layout, and where in NVIDIA/TensorRT-LLM
(1.2.x and the 1.3.0 release candidates) each rule below was read, is calib/export/trtllm_engine.py's docstring.
Imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from calib.ckpt import formats
from calib.ckpt.names import trtllm_ckpt_scale_name
from calib.ckpt.reader import CheckpointFiles, Problem
from calib.verify.checker import Checker
from calib.verify.common import SMALLEST_SCALE

NAME = "trtllm-engine"


def declared(ck: CheckpointFiles) -> bool:
    return formats.is_trtllm_checkpoint(ck.config)


def view(ck: CheckpointFiles) -> dict[str, Any]:
    """The checkpoint's grid, its declared KV algorithm and, per rank file, its scale tensors (dtype, shape,
    values) or why the file could not be read."""
    from safetensors import safe_open

    quant = ck.config.get("quantization")      # ck.config is {} where config.json is unreadable
    out: dict[str, Any] = {"algo": quant.get("kv_cache_quant_algo") if isinstance(quant, dict) else None, "ranks": {},
                           "error": None}
    try:
        n, tp, pp = formats.trtllm_ckpt_grid(ck.config)
    except ValueError as e:
        out["error"] = str(e)
        return out
    out["tp"] = tp
    for r, layers in formats.trtllm_rank_layers(n, tp, pp).items():
        path = ck.path / f"rank{r}.safetensors"
        found: dict[int, Any] = {}
        try:
            with safe_open(str(path), framework="numpy") as f:
                keys = set(f.keys())
                for j, layer in enumerate(layers):
                    name = trtllm_ckpt_scale_name(j)
                    if name in keys:
                        t = f.get_tensor(name)
                        found[layer] = (str(t.dtype), list(t.shape), [float(x) for x in t.reshape(-1)[:4]])
            out["ranks"][r] = {"file": path.name, "layers": layers, "scales": found}
        except (OSError, ValueError, RuntimeError) as e:
            out["ranks"][r] = {"file": path.name, "layers": layers, "error": str(e)[:200]}
    return out


def _p(where: str, message: str, severity: str = "error", code: str = "") -> Problem:
    return Problem(NAME, where, message, severity, code)


def grid_and_algo(ck: CheckpointFiles, v: dict[str, Any]) -> Iterator[Problem]:
    """modeling_utils.py PretrainedConfig / Mapping: a valid tp x pp grid; quantize.py: FP8 or INT8 KV declared."""
    if v["error"]:
        yield _p("config.json", v["error"], code="trtllm-engine.grid")
    if v["algo"] not in formats.TRTLLM_CKPT_KV_ALGOS:
        yield _p("config.json", f"quantization.kv_cache_quant_algo = {v['algo']!r}: the engine builds no quantized KV "
                 f"cache without one of {list(formats.TRTLLM_CKPT_KV_ALGOS)}", code="trtllm-engine.no-kv-algo")


def every_layer_scaled(ck: CheckpointFiles, v: dict[str, Any]) -> Iterator[Problem]:
    """PretrainedModel.load: every rank file holds `kv_cache_scaling_factor` for each of its (stage-local) layers
    (declared by every attention layer once a KV algorithm is set)."""
    if v["algo"] not in formats.TRTLLM_CKPT_KV_ALGOS:
        return
    for r in v["ranks"].values():
        if "error" in r:
            yield _p(r["file"], f"cannot be read: {r['error']}", code="trtllm-engine.rank-file")
            continue
        missing = [layer for layer in r["layers"] if layer not in r["scales"]]
        if missing:
            yield _p(r["file"], f"no kv_cache_scaling_factor for layer(s) {missing[:6]}: PretrainedModel.load "
                     "refuses a checkpoint missing a declared tensor", code="trtllm-engine.missing")


def scale_values(ck: CheckpointFiles, v: dict[str, Any]) -> Iterator[Problem]:
    """process_kv_scaling_factor: one float32 value a layer, finite and > 0 (its reciprocal is taken); and, since
    every tensor-parallel rank of a stage serves the same layer, the same value on each."""
    seen: dict[int, float] = {}
    for r in v["ranks"].values():
        for layer, (dtype, shape, vals) in r.get("scales", {}).items():
            name = f"{r['file']}: layer {layer}"
            if dtype != "float32" or shape != [1]:
                yield _p(name, f"kv_cache_scaling_factor is {dtype} {shape}; the engine expects float32 [1]",
                         code="trtllm-engine.shape")
            if not vals or not all(math.isfinite(x) and x >= SMALLEST_SCALE for x in vals):
                yield _p(name, f"kv_cache_scaling_factor = {vals[:1]}: must be finite and a normal positive float32",
                         code="trtllm-engine.value")
                continue
            if layer in seen and seen[layer] != vals[0]:
                yield _p(name, f"kv_cache_scaling_factor {vals[0]:.6g} differs from another rank's {seen[layer]:.6g} "
                         "for the same layer", "warning", code="trtllm-engine.ranks-differ")
            seen.setdefault(layer, vals[0])


CHECKER = Checker(NAME, view, (grid_and_algo, every_layer_scaled, scale_values), declared)
