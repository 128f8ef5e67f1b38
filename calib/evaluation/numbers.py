"""Which numbers decide for an arm, and what they say beyond the decision.

Why: an emulation that does not match the engine can ship what the engine degrades or refuse what it serves
fine (issue: +0.99 % emulated vs +2.72 % measured on one text). So every decision reads the engine's numbers
when the engine measured the arm, the emulation's otherwise (`decisive`), and the verdict says which. The engine
returns its numbers typed (calib.engine.metrics.EngineNumbers); they are scored here and in the verdict, never in
the engine. Two further rules keep the advice honest:
- when calibrated and default scales are within noise, the verdict says so and why (docs/design.md §4:
  inside e4m3's normal range the relative rounding error does not depend on the scale), and it shows the
  layers that saturate at scale 1.0;
- skipping layers is recommended only when the engine measured the skip and confirmed the gain.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from calib.engine.metrics import BucketRow, Summary
from calib.evaluation.results import ArmMetrics, Reference
from calib.recipe.dtypes import kv_format

ENGINE, EMULATION = "engine", "emulation"

Entry = Reference | ArmMetrics


def engine_ok(entry: Entry) -> bool:
    return entry.engine is not None and entry.engine.ok


# An engine arm is implausible for its format when it is off the model-dtype reference by more than any KV format
# kvcalib serves costs: a tenfold perplexity (FP8 at scale 1.0 measured +1 % to +4 % in GPU vLLM; even INT8 rounded
# at scale 1.0 cost about x10 in kvcalib's emulation of the default model), or a mean KL past ln 10 nats —
# the same tenfold loss counted as a divergence per token. CPU vLLM 0.32 accepting fp8_per_token_head and returning
# perplexity 224,275 against 22.4 (x10,000) is what this catches. The emulation of the same arm is the second
# opinion: when it is as far off, the format itself is that bad and the engine is believed.
MAX_PPL_RATIO = 10.0
MAX_KL = math.log(MAX_PPL_RATIO)


def implausible(entry: Entry) -> str | None:
    """"engine output implausible for <format> on <engine version>" with the numbers, when the engine's numbers of
    this arm are orders of magnitude off the reference and its emulation is not; None otherwise."""
    if isinstance(entry, Reference) or not engine_ok(entry):
        return None
    g, s = entry.engine, entry.engine.summary
    ratio, emu = 1.0 + s.ppl_rel, 1.0 + entry.summary.ppl_rel
    bad = not math.isfinite(s.ppl) or ratio > MAX_PPL_RATIO or not math.isfinite(s.kl) or s.kl > MAX_KL
    return (f"engine output implausible for {g.kv_cache_dtype or entry.info.dtype} on {g.engine} {g.version} (ppl "
            f"x{ratio:.4g}, KL {s.kl:.3g} vs the reference; emulated x{emu:.4g}): not ranked"
            if bad and emu <= MAX_PPL_RATIO else None)


@dataclass(frozen=True)
class Numbers:
    """The numbers a decision reads for one arm (`decisive`): per bucket, overall and per-sample NLL, with their
    source and how the verdict names them."""
    source: str
    label: str
    buckets: Mapping[str, BucketRow]
    summary: Summary
    sample_nll: tuple[float, ...]


def decisive(entry: Entry) -> Numbers:
    """The numbers that decide for this arm: the engine's where it measured the arm, the emulation's otherwise."""
    if not engine_ok(entry):
        return Numbers(EMULATION, "emulated", entry.buckets, entry.summary, tuple(entry.sample_nll))
    g = entry.engine
    return Numbers(ENGINE, f"{g.engine} {g.version}, KL a lower bound", g.buckets, g.summary, g.sample_nll)


def paired(a: Sequence[float], b: Sequence[float], tokens: Sequence[int]) -> tuple[float, float] | None:
    """(log ppl ratio a/b, its standard error) from per-sample NLL sums; None with fewer than 2 samples."""
    n, t = len(a), float(sum(tokens))
    if n < 2 or n != len(b) or n != len(tokens) or t <= 0:
        return None
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / t
    return mean, math.sqrt(sum((di - ti * mean) ** 2 for di, ti in zip(d, tokens)) * n / (n - 1)) / t


def scales_within_noise(ref: Reference, results: Mapping[str, ArmMetrics],
                        sample_tokens: Sequence[int]) -> dict[str, Any] | None:
    """Calibrated arms whose perplexity is within noise (2 standard errors, paired by sample) of the default
    scale's, with the reason when no value at scale 1.0 leaves the dtype's range; None without both arms."""
    default = results.get("default")
    if not default or default.info.dtype == "int8":
        return None
    same, source = [], None
    for name, e in results.items():
        if e.info.kind != "checkpoint" or e.info.skip or e.info.dtype != default.info.dtype:
            continue
        nd, na = decisive(default), decisive(e)       # `paired`: None without two samples measured alike
        r = paired(na.sample_nll, nd.sample_nll, sample_tokens) if nd.source == na.source else None
        if r is not None and abs(r[0]) <= 2 * r[1]:
            same.append({"arm": name, "ppl_ratio": math.exp(r[0]), "noise": 2 * r[1]})
            source = na.source
    if not same:
        return None
    qmax = kv_format(default.info.dtype).qmax
    k = max((max(r.k_amax) for r in ref.ranges.values()), default=math.nan)
    v = max((max(r.v_amax) for r in ref.ranges.values()), default=math.nan)
    names = ", ".join(f"`{s['arm']}` (ppl x{s['ppl_ratio']:.4f}, noise ±{100 * s['noise']:.2g}%)" for s in same)
    text = f"Calibrated and default scales are within noise here ({source}): {names}."
    if max(k, v) <= qmax:
        text += (f" Why: at scale 1.0 no K or V value leaves the FP8 range (largest |K| {k:.3g}, |V| {v:.3g} <= "
                 f"{qmax:g}), and inside the normal range the FP8 grid's relative rounding error does not depend on "
                 "the scale; a scale only matters for saturation, subnormals and FP8 attention (Q).")
    return {"arms": same, "numbers": source, "k_amax": k, "v_amax": v, "text": text}


def saturated_layers(entry: ArmMetrics, top: int = 5) -> dict[str, dict[str, float]]:
    """{layer: {k, v}} shares of values beyond the dtype's range under this arm (emulated), worst first."""
    rows = {i: {"k": r["k_saturated"], "v": r["v_saturated"]} for i, r in entry.layers.items()
            if r.get("k_saturated", 0) > 0 or r.get("v_saturated", 0) > 0}
    return {i: rows[i] for i in sorted(rows, key=lambda i: -max(rows[i].values()))[:top]}


