"""The report's engine part: emulation and engine side by side, KV-cache capacity, and arms the engine did
not run with the reason — so a reader sees at once how far the emulation is from the engine it stands for.

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
from calib.safety import files

PLOT = "engine_vs_emulation.png"


def has_engine(doc: dict[str, Any]) -> bool:
    return any("engine" in e for e in doc["arms"].values())


def _engine(entry: dict[str, Any]) -> dict[str, Any] | None:
    """The arm's engine entry where the engine measured it, else None."""
    g = entry.get("engine") or {}
    return g if g.get("status") == "ok" else None


def _pk(tables: Sequence[dict[str, Any] | None]) -> list[str]:
    """Passkey correct/total of each table over the buckets every table that ran has (the emulation may have
    asked only the shorter buckets' prompts)."""
    ran = [t for t in tables if t]
    shared = [b for b in (ran[0] if ran else {}) if all(b in t for t in ran)]
    return ["–" if not t else f"{sum(t[b]['correct'] for b in shared)}/{sum(t[b]['total'] for b in shared)}"
            for t in tables]


def over(rows: Mapping[str, Mapping[str, Any]], buckets: Sequence[str]) -> dict[str, Any] | None:
    """An arm's numbers over the samples of `buckets`, from its per-bucket rows weighted by their tokens: a bucket's
    perplexity is exp(NLL / tokens) and its KL and top-1 are means over its tokens, so the sums are exactly the
    numbers over those samples. None where the arm has none of these buckets."""
    picked = [rows[b] for b in buckets if b in rows]
    tokens = sum(r["tokens"] for r in picked)
    if not tokens:
        return None

    def mean(key: str, of: Callable[[float], float] = float) -> float | None:
        if any(r.get(key) is None for r in picked):      # report.json writes a non-finite number as null
            return None
        return sum(of(r[key]) * r["tokens"] for r in picked) / tokens

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
    """Every arm's emulated and engine numbers over the samples both measured: the buckets the reference's
    emulation and its engine run both have, with the same number of samples (without an engine reference, the
    emulated buckets)."""
    ref = doc["arms"][doc["reference"]]
    eng = (_engine(ref) or {}).get("buckets")
    shared = tuple(b for b, r in ref["buckets"].items() if eng is None or (b in eng and eng[b]["samples"] == r["samples"]))
    arms = {n: (over(e["buckets"], shared), over(g["buckets"], shared) if (g := _engine(e)) else None)
            for n, e in doc["arms"].items()}
    return SideBySide(shared, sum(ref["buckets"][b]["samples"] for b in shared), arms)


def _coverage(shared: SideBySide) -> str:
    """Which samples the side-by-side numbers are over, in words."""
    last = max((int(b) for b in shared.buckets), default=None)
    return f"over the {shared.samples} samples both measured" + (f" (buckets <= {last})" if last else "")


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.5g}"


