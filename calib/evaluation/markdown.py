"""report.md: the evaluation's tables and verdict as GitHub markdown, from the typed report.

Why a module of its own: calib/evaluation/verdict.py decides (thresholds, verdict, skip plan) and
calib/evaluation/report.py writes the files; this one only renders. Every number it prints is already in
report.json; nothing here computes a decision, so a change of wording cannot change what the verdict says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from calib.evaluation import engine_report, significance
from calib.evaluation.results import passkey_correct

# `rep` below is a calib.evaluation.report.Report; it is not imported (report.py imports this module: no cycle)
Report = Any

def _cell(x: Any, fmt: str = ".3g") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return "∞" if x == math.inf else format(x, fmt)
    return str(x).replace("|", "\\|").replace("\n", " ")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A GitHub markdown table; every row has exactly len(headers) cells."""
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        if len(r) != len(headers):
            raise ValueError(f"table row has {len(r)} cells for {len(headers)} columns: {r}")
        out.append("| " + " | ".join(_cell(c) for c in r) + " |")
    return out + [""]


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.3g}%"


def _passkey_cell(rows: Mapping[str, Any] | None) -> str:
    pk = passkey_correct(rows)
    return "–" if pk is None else f"{pk[0]}/{pk[1]}"


def markdown(rep: Report, doc: Mapping[str, Any], plots: Sequence[str]) -> str:
    """report.md from the typed report; `doc` (report.json's document) feeds the engine section, which
    calib/evaluation/engine_report.py renders from the engine's own entries."""
    meta, ref, th, v = rep.meta, rep.reference, rep.thresholds, rep.verdict
    ref_name, quant = rep.reference_name, rep.arms
    d = meta["data"]
    held = d["held_out"]
    lines = [f"# KV-cache evaluation: `{meta['model']}`", "", "## Verdict", "", f"**{v.text}**", "",
             f"Rule: every length bucket's mean next-token KL to {ref_name} <= {th.max_kl:g} nats, perplexity "
             f"<= +{100 * th.max_ppl_increase:g}%, passkey not a significant drop of more than {th.passkey_drop} "
             f"below {ref_name}'s (exact McNemar per bucket, paired by prompt). "
             f"Dominant layers: attention-output error >= {th.dominance:g}x the median layer's.", ""]
    if v.dominant_layers:
        lines += [f"Layers dominating the error of `{v.dominant_in}`: {list(v.dominant_layers)}.", ""]
    lines += _format_lines(rep)
    if held.get("checked_against"):
        held_txt = f"{held['excluded_samples']} calibration samples of `{held['checked_against']}` left out"
        held_txt += "" if held.get("reproduced_exactly") else " (calibration stream not reproduced exactly)"
    else:
        held_txt = held.get("note", "")
    lines += [f"Data: `{d['source']}`: {d['samples']} samples, {d['tokens']} tokens; {held_txt}. "
              f"Model dtype {meta['model_dtype']} on {meta['device']}; {len(meta['layers'])} layers, "
              f"{meta['kv_heads']} KV heads x {meta['head_dim']}.", ""]
    emu = meta.get("emulation")
    if emu:
        lines += [f"Emulated engine: {emu['line']}.", ""]
    s = ref.summary
    rows = [[ref_name, "reference", ref_name, "–", s.kl, s.max_bucket_kl, _pct(s.top1), s.ppl, "–",
             _passkey_cell(ref.passkey), "reference", ref.seconds.total]]
    for n, e in quant.items():
        s = e.summary
        rows.append([n, e.info.kind, e.info.dtype or ref_name, e.info.granularity, s.kl, s.max_bucket_kl, _pct(s.top1),
                     s.ppl, _pct(s.ppl_rel), _passkey_cell(e.passkey), rep.within(n), e.seconds.total])
    lines += ["## Arms", ""]
    if engine_report.has_engine(doc):      # these are emulated; the engine's, over its own samples, follow
        lines += [f"Emulated numbers, over the {ref.summary.samples} samples the emulation measured; `within threshold` "
                  "reads the verdict's numbers (the engine's where it ran the arm, over every sample it measured).", ""]
    lines += table(
        ["arm", "kind", "dtype", "granularity", "mean KL", "worst-bucket KL", "top-1", "ppl", "Δppl", "passkey",
         "within threshold", "seconds"], rows)
    lines += engine_report.markdown(doc, table)
    lines += memory_lines(meta.get("memory"))
    lines += ["## Per layer", "", "Saturated: share of values with |x / scale| > qmax. Flushed: share of nonzero "
              "values stored as 0. SNR over real tokens. Attention error: ||o - ô|| / ||o|| of the layer's "
              "attention output with quantised K/V (same inputs).", ""]
    for n, e in quant.items():
        sc = e.info.scales
        rows = [[i, sc["k"].get(i), sc["v"].get(i), _pct(r["k_saturated"]), _pct(r["k_flushed"]), r["k_snr_db"],
                 _pct(r["v_saturated"]), _pct(r["v_flushed"]), r["v_snr_db"], r["attn_rel_error"]]
                for i, r in e.layers.items()]
        lines += [f"### `{n}`", ""] + table(["layer", "k_scale", "v_scale", "K sat", "K flushed", "K SNR dB", "V sat",
                                             "V flushed", "V SNR dB", "attn error"], rows)
    lines += ["## By context length", ""] + table(
        ["arm", "bucket <=", "samples", "tokens", "KL", "top-1", "ppl", f"{ref_name} ppl", "Δppl"],
        [[n, b, r.samples, r.tokens, r.kl, _pct(r.top1), r.ppl, r.ppl_ref, _pct(r.ppl_rel)]
         for n, e in quant.items() for b, r in e.buckets.items()])
    lines += ["## Passkey retrieval", ""]
    ref_pk = passkey_correct(ref.passkey)
    if ref_pk and ref_pk[0] == 0:
        lines += [f"{ref_name} itself retrieves no key: on this model the test cannot show KV damage.", ""]
    if ref.passkey:
        every = [(ref_name, ref.passkey), *((n, e.passkey) for n, e in quant.items())]
        lines += table(["arm", "bucket <=", "correct", "accuracy", "by depth"],
                       [[n, b, f"{r.correct}/{r.total}", _pct(r.accuracy),
                         " ".join(f"{k}:{x.correct}/{x.total}" for k, x in r.by_depth.items())]
                        for n, pk in every for b, r in (pk or {}).items()])
        lines += _significance_lines(rep)
    else:
        lines += ["Not run (see notes).", ""]
    lines += _failure_lines(rep)
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    notes = list(meta.get("notes", [])) + [f"`{n}`: {x}" for n, e in quant.items() for x in e.info.notes]
    if notes:
        lines += ["## Notes", ""] + [f"- {x}" for x in notes] + [""]
    return "\n".join(lines)


