"""Capture K and V exactly as the KV cache stores them, and accumulate their ranges.

Where: every modern transformers attention module calls the function registered in
`ALL_ATTENTION_FUNCTIONS` under `config._attn_implementation` with `(module, query, key, value, mask)`,
right after RoPE (and q/k-norm) and before grouped-query expansion — K/V of shape
`[batch, kv_heads, seq, head_dim]`, the tensors the cache holds. A wrapper registered under a fresh name records
statistics and calls the model's *own* implementation with the same arguments: bit-identical outputs, whatever
the cache class or the name of its argument (hooks on the cache's `update` silently stop firing when those
change); forward hooks on `k_proj` would see K before RoPE — the wrong tensor.

Padding (`KVCapture.masking`) never reaches a statistic; statistics stay on the model's device: no host sync
per batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from calib.capture import kernels
from calib.capture.observers import AbsMaxObserver, StateObserver
from calib.errors import KvcalibError
from calib.model.attention import route_attention
from calib.recipe.dtypes import FP8_E4M3
from calib.scales.stats import LayerStats, Stats

class CaptureError(KvcalibError, RuntimeError):
    """K/V capture did not see what it must (missing layers, shape mismatch, non-finite values)."""


Factory = Callable[[], Any]


@dataclass(frozen=True)
class CaptureSpec:
    """What to record per layer. `k_observer`/`v_observer` make the range observers of the recipe (None: the
    exact absmax is the range); `q` records Q; `channels` keeps per-channel maxima; `token_quantiles` keeps
    quantiles (in percent) of the per-token maxima."""
    k_observer: Factory | None = None
    v_observer: Factory | None = None
    q: bool = False
    channels: bool = False
    token_quantiles: tuple[float, ...] = ()
    token_observer: Callable[[float], Any] | None = None


class ChannelMaxObserver(StateObserver):
    """Exact running max of |x| per head and channel: state {'amax': [heads, head_dim]}."""

    KEYS = ("amax",)

    def update(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        a = x.detach().abs()
        if mask is not None:
            a = a.masked_fill(~mask[:, None, :, None], 0)
        self._fold({"amax": a.amax(dim=(0, 2)).float()})


class OverflowCounter(StateObserver):
    """Fraction of real values with |x| > limit — what an FP8 cache with scale 1.0 clips (limit 448).
    State: {'over': [] int64, 'total': [] int64}."""

    KEYS = ("over", "total")

    def __init__(self, limit: float = FP8_E4M3.qmax) -> None:
        super().__init__()
        self.limit = limit

    def running(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(over, total) int64 counters that `calib.capture.kernels` adds batches of x into, in place."""
        s = self._running(x.device, lambda: {k: torch.zeros((), dtype=torch.int64, device=x.device) for k in self.KEYS})
        return s["over"], s["total"]

    def update(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        scratch = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
        kernels.absmax_(x, mask, scratch, *self.running(x), limit=self.limit)

    def _fold(self, batch: dict[str, torch.Tensor]) -> None:
        self._state = {k: v + batch[k].to(v.device) for k, v in self._state.items()} if self._state else batch

    def fraction(self) -> torch.Tensor:
        """The fraction (0-dim float32, on the CPU) of the values seen with |x| > limit."""
        s = self._state
        return (s["over"].double() / s["total"].clamp_min(1).double()).float().cpu()


class _Group:
    """Observers under names (`_members()`; None: not kept), merged, checkpointed (`name.key` tensors) and
    loaded as one."""

    def merge(self, other: "_Group") -> None:
        theirs = other._members()
        for name, mine in self._members().items():
            if mine is not None and theirs[name] is not None:
                mine.merge(theirs[name])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v.detach().cpu() for name, obs in self._members().items() if obs is not None
                for k, v in obs.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, obs in self._members().items():
            part = {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")}
            if obs is not None and part:
                obs.load_state_dict(part)

    def to_cpu(self) -> "_Group":
        """The same observers, their state on the CPU (for gathering across processes)."""
        for obs in self._members().values():
            if obs is not None:
                obs.to_cpu()
        return self


class _TokenMax(_Group):
    """Feeds each token's max |x| (per head) into quantile observers: the ranges a per-token scheme sees."""

    def __init__(self, quantiles: tuple[float, ...], make: Callable[[float], Any]) -> None:
        self.observers = [make(q) for q in quantiles]

    def _members(self) -> dict[str, Any]:
        return {str(j): o for j, o in enumerate(self.observers)}

    def update(self, x: torch.Tensor, mask: torch.Tensor | None) -> None:
        per_token = x.detach().abs().amax(dim=-1, keepdim=True)     # [b, h, s, 1]
        for o in self.observers:
            o.update(per_token, mask)

    def amax(self) -> torch.Tensor:
        return torch.stack([o.amax() for o in self.observers])


class _LayerObservers(_Group):
    def __init__(self, spec: CaptureSpec) -> None:
        self.k, self.v = AbsMaxObserver(), AbsMaxObserver()
        self.k_clip = spec.k_observer() if spec.k_observer else None
        self.v_clip = spec.v_observer() if spec.v_observer else None
        self.q = AbsMaxObserver() if spec.q else None
        self.k_ch, self.v_ch = (ChannelMaxObserver() if spec.channels else None for _ in "kv")
        tok = spec.token_quantiles and spec.token_observer
        self.k_tok, self.v_tok = (_TokenMax(spec.token_quantiles, spec.token_observer) if tok else None for _ in "kv")
        self.k_over, self.v_over = OverflowCounter(), OverflowCounter()

    def update(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> None:
        for x, amax, over, clip in ((k, self.k, self.k_over, self.k_clip), (v, self.v, self.v_over, self.v_clip)):
            running = amax.running(x)
            kernels.absmax_(x, mask, running, *over.running(x), limit=over.limit)   # one pass for both
            if clip is not None:
                clip.update(x, mask, amax=running)
        for obs, x in ((self.q, q), (self.k_ch, k), (self.v_ch, v), (self.k_tok, k), (self.v_tok, v)):
            if obs is not None:
                obs.update(x, mask)

    def _members(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ("k", "v", "k_clip", "v_clip", "q", "k_ch", "v_ch", "k_tok",
                                                       "v_tok", "k_over", "v_over")}

    def read(self) -> LayerStats:
        """The members in LayerStats' field order: ranges, and the overflow fractions last."""
        return LayerStats(*(None if o is None else o.fraction() if isinstance(o, OverflowCounter) else o.amax()
                            for o in self._members().values()))


class KVCapture(_Group):
    """Receives Q/K/V from the attention wrapper and keeps one set of observers per layer (`layers.{i}`)."""

    def __init__(self, layers: list[int], spec: CaptureSpec | None = None) -> None:
        self.layers = list(layers)
        self.token_mask: torch.Tensor | None = None
        self._obs = {i: _LayerObservers(spec or CaptureSpec()) for i in self.layers}

    @contextlib.contextmanager
    def masking(self, token_mask: torch.Tensor | None) -> Iterator["KVCapture"]:
        """Record the attention calls inside over the real tokens of `token_mask` ([batch, seq], True = real);
        cleared after, whatever happens inside, so it never leaks into the next pass."""
        self.token_mask = token_mask
        try:
            yield self
        finally:
            self.token_mask = None

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if layer not in self._obs:
            raise CaptureError(f"attention layer {layer} is not among the model's attention layers {self.layers}")
        mask = self.token_mask
        if mask is not None and mask.shape != (key.shape[0], key.shape[2]):
            raise CaptureError(f"layer {layer}: K has batch x seq {(key.shape[0], key.shape[2])} but the token mask "
                               f"is {tuple(mask.shape)}; run with use_cache=False and no past K/V")
        self._obs[layer].update(query, key, value, mask)

    def _members(self) -> dict[str, Any]:
        return {f"layers.{i}": o for i, o in self._obs.items()}

    def merge_across(self, merge: Callable[[dict[int, Any]], dict[int, Any]]) -> None:
        """Replace the per-layer observers by `merge(observers)` (e.g. the merge over all ranks)."""
        self._obs = merge(self._obs)

    def stats(self) -> Stats:
        """The statistics of every layer; errors name layers that were never seen or are not finite."""
        if missing := [i for i in self.layers if not self._obs[i].k.seen]:
            raise CaptureError(
                f"attention layers {missing} never passed K/V through the attention interface; this architecture "
                "does not use transformers' AttentionInterface for them and cannot be calibrated")
        out = {i: self._obs[i].read() for i in self.layers}
        for i, s in out.items():
            for name, t in (("K", s.k_amax), ("V", s.v_amax), ("Q", s.q_amax)):
                if t is not None and not torch.isfinite(t).all():
                    raise CaptureError(f"layer {i}: {name} holds NaN/Inf values; the model produces non-finite "
                                       "activations on this data (check the dtype and the weights)")
        return out


@contextlib.contextmanager
def capture_kv(model: torch.nn.Module, layers: list[int], spec: CaptureSpec | None = None) -> Iterator[KVCapture]:
    """Route every attention call of `model` through a recording wrapper; always restores the model. Usage:
        with capture_kv(model, layers) as cap, torch.inference_mode(), cap.masking(attention_mask.bool()):
            model(input_ids=ids, attention_mask=attention_mask, use_cache=False)
        stats = cap.stats()
    """
    capture = KVCapture(layers, spec)

    def make(delegate: Callable) -> Callable:
        def recording_attention(module, query, key, value, attention_mask, **kwargs):
            capture.record(module.layer_idx, query, key, value)
            return delegate(module, query, key, value, attention_mask, **kwargs)
        return recording_attention

    with route_attention(model, make, "capture"):
        yield capture
