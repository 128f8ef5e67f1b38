"""What an arm is (one way of storing the KV cache: a format plus per-layer K/V scales) and how the arms of an
evaluation are built: the model's own dtype, the engines' default scale 1.0, a checkpoint's scales as an
engine would load them, a statistics file's ranges at each granularity, whole KV formats, skips.

Why a module of its own: arms are what `kvcalib eval`, `tune`, `validate` and the routes compare, and what
their reports describe; the fake-quant hook (`calib/evaluation/fakequant.py`) only applies one arm at a
time. Reading a checkpoint or a statistics file into scales shaped for K/V is independent of how the hook
quantises with them, and the hook's readers need none of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from calib.ckpt.kvinfo import read_kv_info
from calib.errors import KvcalibError
from calib.evaluation.results import ArmInfo
from calib.recipe import support
from calib.recipe.dtypes import FP8_E4M3, FP8_E5M2, INT8, KVDtype, kv_dtype, kv_format
from calib.safety.readers import raising
from calib.scales.fold import amax_to_scale
from calib.scales.stats import LayerStats, Stats

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
        if not (torch.isfinite(t).all() and (t >= torch.finfo(torch.float32).tiny).all()):
            # a subnormal scale (k_scale 1e-45) saturates every value: never an arm that could be shipped
            raise EvalError(f"{where}: scales must be finite and at least the smallest normal float32 "
                            f"({torch.finfo(torch.float32).tiny:.3g}), got {t.tolist()[:8]}")
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
    dtype = INT8 if (info.kv_scheme or {}).get("type") == "int" or info.kv_cache_quant_algo == "INT8" else FP8_E4M3
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
    drop = set(sliding)
    return [replace(a.skipping(drop), name=f"{a.name} skip {SLIDING_SKIP}", skip_kind=SLIDING_SKIP,
                    notes=a.notes + (f"the {len(drop)} sliding-window layers {sorted(drop)} kept at the model dtype, "
                                     f"as vLLM serves with --kv-cache-dtype-skip-layers {SLIDING_SKIP}",))
            for a in arms if drop and a.kind in ("default", "checkpoint") and not a.name.endswith("@tensor")
            and not a.skip]


def read_stats(path: str) -> tuple[Stats, dict[str, Any] | None]:
    """The per-layer ranges of a kvcalib statistics file (a statistics-only output directory or its
    stats.safetensors) and its header (recipe, data), through calib.capture.statsfile's one reader."""
    from calib.capture import statsfile

    with raising(EvalError, statsfile.StatsError):
        sf = statsfile.load_output(Path(path), "--stats")
        return sf.stats(), sf.header


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
            out.append(replace(default_arm(geo, d), name=d.name, kind=FORMAT,
                               notes=("fp8_e5m2: unscaled (scale 1.0), 2 mantissa bits, range to 57344",)))
    return out
