"""Engine-faithful fake quantisation of K/V: the hook that stores K and V as one arm (`calib/evaluation/arms.py`) would.

Why at the capture point: the engine quantises K and V when it writes them to the cache, after RoPE and
k-norm and before grouped-query expansion — exactly what transformers hands the function registered in
`ALL_ATTENTION_FUNCTIONS` (docs/design.md §3). So the hook here is the calibration hook's twin: it
replaces K and V by what the cache would give back for every token attention reads, prompt included, then
calls the model's own attention: full-precision prompt K/V would hide exactly the damage we look for.

Which engine's arithmetic: `calib/evaluation/emulate.py` names what each engine does to Q, K, V and P (the
hook's `emulation`), with `calib/scales/fp8.py`'s bit-exact conversions; for FlashAttention-3's FP8 path (Q and
P in FP8 too) the hook runs `calib/evaluation/fa3.py` instead of the model's attention function.

Why a module of its own: how the cache would store an arm's K/V is independent of what the arms are
(`calib/evaluation/arms.py`) and of how an evaluation picks samples and scores logits
(`calib/evaluation/measure.py`, `calib/tune/`). The switches change only through `FakeQuantKV.applying`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.attention.bias import causal_lower_right

from calib.capture import hook as observe
from calib.evaluation import dynamic, emulate, fa3
from calib.evaluation.arms import Arm, EvalError
from calib.model.attention import route_attention
from calib.recipe.dtypes import FP8_E4M3, FP8_E5M2, KVDtype
from calib.scales import fp8
from calib.scales.fold import MIN_SCALE
from calib.scales.quant import quantize

_TERMS = ("sat", "flush", "nonzero", "n", "signal", "noise")


def cache_codes(x: torch.Tensor, scale: torch.Tensor | float, dtype: KVDtype,
                cast: emulate.Cast | None = None) -> torch.Tensor:
    """The codes (float32 grid values) the engine's cache write stores for x; `cast`: how an FP8 cache rounds and
    applies the scale (None: `quant.quantize`). INT8 rounds to nearest, as every engine serving INT8 KV does."""
    if dtype is FP8_E5M2:           # vLLM's CPU write truncates e5m2 as it does e4m3; CUDA rounds to nearest
        rounding = fp8.RZ if cast is not None and cast.rounding.startswith("rz") else fp8.RNE
        op = cast.scale_op if cast is not None and cast.scale_op != "reciprocal-model" else "divide"
        return fp8.quantize(x, scale, fp8.E5M2, rounding, op)
    if cast is None or dtype is not FP8_E4M3:
        return quantize(x, scale, dtype)
    return fp8.cache_write(x, scale, cast.rounding, cast.scale_op)


def fake_quant_terms(x: torch.Tensor, scale: torch.Tensor | str, dtype: KVDtype, mask: torch.Tensor | None,
                     measure: bool, cast: emulate.Cast | None = None,
                     out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(what the cache gives back for x, in `out_dtype` (default x's), and when `measure` the float64 sums
    `_TERMS` over real tokens: saturated values, nonzero values stored as 0, nonzero values, values, sum x^2,
    sum (x - x_hat)^2). `cast`: the engine's FP8 conversion (`cache_codes`)."""
    per_token = isinstance(scale, str)
    if dtype.dynamic:   # the engine's own per-token-head cache (calib.evaluation.dynamic): exactly its write and read
        codes = back = dynamic.read_back(x, dtype)
    else:
        if per_token:
            scale = x.detach().abs().amax(dim=-1, keepdim=True).float().div(dtype.qmax).clamp_min(MIN_SCALE)
        codes = cache_codes(x, scale, dtype, cast)
        back = codes * scale
    x_hat = back.to(out_dtype or x.dtype)
    if not measure:
        return x_hat, None
    w = torch.ones((), device=x.device) if mask is None else mask[:, None, :, None].to(torch.float32)
    xf = x.float()
    # nothing saturates where each token's own max is the scale (a 1-ulp overshoot of x / scale there is not
    # saturation); a nonzero value read back as 0 counts as flushed
    clip = not (dtype.dynamic or per_token)
    sat = (xf / scale).abs() > dtype.qmax if clip else torch.zeros_like(xf, dtype=torch.bool)
    nonzero = xf != 0
    parts = (sat, (codes == 0) & nonzero, nonzero, torch.ones_like(xf), xf * xf, (xf - x_hat.float()) ** 2)
    return x_hat, torch.stack([(p * w).sum(dtype=torch.float64) for p in parts])


