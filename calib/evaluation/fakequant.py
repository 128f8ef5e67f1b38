"""Engine-faithful fake quantisation of K/V, and the arms (ways of storing the KV cache) it applies.

Why at the capture point: the engine quantises K and V when it writes them to the cache, after RoPE and
k-norm and before grouped-query expansion — exactly what transformers hands the function registered in
`ALL_ATTENTION_FUNCTIONS` (docs/design.md §3). So the hook here is the calibration hook's twin: it
replaces K and V by what the cache would give back (`fake_quant`: divide by the scale, saturate, round,
multiply back) for every token attention reads, prompt included, and then calls the model's own attention.
Perplexity measured with full-precision prompt K/V would hide exactly the damage we look for.

Which engine's arithmetic: `calib/evaluation/emulate.py` names what each engine does to Q, K, V and the softmax
probabilities (the hook's `emulation`); the conversions are `calib/scales/fp8.py`'s, exact to the bit. For
FlashAttention-3's FP8 path (Q and P in FP8 too) the hook runs `calib/evaluation/fa3.py` instead of the
model's attention function: FA3's blockwise arithmetic, a Triton kernel on CUDA and its float32 reference
elsewhere.

Why a module of its own: what an arm is and how the cache would store it (scales from a checkpoint or a
statistics file, shaped per tensor/head/channel or per token) is independent of how an evaluation picks
its samples and scores logits (`calib/evaluation/measure.py`, which drives this hook, and `calib/tune/`).
The hook's switches change only through `FakeQuantKV.applying`, one `with` per batch or generation.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from calib.capture import hook as observe
from calib.capture.stats import LayerStats, Stats
from calib.ckpt.kvinfo import KVInfo, read_kv_info
from calib.engine import support
from calib.errors import KvcalibError
from calib.evaluation import dynamic, emulate, fa3
from calib.evaluation.results import ArmInfo
from calib.model.attention import route_attention
from calib.recipe.dtypes import FP8_E4M3, FP8_E5M2, INT8, KVDtype, kv_dtype, kv_format
from calib.scales import fp8
from calib.scales.fold import MIN_SCALE, amax_to_scale
from calib.scales.quant import quantize

TOKEN = "token"            # an arm's scale for a layer may be this: dynamic, each token's own max|x| / qmax


class EvalError(KvcalibError, ValueError):
    """The evaluation cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class Arm:
    """One way of storing the KV cache. `k`/`v` map a layer to its scale, already shaped to broadcast
    against K of shape [b, kv_heads, s, head_dim] ([] / [1,h,1,1] / [1,h,1,d]) or TOKEN; a layer absent
    from both stays unquantised. `dtype` None marks the reference. `q` maps a layer to its per-tensor q_scale
    (what vLLM's FlashAttention-3 FP8 path quantises Q with; 1.0 where absent, vLLM's default)."""
    name: str
    dtype: KVDtype | None
    k: Mapping[int, torch.Tensor | str] = field(default_factory=dict)
    v: Mapping[int, torch.Tensor | str] = field(default_factory=dict)
    kind: str = "reference"           # reference | default | checkpoint | stats | format
    granularity: str = "tensor"
    shippable: bool = True            # an engine can serve it (per-channel/per-token are what-ifs)
    source: str | None = None
    skip: tuple[int, ...] = ()        # layers this evaluation left unquantised to measure a skip
    serve_skip: tuple[int, ...] = ()  # layers the checkpoint was calibrated to skip (served with the skip flag)
    notes: tuple[str, ...] = ()
    q: Mapping[int, torch.Tensor] = field(default_factory=dict)
    skip_kind: str | None = None      # the skip is a layer kind the engine's flag names (SLIDING_SKIP)

    def q_scale(self, layer: int) -> torch.Tensor | float:
        return self.q.get(layer, 1.0)

    def skipping(self, layers: Iterable[int]) -> "Arm":
        drop = set(layers) | set(self.skip)
        keep = {i: s for i, s in self.k.items() if i not in drop}
        return replace(self, name=f"{self.name} skip {','.join(map(str, sorted(drop)))}", k=keep,
                       v={i: s for i, s in self.v.items() if i not in drop}, skip=tuple(sorted(drop)))

    def to(self, device: torch.device) -> "Arm":
        def move(m):
            return {i: s if isinstance(s, str) else s.to(device) for i, s in m.items()}
        return replace(self, k=move(self.k), v=move(self.v), q=move(self.q))

    def info(self) -> ArmInfo:
        """What the report and the advice say about this arm; scales as their max over heads per layer."""
        def per_layer(m):
            return {str(i): None if isinstance(s, str) else float(s.max()) for i, s in sorted(m.items())}
        return ArmInfo(self.kind, self.dtype.name if self.dtype else None, self.granularity, self.shippable, self.source,
                       tuple(self.skip), tuple(self.serve_skip), tuple(self.notes),
                       {"k": per_layer(self.k), "v": per_layer(self.v), "q": per_layer(self.q)}, self.skip_kind)


