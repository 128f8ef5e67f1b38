"""Evaluation: how far does an FP8 (or INT8) KV cache with given scales drift from the model's own dtype?

Why at the capture point: the engine quantises K and V when it writes them to the cache, after RoPE and
k-norm and before grouped-query expansion — exactly what transformers hands the function registered in
`ALL_ATTENTION_FUNCTIONS` (DESIGN.md section 3). So the hook here is the calibration hook's twin: it
replaces K and V by what the cache would give back (`fake_quant`: divide by the scale, saturate, round,
multiply back) for every token attention reads, prompt included, and then calls the model's own attention.
Perplexity measured with full-precision prompt K/V would hide exactly the damage we look for.

Arms are compared in one pass over held-out samples: for each batch the reference (no quantisation)
runs once, then every arm; nothing but per-bucket sums is kept, so memory does not grow with the data.
Logits are formed from the final hidden states a chunk of positions at a time, so no [seq, vocab]
tensor of a whole batch ever exists (checked once against the model's own forward; models whose head
does more fall back to full logits). Report and verdict: `calib/report.py`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from . import data as data_mod
from . import model as model_mod
from . import observe, passkey, report
from .checkpoint import read_kv_info
from .quant import FP8_E4M3, INT8, KVDtype, by_name, quantize
from .scales import MIN_SCALE, amax_to_scale

TOKEN = "token"            # an arm's scale for a layer may be this: dynamic, each token's own max|x| / qmax
OVERLAP_WINDOW = 16        # tokens compared to recognise a calibration sample among the eval samples
FAILURE_CONTEXT = 24       # tokens of text shown before a failure position
_ids = itertools.count()
Log = Callable[[str], Any]


class EvalError(ValueError):
    """The evaluation cannot run as asked; the message says what to change."""


@dataclass(frozen=True)
class EvalConfig:
    """One `kvcalib eval` run. `scales`: checkpoint directories (any tool's layout); `stats`: a kvcalib
    statistics-only output (directory or its stats.safetensors) for per-tensor/head/channel/token arms."""
    model: str
    data: str
    out: Path
    scales: tuple[str, ...] = ()
    stats: str | None = None
    dtype: str = "fp8_e4m3"
    buckets: tuple[int, ...] = (512, 2048, 8192)
    samples: int = 64
    min_tokens: int = 16
    pack: bool = False                # concatenate records into samples that fill every bucket
    batch_size: int = 4
    seed: int = 0
    passkey_trials: int = 1           # prompts per depth per bucket; 0 turns passkey off
    failures: int = 3                 # worst samples (by KL) kept per arm
    plots: bool = True
    thresholds: report.Thresholds = field(default_factory=report.Thresholds)
    device: str | None = None
    trust_remote_code: bool = False
    force: bool = False


@dataclass(frozen=True)
class Arm:
    """One way of storing the KV cache. `k`/`v` map a layer to its scale, already shaped to broadcast
    against K of shape [b, kv_heads, s, head_dim] ([] / [1,h,1,1] / [1,h,1,d]) or TOKEN; a layer absent
    from both stays unquantised. `dtype` None marks the reference."""
    name: str
    dtype: KVDtype | None
    k: Mapping[int, torch.Tensor | str] = field(default_factory=dict)
    v: Mapping[int, torch.Tensor | str] = field(default_factory=dict)
    kind: str = "reference"           # reference | default | checkpoint | stats
    granularity: str = "tensor"
    shippable: bool = True            # an engine can serve it (per-channel/per-token are what-ifs)
    source: str | None = None
    skip: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    def skipping(self, layers: Iterable[int]) -> "Arm":
        drop = set(layers) | set(self.skip)
        keep = {i: s for i, s in self.k.items() if i not in drop}
        return replace(self, name=f"{self.name} skip {','.join(map(str, sorted(drop)))}", k=keep,
                       v={i: s for i, s in self.v.items() if i not in drop}, skip=tuple(sorted(drop)))

    def to(self, device: torch.device) -> "Arm":
        def move(m):
            return {i: s if isinstance(s, str) else s.to(device) for i, s in m.items()}
        return replace(self, k=move(self.k), v=move(self.v))

    def describe(self) -> dict[str, Any]:
        def per_layer(m):
            return {str(i): None if isinstance(s, str) else float(s.max()) for i, s in sorted(m.items())}
        return {"kind": self.kind, "dtype": self.dtype.name if self.dtype else None, "granularity": self.granularity,
                "shippable": self.shippable, "source": self.source, "skip": list(self.skip), "notes": list(self.notes),
                "scales": {"k": per_layer(self.k), "v": per_layer(self.v)}}


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


def _checkpoint_dtype(path: Path, info: Any) -> KVDtype:
    scheme = info.kv_scheme or {}
    if scheme.get("type") == "int":
        return INT8
    hq = path / "hf_quant_config.json"
    if hq.is_file() and json.loads(hq.read_text()).get("quantization", {}).get("kv_cache_quant_algo") == "INT8":
        return INT8
    return FP8_E4M3


def checkpoint_arms(path: str, geo: Geometry) -> list[Arm]:
    """The arm of a checkpoint's K/V scales as stored, plus its per-tensor fold when the scales are per head
    (what vLLM applies outside its FlashAttention-3 backend)."""
    try:
        info = read_kv_info(path)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise EvalError(f"--scales {path}: {e}") from None
    if not info.scales:
        raise EvalError(f"--scales {path}: no K/V scale tensors (*.k_scale / *.v_scale) found")
    if info.num_layers is not None and info.num_layers != len(geo.layers):
        raise EvalError(f"--scales {path} is for a model with {info.num_layers} layers; this model has "
                        f"{len(geo.layers)}")
    dtype = _checkpoint_dtype(Path(path), info)
    k, v, notes = {}, {}, []
    for i in geo.layers:
        sc = info.scales.get(i, {})
        k[i] = geo.shape(sc.get("k", [1.0]), f"--scales {path} layer {i} k_scale")
        v[i] = geo.shape(sc.get("v", [1.0]), f"--scales {path} layer {i} v_scale")
    missing = [i for i in geo.layers if not {"k", "v"} <= set(info.scales.get(i, {}))]
    if missing:
        notes.append(f"no scales for layers {missing}: engines use 1.0 there, and so does this arm")
    if "trtllm" in info.targets and "vllm" not in info.targets and dtype is FP8_E4M3:
        notes.append("TensorRT-LLM's FP8 KV path currently runs with scale 1.0 whatever the checkpoint says "
                     "(DESIGN.md section 5): served there, this checkpoint behaves like the 'default' arm")
    per_head = any(s.dim() == 4 for s in (*k.values(), *v.values()))
    arm = Arm(f"calibrated:{path}", dtype, k, v, kind="checkpoint", granularity="head" if per_head else "tensor",
              source=str(path), notes=tuple(notes))
    if not per_head:
        return [arm]
    fold = {i: s.max().reshape(()) for i, s in k.items()}, {i: s.max().reshape(()) for i, s in v.items()}
    return [replace(arm, notes=arm.notes + ("per-head scales apply per head only on vLLM's FlashAttention-3 "
                                            "backend; see the '@tensor' arm for other backends",)),
            replace(arm, name=f"{arm.name}@tensor", k=fold[0], v=fold[1], granularity="tensor",
                    notes=("the per-head scales folded to their max: what vLLM applies outside FlashAttention-3",))]


def stats_arms(path: str, geo: Geometry, default_dtype: str) -> list[Arm]:
    """Per-tensor / per-head / per-channel (when recorded) / per-token arms from a statistics-only output."""
    from safetensors.torch import load_file

    p = Path(path)
    file = p / "stats.safetensors" if p.is_dir() else p
    if not file.is_file():
        raise EvalError(f"--stats {path}: no stats.safetensors (write one with a statistics-only recipe, targets: [])")
    stats = observe.stats_from_tensors(load_file(str(file)))
    if sorted(stats) != sorted(geo.layers):
        raise EvalError(f"--stats {path} covers layers {sorted(stats)}, the model has {list(geo.layers)}")
    prov = file.parent / "kvcalib.json"
    name = json.loads(prov.read_text()).get("recipe", {}).get("dtype", default_dtype) if prov.is_file() else default_dtype
    dtype = by_name(name)

    def arm(gran: str, pick: Callable[[observe.LayerStats, str], Any] | None, shippable: bool) -> Arm:
        def scales(kind):
            if pick is None:
                return {i: TOKEN for i in geo.layers}
            return {i: geo.shape(amax_to_scale(pick(s, kind), 1.0, dtype.qmax), f"--stats {path} layer {i}")
                    for i, s in stats.items()}
        return Arm(f"per-{gran}:{path}", dtype, scales("k"), scales("v"), kind="stats", granularity=gran,
                   shippable=shippable, source=str(path))

    arms = [arm("tensor", lambda s, kind: s.clip(kind).max(), True), arm("head", lambda s, kind: s.clip(kind), True)]
    if all(s.k_channel is not None and s.v_channel is not None for s in stats.values()):
        arms.append(arm("channel", lambda s, kind: s.k_channel if kind == "k" else s.v_channel, False))
    arms.append(arm("token", None, False))
    return arms


# ------------------------------------------------------------------------------- the fake-quant hook

_TERMS = ("sat", "flush", "nonzero", "n", "signal", "noise")


def fake_quant_terms(x: torch.Tensor, scale: torch.Tensor | str, dtype: KVDtype, mask: torch.Tensor | None,
                     measure: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(what the cache gives back for x, and when `measure` the float64 sums `_TERMS` over real tokens:
    saturated values, nonzero values stored as 0, nonzero values, values, sum x^2, sum (x - x_hat)^2)."""
    dynamic = isinstance(scale, str)
    if dynamic:
        scale = x.detach().abs().amax(dim=-1, keepdim=True).float().div(dtype.qmax).clamp_min(MIN_SCALE)
    codes = quantize(x, scale, dtype)
    x_hat = (codes * scale).to(x.dtype)
    if not measure:
        return x_hat, None
    w = torch.ones((), device=x.device) if mask is None else mask[:, None, :, None].to(torch.float32)
    xf = x.float()
    # a token's own max maps to qmax; a 1-ulp overshoot of x / scale there is not saturation
    sat = torch.zeros_like(xf, dtype=torch.bool) if dynamic else (xf / scale).abs() > dtype.qmax
    nonzero = xf != 0
    parts = (sat, (codes == 0) & nonzero, nonzero, torch.ones_like(xf), xf * xf, (xf - x_hat.float()) ** 2)
    return x_hat, torch.stack([(p * w).sum(dtype=torch.float64) for p in parts])


def _output_terms(ref: torch.Tensor, out: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """sum |o - o_hat|^2 and sum |o|^2 over real tokens; attention outputs are [b, s, heads, d]."""
    w = mask[:, :, None, None].to(torch.float32) if mask is not None and ref.shape[:2] == mask.shape else 1.0
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
                row[f"{kind}_snr_db"] = 10 * math.log10(signal / noise) if noise > 0 and signal > 0 else math.inf
            err, ref = vals[-2:]
            row["attn_rel_error"] = math.sqrt(err / ref) if ref > 0 else 0.0
            out[str(i)] = row
        return out


class FakeQuantKV:
    """Switches of the installed hook. `arm` None: pass K/V through untouched (bit-identical outputs).
    `token_mask` ([batch, seq], True = real token) keeps padding out of every metric; `meter` receives the
    per-layer sums (None: do not measure, e.g. during generation); `ranges` records per-head max |K|, |V|."""

    def __init__(self) -> None:
        self.arm: Arm | None = None
        self.token_mask: torch.Tensor | None = None
        self.meter: Meter | None = None
        self.ranges: dict[int, tuple[observe.AbsMaxObserver, observe.AbsMaxObserver]] | None = None

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
        measure = self.meter is not None
        k_hat, k_terms = fake_quant_terms(key, arm.k[layer], arm.dtype, mask, measure)
        v_hat, v_terms = fake_quant_terms(value, arm.v[layer], arm.dtype, mask, measure)
        out = delegate(module, query, k_hat, v_hat, attention_mask, **kwargs)
        if measure:
            ref = delegate(module, query, key, value, attention_mask, **kwargs)
            self.meter.add(layer, torch.cat([k_terms, v_terms, _output_terms(ref[0], out[0], mask)]))
        return out


@contextlib.contextmanager
def fake_quant_kv(model: torch.nn.Module) -> Iterator[FakeQuantKV]:
    """Route every attention call of `model` through the fake-quant hook; always restores the model."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = model.config._attn_implementation
    if original not in ("eager", "sdpa") and original not in ALL_ATTENTION_FUNCTIONS:
        raise observe.CaptureError(f"attention implementation {original!r} is not known to transformers' AttentionInterface")
    delegate = observe._delegate_for(original)
    state = FakeQuantKV()
    name = f"kvcalib_fakequant_{next(_ids)}"

    def attention(module, query, key, value, attention_mask, **kwargs):
        return state.attend(delegate, module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    try:
        model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise observe.CaptureError(f"{type(model).__name__} refused a custom attention implementation")
        yield state
    finally:
        try:
            model.set_attn_implementation(original)
        finally:
            ALL_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)
            ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)


# ------------------------------------------------------------------------------------------- logits

class _Head:
    """Next-token log-probabilities from final hidden states, a chunk of positions at a time."""

    def __init__(self, lm: torch.nn.Module) -> None:
        cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        self.lm, self.full = lm, False
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.multiply = getattr(cfg, "logit_scale", None)       # Cohere
        self.divide = getattr(cfg, "logits_scaling", None)       # Granite
        self.rows = max(1, 2 ** 24 // int(cfg.vocab_size))

    def features(self, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if self.full:
            return self.lm(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return self.lm.base_model(input_ids=ids, attention_mask=mask, use_cache=False)[0]

    def log_probs(self, h: torch.Tensor) -> torch.Tensor:
        z = h.float() if self.full else self.lm.get_output_embeddings()(h).float()
        if not self.full:
            z = z * self.multiply if self.multiply else z
            z = z / self.divide if self.divide else z
            z = torch.tanh(z / self.softcap) * self.softcap if self.softcap else z
        return torch.log_softmax(z, dim=-1)

    def verify(self, ids: Sequence[int]) -> str | None:
        """Compare with the model's own logits once; fall back to full logits on a mismatch."""
        x = torch.tensor([list(ids[:32])], device=next(self.lm.parameters()).device)
        want = torch.log_softmax(self.lm(input_ids=x, use_cache=False).logits.float(), dim=-1)
        if torch.allclose(self.log_probs(self.features(x, None)), want, rtol=1e-3, atol=1e-3):
            return None
        self.full = True
        return "the model's head does more than a linear layer here: logits are computed in full per batch"


# ------------------------------------------------------------------------------------------- samples

@dataclass(frozen=True)
class Sample:
    index: int
    ids: tuple[int, ...]
    bucket: int          # the smallest bucket (token length) >= len(ids)


def usable_buckets(requested: Iterable[int], max_positions: int | None) -> tuple[tuple[int, ...], list[int]]:
    """(buckets within the model's context, dropped ones); the context itself when none fits."""
    req = sorted(set(int(b) for b in requested))
    if any(b < 2 for b in req):
        raise EvalError(f"buckets {req}: every bucket must be at least 2 tokens")
    kept = [b for b in req if not max_positions or b <= max_positions]
    return tuple(kept or [int(max_positions)]), [b for b in req if b not in kept]


def _same_source(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.resolve() == pb.resolve() if pa.exists() and pb.exists() else a == b


def calibration_windows(provenances: Sequence[tuple[str, dict | None]], data_src: str, tokenizer: Any,
                        vocab: int | None) -> tuple[set[int] | None, dict[str, Any]]:
    """Hashes of every OVERLAP_WINDOW-token window of the calibration samples of the first kvcalib output
    that calibrated on `data_src` (its recipe replays the same deterministic stream), and what was found."""
    for where, prov in provenances:
        src, recipe = (prov or {}).get("data", {}).get("source"), (prov or {}).get("recipe")
        if not src or not recipe or not _same_source(str(src), data_src):
            continue
        rep = data_mod.DataReport()
        seqs = list(data_mod.samples(src, tokenizer, seq_len=recipe["seq_len"], max_samples=recipe["samples"],
                                     min_tokens=recipe["min_tokens"], pack=recipe["pack"], seed=recipe["seed"],
                                     vocab_size=vocab, report=rep))
        flat = [t for s in seqs for t in s]
        windows = {hash(tuple(flat[i:i + OVERLAP_WINDOW])) for i in range(len(flat) - OVERLAP_WINDOW + 1)}
        exact = f"sha256:{rep.fingerprint}" == prov["data"].get("fingerprint")
        return windows, {"checked_against": where, "calibration_samples": len(seqs), "reproduced_exactly": exact}
    return None, {"checked_against": None, "note": "no kvcalib output calibrated on this DATA was given: eval "
                  "samples are not checked against calibration samples"}


def select_samples(cfg: EvalConfig, tokenizer: Any, vocab: int | None, buckets: Sequence[int],
                   windows: set[int] | None) -> tuple[list[Sample], data_mod.DataReport, int]:
    """Held-out samples (records whose first tokens appear in the calibration stream are left out), cut to the
    largest bucket or, with `pack`, concatenated into samples cycling through every bucket's length."""
    read = data_mod.DataReport()
    stream = data_mod.samples(cfg.data, tokenizer, seq_len=2 ** 31 if cfg.pack else max(buckets), max_samples=2 ** 31,
                              min_tokens=cfg.min_tokens, pack=False, seed=cfg.seed, vocab_size=vocab, report=read)
    excluded = 0

    def held_out() -> Iterator[list[int]]:
        nonlocal excluded
        for ids in stream:
            if windows and len(ids) >= OVERLAP_WINDOW and hash(tuple(ids[:OVERLAP_WINDOW])) in windows:
                excluded += 1
                continue
            yield ids

    seqs: Iterator[list[int]] = held_out()
    if cfg.pack:
        seqs = _pack(seqs, buckets)
    used, out = data_mod.DataReport(), []
    for ids in itertools.islice(seqs, cfg.samples):
        used.add(ids)
        out.append(Sample(len(out), tuple(ids), next(b for b in sorted(buckets) if b >= len(ids))))
    used.column, used.skipped_short = read.column, read.skipped_short
    if not out:
        raise EvalError(f"DATA {cfg.data}: no held-out samples left ({excluded} were calibration samples)")
    return out, used, excluded


def _pack(seqs: Iterable[list[int]], lengths: Sequence[int]) -> Iterator[list[int]]:
    buf: list[int] = []
    cycle = itertools.cycle(sorted(lengths))
    want = next(cycle)
    for s in seqs:
        buf.extend(s)
        while len(buf) >= want:
            yield buf[:want]
            buf, want = buf[want:], next(cycle)


# ------------------------------------------------------------------------------------------- measuring

@dataclass(frozen=True)
class Session:
    """Everything a measuring pass needs; the hook stays installed for the whole evaluation."""
    lm: torch.nn.Module
    hook: FakeQuantKV
    head: _Head
    tokenizer: Any
    samples: tuple[Sample, ...]
    buckets: tuple[int, ...]
    batch_size: int = 4
    pad_id: int = 0
    failures: int = 3

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _chunked(head: _Head, h_ref: torch.Tensor, h_arm: torch.Tensor | None, tgt: torch.Tensor) -> list[torch.Tensor]:
    """Reference only: [nll, top1]; with an arm: [kl(ref || arm), top1 agrees, nll, arm top1]."""
    parts = []
    for a in range(0, tgt.numel(), head.rows):
        sl = slice(a, a + head.rows)
        lr = head.log_probs(h_ref[sl])
        if h_arm is None:
            parts.append((-lr.gather(-1, tgt[sl, None])[:, 0], lr.argmax(-1)))
            continue
        la = head.log_probs(h_arm[sl])
        top = la.argmax(-1)
        parts.append(((lr.exp() * (lr - la)).sum(-1).clamp_min(0), top == lr.argmax(-1),
                      -la.gather(-1, tgt[sl, None])[:, 0], top))
    return [torch.cat(p) for p in zip(*parts)]


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids)) if tokenizer is not None else " ".join(map(str, ids))


class _Acc:
    """Running sums of one arm: per bucket [tokens, KL, top-1 agreements, NLL], per layer (Meter), the worst samples."""

    def __init__(self, buckets: int, device: torch.device) -> None:
        self.sums = torch.zeros(4, buckets, dtype=torch.float64, device=device)
        self.meter, self.worst, self.seconds = Meter(), [], 0.0

    def track(self, s: Session, group: Sequence[Sample], valid: torch.Tensor, kl: torch.Tensor,
              ref_top: torch.Tensor, arm_top: torch.Tensor) -> None:
        if s.failures <= 0:
            return
        dense = torch.zeros(valid.shape, dtype=kl.dtype, device=kl.device).masked_scatter_(valid, kl)
        counts = valid.sum(1).tolist()
        means = (dense.sum(1) / valid.sum(1).clamp_min(1)).tolist()
        tops = [torch.zeros(valid.shape, dtype=torch.long, device=kl.device).masked_scatter_(valid, t)
                for t in (ref_top, arm_top)]
        for r, sample in enumerate(group):
            floor = self.worst[-1]["mean_kl"] if len(self.worst) >= s.failures else -1.0
            if counts[r] == 0 or means[r] <= floor:
                continue
            worst = dense[r].topk(min(2, counts[r])).indices.tolist()
            ids = sample.ids
            self.worst.append({"sample": sample.index, "tokens": len(ids), "bucket": sample.bucket, "mean_kl": means[r],
                               "positions": [{"position": p, "kl": float(dense[r, p]),
                                              "context": _decode(s.tokenizer, ids[max(0, p - FAILURE_CONTEXT):p + 1]),
                                              "next": _decode(s.tokenizer, ids[p + 1:p + 2]),
                                              "reference_predicts": _decode(s.tokenizer, [int(tops[0][r, p])]),
                                              "arm_predicts": _decode(s.tokenizer, [int(tops[1][r, p])])}
                                             for p in worst]})
            self.worst.sort(key=lambda w: -w["mean_kl"])
            del self.worst[s.failures:]


def _bucket_table(s: Session, sums: torch.Tensor, ref_nll: torch.Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per bucket and overall: tokens, KL, top-1 agreement, perplexity and its change against the reference."""
    def row(t, kl, agree, nll, rnll, n_samples):
        t = max(t, 1e-300)
        ppl, ppl_ref = math.exp(nll / t), math.exp(rnll / t)
        return {"samples": n_samples, "tokens": int(t), "kl": kl / t, "top1": agree / t, "ppl": ppl,
                "ppl_ref": ppl_ref, "ppl_delta": ppl - ppl_ref, "ppl_rel": ppl / ppl_ref - 1}
    per = sums.tolist()
    counts = [sum(1 for x in s.samples if x.bucket == b) for b in s.buckets]
    table = {str(b): row(per[0][j], per[1][j], per[2][j], per[3][j], float(ref_nll[j]), counts[j])
             for j, b in enumerate(s.buckets) if per[0][j] > 0}
    total = row(*(sum(x) for x in per), float(ref_nll.sum()), len(s.samples))
    total["max_bucket_kl"] = max(r["kl"] for r in table.values())
    return table, total


def measure(s: Session, arms: Sequence[Arm], ranges: bool = False) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """One pass over the samples: per batch the reference once, then every arm. Returns (reference entry,
    {arm name: entry}) with per-bucket, overall, per-layer numbers, the worst samples and the seconds spent."""
    from .pipeline import batches

    dev, nb = s.device, len(s.buckets)
    arms = [a.to(dev) for a in arms]
    accs = {a.name: _Acc(nb, dev) for a in arms}
    ref_sums = torch.zeros(2, nb, dtype=torch.float64, device=dev)      # tokens, nll
    recorded: dict[int, tuple[observe.AbsMaxObserver, observe.AbsMaxObserver]] = {}
    ref_seconds = 0.0
    order = sorted(s.samples, key=lambda x: len(x.ids))
    groups = [order[i:i + s.batch_size] for i in range(0, len(order), s.batch_size)]
    for group, (ids, mask) in zip(groups, batches([list(x.ids) for x in order], s.batch_size, s.pad_id)):
        t0 = _clock(dev)
        ids, mask = ids.to(dev), mask.to(dev)
        valid = (mask[:, 1:] * mask[:, :-1]).bool()
        where = torch.tensor([s.buckets.index(x.bucket) for x in group], device=dev)[valid.nonzero()[:, 0]]
        tgt = ids[:, 1:][valid]
        s.hook.arm, s.hook.meter, s.hook.token_mask = None, None, mask.bool()
        s.hook.ranges = recorded if ranges else None
        h_ref = s.head.features(ids, mask)[:, :-1][valid]
        s.hook.ranges = None
        ref_nll, ref_top = _chunked(s.head, h_ref, None, tgt)
        ref_sums.index_add_(1, where, torch.stack([torch.ones_like(ref_nll), ref_nll]).double())
        ref_seconds += _clock(dev) - t0
        for arm in arms:
            t0, acc = _clock(dev), accs[arm.name]
            s.hook.arm, s.hook.meter = arm, acc.meter
            kl, agree, nll, top = _chunked(s.head, h_ref, s.head.features(ids, mask)[:, :-1][valid], tgt)
            acc.sums.index_add_(1, where, torch.stack([torch.ones_like(kl), kl, agree.to(kl.dtype), nll]).double())
            acc.track(s, group, valid, kl, ref_top, top)
            acc.seconds += _clock(dev) - t0
    s.hook.arm = s.hook.meter = s.hook.token_mask = None
    zero = torch.zeros_like(ref_sums[0])   # the reference against itself: KL 0, top-1 agreement 1
    ref_table, ref_total = _bucket_table(s, torch.stack([ref_sums[0], zero, ref_sums[0], ref_sums[1]]), ref_sums[1])
    ref = {"buckets": ref_table, "summary": ref_total, "seconds": {"metrics": ref_seconds},
           "ranges": {str(i): {"k_amax": o[0].amax().tolist(), "v_amax": o[1].amax().tolist()}
                      for i, o in sorted(recorded.items())}}
    out = {}
    for arm in arms:
        acc = accs[arm.name]
        table, total = _bucket_table(s, acc.sums, ref_sums[1])
        out[arm.name] = {**arm.describe(), "buckets": table, "summary": total, "layers": acc.meter.read(),
                         "failures": acc.worst, "seconds": {"metrics": acc.seconds}}
    return ref, out


def run_passkey(s: Session, arm: Arm | None, prompts: Sequence[passkey.Prompt]) -> tuple[dict[str, Any], float]:
    """Passkey accuracy per bucket under `arm` (None: the reference) and the seconds it took."""
    t0 = _clock(s.device)
    s.hook.arm, s.hook.meter, s.hook.token_mask = (arm.to(s.device) if arm else None), None, None
    try:
        outcomes = passkey.run(s.lm, s.tokenizer, prompts)
    finally:
        s.hook.arm = None
    return passkey.summarize(outcomes), _clock(s.device) - t0


# ------------------------------------------------------------------------------------------- the run

def load_causal_lm(source: str, device: str | None = None, trust_remote_code: bool = False) -> model_mod.LoadedModel:
    """Like `model.load`, but with the LM head: evaluation needs logits. `LoadedModel.model` is the causal LM."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = model_mod.resolve_source(source)
    config = AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code)
    model_mod.check_cache_kind(config, f"MODEL {src}")
    dev = model_mod.pick_device(device)
    try:
        with model_mod._quiet_transformers():
            lm = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16 if dev.type == "cuda" else "auto",
                                                      trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise model_mod.ModelError(f"MODEL {src}: no causal LM could be loaded ({str(e).splitlines()[0]})") from None
    lm.to(dev).eval()
    layers = model_mod.find_attention_layers(lm)
    if not layers:
        raise model_mod.ModelError(f"MODEL {src}: no attention layers with a layer_idx; K/V cannot be reached")
    return model_mod.LoadedModel(lm, model_mod._load_tokenizer(src, trust_remote_code), src,
                                 config.get_text_config(), layers, dev)


@dataclass(frozen=True)
class EvalResult:
    out: Path
    verdict: dict[str, Any]
    report: dict[str, Any]
    seconds: float


def _arms(cfg: EvalConfig, geo: Geometry) -> list[Arm]:
    arms = [default_arm(geo, by_name(cfg.dtype))]
    for path in cfg.scales:
        arms += checkpoint_arms(path, geo)
    if cfg.stats:
        arms += stats_arms(cfg.stats, geo, cfg.dtype)
    seen: dict[str, int] = {}
    out = []
    for a in arms:                      # the same path given twice still gives two readable, distinct names
        seen[a.name] = seen.get(a.name, 0) + 1
        out.append(a if seen[a.name] == 1 else replace(a, name=f"{a.name}#{seen[a.name]}"))
    return out


def _provenances(cfg: EvalConfig) -> list[tuple[str, dict | None]]:
    out: list[tuple[str, dict | None]] = [(p, read_kv_info(p).provenance) for p in cfg.scales]
    if cfg.stats:
        p = Path(cfg.stats)
        prov = (p if p.is_dir() else p.parent) / "kvcalib.json"
        out.append((cfg.stats, json.loads(prov.read_text()) if prov.is_file() else None))
    return out


def run_eval(cfg: EvalConfig, log: Log = lambda _m: None) -> EvalResult:
    """Evaluate every arm against the reference on held-out samples and write the report to `cfg.out`."""
    t_start = time.perf_counter()
    if Path(cfg.out).exists() and not cfg.force:
        raise EvalError(f"output {cfg.out} already exists; pass --force to replace it or choose another --out")
    data_mod.check_source(cfg.data)
    loaded = load_causal_lm(cfg.model, cfg.device, cfg.trust_remote_code)
    lm, tok, config = loaded.model, loaded.tokenizer, loaded.config
    geo = Geometry.of(config, loaded.attention_layers)
    arms = _arms(cfg, geo)
    vocab = getattr(config, "vocab_size", None)
    buckets, dropped = usable_buckets(cfg.buckets, getattr(config, "max_position_embeddings", None))
    notes = [f"buckets {dropped} exceed the model's context ({config.max_position_embeddings} tokens): dropped"] if dropped else []
    windows, held_out = calibration_windows(_provenances(cfg), cfg.data, tok, vocab)
    samples, used, excluded = select_samples(cfg, tok, vocab, buckets, windows)
    held_out["excluded_samples"] = excluded
    prompts: list[passkey.Prompt] = []
    if tok is None:
        notes.append("passkey retrieval skipped: the model has no tokenizer")
    elif cfg.passkey_trials > 0:
        prompts, pk_notes = passkey.prompts(tok, buckets, cfg.passkey_trials, cfg.seed)
        notes += pk_notes
    log(f"eval: {len(samples)} samples / {used.tokens} tokens, {len(arms)} arms + reference, "
        f"{len(prompts)} passkey prompts per arm")
    ref_arm = reference_arm(loaded.dtype)
    with fake_quant_kv(lm) as hook, torch.inference_mode():
        head = _Head(lm)
        note = head.verify(samples[0].ids)
        notes += [note] if note else []
        pad = getattr(tok, "pad_token_id", None) or 0
        s = Session(lm, hook, head, tok, tuple(samples), buckets, cfg.batch_size, pad, cfg.failures)
        ref, results = measure(s, arms, ranges=True)
        by_name_ = {a.name: a for a in arms}
        if prompts:
            ref["passkey"], ref["seconds"]["passkey"] = run_passkey(s, None, prompts)
            for a in arms:
                results[a.name]["passkey"], results[a.name]["seconds"]["passkey"] = run_passkey(s, a, prompts)
        for name, layers in report.skip_plan(ref, results, cfg.thresholds):
            for k in range(1, len(layers) + 1):      # smallest prefix of the dominant layers that passes
                trial = by_name_[name].skipping(layers[:k])
                log(f"eval: measuring {trial.name}")
                _, r = measure(s, [trial])
                if prompts:
                    r[trial.name]["passkey"], r[trial.name]["seconds"]["passkey"] = run_passkey(s, trial, prompts)
                results.update(r)
                if not report.failures(r[trial.name], ref, cfg.thresholds):
                    break
    meta = {"model": str(cfg.model), "model_dtype": str(loaded.dtype).removeprefix("torch."),
            "device": str(loaded.device), "layers": list(geo.layers), "kv_heads": geo.kv_heads,
            "head_dim": geo.head_dim, "data": {"source": str(cfg.data), **used.to_dict(), "held_out": held_out},
            "buckets": list(buckets), "config": _config_dict(cfg), "notes": notes, "reference": ref_arm.name,
            "seconds": time.perf_counter() - t_start}
    doc = report.document(meta, ref, results, cfg.thresholds)
    report.write(Path(cfg.out), doc, force=cfg.force, plots=cfg.plots)
    return EvalResult(Path(cfg.out), doc["verdict"], doc, time.perf_counter() - t_start)


def _config_dict(cfg: EvalConfig) -> dict[str, Any]:
    d = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
    d.update(out=str(cfg.out), scales=list(cfg.scales), buckets=list(cfg.buckets), thresholds=cfg.thresholds.to_dict())
    return d
