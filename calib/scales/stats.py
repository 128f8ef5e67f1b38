"""What a capture hands on: one layer's ranges (`LayerStats`), a model's (`Stats`), and their flat tensor form.

Why a module of its own: the statistics are read by more stages than the one that records them (scales,
statistics files, evaluation, tune), none of which needs the attention hook (calib.capture.hook) that fills
them; it lives with the scales, their input, so the scales never import the capture.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class LayerStats:
    """What one attention layer's cached K and V (and optionally Q) looked like.

    k_amax, v_amax   [kv_heads]            exact max |x| over all real tokens (always kept)
    k_clip, v_clip   [kv_heads]            the recipe observer's range (== amax for `absmax`)
    q_amax           [heads] | None        exact max |Q| after RoPE, when q_scale is asked for
    k_channel, ...   [kv_heads, head_dim]  per-channel max |x| (granularity `channel`)
    k_token, ...     [len(quantiles), kv_heads]  quantiles over tokens of each token's max |x| (`token`)
    """
    k_amax: torch.Tensor
    v_amax: torch.Tensor
    k_clip: torch.Tensor | None = None
    v_clip: torch.Tensor | None = None
    q_amax: torch.Tensor | None = None
    k_channel: torch.Tensor | None = None
    v_channel: torch.Tensor | None = None
    k_token: torch.Tensor | None = None
    v_token: torch.Tensor | None = None
    k_over: torch.Tensor | None = None   # [] fraction of real K values with |x| > 448 (saturate at scale 1.0)
    v_over: torch.Tensor | None = None

    def clip(self, kind: str) -> torch.Tensor:
        c = self.k_clip if kind == "k" else self.v_clip
        return c if c is not None else (self.k_amax if kind == "k" else self.v_amax)


Stats = dict[int, LayerStats]


def stats_to_tensors(stats: Stats) -> dict[str, torch.Tensor]:
    """Flat `layers.{i}.{field}` float32 tensors (for a safetensors file; fields that were not kept are absent)."""
    return {f"layers.{i}.{f.name}": t.to(torch.float32).contiguous() for i, s in stats.items()
            for f in fields(LayerStats) if (t := getattr(s, f.name)) is not None}