# ------------------------------------------------------------------------------------------- arms

@dataclass(frozen=True)
class Geometry:
    layers: tuple[int, ...]
    kv_heads: int
    head_dim: int

    @staticmethod
    def of(config: Any, layers: Sequence[int]) -> "Geometry":
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return Geometry(tuple(layers), heads, dim)

    def shape(self, values: Any, where: str) -> torch.Tensor:
        t = torch.as_tensor(values, dtype=torch.float32).reshape(-1)
        if not (torch.isfinite(t).all() and (t > 0).all()):
            raise EvalError(f"{where}: scales must be finite and > 0, got {t.tolist()[:8]}")
        h, d = self.kv_heads, self.head_dim
        shapes = {1: (), h: (1, h, 1, 1), h * d: (1, h, 1, d)}
        if t.numel() not in shapes:
            raise EvalError(f"{where}: {t.numel()} scale values fit neither per tensor (1), per KV head ({h}) "
                            f"nor per channel ({h}x{d}); is it a checkpoint of another model?")
        return t.reshape(shapes[t.numel()])


def reference_arm(model_dtype: torch.dtype) -> Arm:
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    return Arm(short.get(model_dtype, str(model_dtype).removeprefix("torch.")), None)


def default_arm(geo: Geometry, dtype: KVDtype) -> Arm:
    one = torch.tensor(1.0)
    return Arm("default", dtype, {i: one for i in geo.layers}, {i: one for i in geo.layers}, kind="default",
               notes=("scale 1.0: what vLLM and TensorRT-LLM use when a checkpoint carries no KV scales",))


def _checkpoint_dtype(info: KVInfo) -> KVDtype:
    scheme = info.kv_scheme or {}
    if scheme.get("type") == "int" or info.kv_cache_quant_algo == "INT8":
        return INT8
    return FP8_E4M3


