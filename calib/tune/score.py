"""Candidates as evaluation arms, scored by the emulation `kvcalib eval` uses, and how to compare two of them.

Why through `calib/evaluation/fakequant.py` and `calib/evaluation/measure.py`: a second evaluator would drift from the one
whose agreement with the real engine has been measured (docs/design.md §6). A candidate becomes an `Arm`
holding the scales the engine would apply: per-head scales and q_scale only where the emulated backend
reads them (FlashAttention-3), the max over heads elsewhere; TensorRT-LLM's FP8 path at scale 1.0 whatever
the checkpoint holds; skipped layers unquantised.

Noise: the emulation is deterministic, so two arms always differ by some amount on a given text; whether
the difference would survive other text is what matters. `paired` compares two arms sample by sample on
the same held-out samples (mean KL to the reference per token, and mean NLL per token: the perplexity
change) and gives twice the standard error of that mean over samples: a difference inside it is not
measurable with these samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from calib.evaluation import emulate, numbers
from calib.evaluation.arms import Arm, Geometry
from calib.evaluation.results import ArmMetrics
from calib.recipe.dtypes import FP8_E4M3, kv_dtype
from calib.scales import fold as scales_mod
from calib.tune.space import Candidate

NOISE_SE = 2.0          # a difference is measurable when it exceeds this many standard errors


def arm_for(c: Candidate, stats: Any, geo: Geometry, emulation: emulate.Emulation) -> Arm:
    """The arm that stores the KV cache as the target engine would with this candidate's checkpoint."""
    dtype = kv_dtype(c.dtype)
    sc = scales_mod.compute(stats, dtype=c.dtype, granularity=c.granularity, headroom=c.headroom)
    fa3 = emulation.attention == "fa3"
    notes, k, v, q = [], {}, {}, {}
    for i in geo.layers:
        if i in c.skip:
            continue
        s = sc[i]
        if c.target == "trtllm" and dtype is FP8_E4M3:
            k[i] = v[i] = torch.tensor(1.0)
        elif fa3 and c.granularity == "head":
            k[i], v[i] = geo.shape(s.k_scale, f"layer {i} k_scale"), geo.shape(s.v_scale, f"layer {i} v_scale")
        else:
            k[i], v[i] = s.k_scale.max().reshape(()), s.v_scale.max().reshape(())
        if c.q_scale and fa3 and s.q_scale is not None:
            q[i] = s.q_scale.max().reshape(()).float()
    if c.target == "trtllm" and dtype is FP8_E4M3:
        notes.append("TensorRT-LLM's FP8 KV path runs with scale 1.0 whatever the checkpoint holds")
    elif c.granularity == "head" and not fa3:
        notes.append(f"per-head scales folded to their max: what vLLM applies outside FlashAttention-3 "
                     f"(emulation {emulation.name})")
    if c.q_scale and not fa3:
        notes.append(f"q_scale unused: only FlashAttention-3's FP8 attention reads it (emulation {emulation.name})")
    return Arm(c.name, dtype, k, v, kind="candidate", granularity=c.granularity, skip=c.skip, notes=tuple(notes),
               q=q)


def arm_key(arm: Arm) -> tuple:
    """Arms with equal keys store the cache identically: measuring one measures both (deterministic)."""
    def b(t: Any) -> bytes:
        return t.detach().cpu().float().numpy().tobytes()
    return (arm.dtype.name if arm.dtype else None, tuple(sorted(arm.skip)),
            tuple((i, b(arm.k[i]), b(arm.v[i])) for i in sorted(arm.k)), tuple((i, b(t)) for i, t in sorted(arm.q.items())))


def only_layer(arm: Arm, layer: int) -> Arm:
    """`arm` with every layer but `layer` unquantised: that layer's sensitivity."""
    return replace(arm, name=f"only layer {layer}", k={layer: arm.k[layer]}, v={layer: arm.v[layer]},
                   q={layer: arm.q[layer]} if layer in arm.q else {},
                   skip=tuple(i for i in arm.k if i != layer), kind="sensitivity")


@dataclass(frozen=True)
class Paired:
    """Arm a minus arm b on the same samples: mean NLL per token (≈ relative perplexity change) ± noise."""
    delta: float
    noise: float
    samples: int

    @property
    def measurable(self) -> bool:
        return abs(self.delta) > self.noise

    def to_dict(self) -> dict[str, Any]:
        return {"delta_per_token": self.delta, "noise": self.noise, "samples": self.samples,
                "measurable": self.measurable}


def compare(a: ArmMetrics, b: ArmMetrics, tokens: Sequence[int]) -> dict[str, Any]:
    """Entry a against entry b on the same samples: KL to the reference and NLL (perplexity), each paired with
    its noise; `better` / `worse` when either differs measurably in that direction."""
    kl = paired(a.sample_kl, b.sample_kl, tokens)
    nll = paired(a.sample_nll, b.sample_nll, tokens)
    def way(sign: int) -> bool:
        return any(p.measurable and sign * p.delta > 0 for p in (kl, nll))
    return {"kl": kl.to_dict(), "nll": nll.to_dict(), "measurable": kl.measurable or nll.measurable,
            "better": way(-1), "worse": way(1)}


def paired(a: Sequence[float], b: Sequence[float], tokens: Sequence[int]) -> Paired:
    """Ratio estimate of sum(a - b) / sum(tokens) and NOISE_SE standard errors of it over samples (the verdict's
    estimator, calib.evaluation.numbers.paired); infinite noise with fewer than two samples."""
    r, total = numbers.paired(a, b, tokens), float(sum(tokens))
    if r is None:
        return Paired(sum(x - y for x, y in zip(a, b)) / total if total else 0.0, math.inf, len(a))
    return Paired(r[0], NOISE_SE * r[1], len(a))


def slim(entry: ArmMetrics) -> dict[str, Any]:
    """What tune.json keeps of an arm's numbers: per-bucket and overall numbers, per-sample NLL."""
    keep = ("buckets", "summary", "sample_nll", "sample_kl", "seconds", "notes", "engine")
    d = entry.to_dict()
    return {k: d[k] for k in keep if k in d}