def _output_terms(module: Any, ref: torch.Tensor, out: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """sum |o - o_hat|^2 and sum |o|^2 over real tokens of the attention block's output: after the output
    projection where the module has `o_proj` (per-head output scales that o_proj undoes would otherwise hide
    a broken head), else of the attention function's output [b, s, heads, d]."""
    proj = getattr(module, "o_proj", None)
    if isinstance(proj, torch.nn.Module) and ref.dim() == 4:
        ref, out = proj(ref.reshape(*ref.shape[:2], -1)), proj(out.reshape(*out.shape[:2], -1))
    w = mask.reshape(*mask.shape, *[1] * (ref.dim() - 2)).to(torch.float32) \
        if mask is not None and ref.shape[:2] == mask.shape else 1.0
    diff = (ref.float() - out.float()) ** 2
    return torch.stack([(diff * w).sum(dtype=torch.float64), (ref.float() ** 2 * w).sum(dtype=torch.float64)])


class Meter:
    """Per-layer sums of one arm over every batch it saw; read once at the end (no host sync per batch)."""

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}

    def add(self, layer: int, terms: torch.Tensor) -> None:
        self.sums[layer] = terms if layer not in self.sums else self.sums[layer] + terms

    def read(self) -> dict[str, dict[str, float]]:
        out = {}
        for i, t in sorted(self.sums.items()):
            vals = t.tolist()
            row = {}
            for kind, base in (("k", 0), ("v", len(_TERMS))):
                sat, flush, nonzero, n, signal, noise = vals[base:base + len(_TERMS)]
                row[f"{kind}_saturated"] = sat / max(n, 1)
                row[f"{kind}_flushed"] = flush / max(nonzero, 1)
                # NaN/inf K or V must read as NaN here, not as "exact" (+inf) or "no error" (0)
                row[f"{kind}_snr_db"] = (math.nan if not math.isfinite(signal + noise) else
                                         10 * math.log10(signal / noise) if noise > 0 and signal > 0 else math.inf)
            err, ref = vals[-2:]
            row["attn_rel_error"] = (math.nan if not math.isfinite(err + ref) else
                                     math.sqrt(err / ref) if ref > 0 else 0.0)
            out[str(i)] = row
        return out


Ranges = dict[int, tuple[observe.AbsMaxObserver, observe.AbsMaxObserver]]


class FakeQuantKV:
    """Switches of the installed hook, set for one batch (or one generation) by `applying` and all off outside
    it; `emulation` is the engine whose arithmetic quantised arms follow (`calib/evaluation/emulate.py`)."""

    def __init__(self, emulation: emulate.Emulation | None = None) -> None:
        self.emulation = emulation or emulate.by_name(emulate.DEFAULT)
        self.arm: Arm | None = None
        self.token_mask: torch.Tensor | None = None
        self.meter: Meter | None = None
        self.ranges: Ranges | None = None
        self.right_padded = False       # token_mask is a prefix of real tokens in every row

    @contextlib.contextmanager
    def applying(self, arm: Arm | None = None, *, meter: Meter | None = None, token_mask: torch.Tensor | None = None,
                 ranges: Ranges | None = None) -> Iterator["FakeQuantKV"]:
        """Every attention call inside stores K/V as `arm` would (None: untouched, bit-identical outputs),
        measured into `meter` (None: not measured, e.g. generation) over the real tokens of `token_mask`
        ([batch, seq]), recording per-head max |K|, |V| into `ranges`; all switches off after."""
        self.arm, self.meter, self.token_mask, self.ranges = arm, meter, token_mask, ranges
        self.right_padded = token_mask is not None and bool(torch.equal(     # every row real tokens, then padding
            token_mask.bool(), torch.arange(token_mask.shape[1], device=token_mask.device)
            < token_mask.sum(dim=1, keepdim=True)))                    # (calib.data.batching.pad)
        try:
            yield self
        finally:
            self.arm = self.meter = self.token_mask = self.ranges = None
            self.right_padded = False

    def attend(self, delegate: Callable, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, **kwargs: Any) -> Any:
        layer, mask = module.layer_idx, self.token_mask
        if mask is not None and mask.shape != (key.shape[0], key.shape[2]):
            mask = None
        if self.ranges is not None:
            obs = self.ranges.setdefault(layer, (observe.AbsMaxObserver(), observe.AbsMaxObserver()))
            obs[0].update(key, mask)
            obs[1].update(value, mask)
        arm = self.arm
        if arm is None or arm.dtype is None or (layer not in arm.k and layer not in arm.v):
            return delegate(module, query, key, value, attention_mask, **kwargs)
        measure, emu = self.meter is not None, self.emulation
        fa3 = emu.attention == "fa3" and arm.dtype is FP8_E4M3
        wide = torch.float32 if fa3 else None
        k_hat, k_terms = fake_quant_terms(key, arm.k[layer], arm.dtype, mask, measure, emu.k, wide)
        v_hat, v_terms = fake_quant_terms(value, arm.v[layer], arm.dtype, mask, measure, emu.v, wide)
        if fa3:
            plain = self.right_padded and mask is not None and query.shape[2] == key.shape[2]
            out = (_fa3(module, query, k_hat, v_hat, attention_mask, arm, layer, emu, kwargs, plain), None)
        else:
            out = delegate(module, query, k_hat, v_hat, attention_mask, **kwargs)
        if measure:
            ref, got, m = _reference_output(delegate, module, query, key, value, attention_mask, kwargs, out[0], mask)
            self.meter.add(layer, torch.cat([k_terms, v_terms, _output_terms(module, ref, got, m)]))
        return out


