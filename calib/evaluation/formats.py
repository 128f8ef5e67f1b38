"""Which KV format to serve: the fewest cache bytes per token that pass the quality bar.

Why a rule of its own: the question users ask before calibrating is whether calibration is worth it at all —
static calibrated FP8 against the engine's dynamic per-token-head caches (which need no calibration but store a
float32 scale per token and head) or FP8 at scale 1.0 (issue 25). The per-arm verdict (calib/evaluation/verdict.py)
ranks arms by KL; this ranks formats by memory, because memory is what a quantised cache is for:
1. an arm qualifies when the verdict's `failures` finds nothing (the engine's numbers where it measured the arm;
   engine output implausible for the format never qualifies: calib/evaluation/numbers.py `implausible`);
2. among qualifying arms, the fewest bytes per token per layer (calib.recipe.dtypes `bytes_per_token`,
   the scale storage included; the reference stores the model dtype);
3. a tie goes to the format the most engine backends serve (calib.recipe.support), then to the lowest KL.
The text then says whether static calibration beat the dynamic formats on this model and data, and why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from calib.evaluation.numbers import decisive, engine_ok, implausible
from calib.evaluation.results import record
from calib.recipe import dtypes, support

# static scales: 1.0, a checkpoint's, a statistics file's what-if, a tune candidate's
STATIC_KINDS = ("default", "checkpoint", "stats", "candidate")


@dataclass(frozen=True)
class FormatRow:
    """One arm as a format: bytes per token per layer (model), the engine's measured bytes per token per layer (its
    pool over the tokens it fits, over the layers; None where it did not run or its numbers are implausible), how
    many engine backends serve the format, and why it misses the bar."""
    arm: str
    format: str
    kind: str
    bytes_per_token: float
    engine_bytes_per_token: float | None
    served_by: int
    ppl_rel: float
    kl: float
    numbers: str
    misses: tuple[str, ...]

    @property
    def passes(self) -> bool:
        return not self.misses

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in record(self).items() if k != "misses"}, "passes": self.passes,
                "misses": list(self.misses)}


@dataclass(frozen=True)
class FormatChoice:
    chosen: str | None                  # the arm (None: nothing quantised passes; keep the reference)
    text: str
    static_vs_dynamic: str | None
    rows: tuple[FormatRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return record(self)


def served_by(fmt: str) -> int:
    """How many (engine, backend) pairs of the support matrix serve a `fmt` cache at all (newest versions read).
    Read from the `skip_layers` aspect: the format's own cell there is refused only where the cache itself is (the
    `tensor` aspect says what happens to a checkpoint's scales, which an unscaled or dynamic format never has)."""
    n = 0
    for name, e in support.ENGINES.items():
        for b in e.backends:
            try:
                effect = support.effect(name, None, b, fmt, "skip_layers")
            except support.SupportError:
                continue
            n += effect not in (support.Effect.REFUSED, support.Effect.BROKEN)
    return n


def rows(results: Mapping[str, Any], failures: Callable[[Any], list[str]], kv_heads: int, head_dim: int,
         layers: int = 1) -> list[FormatRow]:
    """Every quantised, shippable arm without a skip trial as a FormatRow (the reference is the fallback)."""
    out = []
    for name, e in results.items():
        info = e.info
        if info.dtype is None or not info.shippable or info.skip or info.kind not in (*STATIC_KINDS, "format"):
            continue
        fmt = dtypes.kv_format(info.dtype)
        nums = decisive(e)
        tpg = e.engine.tokens_per_gib if engine_ok(e) and not implausible(e) else None
        eng = 2 ** 30 / tpg / max(layers, 1) if tpg else None
        out.append(FormatRow(name, fmt.name, info.kind, fmt.bytes_per_token(kv_heads, head_dim), eng,
                             served_by(fmt.name), nums.summary.ppl_rel, nums.summary.kl, nums.source,
                             tuple(failures(e))))
    return out