def saturation_text(name: str, entry: ArmMetrics, ref: Reference) -> str | None:
    sat = saturated_layers(entry)
    if not sat:
        return None

    def amax(i: str, kind: str) -> str:
        r = ref.ranges.get(i)
        return f", max |{kind.upper()}| {max(r.k_amax if kind == 'k' else r.v_amax):.3g}" if r else ""
    return f"`{name}` saturates: " + "; ".join(f"layer {i} (K {100 * s['k']:.3g}%{amax(i, 'k')}, V {100 * s['v']:.3g}%"
                                               f"{amax(i, 'v')})" for i, s in sat.items()) + "."


def skip_confirmed(trial: ArmMetrics, base: ArmMetrics) -> tuple[bool, str]:
    """Whether the engine confirms that the skip trial beats its base arm (lower ppl), and why not."""
    if not engine_ok(trial):
        why = (trial.engine and trial.engine.reason) or "no engine was run (`kvcalib eval --engine vllm`)"
        return False, f"unconfirmed: the engine did not measure it ({why})"
    t, b = trial.engine.summary.ppl, base.engine.summary.ppl if engine_ok(base) else None
    if b is not None and t >= b:
        return False, (f"the engine does not confirm the gain (ppl {t:.4g} with the skip vs {b:.4g} without)")
    return True, "confirmed by the engine"
