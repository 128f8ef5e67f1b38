"""Granularities: how many scales a layer's K (or V) gets, as small frozen values.

Why values and not strings: each granularity knows the shape it produces and whether an engine can read
it, so the recipe validates a combination once instead of every stage re-checking strings. Torch-free (the
recipe imports it); `fold` works on whatever tensor it is given.

Shapes below are for a layer with `kv_heads = 8`, `head_dim = 128`, a batch of 4 sequences of 512 tokens;
the cached K/V has shape [4, 8, 512, 128].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PerTensor:
    """One scale per layer for K and one for V: shape [] (e.g. tensor(0.0123)).
    What every engine reads; vLLM strategy `tensor`, TensorRT-LLM scalars."""
    name: str = "tensor"
    exportable: bool = True

    def fold(self, per_head: torch.Tensor) -> torch.Tensor:
        return per_head.max()


@dataclass(frozen=True)
class PerHead:
    """One scale per KV head: shape [8]. vLLM strategy `attn_head` (tensor [8, 1, 1]; used per head only on
    its FlashAttention-3 backend, folded to the max elsewhere); folded to per-tensor for engines that
    read one scale."""
    name: str = "head"
    exportable: bool = True

    def fold(self, per_head: torch.Tensor) -> torch.Tensor:
        return per_head


@dataclass(frozen=True)
class PerChannel:
    """One range per KV head and channel: shape [8, 128]. No engine reads it; kept as statistics for
    analysis and for the evaluation's fake quantisation."""
    name: str = "channel"
    exportable: bool = False


@dataclass(frozen=True)
class PerToken:
    """Per-token ranges: the distribution (quantiles over tokens of each token's max |x|, per head, shape
    [quantiles, 8]) that a dynamic per-token scheme would see. Statistics only; not exportable."""
    name: str = "token"
    exportable: bool = False


Granularity = PerTensor | PerHead | PerChannel | PerToken
GRANULARITIES: dict[str, Granularity] = {g.name: g for g in (PerTensor(), PerHead(), PerChannel(), PerToken())}


def by_name(name: str) -> Granularity:
    """The granularity called `name`; ValueError naming the accepted ones otherwise."""
    try:
        return GRANULARITIES[name]
    except KeyError:
        raise ValueError(f"unknown granularity {name!r}; accepted: {list(GRANULARITIES)}") from None