def checkpoint_arms(path: str, geo: Geometry, per_head_kv: bool = True) -> list[Arm]:
    """The arm of a checkpoint's K/V scales as stored, plus its per-tensor fold when the scales are per head
    (what vLLM applies outside its FlashAttention-3 backend)."""
    try:
        info = read_kv_info(path)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise EvalError(f"--scales {path}: {e}") from None
    if info.unmapped:     # the engines would not load it as that layer's scale: no arm may use it as loaded
        name, why = next(iter(info.unmapped.items()))
        more = f" (and {len(info.unmapped) - 1} more)" if len(info.unmapped) > 1 else ""
        raise EvalError(f"--scales {path}: tensor {name!r}{more}: {why}; no engine loads it as a KV scale, so no "
                        f"arm can use it (`kvcalib verify {path}` lists every problem)")
    if not info.scales:
        raise EvalError(f"--scales {path}: no K/V scale tensors (*.k_scale / *.v_scale) found")
    if info.num_layers is not None and info.num_layers != len(geo.layers):
        raise EvalError(f"--scales {path} is for a model with {info.num_layers} layers; this model has "
                        f"{len(geo.layers)}")
    dtype = _checkpoint_dtype(info)
    k, v, notes = {}, {}, []
    serve_skip = tuple(sorted(int(i) for i in (info.provenance or {}).get("skipped_layers") or []))
    if serve_skip:
        notes.append(f"calibrated with skip_layers {list(serve_skip)}: those layers stay unquantised here, as when "
                     f"served with --kv-cache-dtype-skip-layers {' '.join(map(str, serve_skip))}")
    for i in (i for i in geo.layers if i not in serve_skip):
        sc = info.scales.get(i, {})
        k[i] = geo.shape(sc.get("k", [1.0]), f"--scales {path} layer {i} k_scale")
        v[i] = geo.shape(sc.get("v", [1.0]), f"--scales {path} layer {i} v_scale")
    q = {}
    for i in k:
        vals = info.scales.get(i, {}).get("q")
        if vals:
            t = torch.tensor(vals, dtype=torch.float32)
            if not (torch.isfinite(t).all() and (t > 0).all()):
                raise EvalError(f"--scales {path} layer {i} q_scale: scales must be finite and > 0, got {vals[:8]}")
            q[i] = t.max().reshape(())
    if any(len(info.scales.get(i, {}).get("q") or []) > 1 for i in k):
        notes.append("per-head q_scale folded to its max: vLLM quantises Q with one scale per tensor")
    missing = [i for i in k if not {"k", "v"} <= set(info.scales.get(i, {}))]
    if missing:
        notes.append(f"no scales for layers {missing}: engines use 1.0 there, and so does this arm")
    if "trtllm" in info.targets and "vllm" not in info.targets:
        trt = support.outcome("trtllm", support.Calibrated(dtype.name))
        if trt.per_backend[0].cells[0].effect is support.Effect.IGNORED:
            notes.append(f"TensorRT-LLM {trt.version} ignores these scales ({trt.per_backend[0].cells[0].note}): "
                         "served there, this checkpoint behaves like the 'default' arm (`--target trtllm` "
                         "evaluates it so)")
    per_head = any(s.dim() == 4 for s in (*k.values(), *v.values()))
    arm = Arm(f"calibrated:{path}", dtype, k, v, kind="checkpoint", granularity="head" if per_head else "tensor",
              source=str(path), serve_skip=serve_skip, notes=tuple(notes), q=q)
    if not per_head:
        return [arm]
    fold = {i: s.max().reshape(()) for i, s in k.items()}, {i: s.max().reshape(()) for i, s in v.items()}
    if not per_head_kv:     # the emulated engine applies one scale per layer: the checkpoint arm is the fold
        return [replace(arm, k=fold[0], v=fold[1], granularity="tensor",
                        notes=arm.notes + ("per-head scales folded to their max: the emulated engine applies one "
                                           "scale per layer (vLLM outside FlashAttention-3, TensorRT-LLM)",))]
    head = support.outcome("vllm", support.Calibrated(dtype.name, "head"))
    return [replace(arm, notes=arm.notes + (f"per-head scales on {'; '.join(head.lines())}; see the '@tensor' "
                                            "arm for the max over heads",)),
            replace(arm, name=f"{arm.name}@tensor", k=fold[0], v=fold[1], granularity="tensor",
                    notes=("the per-head scales folded to their max: what vLLM applies outside FlashAttention-3",))]


SLIDING_SKIP = "sliding_window"     # vLLM's --kv-cache-dtype-skip-layers value for every sliding-window layer