DIAG_QUERIES = 4096     # a longer sequence's attention error is read on its last this many queries


def _reference_output(delegate: Callable, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, kwargs: dict[str, Any], out: torch.Tensor, mask: torch.Tensor | None):
    """(reference output, arm output, token mask) for the attention-error diagnostic. Beyond DIAG_QUERIES queries
    of an SDPA prefill, only the last DIAG_QUERIES (which see the most keys): all queries again would cost a
    quarter of the arm's time at 128K. Plain causal goes in as a bottom-right causal bias (no mask tensor), a
    sliding window or the model's 4-D mask as a sliced mask."""
    n, t = query.shape[2], key.shape[2]
    sdpa = getattr(delegate, "__name__", "") == "sdpa_attention_forward"
    if n <= DIAG_QUERIES or n != t or not sdpa or not (attention_mask is None or attention_mask.dim() == 4):
        return delegate(module, query, key, value, attention_mask, **kwargs)[0], out, mask
    w = DIAG_QUERIES
    window = kwargs.get("sliding_window")
    if attention_mask is None and not window:
        # bottom-right causal without a mask tensor: flash / memory-efficient kernels take it as is (an explicit
        # [w, t] mask sends SDPA to a slower masked kernel); they want equal head counts, so GQA is expanded
        groups = query.shape[1] // key.shape[1]
        k, v = (key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)) if groups > 1 else (key, value)
        ref = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, -w:], k, v, attn_mask=causal_lower_right(w, t), scale=kwargs.get("scaling"))
        return ref.transpose(1, 2), out[:, -w:], None if mask is None else mask[:, -w:]
    if attention_mask is None:
        rows = torch.arange(t - w, t, device=query.device)[:, None]
        cols = torch.arange(t, device=query.device)[None, :]
        sub = ((cols <= rows) & (cols > rows - int(window)))[None, None]
    else:
        sub = attention_mask[:, :, -w:, :]
    ref = delegate(module, query[:, :, -w:], key, value, sub, **kwargs)[0]
    return ref, out[:, -w:], None if mask is None else mask[:, -w:]


def _descale(scale: torch.Tensor | str, kv_heads: int) -> torch.Tensor | None:
    """An arm's scale as FA3's descale (one per tensor or per KV head); None where FA3 takes none (per
    channel, per token: the what-if arms), and the kernel then multiplies the values as they are."""
    if isinstance(scale, str) or scale.numel() not in (1, kv_heads):
        return None
    return scale.reshape(-1).float()


def _fa3(module: Any, query: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor, attention_mask: Any,
         arm: Arm, layer: int, emu: emulate.Emulation, kwargs: dict[str, Any], plain: bool) -> torch.Tensor:
    """FlashAttention-3's FP8 attention (`fa3.fa3_attention`) in place of the model's own, same layout/dtype.
    Window and softcap as the model hands them to its attention function (and vLLM to FA3); a window past every
    key is none (flash_api.cpp mha_fwd: window_size_left >= max_seqlen_k - 1 becomes -1, the non-local kBlockN).
    `plain`: a right-padded full forward, where a causal mask (plus the window) gives every real token what
    transformers' 4-D mask gives it, so the dense mask is not read (padding rows differ; no metric reads them)."""
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise EvalError("--emulate vllm-fa3 does not model attention sinks; use --emulate kv-only for this model")
    scaling = kwargs.get("scaling")
    scaling = scaling if scaling is not None else getattr(module, "scaling", query.shape[-1] ** -0.5)
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) else None
    causal = bool(getattr(module, "is_causal", True))
    config = getattr(module, "config", None)
    if plain and causal and not getattr(config, "attention_chunk_size", None):
        mask = None
    window = kwargs.get("sliding_window")
    window_left = int(window) - 1 if window and int(window) - 1 < k_hat.shape[2] - 1 else None
    kvh = k_hat.shape[1]
    return fa3.fa3_attention(query, k_hat, v_hat, scaling=float(scaling), q_scale=arm.q_scale(layer), mask=mask,
                             k_scale=_descale(arm.k[layer], kvh), v_scale=_descale(arm.v[layer], kvh), causal=causal,
                             window_left=window_left, quant_q=emu.q is not None, quant_p=emu.p is not None,
                             softcap=kwargs.get("softcap") or None).to(query.dtype).contiguous()


@contextlib.contextmanager
def fake_quant_kv(model: torch.nn.Module, emulation: emulate.Emulation | None = None) -> Iterator[FakeQuantKV]:
    """Route every attention call of `model` through the fake-quant hook; always restores the model."""
    state = FakeQuantKV(emulation)

    def make(delegate):
        def attention(module, query, key, value, attention_mask, **kwargs):
            return state.attend(delegate, module, query, key, value, attention_mask, **kwargs)
        return attention

    with route_attention(model, make, "fakequant"):
        yield state
