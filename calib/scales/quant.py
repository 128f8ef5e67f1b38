"""Fake quantisation that does what the engine's KV-cache write does, so evaluation and MSE search see
the same numbers the cache will hold.

The engine stores `q = saturate(x / scale)` rounded to the cache dtype and reads back `q * scale`
(docs/design.md §4); emulated in float32, FP8 through the torch float type (round to nearest even) and INT8
with `torch.round`, both clamped *explicitly* first: whether a cast saturates or produces NaN out of range
differs between versions/backends. `scale` broadcasts against `x` (scalar, per head `[h, 1, 1]`, ...).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from calib.recipe.dtypes import KV_DTYPES, KVDtype


def _round_through(cast: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Round to the nearest value of the float type `cast` (calib.recipe.dtypes `KVDtype.cast`), back in float32."""
    kind = getattr(torch, cast)
    return lambda q: q.to(kind).to(torch.float32)


# each static format's rounding, from its registry entry: through its float type, else to integers
_ROUND: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    d.name: torch.round if d.cast is None else _round_through(d.cast) for d in KV_DTYPES.values()}


def quantize(x: torch.Tensor, scale: torch.Tensor | float, dtype: KVDtype) -> torch.Tensor:
    """The stored codes (float32 values of the cache dtype): round(saturate(x / scale)), x / scale in float32 as
    the engine's cache-write kernel computes it."""
    scaled = x.to(torch.float32) / torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if dtype.name not in _ROUND:
        raise ValueError(f"no rounding rule for KV dtype {dtype.name!r}; accepted: {sorted(_ROUND)}")
    return _ROUND[dtype.name](scaled.clamp(-dtype.qmax, dtype.qmax))


def fake_quant(x: torch.Tensor, scale: torch.Tensor | float, dtype: KVDtype) -> torch.Tensor:
    """What the attention reads back from the cache: quantize(x) * scale, in x's dtype."""
    scale32 = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return (quantize(x, scale32, dtype) * scale32).to(x.dtype)