def sliding_skip_arms(arms: Sequence[Arm], sliding: Sequence[int]) -> list[Arm]:
    """For a model with sliding-window layers: the default arm and every checkpoint arm the engine serves as
    stored, again with those layers kept at the model dtype (vLLM: `--kv-cache-dtype-skip-layers sliding_window`).
    Emulated, a skipped layer is simply absent from the arm's scales, so the hook leaves its K/V untouched."""
    if not sliding:
        return []
    out = []
    for a in arms:
        if a.kind not in ("default", "checkpoint") or a.name.endswith("@tensor") or a.skip:
            continue
        drop = set(sliding)
        out.append(replace(a.skipping(drop), name=f"{a.name} skip {SLIDING_SKIP}", skip_kind=SLIDING_SKIP,
                           notes=a.notes + (f"the {len(drop)} sliding-window layers {sorted(drop)} kept at the model "
                                            f"dtype, as vLLM serves with --kv-cache-dtype-skip-layers {SLIDING_SKIP}",)))
    return out


def read_stats(path: str) -> tuple[Stats, dict[str, Any] | None]:
    """The per-layer ranges of a kvcalib statistics file (a statistics-only output directory or its
    stats.safetensors) and its header (recipe, data), through calib.capture.statsfile's one reader."""
    from calib.capture import statsfile

    try:
        sf = statsfile.load_output(Path(path), "--stats")
        return sf.stats(), sf.header
    except statsfile.StatsError as e:
        raise EvalError(str(e)) from None


def stats_arms(path: str, geo: Geometry, default_dtype: str) -> list[Arm]:
    """Per-tensor / per-head / per-channel (when recorded) / per-token arms from a statistics-only output."""
    stats, header = read_stats(path)
    if sorted(stats) != sorted(geo.layers):
        raise EvalError(f"--stats {path} covers layers {sorted(stats)}, the model has {list(geo.layers)}")
    dtype = kv_dtype((header or {}).get("recipe", {}).get("dtype", default_dtype))

    def arm(gran: str, pick: Callable[[LayerStats, str], Any] | None, shippable: bool) -> Arm:
        def scales(kind):
            if pick is None:
                return {i: TOKEN for i in geo.layers}
            return {i: geo.shape(amax_to_scale(pick(s, kind), 1.0, dtype.qmax), f"--stats {path} layer {i}")
                    for i, s in stats.items()}
        return Arm(f"per-{gran}:{path}", dtype, scales("k"), scales("v"), kind="stats", granularity=gran,
                   shippable=shippable, source=str(path), q=q)

    q = {i: amax_to_scale(s.q_amax.max(), 1.0, dtype.qmax).reshape(()).float()
         for i, s in stats.items() if s.q_amax is not None and dtype is FP8_E4M3}

    arms = [arm("tensor", lambda s, kind: s.clip(kind).max(), True), arm("head", lambda s, kind: s.clip(kind), True)]
    if all(s.k_channel is not None and s.v_channel is not None for s in stats.values()):
        arms.append(arm("channel", lambda s, kind: s.k_channel if kind == "k" else s.v_channel, False))
    arms.append(arm("token", None, False))
    return arms


def arms_for(geo: Geometry, dtype: str, scales: Sequence[str] = (), stats: str | None = None,
             per_head_kv: bool = True) -> list[Arm]:
    """The default arm, every checkpoint's arms, then the statistics file's arms, under distinct names.
    `per_head_kv`: whether the emulated engine applies per-head scales per head (see `checkpoint_arms`)."""
    arms = [default_arm(geo, kv_dtype(dtype))]
    for path in scales:
        arms += checkpoint_arms(path, geo, per_head_kv)
    if stats:
        arms += stats_arms(stats, geo, dtype)
    seen: dict[str, int] = {}
    out = []
    for a in arms:                      # the same path given twice still gives two readable, distinct names
        seen[a.name] = seen.get(a.name, 0) + 1
        out.append(a if seen[a.name] == 1 else replace(a, name=f"{a.name}#{seen[a.name]}"))
    return out


FORMAT = "format"          # the kind of an arm that is a whole KV format of the engine's (no kvcalib scales)


