"""The report's engine part: emulation and engine side by side, KV-cache capacity, and arms the engine did
not run with the reason — so a reader sees at once how far the emulation is from the engine it stands for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from calib.safety import files

PLOT = "engine_vs_emulation.png"


def has_engine(doc: dict[str, Any]) -> bool:
    return any("engine" in e for e in doc["arms"].values())


def _pk(entry: dict[str, Any] | None) -> str:
    pk = (entry or {}).get("passkey")
    if not pk:
        return "–"
    return f"{sum(b['correct'] for b in pk.values())}/{sum(b['total'] for b in pk.values())}"


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.5g}"


def markdown(doc: dict[str, Any], table: Callable[[Sequence[str], Sequence[Sequence[Any]]], list[str]]) -> list[str]:
    """Lines of the '## Emulation vs engine' section (empty when no engine ran)."""
    if not has_engine(doc):
        return []
    ref_name, arms, numbers = doc["reference"], doc["arms"], doc["verdict"].get("numbers", {})
    eng = doc.get("engine") or {}

    def pct(x):
        return "–" if x is None else f"{100 * x:+.3g}%"

    rows, not_run, cap, implausible = [], [], [], []
    for n, e in arms.items():
        g = e.get("engine") or {}
        odd = [m for m in e.get("misses") or [] if m.startswith("engine output implausible")]
        s, es = e["summary"], (g.get("summary") if g.get("status") == "ok" else None) or {}
        greedy = (es.get("greedy") or {}).get("prefix")
        rows.append([n, numbers.get(n, "reference" if n == ref_name else "emulation"), _num(s["ppl"]), _num(es.get("ppl")),
                     pct(s["ppl_rel"]) if n != ref_name else "–", pct(es.get("ppl_rel")) if es and n != ref_name else "–",
                     s["kl"], es.get("kl"), es.get("kl_unresolved_mass"), f"{100 * s['top1']:.3g}%",
                     "–" if not es else f"{100 * es['top1']:.3g}%", "–" if greedy is None else f"{100 * greedy:.3g}%",
                     _pk(e), _pk(g), "implausible" if odd else g.get("status", "–").replace("_", " ")])
        if odd:
            implausible.append(f"- `{n}`: {odd[0]}")
        if g.get("status") == "not_run":
            not_run.append(f"- `{n}`: not run: {g['reason']}")
        elif g.get("status") == "ok":
            cap.append([n, g.get("kv_cache_dtype"), g.get("kv_capacity_tokens"), g.get("kv_gib"), g.get("tokens_per_gib"),
                        context_capacity(g.get("kv_groups"))])
    lines = ["## Emulation vs engine", "",
             f"Engine: {eng.get('name')} {eng.get('version')} on exactly the evaluation's token ids (prompt "
             f"log-probabilities, top-{eng.get('top_k')}). Engine KL is a lower bound from the top-k (`unresolved`: the "
             f"{ref_name} run's probability mass outside the tokens known in both runs); perplexity and top-1 are "
             "exact. Greedy: share of greedy continuation tokens equal to the reference's before the first "
             "difference. `numbers`: what the verdict read.", ""]
    lines += table(["arm", "numbers", "ppl emulated", "ppl engine", "Δppl emulated", "Δppl engine", "KL emulated",
                    "KL engine (≥)", "unresolved", "top-1 emulated", "top-1 engine", "greedy engine",
                    "passkey emulated", "passkey engine", "engine"], rows)
    if cap:
        lines += ["KV-cache capacity measured by the engine (same pool size for every arm). Pool: blocks x block "
                  "size, which on a hybrid model counts one group's blocks; context: the engine's own capacity in "
                  "context tokens (requests of max_model_len its pool holds x max_model_len), where it said.", ""]
        lines += table(["arm", "KV cache dtype", "pool tokens", "GiB", "pool tokens/GiB", "context tokens"], cap)
    if implausible:
        lines += ["Engine numbers implausible for the arm's format (orders of magnitude off the reference while the "
                  "emulation is not; never ranked):", ""] + implausible + [""]
    if not_run:
        lines += ["Arms the engine did not run:", ""] + not_run + [""]
    return lines


def context_capacity(groups: dict[str, Any] | None) -> str:
    """The engine's capacity in context tokens at its max_model_len ("–" where it did not report it)."""
    size, length = (groups or {}).get("size_tokens"), (groups or {}).get("max_model_len")
    return "–" if size is None or not length else f"{size:,} at max_model_len {length:,}"


def plot(doc: dict[str, Any], out: Path) -> str | None:
    """A bar chart of the perplexity change per arm, emulated and measured; the file name, or None."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    ref_name = doc["reference"]
    names = [n for n in doc["arms"] if n != ref_name]
    if not names or not has_engine(doc):
        return None

    def rel(e: dict[str, Any] | None) -> float:
        x = (e or {}).get("summary", {}).get("ppl_rel")
        return math.nan if x is None else 100 * x

    emu = [rel(doc["arms"][n]) for n in names]
    eng = [rel(doc["arms"][n]["engine"]) if (doc["arms"][n].get("engine") or {}).get("status") == "ok" else math.nan
           for n in names]
    fig = Figure(figsize=(max(6, 1.2 * len(names)), 4), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], emu, width=0.4, label="emulated")
    ax.bar([x + 0.2 for x in xs], eng, width=0.4, label="engine (missing: not run)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set(xticks=list(xs), ylabel=f"perplexity change vs {ref_name} (%)", title="Emulation vs engine")
    ax.set_xticklabels([n if len(n) < 28 else "…" + n[-27:] for n in names], rotation=20, ha="right", fontsize=7)
    ax.legend(fontsize=7)
    FigureCanvasAgg(fig)
    with files.open_new(out / PLOT, "wb") as f:
        fig.savefig(f, dpi=90, format="png")
    return PLOT