def memory_lines(mem: Mapping[str, Any] | None) -> list[str]:
    """The KV memory table (calib.evaluation.memory.table): per arm and length, the bytes model's tokens per GiB and
    share of the reference's bytes saved, next to the engine's own capacity figure."""
    if not mem:
        return []
    lengths = list(next(iter(mem["rows"].values()))["model"])
    def check(c: Mapping[str, Any] | None) -> str:
        if not c:
            return "–"
        engine = "not reported" if c["engine"] is None else f"{c['engine']:,}"
        if c["problems"]:
            return f"{engine} ({'; '.join(c['problems'])})"
        return f"{engine} vs {c['bytes_model']:,} at {c['max_model_len']:,}"
    rows = [[n, *(f"{r['model'][L]['tokens_per_gib']:,.0f} ({_pct(r['model'][L]['saving'])})" for L in lengths),
             _cell(r.get("engine_tokens_per_gib"), ",.0f"), check(r.get("engine_check"))]
            for n, r in mem["rows"].items()]
    return (["## KV memory", "", f"Layer kinds: {mem['layer_kinds']}. Tokens per GiB at each length (share of the "
             f"reference's bytes saved); {mem['note']}. Engine capacity: the engine's own count (vLLM: requests of "
             "max_model_len the pool holds x max_model_len, a sliding layer reserving its window plus the tokens in "
             "flight) vs the bytes model's in that definition.", ""]
            + table(["arm", *(f"tokens/GiB at {L}" for L in lengths), "engine tokens/GiB (blocks)",
                     "engine capacity vs bytes model"], rows))


