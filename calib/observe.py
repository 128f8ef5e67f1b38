"""Capture K and V exactly as the KV cache stores them, and accumulate their ranges.

Where: every modern transformers attention module calls the function registered in
`ALL_ATTENTION_FUNCTIONS` under `config._attn_implementation` with `(module, query, key, value, mask)`,
right after RoPE (and q/k-norm) and before grouped-query expansion — K/V of shape
`[batch, kv_heads, seq, head_dim]`, the tensors the cache holds. We register a wrapper under a fresh name,
switch the model to it, record statistics, and call the model's *own* implementation with the same
arguments, so outputs are bit-identical. This does not depend on the cache class or the name of the cache
argument (hooks on the cache's `update` silently stop firing when those change), and forward hooks on
`k_proj` would see K before RoPE — the wrong tensor.

Padding: the caller sets `capture.token_mask` (`[batch, seq]`, True for real tokens) before each forward;
padded positions never reach a statistic. Statistics stay on the model's device: no host sync per batch.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

_ids = itertools.count()


class CaptureError(RuntimeError):
    """K/V capture did not see what it must (missing layers, shape mismatch, non-finite values)."""


class AbsMaxObserver:
    """Exact running max of |x| per KV head, over real tokens only.

    update(x [batch, heads, seq, dim], mask [batch, seq]) folds a batch in; amax() reads the state
    (shape [heads], float32) without changing it; merge() combines observers of disjoint data.
    """

    def __init__(self) -> None:
        self._amax: torch.Tensor | None = None

    def update(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        per_token = x.detach().abs().amax(dim=-1)                     # [b, h, s]
        if mask is not None:
            per_token = per_token.masked_fill(~mask[:, None, :], 0)
        batch_amax = per_token.amax(dim=(0, 2)).float()                  # [h]
        self._amax = batch_amax if self._amax is None else torch.maximum(self._amax, batch_amax)

    def merge(self, other: "AbsMaxObserver") -> None:
        if other._amax is not None:
            self._amax = other._amax.clone() if self._amax is None else torch.maximum(self._amax, other._amax)

    def amax(self) -> torch.Tensor:
        if self._amax is None:
            raise CaptureError("observer has seen no data")
        return self._amax.detach().cpu().clone()


@dataclass(frozen=True)
class LayerStats:
    """Ranges of one attention layer's cached K and V. Shapes: k_amax, v_amax [kv_heads] float32."""
    k_amax: torch.Tensor
    v_amax: torch.Tensor


Stats = dict[int, LayerStats]


class KVCapture:
    """Receives K/V from the attention wrapper and keeps one observer pair per layer."""

    def __init__(self, layers: list[int]) -> None:
        self.layers = list(layers)
        self.token_mask: torch.Tensor | None = None
        self._k = {i: AbsMaxObserver() for i in self.layers}
        self._v = {i: AbsMaxObserver() for i in self.layers}

    def record(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if layer not in self._k:
            raise CaptureError(f"attention layer {layer} is not among the model's attention layers {self.layers}")
        mask = self.token_mask
        if mask is not None and mask.shape != (key.shape[0], key.shape[2]):
            raise CaptureError(f"layer {layer}: K has batch x seq {tuple(key.shape[::2][:2])} but the token mask "
                               f"is {tuple(mask.shape)}; run with use_cache=False and no past K/V")
        self._k[layer].update(key, mask)
        self._v[layer].update(value, mask)

    def stats(self) -> Stats:
        """The statistics of every layer; errors name layers that were never seen or are not finite."""
        missing = [i for i in self.layers if self._k[i]._amax is None]
        if missing:
            raise CaptureError(
                f"attention layers {missing} never passed K/V through the attention interface; this architecture "
                "does not use transformers' AttentionInterface for them and cannot be calibrated")
        out = {i: LayerStats(self._k[i].amax(), self._v[i].amax()) for i in self.layers}
        for i, s in out.items():
            for name, t in (("K", s.k_amax), ("V", s.v_amax)):
                if not torch.isfinite(t).all():
                    raise CaptureError(f"layer {i}: {name} holds NaN/Inf values; the model produces non-finite "
                                       "activations on this data (check the dtype and the weights)")
        return out


def _delegate_for(impl: str) -> Callable:
    """The model's own attention function for `impl` ('eager' lives in each model's modeling file)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl != "eager":
        return ALL_ATTENTION_FUNCTIONS[impl]
    cache: dict[type, Callable] = {}

    def eager(module, *args, **kwargs):
        fn = cache.get(type(module))
        if fn is None:
            fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if fn is None:
                raise CaptureError(f"{type(module).__name__} has no eager_attention_forward to delegate to")
            cache[type(module)] = fn
        return fn(module, *args, **kwargs)

    return eager


@contextlib.contextmanager
def capture_kv(model: torch.nn.Module, layers: list[int]) -> Iterator[KVCapture]:
    """Route every attention call of `model` through a recording wrapper; always restores the model.

    Usage:
        with capture_kv(model, layers) as cap, torch.inference_mode():
            cap.token_mask = attention_mask.bool()
            model(input_ids=ids, attention_mask=attention_mask, use_cache=False)
        stats = cap.stats()
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = model.config._attn_implementation
    if original not in ("eager", "sdpa") and original not in ALL_ATTENTION_FUNCTIONS:
        raise CaptureError(f"attention implementation {original!r} is not known to transformers' AttentionInterface")
    delegate = _delegate_for(original)
    capture = KVCapture(layers)
    name = f"kvcalib_capture_{next(_ids)}"

    def recording_attention(module, query, key, value, attention_mask, **kwargs):
        capture.record(module.layer_idx, key, value)
        return delegate(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, recording_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    try:
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise CaptureError(f"{type(model).__name__} refused a custom attention implementation; "
                               "it does not use transformers' AttentionInterface")
        yield capture
    finally:
        try:
            model.set_attn_implementation(original)
        finally:
            ALL_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)
            ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)