def format_arms(geo: Geometry, names: Sequence[str]) -> list[Arm]:
    """One arm per KV format in `names` that needs no scales of kvcalib's: `fp8_e5m2` (always scale 1.0) and the
    dynamic per-token-head caches (scales computed at the cache write, calib.evaluation.dynamic). The static
    formats are already the default and checkpoint arms, so they add nothing here."""
    out = []
    for name in dict.fromkeys(names):
        try:
            d = kv_format(name)
        except ValueError as e:
            raise EvalError(f"--formats: {e}") from None
        if d.dynamic:
            marker = {i: d.name for i in geo.layers}
            out.append(Arm(d.name, d, marker, dict(marker), kind=FORMAT, granularity="token_head",
                           notes=(f"{d.name}: one float32 scale per token and KV head computed at the cache write "
                                  "(vLLM's Triton backend); no calibration",)))
        elif d is FP8_E5M2:
            one = torch.tensor(1.0)
            out.append(Arm(d.name, d, {i: one for i in geo.layers}, {i: one for i in geo.layers}, kind=FORMAT,
                           notes=("fp8_e5m2: unscaled (scale 1.0), 2 mantissa bits, range to 57344",)))
    return out


# ------------------------------------------------------------------------------- the fake-quant hook

_TERMS = ("sat", "flush", "nonzero", "n", "signal", "noise")


def cache_codes(x: torch.Tensor, scale: torch.Tensor | float, dtype: KVDtype,
                cast: emulate.Cast | None = None) -> torch.Tensor:
    """The codes (float32 grid values) the engine's cache write stores for x: `cast` says how an FP8 cache
    rounds and applies the scale (None: `quant.quantize`, x / scale rounded to nearest). INT8 always rounds
    to nearest: every engine serving INT8 KV does."""
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
    if dtype.dynamic:               # the engine's own per-token-head cache: exactly its write and read
        return _dynamic_terms(x, dtype, mask, measure, out_dtype)
    dynamic = isinstance(scale, str)
    if dynamic:
        scale = x.detach().abs().amax(dim=-1, keepdim=True).float().div(dtype.qmax).clamp_min(MIN_SCALE)
    codes = cache_codes(x, scale, dtype, cast)
    x_hat = (codes * scale).to(out_dtype or x.dtype)
    if not measure:
        return x_hat, None
    w = torch.ones((), device=x.device) if mask is None else mask[:, None, :, None].to(torch.float32)
    xf = x.float()
    # a token's own max maps to qmax; a 1-ulp overshoot of x / scale there is not saturation
    sat = torch.zeros_like(xf, dtype=torch.bool) if dynamic else (xf / scale).abs() > dtype.qmax
    nonzero = xf != 0
    parts = (sat, (codes == 0) & nonzero, nonzero, torch.ones_like(xf), xf * xf, (xf - x_hat.float()) ** 2)
    return x_hat, torch.stack([(p * w).sum(dtype=torch.float64) for p in parts])