def _format_lines(rep: Report) -> list[str]:
    """The '## KV formats' section: each format arm's bytes per token, the choice and static vs dynamic."""
    fmt = rep.formats()
    if fmt is None:
        return []
    rows = [[r.arm, r.format, r.bytes_per_token, "–" if r.engine_bytes_per_token is None else
             f"{r.engine_bytes_per_token:.4g}", r.served_by, _pct(r.ppl_rel), r.kl, r.numbers,
             "yes" if r.passes else "; ".join(r.misses)] for r in fmt.rows]
    lines = ["## KV formats", "", f"**{fmt.text}**", ""]
    lines += [fmt.static_vs_dynamic, ""] if fmt.static_vs_dynamic else []
    lines += ["Bytes per token per layer: K and V of every KV head plus the per-token float32 scales of the dynamic "
              "formats; engine: its pool over the tokens it fits, per layer (block rounding included). Served by: engine backends that serve "
              "the format (the support matrix). Rule: the fewest bytes within the bar, ties to the format more "
              "backends serve, then the lower KL.", ""]
    return lines + table(["arm", "format", "bytes/token/layer", "engine bytes/token/layer", "served by", "Δppl", "mean KL",
                          "numbers", "within the bar"], rows)


def _significance_lines(rep: Report) -> list[str]:
    """Each arm's passkey paired with the reference's, per bucket: the exact McNemar test and what it concludes."""
    rows = []
    for n in rep.arms:
        pk = rep.passkey(n)
        for t in pk.buckets if pk else ():
            depth = " ".join(f"{d.depth}:{d.losses}-/{d.gains}+" for d in pk.depths if d.bucket == t.bucket)
            rows.append([n, t.bucket, t.prompts, t.reference, t.arm, t.losses, t.gains, f"{t.p:.3g}",
                         f"{t.alpha:.3g}", t.conclusion(pk.allowed) + ("" if t.powered else " (underpowered)"), depth])
    if not rows:
        return []
    return ["### Paired with the reference", "",
            f"Exact McNemar test on the prompts each run answered (lost: reference right, arm wrong; gained: the "
            f"reverse); one-sided p of the drop against alpha {significance.ALPHA:g} / buckets. Underpowered: fewer "
            f"than {significance.DEFAULT_PROMPTS} prompts, the number that detects a "
            f"{100 * significance.DETECT_DROP:g}-point drop with power {significance.POWER:g}.", ""] + table(
        ["arm", "bucket <=", "prompts", "reference correct", "arm correct", "lost", "gained", "p (drop)", "alpha",
         "conclusion", "by depth (lost-/gained+)"], rows)


def _failure_lines(rep: Report) -> list[str]:
    """The worst samples (largest mean KL) of the verdict's arm (or the best one) and of the default arm."""
    v = rep.verdict
    names = [n for n in dict.fromkeys([v.arm or v.dominant_in, "default"]) if n in rep.arms]
    out = ["## Failure samples", ""]
    for n in names:
        out += [f"### `{n}`", ""]
        for f in rep.arms[n].failures:
            out.append(f"- sample {f.sample} ({f.tokens} tokens, bucket <= {f.bucket}): mean KL {f.mean_kl:.3g}")
            for p in f.positions:
                text = p.context.replace("```", "'''").replace("\n", "\n    ")
                out += [f"  - position {p.position}, KL {p.kl:.3g}: next is {p.next!r}, "
                        f"{rep.reference_name} predicts {p.reference_predicts!r}, this arm {p.arm_predicts!r}; "
                        "text before:", "", "    ```", f"    {text}", "    ```", ""]
        out.append("")
    return out