def order(table: list[FormatRow]) -> list[FormatRow]:
    """The rows within the bar, best first by the module's rule."""
    return sorted((r for r in table if r.passes), key=lambda r: (r.bytes_per_token, -r.served_by, r.kl))


def choose(results: Mapping[str, Any], failures: Callable[[Any], list[str]], model_dtype: str, kv_heads: int,
           head_dim: int, reference: str, layers: int = 1) -> FormatChoice:
    """The format to serve by the module's rule, with the static-vs-dynamic statement."""
    table = rows(results, failures, kv_heads, head_dim, layers)
    ref_bytes = dtypes.model_bytes_per_token(model_dtype, kv_heads, head_dim)
    ok = order(table)
    if ok:
        best = ok[0]
        text = (f"Fewest bytes within the bar: `{best.arm}` ({best.format}, {best.bytes_per_token:g} bytes per token "
                f"per layer vs {ref_bytes:g} for {reference}, {100 * (1 - best.bytes_per_token / ref_bytes):.0f}% "
                f"less; ppl {100 * best.ppl_rel:+.2f}% on the {best.numbers}'s numbers).")
        ties = [r.arm for r in ok[1:] if r.bytes_per_token == best.bytes_per_token]
        if ties:
            text += (f" Same size: {', '.join(f'`{t}`' for t in ties)}; chosen for being served by more engine "
                     "backends, then for the lower KL.")
    else:
        best = None
        text = f"No quantised format is within the bar: keep {reference.upper()} KV ({ref_bytes:g} bytes per token per layer)."
    return FormatChoice(best.arm if best else None, text, static_vs_dynamic(table), tuple(table))


def static_vs_dynamic(table: list[FormatRow]) -> str | None:
    """Whether static FP8/INT8 scales (calibrated checkpoints, or scale 1.0) beat the dynamic per-token-head
    caches on this model and data: on the bar, then on the perplexity rise at the bytes each stores. Compared with
    the 8-bit dynamic caches where measured (INT4 is a different size class: the choice above weighs it). None
    without both kinds."""
    static = [r for r in table if r.kind in STATIC_KINDS]
    dyn = [r for r in table if dtypes.kv_format(r.format).dynamic]
    if not static or not dyn:
        return None
    s_best = min([r for r in static if r.kind != "default"] or static, key=lambda r: (not r.passes, r.ppl_rel))
    eight = [r for r in dyn if dtypes.kv_format(r.format).bits == 8]
    d_best = min(eight or dyn, key=lambda r: (not r.passes, r.ppl_rel))
    what = "static (scale 1.0)" if s_best.kind == "default" else "calibrated static"
    nums = (f"`{s_best.arm}` {100 * s_best.ppl_rel:+.2f}% ({s_best.numbers}) at {s_best.bytes_per_token:g} bytes per "
            f"token per layer vs `{d_best.arm}` {100 * d_best.ppl_rel:+.2f}% ({d_best.numbers}) at "
            f"{d_best.bytes_per_token:g}")
    fewer = d_best.bytes_per_token - s_best.bytes_per_token
    size = (f"{fewer:g} fewer bytes per token per layer (no per-token scales)" if fewer > 0 else
            f"{-fewer:g} more bytes per token per layer" if fewer < 0 else "the same bytes")
    if s_best.passes and (not d_best.passes or s_best.ppl_rel <= d_best.ppl_rel):
        return f"Here {what} {s_best.format} is as good as the dynamic formats or better: {nums}, with {size}."
    if d_best.passes and not s_best.passes:
        return (f"Here the dynamic {d_best.format} beats {what} {s_best.format}: {nums}; only the dynamic cache is "
                "within the bar (its scales follow each token's range; it needs vLLM's Triton backend).")
    if not s_best.passes and not d_best.passes:
        return f"Neither {what} {s_best.format} nor the dynamic formats are within the bar here: {nums}."
    return (f"Both are within the bar; the dynamic {d_best.format} loses less ({nums}); static {s_best.format} "
            f"stores {size} and more backends serve it.")
