"""Fold observed K/V ranges into the scales an engine multiplies its FP8 cache by.

Semantics (both vLLM and TensorRT-LLM): the stored scale is the *dequantisation* multiplier. The engine
writes `fp8 = saturate(x / scale)` and reads `x ≈ fp8 * scale`, so `scale = amax * headroom / 448` maps the
largest observed |x| onto FP8 e4m3's largest finite value (448). A scale of 1.0 — what the engines use
when a checkpoint carries none — saturates every |x| > 448 and flushes every |x| < 2^-9 to zero.

Scales are float32 (a bf16 scale keeps only ~3 significant digits). An all-zero range gets the smallest normal
float32: any scale represents zeros exactly, and a zero or infinite scale would break the engine's division.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calib.recipe.dtypes import FP8_E4M3, KVDtype, kv_dtype
from calib.recipe.granularity import Granularity, by_name as granularity_by_name
from calib.scales.stats import Stats

FP8_E4M3_MAX = FP8_E4M3.qmax
MIN_SCALE = float(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class LayerScales:
    """Scales of one layer (float32; shape [] per tensor, [kv_heads] per head; q: [] or [heads]) plus the
    exact per-head ranges they came from."""
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_amax: torch.Tensor      # [kv_heads]
    v_amax: torch.Tensor      # [kv_heads]
    q_scale: torch.Tensor | None = None


Scales = dict[int, LayerScales]


def amax_to_scale(amax: torch.Tensor, headroom: float = 1.0, qmax: float = FP8_E4M3_MAX) -> torch.Tensor:
    """float32 scale(s) for the given range(s); never zero, negative or non-finite."""
    amax = amax.to(torch.float32)
    if not torch.isfinite(amax).all() or (amax < 0).any():
        raise ValueError(f"ranges must be finite and >= 0, got {amax.tolist()}")
    scale = amax * torch.tensor(headroom, dtype=torch.float32) / torch.tensor(qmax, dtype=torch.float32)
    scale = scale.clamp_min(MIN_SCALE)
    if not torch.isfinite(scale).all():
        raise ValueError(f"headroom {headroom} makes a scale overflow float32 for ranges {amax.tolist()}")
    return scale


def per_tensor_fp8(stats: Stats, headroom: float = 1.0) -> Scales:
    """One K and one V FP8 scale per layer: the max over KV heads of the observed range."""
    return compute(stats, dtype="fp8_e4m3", granularity="tensor", headroom=headroom)


def compute(stats: Stats, *, dtype: str | KVDtype, granularity: str | Granularity, headroom: float = 1.0) -> Scales:
    """Scales of every layer at `granularity` (`tensor`: max over heads; `head`: one per KV head) for `dtype`
    (registry values, or their names). K and V use the recipe observer's range; Q (when observed) its exact max."""
    gran = granularity_by_name(granularity) if isinstance(granularity, str) else granularity
    qmax = (kv_dtype(dtype) if isinstance(dtype, str) else dtype).qmax
    if not gran.exportable:
        raise ValueError(f"granularity {gran.name!r} is statistics only; no engine reads its scales")
    return {
        layer: LayerScales(
            k_scale=amax_to_scale(gran.fold(s.clip("k")), headroom, qmax),
            v_scale=amax_to_scale(gran.fold(s.clip("v")), headroom, qmax),
            k_amax=s.k_amax,
            v_amax=s.v_amax,
            q_scale=None if s.q_amax is None else amax_to_scale(gran.fold(s.q_amax), headroom, qmax),
        )
        for layer, s in sorted(stats.items())
    }


def shared_kv_scales(stats: Stats, *, dtype: str | KVDtype, headroom: float = 1.0) -> dict[int, torch.Tensor]:
    """One scale per layer shared by K and V (TensorRT-LLM's TensorRT-engine backend: one
    `kv_cache_scaling_factor` per layer; calib.export.trtllm_engine), float32 shape [1]: the max over K, V and
    KV heads of the recipe observer's range, as a scale. `amax_to_scale` is monotone, so this is
    max(k_scale, v_scale) of `compute` per tensor, and `shared_from_scales` agrees with it exactly."""
    qmax = (kv_dtype(dtype) if isinstance(dtype, str) else dtype).qmax
    return {layer: amax_to_scale(torch.maximum(s.clip("k").max(), s.clip("v").max()).reshape(1), headroom, qmax)
            for layer, s in sorted(stats.items())}


def shared_from_scales(scales: Scales) -> dict[int, torch.Tensor]:
    """The shared per-layer scale (float32 shape [1]) of scales already folded per K and per V: max over K and
    V (and heads) of the scales, which equals `shared_kv_scales` of the statistics they came from."""
    return {layer: torch.maximum(torch.as_tensor(s.k_scale, dtype=torch.float32).max(),
                                 torch.as_tensor(s.v_scale, dtype=torch.float32).max()).reshape(1).contiguous()
            for layer, s in sorted(scales.items())}


def per_tensor(s: LayerScales) -> tuple[float, float]:
    """(k, v) folded to one scale each — what engines that read a single scale per layer get."""
    return float(s.k_scale.max()), float(s.v_scale.max())