def _dynamic_terms(x: torch.Tensor, dtype: KVDtype, mask: torch.Tensor | None, measure: bool,
                   out_dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`fake_quant_terms` for a per-token-head cache (calib.evaluation.dynamic): nothing saturates (each
    token's own range is the scale); a nonzero value read back as 0 counts as flushed."""
    x_hat32 = dynamic.read_back(x, dtype)
    x_hat = x_hat32.to(out_dtype or x.dtype)
    if not measure:
        return x_hat, None
    w = torch.ones((), device=x.device) if mask is None else mask[:, None, :, None].to(torch.float32)
    xf = x.float()
    nonzero = xf != 0
    parts = (torch.zeros_like(xf), (x_hat32 == 0) & nonzero, nonzero, torch.ones_like(xf), xf * xf,
             (xf - x_hat.float()) ** 2)
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
    """Switches of the installed hook. `arm` None: pass K/V through untouched (bit-identical outputs).
    `token_mask` ([batch, seq], True = real token) keeps padding out of every metric; `meter` receives the
    per-layer sums (None: do not measure, e.g. during generation); `ranges` records per-head max |K|, |V|;
    `emulation` is the engine whose arithmetic quantised arms follow (`calib/evaluation/emulate.py`). The switches are
    set for one batch (or one generation) by `applying` and are all off outside it."""

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
        """Every attention call inside stores K/V as `arm` would (None: untouched), measured into `meter`
        over the real tokens of `token_mask`, recording K/V ranges into `ranges`; all switches off after,
        whatever happens inside."""
        self.arm, self.meter, self.token_mask, self.ranges = arm, meter, token_mask, ranges
        self.right_padded = token_mask is not None and _right_padded(token_mask)
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
    """(reference output, arm output, token mask) for the attention-error diagnostic. Over DIAG_QUERIES queries of
    a prefill through SDPA, only the last DIAG_QUERIES queries (which see the most keys) against every key: the
    model's own attention over all queries again would cost as much as the reference pass's attention, a
    quarter of the arm's time at 128K. Causality (bottom-right) and a sliding window go into the sliced mask."""
    n, t = query.shape[2], key.shape[2]
    sdpa = getattr(delegate, "__name__", "") == "sdpa_attention_forward"
    if n <= DIAG_QUERIES or n != t or not sdpa or not (attention_mask is None or attention_mask.dim() == 4):
        return delegate(module, query, key, value, attention_mask, **kwargs)[0], out, mask
    w = DIAG_QUERIES
    if attention_mask is None:
        rows = torch.arange(t - w, t, device=query.device)[:, None]
        cols = torch.arange(t, device=query.device)[None, :]
        sub = cols <= rows
        window = kwargs.get("sliding_window")
        if window:
            sub = sub & (cols > rows - int(window))
        sub = sub[None, None]
    else:
        sub = attention_mask[:, :, -w:, :]
    ref = delegate(module, query[:, :, -w:], key, value, sub, **kwargs)[0]
    return ref, out[:, -w:], None if mask is None else mask[:, -w:]


def _right_padded(token_mask: torch.Tensor) -> bool:
    """Whether every row of [batch, seq] `token_mask` is real tokens then padding (calib.data.batching.pad)."""
    n = token_mask.sum(dim=1, keepdim=True)
    return bool(torch.equal(token_mask.bool(), torch.arange(token_mask.shape[1], device=token_mask.device) < n))


def _descale(scale: torch.Tensor | str, kv_heads: int) -> torch.Tensor | None:
    """An arm's scale as FA3's descale (one per tensor or per KV head); None where FA3 takes none (per
    channel, per token: the what-if arms), and the kernel then multiplies the values as they are."""
    if isinstance(scale, str) or scale.numel() not in (1, kv_heads):
        return None
    return scale.reshape(-1).float()


def _fa3(module: Any, query: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor, attention_mask: Any,
         arm: Arm, layer: int, emu: emulate.Emulation, kwargs: dict[str, Any], plain: bool) -> torch.Tensor:
    """FlashAttention-3's FP8 attention (`fa3.fa3_attention`) in place of the model's own, same layout/dtype.

    The layer's sliding window and logit softcap come from what the model hands its attention function
    (`sliding_window`, `softcap`), as vLLM hands them to FA3; a window reaching past every key is no window
    (flash-attention hopper/flash_api.cpp mha_fwd: window_size_left >= max_seqlen_k - 1 becomes -1, which
    also picks the non-local kBlockN). `plain`: the batch is right-padded and this is a full forward, so a
    causal mask (plus the window) gives every real token what transformers' 4-D mask gives it; the dense
    mask is then not read (padding rows differ, and no metric reads them)."""
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
    out = fa3.fa3_attention(query, k_hat, v_hat, scaling=float(scaling), q_scale=arm.q_scale(layer),
                            k_scale=_descale(arm.k[layer], kvh), v_scale=_descale(arm.v[layer], kvh), mask=mask,
                            causal=causal, window_left=window_left, quant_q=emu.q is not None,
                            quant_p=emu.p is not None, softcap=kwargs.get("softcap") or None)
    return out.to(query.dtype).contiguous()


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