def markdown(doc: dict[str, Any], table: Callable[[Sequence[str], Sequence[Sequence[Any]]], list[str]]) -> list[str]:
    """Lines of the '## Emulation vs engine' section (empty when no engine ran): emulated and engine numbers over
    the same samples (`side_by_side`), then the engine's over all its samples where it measured more."""
    if not has_engine(doc):
        return []
    ref_name, arms, numbers = doc["reference"], doc["arms"], doc["verdict"].get("numbers", {})
    eng = doc.get("engine") or {}
    shared = side_by_side(doc)

    def pct(x):
        return "–" if x is None else f"{100 * x:+.3g}%"

    def share(x):
        return "–" if x is None else f"{100 * x:.3g}%"

    rows, not_run, cap, implausible, whole = [], [], [], [], []
    for n, e in arms.items():
        g = e.get("engine") or {}
        odd = [m for m in e.get("misses") or [] if m.startswith("engine output implausible")]
        s, es = shared.arms[n][0] or {}, shared.arms[n][1] or {}
        greedy = ((g.get("summary") or {}).get("greedy") or {}).get("prefix") if es else None
        rows.append([n, numbers.get(n, "reference" if n == ref_name else "emulation"), _num(s.get("ppl")),
                     _num(es.get("ppl")), pct(s.get("ppl_rel")) if n != ref_name else "–",
                     pct(es.get("ppl_rel")) if n != ref_name else "–", s.get("kl"), es.get("kl"),
                     es.get("kl_unresolved_mass"), share(s.get("top1")), share(es.get("top1")), share(greedy),
                     *_pk([e.get("passkey"), g.get("passkey")]), "implausible" if odd else g.get("status", "–").replace("_", " ")])
        if es:
            a = g["summary"]
            whole.append([n, a["samples"], _num(a["ppl"]), pct(a["ppl_rel"]) if n != ref_name else "–", a["kl"],
                          share(a["top1"]), _pk([g.get("passkey")])[0]])
        if odd:
            implausible.append(f"- `{n}`: {odd[0]}")
        if g.get("status") == "not_run":
            not_run.append(f"- `{n}`: not run: {g['reason']}")
        elif g.get("status") == "ok":
            cap.append([n, g.get("kv_cache_dtype"), g.get("kv_capacity_tokens"), g.get("kv_gib"), g.get("tokens_per_gib"),
                        context_capacity(g.get("kv_groups"))])
    more = any(r[1] > shared.samples for r in whole)
    lines = ["## Emulation vs engine", "",
             f"Engine: {eng.get('name')} {eng.get('version')} on exactly the evaluation's token ids (prompt "
             f"log-probabilities, top-{eng.get('top_k')}). Emulated and engine numbers side by side are "
             f"{_coverage(shared)}; passkey over the buckets both asked. Engine KL is a lower bound from the top-k "
             f"(`unresolved`: the {ref_name} run's probability mass outside the tokens known in both runs); "
             "perplexity and top-1 are exact. Greedy: share of greedy continuation tokens equal to the reference's "
             "before the first difference (every sample the engine ran). `numbers`: what the verdict read"
             + (", the engine's over all its samples (the table after this one)." if more else "."), ""]
    lines += table(["arm", "numbers", "ppl emulated", "ppl engine", "Δppl emulated", "Δppl engine", "KL emulated",
                    "KL engine (≥)", "unresolved", "top-1 emulated", "top-1 engine", "greedy engine",
                    "passkey emulated", "passkey engine", "engine"], rows)
    if more:
        lines += [f"The engine over all the samples it measured (the emulation measured {shared.samples} of them): "
                  "what the verdict reads where the engine ran the arm.", ""]
        lines += table(["arm", "samples", "ppl engine", "Δppl engine", "KL engine (≥)", "top-1 engine",
                        "passkey engine"], whole)
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
    """A bar chart of the perplexity change per arm, emulated and measured over the same samples; the file name,
    or None."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    ref_name = doc["reference"]
    names = [n for n in doc["arms"] if n != ref_name]
    if not names or not has_engine(doc):
        return None

    shared = side_by_side(doc)

    def rel(numbers: dict[str, Any] | None) -> float:
        return math.nan if numbers is None else 100 * numbers["ppl_rel"]

    emu = [rel(shared.arms[n][0]) for n in names]
    eng = [rel(shared.arms[n][1]) for n in names]
    fig = Figure(figsize=(max(6, 1.2 * len(names)), 4), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], emu, width=0.4, label="emulated")
    ax.bar([x + 0.2 for x in xs], eng, width=0.4, label="engine (missing: not run)")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set(xticks=list(xs), ylabel=f"perplexity change vs {ref_name} (%)",
           title=f"Emulation vs engine, {_coverage(shared)}")
    ax.set_xticklabels([n if len(n) < 28 else "…" + n[-27:] for n in names], rotation=20, ha="right", fontsize=7)
    ax.legend(fontsize=7)
    FigureCanvasAgg(fig)
    with files.open_new(out / PLOT, "wb") as f:
        fig.savefig(f, dpi=90, format="png")
    return PLOT
