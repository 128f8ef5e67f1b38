"""The evaluation's PNG plots: scales and per-head ranges, per-layer error, KL by length bucket.

Why a module of its own: plotting is optional (matplotlib may be missing, then the report says so) and shares
nothing with the verdict or the markdown; report.py calls `plot_all` and records the file names.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from calib.safety import files

PLOTS = ("scales.png", "layer_error.png", "kl_by_bucket.png")


def _pos(x: float | None) -> float:
    """For log axes: NaN for missing/non-finite values, tiny values for zero."""
    return math.nan if x is None or not math.isfinite(x) else max(x, 1e-12)


def save(fig: Any, path: Path) -> None:
    """`fig` as a PNG at `path`, drawn by matplotlib's Agg canvas (no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    with files.open_new(path, "wb") as f:
        fig.savefig(f, dpi=90, format="png")


def plot_all(rep: Any, out: Path) -> tuple[list[str], str | None]:
    """Write the PNG plots of `rep` (calib.evaluation.report.Report) into `out`; returns (file names, a note when plots could not be made)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install matplotlib)"
    ref_name, quant = rep.reference_name, rep.arms
    layers = [str(i) for i in rep.meta["layers"]]

    fig = Figure(figsize=(12, 8), layout="constrained")
    for j, kind in enumerate(("k", "v")):
        ax = fig.add_subplot(2, 2, 1 + j)
        for n, e in quant.items():
            ys = [_pos(e.info.scales[kind].get(i)) for i in layers]
            if any(math.isfinite(y) for y in ys):
                ax.plot([int(i) for i in layers], ys, marker="o", label=n)
        ax.set(yscale="log", xlabel="layer", ylabel=f"{kind}_scale (max over heads)", title=f"{kind.upper()} scales")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=6)
        amax = [list(getattr(rep.reference.ranges[i], f"{kind}_amax")) for i in layers]
        ax = fig.add_subplot(2, 2, 3 + j)
        im = ax.imshow(amax, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set(xlabel="KV head", ylabel="layer", title=f"max |{kind.upper()}| per head ({ref_name} pass)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(im, ax=ax)
    save(fig, out / PLOTS[0])

    fig = Figure(figsize=(12, 4), layout="constrained")
    for j, (key, label) in enumerate((("attn_rel_error", "attention output rel. error"), ("k_snr_db", "K SNR (dB)"),
                                      ("v_snr_db", "V SNR (dB)"))):
        ax = fig.add_subplot(1, 3, 1 + j)
        for n, e in quant.items():
            ys = [_pos(y) if j == 0 else (y if y is not None and math.isfinite(y) else math.nan)
                  for y in (r[key] for r in e.layers.values())]
            ax.plot([int(i) for i in e.layers], ys, marker="o", label=n)
        ax.set(xlabel="layer", title=label, yscale="log" if j == 0 else "linear")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=6)
    save(fig, out / PLOTS[1])

    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    buckets = [str(b) for b in rep.meta["buckets"]]
    for n, e in quant.items():
        ax.plot(range(len(buckets)), [_pos(e.buckets[b].kl if b in e.buckets else None) for b in buckets], marker="o",
                label=n)
    ax.axhline(rep.thresholds.max_kl, color="red", linestyle="--", label="threshold")
    ax.set(xticks=range(len(buckets)), xticklabels=[f"<= {b}" for b in buckets], yscale="log",
           xlabel="context length (tokens)", ylabel=f"mean KL to {ref_name} (nats)", title="KL by length bucket")
    ax.legend(fontsize=6)
    save(fig, out / PLOTS[2])
    return list(PLOTS), None
