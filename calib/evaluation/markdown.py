"""report.md: the evaluation's decision, tables and verdict as GitHub markdown, from the typed report; and the opening
every report shares (eval's report.md, validate.md, tune.md, plan.md).

Why a module of its own: calib/evaluation/verdict.py decides (thresholds, verdict, skip plan) and
calib/evaluation/report.py writes the files; this one only renders. Every number it prints is already in report.json;
nothing here computes a decision, so a change of wording cannot change what the verdict says.

Why every report opens the same way (`lead`): a reader asks "what do I serve, and with which command?" before anything
else. So the decision comes first in one line, then one table (each arm: its decision, its quality against the bar, its
KV capacity — the engine's own count where it ran, else the bytes model's, said which — and its speed where it was
measured), then the whole serve command; the per-bucket and per-layer detail follows, the per-layer tables last. Paths
are written relative to the folder the command ran in (`relative`): report.json keeps them whole.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from calib.evaluation import engine_report, significance
from calib.evaluation.capacity import ENGINE, QUALITY, RECOMMENDED
from calib.evaluation.numbers import decisive
from calib.evaluation.results import passkey_correct

# `rep` below is a calib.evaluation.report.Report; it is not imported (report.py imports this module: no cycle)
Report = Any
DTYPE_TITLE = {"bfloat16": "BF16", "float16": "FP16", "float32": "FP32"}
SHIPS = ("ship", "ship_with_skip")         # the verdict's actions that serve a quantized KV cache


def dtype_title(name: str) -> str:
    """How a report names a model dtype: BF16, FP16, FP32 (another name upper-cased)."""
    return DTYPE_TITLE.get(name, name.upper())


# an absolute path in prose or a command: after a space, quote, backtick, bracket, ':', '=' or ',' (or at the start),
# "/" then a name (not "//" of a URL), up to a space, quote, backtick, pipe or bracket; a shell-quoted one
# ('/a b/c') whole
_PATH = re.compile(r"'(/[\w.~-][^']*)'|(?<![^\s`'\"(\[:=,])(/[\w.~-][^\s`'\"|()\[\]<>]*)")


def relative(text: str, base: Path | None = None) -> str:
    """`text` with every absolute path written relative to `base` (default: the folder the command runs in, the
    user's): report files name the user's files as the user does, and their JSON beside them keeps paths whole."""
    here = str(base or Path.cwd())

    def rel(m: re.Match) -> str:
        if m[1] is not None:
            return shlex.quote(os.path.relpath(m[1], here))
        path = m[2].rstrip(".,:;")
        return os.path.relpath(path, here) + m[2][len(path):]
    return _PATH.sub(rel, text)


def lead(headline: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], serve: str | None,
         after: Sequence[str] = ()) -> list[str]:
    """The opening of every report: the decision in one line, one table (arm, decision, quality, capacity, speed)
    and the whole serve command of the decision; `after`: lines that qualify them (one short paragraph)."""
    out = [headline, ""] + table(headers, rows)
    out += ["```", serve, "```", ""] if serve else []
    return out + ([*after, ""] if after else [])


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
    """report.md from the typed report: the decision, its table and serve command (`lead`), then the verdict's
    reasons and every table; `doc` (report.json's document) feeds the engine section (`engine_lines`), from the
    engine's own entries. Paths relative to the user's folder."""
    meta, ref, th, v = rep.meta, rep.reference, rep.thresholds, rep.verdict
    ref_name, quant, d = rep.reference_name, rep.arms, meta["data"]
    held = d["held_out"]
    lines = [f"# KV-cache evaluation: `{meta['model']}`", ""]
    argv = rep.serve_argv()
    lines += lead(headline(rep), *decision_table(rep), argv and shlex.join(argv), _reference_note(rep))
    lines += ["## Verdict", "", v.text, "",
              f"Rule: every length bucket's mean next-token KL to {ref_name} <= {th.max_kl:g} nats, perplexity "
              f"<= +{100 * th.max_ppl_increase:g}%, passkey not a significant drop of more than {th.passkey_drop} "
              f"below {ref_name}'s (exact McNemar per bucket, paired by prompt). "
              f"Dominant layers: attention-output error >= {th.dominance:g}x the median layer's.", ""]
    if v.dominant_layers:
        lines += [f"Layers dominating the error of `{v.dominant_in}`: {list(v.dominant_layers)}.", ""]
    held_txt = held.get("note", "") if not held.get("checked_against") else (
        f"{held['excluded_samples']} calibration samples of `{held['checked_against']}` left out"
        + ("" if held.get("reproduced_exactly") else " (calibration stream not reproduced exactly)"))
    lines += [f"Data: `{d['source']}`: {d['samples']} samples, {d['tokens']} tokens; {held_txt}. "
              f"Model dtype {meta['model_dtype']} on {meta['device']}; {len(meta['layers'])} layers, "
              f"{meta['kv_heads']} KV heads x {meta['head_dim']}.", ""]
    lines += [f"Emulated engine: {meta['emulation']['line']}.", ""] if meta.get("emulation") else []
    lines += _format_lines(rep)
    rows = [[ref_name, "reference", ref_name, "–", ref.summary.kl, ref.summary.max_bucket_kl, _pct(ref.summary.top1),
             ref.summary.ppl, "–", _passkey_cell(ref.passkey), "reference", ref.seconds.total]]
    rows += [[n, e.info.kind, e.info.dtype or ref_name, e.info.granularity, e.summary.kl, e.summary.max_bucket_kl,
              _pct(e.summary.top1), e.summary.ppl, _pct(e.summary.ppl_rel), _passkey_cell(e.passkey), rep.within(n),
              e.seconds.total] for n, e in quant.items()]
    lines += ["## Arms", ""]
    if engine_report.has_engine(doc):      # these are emulated; the engine's, over its own samples, follow
        lines += [f"Emulated numbers, over the {ref.summary.samples} samples the emulation measured; `within threshold` "
                  "reads the verdict's numbers (the engine's where it ran the arm, over every sample it measured).", ""]
    lines += table(
        ["arm", "kind", "dtype", "granularity", "mean KL", "worst-bucket KL", "top-1", "ppl", "Δppl", "passkey",
         "within threshold", "seconds"], rows)
    lines += engine_lines(doc)
    lines += memory_lines(meta.get("memory"))
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
    head, failures = lines, _failure_lines(rep)   # relative paths in its headings; the samples' own text as it is
    lines = ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""] if plots else []
    notes = list(meta.get("notes", [])) + [f"`{n}`: {x}" for n, e in quant.items() for x in e.info.notes]
    lines += ["## Notes", ""] + [f"- {x}" for x in notes] + [""] if notes else []
    lines += _layer_lines(rep)
    return "\n".join([relative("\n".join(head)), *failures, relative("\n".join(lines))])


def headline(rep: Report) -> str:
    """The decision in one line, in the dtype the model is served in (BF16 for a BF16 model, whatever the reference
    was measured in)."""
    v, dtype = rep.verdict, dtype_title(rep.serving_dtype)
    cap = v.capacity
    if v.action == "ship" and v.arm:
        ratio = cap.ratios.get(v.arm) if cap else None
        gain = "" if ratio is None else f", {ratio:.2f}x {dtype}'s KV capacity ({_source(cap.sources.get(v.arm))})"
        return f"**Ship `{v.arm}`**: {rep.arms[v.arm].info.dtype} KV within the quality bar{gain}."
    if v.action == "ship_with_skip":
        return (f"**Ship `{v.arm}` with layers {list(v.skip_layers)} kept in {dtype}**: within the quality bar, "
                "confirmed by the engine.")
    if v.action == "skip_unconfirmed":
        return (f"**Keep {dtype} KV for now**: `{v.arm}` with layers {list(v.skip_layers)} kept in {dtype} is within "
                "the quality bar in emulation; measure it in the engine before serving it.")
    within = [n for n, label in (cap.labels.items() if cap else ()) if n != rep.reference_name and label != QUALITY]
    if within:
        return (f"**Keep {dtype} KV**: no arm within the quality bar holds more requests than {dtype} beyond noise "
                f"({', '.join(f'`{n}`' for n in within)}).")
    best = v.dominant_in
    if best not in rep.arms:
        return f"**Keep {dtype} KV**: no quantized arm was measured."
    return f"**Keep {dtype} KV**: no arm is within the quality bar (best: `{best}`, {'; '.join(rep.misses(best))})."


def recommended(rep: Report) -> str:
    """The row the decision serves: the arm shipped (a skip: the trial that measured it), else the reference."""
    v = rep.verdict
    if v.action == "ship" and v.arm:
        return v.arm
    if v.action == "ship_with_skip":
        if v.capacity and v.capacity.recommended in rep.arms:
            return v.capacity.recommended
        layers = sorted(v.skip_layers)
        return next((n for n, e in rep.arms.items() if n.startswith(f"{v.arm} skip ")
                     and sorted(set(e.info.skip) | set(e.info.serve_skip)) == layers), v.arm)
    return rep.reference_name


def decision_table(rep: Report) -> tuple[list[str], list[list[Any]]]:
    """(headers, rows) of eval's decision table: the recommended row first, then the reference and every arm; speed
    is not measured by eval."""
    th, cap, dtype = rep.thresholds, rep.verdict.capacity, dtype_title(rep.serving_dtype)
    chosen = recommended(rep)
    at = f" at {cap.length:,} tokens" if cap else ""
    headers = ["arm", "decision", quality_header(th.max_kl, th.max_ppl_increase), f"KV capacity vs {dtype}{at}",
               "speed"]
    ref = rep.reference_name
    rows = [[f"{dtype} KV (reference)", "**recommended**" if chosen == ref else "reference", "reference",
             _capacity_cell(cap, ref), "not measured"]]
    rows += [[f"`{n}`", "**recommended**" if n == chosen else _label(rep, n), _quality_cell(rep, n),
              _capacity_cell(cap, n), "not measured"] for n in rep.arms]
    return headers, sorted(rows, key=lambda r: r[1] != "**recommended**")      # the decision's row first


def quality_header(max_kl: float, max_ppl_increase: float) -> str:
    """The decision table's quality column, the bar in its header (every report's the same words)."""
    return f"quality (worst-bucket KL <= {max_kl:g}, Δppl <= +{100 * max_ppl_increase:g}%)"


def quality_cell(kl: float, ppl_rel: float, max_kl: float, max_ppl_increase: float, source: str) -> str:
    """An arm's worst-bucket KL and perplexity change against the bar, and whose numbers they are."""
    return (f"KL {kl:.3g} {'<=' if kl <= max_kl else '>'} {max_kl:g}, Δppl {100 * ppl_rel:+.2f}% "
            f"{'<=' if ppl_rel <= max_ppl_increase else '>'} +{100 * max_ppl_increase:g}% ({source})")


def _label(rep: Report, name: str) -> str:
    cap, info = rep.verdict.capacity, rep.arms[name].info
    label = cap.labels.get(name) if cap else None
    return (label if label and label != RECOMMENDED else QUALITY if rep.misses(name)
            else "not served as measured" if not info.shippable
            else "within the bar, not confirmed by the engine" if info.skip and rep.verdict.action == "skip_unconfirmed"
            else "within the bar")


def _quality_cell(rep: Report, name: str) -> str:
    e, th = rep.arms[name], rep.thresholds
    nums = decisive(e)
    cell = quality_cell(nums.summary.max_bucket_kl, nums.summary.ppl_rel, th.max_kl, th.max_ppl_increase,
                        "engine" if nums.source == ENGINE else "emulated")
    other = [m for m in rep.misses(name) if not m.startswith(("KL ", "perplexity "))]
    return cell + (f"; {'; '.join(other)}" if other else "")


def _source(source: str | None) -> str:
    return "engine's count" if source == ENGINE else "bytes model" if source else "not known"


def _capacity_cell(cap: Any, name: str) -> str:
    ratio, source = (cap.ratios.get(name), cap.sources.get(name)) if cap else (None, None)
    return "–" if ratio is None or source is None else f"{ratio:.2f}x ({_source(source)})"


def _reference_note(rep: Report) -> list[str]:
    """Where the reference was measured in another dtype than the model serves in (a BF16 model on CPU): said once."""
    measured, served = rep.meta.get("model_dtype", ""), rep.serving_dtype
    if dtype_title(measured) == dtype_title(served):
        return []
    cpu = " (the CPU emulation runs float32)" if str(rep.meta.get("device", "")).startswith("cpu") else ""
    return [f"{dtype_title(served)} is the model's own dtype (its config.json), the KV cache it serves without "
            f"quantization; the reference here was measured in {dtype_title(measured)}{cpu}."]


def memory_lines(mem: Mapping[str, Any] | None) -> list[str]:
    """The KV memory table (calib.evaluation.memory.table): per arm and length, the bytes model's tokens per GiB and
    share of the reference's bytes saved, next to the engine's own capacity figure."""
    if not mem:
        return []
    lengths = list(next(iter(mem["rows"].values()))["model"])

    def check(c: Mapping[str, Any] | None) -> str:
        engine = "not reported" if not c or c["engine"] is None else f"{c['engine']:,}"
        return "–" if not c else f"{engine} ({'; '.join(c['problems'])})" if c["problems"] else \
            f"{engine} vs {c['bytes_model']:,} at {c['max_model_len']:,}"
    rows = [[n, *(f"{r['model'][L]['tokens_per_gib']:,.0f} ({_pct(r['model'][L]['saving'])})" for L in lengths),
             _cell(r.get("engine_tokens_per_gib"), ",.0f"), check(r.get("engine_check"))]
            for n, r in mem["rows"].items()]
    return (["## KV memory", "", f"Layer kinds: {mem['layer_kinds']}. Tokens per GiB at each length (share of the "
             f"reference's bytes saved); {mem['note']}. Engine capacity: the engine's own count (vLLM: requests of "
             "max_model_len the pool holds x max_model_len, a sliding layer reserving its window plus the tokens in "
             "flight) vs the bytes model's in that definition.", ""]
            + table(["arm", *(f"tokens/GiB at {L}" for L in lengths), "engine tokens/GiB (blocks)",
                     "engine capacity vs bytes model"], rows))


def _layer_lines(rep: Report) -> list[str]:
    """The '## Per layer' section, the report's last: one table per quantized arm."""
    lines = ["## Per layer", "", "Saturated: share of values with |x / scale| > qmax. Flushed: share of nonzero "
             "values stored as 0. SNR over real tokens. Attention error: ||o - ô|| / ||o|| of the layer's "
             "attention output with quantised K/V (same inputs).", ""]
    for n, e in rep.arms.items():
        sc = e.info.scales
        rows = [[i, sc["k"].get(i), sc["v"].get(i), _pct(r["k_saturated"]), _pct(r["k_flushed"]), r["k_snr_db"],
                 _pct(r["v_saturated"]), _pct(r["v_flushed"]), r["v_snr_db"], r["attn_rel_error"]]
                for i, r in e.layers.items()]
        lines += [f"### `{n}`", ""] + table(["layer", "k_scale", "v_scale", "K sat", "K flushed", "K SNR dB", "V sat",
                                             "V flushed", "V SNR dB", "attn error"], rows)
    return lines


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


def _passkey_shared(tables: Sequence[Mapping[str, Any] | None]) -> list[str]:
    """Passkey correct/total of each report.json table over the buckets every table that ran has (the emulation may
    have asked only the shorter buckets' prompts)."""
    ran = [t for t in tables if t]
    shared = [b for b in (ran[0] if ran else {}) if all(b in t for t in ran)]
    return ["–" if not t else f"{sum(t[b]['correct'] for b in shared)}/{sum(t[b]['total'] for b in shared)}"
            for t in tables]


def engine_lines(doc: Mapping[str, Any]) -> list[str]:
    """The '## Emulation vs engine' section (empty when no engine ran), from report.json's document: emulated and
    engine numbers over the same samples (engine_report.side_by_side), then the engine's over all its samples where it
    measured more, its KV capacity, and the arms it found implausible or did not run."""
    if not engine_report.has_engine(doc):
        return []
    ref_name, numbers, eng = doc["reference"], doc["verdict"].get("numbers", {}), doc.get("engine") or {}
    shared = engine_report.side_by_side(doc)

    def num(x: float | None) -> str:
        return "–" if x is None else f"{x:.5g}"

    def rel(n: str, x: float | None) -> str:
        return "–" if x is None or n == ref_name else f"{100 * x:+.3g}%"

    rows, not_run, cap, implausible, whole = [], [], [], [], []
    for n, e in doc["arms"].items():
        g = e.get("engine") or {}
        odd = [m for m in e.get("misses") or [] if m.startswith("engine output implausible")]
        s, es = shared.arms[n][0] or {}, shared.arms[n][1] or {}
        greedy = ((g.get("summary") or {}).get("greedy") or {}).get("prefix") if es else None
        rows.append([n, numbers.get(n, "reference" if n == ref_name else "emulation"), num(s.get("ppl")),
                     num(es.get("ppl")), rel(n, s.get("ppl_rel")), rel(n, es.get("ppl_rel")), s.get("kl"),
                     es.get("kl"), es.get("kl_unresolved_mass"), _pct(s.get("top1")), _pct(es.get("top1")),
                     _pct(greedy), *_passkey_shared([e.get("passkey"), g.get("passkey")]),
                     "implausible" if odd else g.get("status", "–").replace("_", " ")])
        if es:
            a = g["summary"]
            whole.append([n, a["samples"], num(a["ppl"]), rel(n, a["ppl_rel"]), a["kl"], _pct(a["top1"]),
                          _passkey_shared([g.get("passkey")])[0]])
        implausible += [f"- `{n}`: {odd[0]}"] if odd else []
        if g.get("status") == "not_run":
            not_run.append(f"- `{n}`: not run: {g['reason']}")
        elif g.get("status") == "ok":
            cap.append([n, g.get("kv_cache_dtype"), g.get("kv_capacity_tokens"), g.get("kv_gib"),
                        g.get("tokens_per_gib"), engine_report.context_capacity(g.get("kv_groups"))])
    more = any(r[1] > shared.samples for r in whole)
    lines = ["## Emulation vs engine", "",
             f"Engine: {eng.get('name')} {eng.get('version')} on exactly the evaluation's token ids (prompt "
             f"log-probabilities, top-{eng.get('top_k')}). Emulated and engine numbers side by side are "
             f"{engine_report.coverage(shared)}; passkey over the buckets both asked. Engine KL is a lower bound from "
             f"the top-k (`unresolved`: the {ref_name} run's probability mass outside the tokens known in both runs); "
             "perplexity and top-1 are exact. Greedy: share of greedy continuation tokens equal to the reference's "
             "before the first difference (every sample the engine ran). `numbers`: what the verdict read"
             + (", the engine's over all its samples (the table after this one)." if more else "."), ""]
    lines += table(["arm", "numbers", "ppl emulated", "ppl engine", "Δppl emulated", "Δppl engine", "KL emulated",
                    "KL engine (≥)", "unresolved", "top-1 emulated", "top-1 engine", "greedy engine",
                    "passkey emulated", "passkey engine", "engine"], rows)
    if more:
        lines += [f"The engine over all the samples it measured (the emulation measured {shared.samples} of them): "
                  "what the verdict reads where the engine ran the arm.", ""] + table(
            ["arm", "samples", "ppl engine", "Δppl engine", "KL engine (≥)", "top-1 engine", "passkey engine"],
            whole)
    if cap:
        lines += ["KV-cache capacity measured by the engine (same pool size for every arm). Pool: blocks x block "
                  "size, which on a hybrid model counts one group's blocks; context: the engine's own capacity in "
                  "context tokens (requests of max_model_len its pool holds x max_model_len), where it said.", ""] + \
            table(["arm", "KV cache dtype", "pool tokens", "GiB", "pool tokens/GiB", "context tokens"], cap)
    lines += ["Engine numbers implausible for the arm's format (orders of magnitude off the reference while the "
              "emulation is not; never ranked):", ""] + implausible + [""] if implausible else []
    return lines + (["Arms the engine did not run:", ""] + not_run + [""] if not_run else [])


def _significance_lines(rep: Report) -> list[str]:
    """Each arm's passkey paired with the reference's, per bucket: the exact McNemar test and what it concludes."""
    rows = []
    for n in rep.arms:
        pk = rep.passkey(n)
        for t in pk.buckets if pk else ():
            depth = " ".join(f"{d.depth}:{d.losses}-/{d.gains}+" for d in pk.depths if d.bucket == t.bucket)
            rows.append([n, t.bucket, t.prompts, t.reference, t.arm, t.losses, t.gains, f"{t.p:.3g}",
                         f"{t.alpha:.3g}", t.conclusion(pk.allowed) + ("" if t.powered else " (underpowered)"), depth])
    return ["### Paired with the reference", "",
            f"Exact McNemar test on the prompts each run answered (lost: reference right, arm wrong; gained: the "
            f"reverse); one-sided p of the drop against alpha {significance.ALPHA:g} / buckets. Underpowered: fewer "
            f"than {significance.DEFAULT_PROMPTS} prompts, the number that detects a "
            f"{100 * significance.DETECT_DROP:g}-point drop with power {significance.POWER:g}.", ""] + table(
        ["arm", "bucket <=", "prompts", "reference correct", "arm correct", "lost", "gained", "p (drop)", "alpha",
         "conclusion", "by depth (lost-/gained+)"], rows) if rows else []


def _failure_lines(rep: Report) -> list[str]:
    """The worst samples (largest mean KL) of the verdict's arm (or the best one) and of the default arm."""
    v = rep.verdict
    names = [n for n in dict.fromkeys([v.arm or v.dominant_in, "default"]) if n in rep.arms]
    out = ["## Failure samples", ""]
    for n in names:
        out += [relative(f"### `{n}`"), ""]
        for f in rep.arms[n].failures:
            out.append(f"- sample {f.sample} ({f.tokens} tokens, bucket <= {f.bucket}): mean KL {f.mean_kl:.3g}")
            for p in f.positions:
                text = p.context.replace("```", "'''").replace("\n", "\n    ")
                out += [f"  - position {p.position}, KL {p.kl:.3g}: next is {p.next!r}, "
                        f"{rep.reference_name} predicts {p.reference_predicts!r}, this arm {p.arm_predicts!r}; "
                        "text before:", "", "    ```", f"    {text}", "    ```", ""]
        out.append("")
    return out
