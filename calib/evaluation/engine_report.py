"""The report's engine part: emulation and engine side by side (rendered by markdown.engine_lines) and its plot —
so a reader sees at once how far the emulation is from the engine it stands for.

Side by side means over the same samples: the emulation may cover only the buckets up to --emulate-up-to while
the engine measures every sample, and a longer sample has another perplexity (BF16 26.5 emulated over the short
buckets against 34.4 in the engine over all of them said nothing about the emulation). So the comparison is over
the buckets both measured (`side_by_side`), says how many samples that is, and the engine's numbers over all its
samples, which the verdict reads, follow in a table of their own, labelled so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calib.engine.metrics import exp
from calib.evaluation.plots import save

PLOT = "engine_vs_emulation.png"


def has_engine(doc: dict[str, Any]) -> bool:
    return any("engine" in e for e in doc["arms"].values())


def _engine(entry: dict[str, Any]) -> dict[str, Any] | None:
    g = entry.get("engine") or {}
    return g if g.get("status") == "ok" else None


def over(rows: Mapping[str, Mapping[str, Any]], buckets: Sequence[str]) -> dict[str, Any] | None:
    """An arm's numbers over the samples of `buckets`, from its per-bucket rows weighted by their tokens: a bucket's
    perplexity is exp(NLL / tokens) and its KL and top-1 are means over its tokens, so the sums are exactly the
    numbers over those samples. None where the arm has none of these buckets."""
    picked = [rows[b] for b in buckets if b in rows]
    tokens = sum(r["tokens"] for r in picked)
    if not tokens:
        return None

    def mean(key: str, of: Callable[[float], float] = float) -> float | None:
        bad = any(r.get(key) is None for r in picked)      # report.json writes a non-finite number as null
        return None if bad else sum(of(r[key]) * r["tokens"] for r in picked) / tokens

    nll, ref_nll = mean("ppl", math.log), mean("ppl_ref", math.log)
    ppl, ppl_ref = (None if x is None else exp(x) for x in (nll, ref_nll))
    return {"samples": sum(r["samples"] for r in picked), "tokens": tokens, "kl": mean("kl"),
            "kl_unresolved_mass": mean("kl_unresolved_mass"), "top1": mean("top1"), "ppl": ppl, "ppl_ref": ppl_ref,
            "ppl_rel": None if nll is None or ref_nll is None else exp(nll - ref_nll) - 1}


@dataclass(frozen=True)
class SideBySide:
    """The buckets both the emulation and the engine measured (with equal sample counts), their samples, and per
    arm (emulated, engine) over exactly those samples (engine None where it did not run the arm)."""
    buckets: tuple[str, ...]
    samples: int
    arms: dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None]]


def side_by_side(doc: dict[str, Any]) -> SideBySide:
    """Every arm's emulated and engine numbers over the samples both measured: the buckets the reference's emulation and
    its engine run both have, with the same number of samples (without an engine reference, the emulated buckets)."""
    ref = doc["arms"][doc["reference"]]
    eng = (_engine(ref) or {}).get("buckets")
    shared = tuple(b for b, r in ref["buckets"].items() if eng is None or (b in eng and eng[b]["samples"] == r["samples"]))
    arms = {n: (over(e["buckets"], shared), over(g["buckets"], shared) if (g := _engine(e)) else None)
            for n, e in doc["arms"].items()}
    return SideBySide(shared, sum(ref["buckets"][b]["samples"] for b in shared), arms)


def coverage(shared: SideBySide) -> str:
    """Which samples the side-by-side numbers are over, in words."""
    last = max((int(b) for b in shared.buckets), default=None)
    return f"over the {shared.samples} samples both measured" + (f" (buckets <= {last})" if last else "")


def context_capacity(groups: dict[str, Any] | None) -> str:
    """The engine's capacity in context tokens at its max_model_len ("–" where it did not report it)."""
    size, length = (groups or {}).get("size_tokens"), (groups or {}).get("max_model_len")
    return "–" if size is None or not length else f"{size:,} at max_model_len {length:,}"


def plot(doc: dict[str, Any], out: Path) -> str | None:
    """A bar chart of the perplexity change per arm, emulated and measured over the same samples; the file name,
    or None."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    ref_name = doc["reference"]
    names = [n for n in doc["arms"] if n != ref_name]
    if not names or not has_engine(doc):
        return None

    shared = side_by_side(doc)
    fig = Figure(figsize=(max(6, 1.2 * len(names)), 4), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    xs = range(len(names))
    for j, (dx, label) in enumerate(((-0.2, "emulated"), (0.2, "engine (missing: not run)"))):
        rel = [math.nan if shared.arms[n][j] is None else 100 * shared.arms[n][j]["ppl_rel"] for n in names]
        ax.bar([x + dx for x in xs], rel, width=0.4, label=label)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set(xticks=list(xs), ylabel=f"perplexity change vs {ref_name} (%)",
           title=f"Emulation vs engine, {coverage(shared)}")
    ax.set_xticklabels([n if len(n) < 28 else "…" + n[-27:] for n in names], rotation=20, ha="right", fontsize=7)
    ax.legend(fontsize=7)
    save(fig, out / PLOT)
    return PLOT
