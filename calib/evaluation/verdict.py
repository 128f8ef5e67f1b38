"""The evaluation's verdict: what to ship, where it breaks, and the numbers behind it.

Why a verdict and not just tables: the person running `eval` has to decide between three actions — ship FP8 KV with some
scales, ship it with a few layers kept in the model dtype, or keep the model-dtype KV cache — and the tables only help
once they know which numbers decide (calib/evaluation/numbers.py: the engine's where it measured the arm). The rule
(thresholds below) is written into every report so the decision can be checked and re-argued.

A skip recommendation is never a guess: `skip_plan` names the layers whose attention-output error dominates, the
evaluation re-measures the arm with those layers unquantised, and only that measurement can turn into "ship with
--kv-cache-dtype-skip-layers ...". Advice names the engine that serves the arm's KV dtype and its setting, never another
engine's flag, and never an engine that would run the scales at 1.0 (the support matrix, calib.recipe.support, says
which).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from calib.engine import command
from calib.evaluation import capacity, measurable, memory, significance
from calib.evaluation import formats as kv_formats
from calib.evaluation.numbers import (EMULATION, ENGINE, decisive, engine_ok, implausible, saturated_layers,
                                     saturation_text, scales_within_noise, skip_confirmed)
from calib.evaluation.results import ArmInfo, ArmMetrics, Reference, record
from calib.recipe import support

SKIP_FLAG = command.SKIP_FLAG


@dataclass(frozen=True)
class Thresholds:
    """When an arm is good enough to ship (defaults; the CLI can override each):
    mean next-token KL to the reference <= max_kl nats in *every* length bucket; perplexity at most
    max_ppl_increase (relative, 0.01 = +1%) above the reference's; passkey answers correct at least the
    reference's count minus passkey_drop, or the drop not significant (calib/evaluation/significance.py:
    exact McNemar on the prompts paired with the reference's). A layer dominates when its attention-output error is at least
    `dominance` times the median layer's; at most `max_skip` layers are tried unquantised."""
    max_kl: float = 0.01
    max_ppl_increase: float = 0.01
    passkey_drop: int = 0
    dominance: float = 3.0
    max_skip: int = 3

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


Results = Mapping[str, ArmMetrics]


def failures(entry: ArmMetrics, ref: Reference, th: Thresholds) -> list[str]:
    """Why `entry` misses the threshold (empty: it is within), on the engine's numbers when the engine
    measured the arm, the emulation's otherwise (calib/evaluation/numbers.py)."""
    odd = implausible(entry)
    if odd:
        return [odd]
    nums = decisive(entry)
    why = [f"KL {row.kl:.3g} > {th.max_kl:g} in bucket <= {b}" for b, row in nums.buckets.items() if row.kl > th.max_kl]
    if nums.summary.ppl_rel > th.max_ppl_increase:
        why.append(f"perplexity +{100 * nums.summary.ppl_rel:.2f}% > +{100 * th.max_ppl_increase:g}%")
    pk = passkey_decision(entry, ref, th)
    return why + list(pk.failed if pk else ())


def passkey_decision(entry: ArmMetrics, ref: Reference, th: Thresholds) -> significance.PasskeyDecision | None:
    """The arm's passkey against the reference's, on the same numbers as the rest of its decision (the
    engine's where it ran the arm)."""
    if decisive(entry).source == ENGINE and engine_ok(ref):
        return significance.decide(ref.engine.passkey, entry.engine.passkey, th.passkey_drop)
    return significance.decide(ref.passkey, entry.passkey, th.passkey_drop)


def dominant_layers(entry: ArmMetrics, th: Thresholds) -> list[int]:
    """Layers whose attention-output error is >= `dominance` x the median layer's, worst first (<= max_skip)."""
    errs = {int(i): row["attn_rel_error"] for i, row in entry.layers.items()}
    if not errs:
        return []
    median = statistics.median(errs.values())
    top = sorted((i for i, e in errs.items() if e > 0 and e >= th.dominance * median), key=lambda i: -errs[i])
    return top[: th.max_skip] if len(top) < len(errs) else []


def _plain(results: Results) -> dict[str, ArmMetrics]:
    """The arms a verdict ranks: shippable, no skip trial, and no engine output implausible for their format."""
    return {n: e for n, e in results.items() if e.info.shippable and not e.info.skip and not implausible(e)}


def skip_plan(ref: Reference, results: Results, th: Thresholds) -> list[tuple[str, list[int]]]:
    """[(arm, dominant layers)] to re-measure unquantised, when no shippable arm is within the threshold."""
    plain = _plain(results)
    if measurable.problems(ref, results) or not plain or any(not failures(e, ref, th) for e in plain.values()):
        return []
    best = min(plain, key=lambda n: _kl(plain[n]))
    layers = dominant_layers(plain[best], th)
    return [(best, layers)] if layers else []


def _kl(entry: ArmMetrics) -> float:
    return decisive(entry).summary.kl


@dataclass(frozen=True)
class Verdict:
    """The decision and its reasons. `action`: ship | ship_with_skip | skip_unconfirmed | keep_reference; `arm`
    the arm to serve (or cut the skip from); `numbers`: per arm, whose numbers decided (engine | emulation);
    `saturated`: per arm named in the text, the layers whose K/V leave the dtype's range."""
    action: str
    arm: str | None
    skip_layers: tuple[int, ...]
    flag: str | None
    within_threshold: tuple[str, ...]
    dominant_layers: tuple[int, ...]
    dominant_in: str | None
    thresholds: Thresholds
    numbers: Mapping[str, str]
    text: str
    scales_within_noise: Mapping[str, Any] | None
    saturated: Mapping[str, Mapping[str, Mapping[str, float]]]
    skips_by_memory: tuple[Mapping[str, Any], ...] = ()    # memory.Candidate.to_dict(), best first
    capacity: capacity.CapacityDecision | None = None         # the capacity rule's ranking (calib.evaluation.capacity)

    def to_dict(self) -> dict[str, Any]:
        """As report.json holds it (`scales_within_noise`, `skips_by_memory`, `capacity` only when found)."""
        return record(self, omit=("scales_within_noise", "skips_by_memory", "capacity"))


def verdict(ref: Reference, results: Results, th: Thresholds, reference: str,
            bytes_model: "memory.Model | None" = None, geometry: tuple[int, int] | None = None,
            target: str | None = None, serving: str | None = None) -> Verdict:
    """The decision: ship an arm, ship it with layers skipped (measured), or keep the reference KV dtype.
    Raises measurable.CannotMeasure ("cannot measure", naming the arm, where and which number) when any
    measured quantity is NaN or infinite: a comparison with NaN is false, so such an arm would "miss" nothing.
    `bytes_model` (calib.evaluation.memory): on a hybrid model every measured skip is also weighed by the memory it
    gives back; the arms within the threshold are ranked by KV capacity (`calib.evaluation.capacity.by_capacity`: the
    engine's count where it ran the arm, else the bytes model's; eval measures no speed, and the text says so);
    `target` (eval --target): the engine whose serve flags the advice names (None: vLLM); `serving`: the dtype the
    model is served in (its config.json's, as the report names it: BF16), which the advice names — on CPU the reference arm is measured in
    float32, but the user keeps BF16 KV, not FP32 (None: the reference arm's name)."""
    measurable.check(ref, results, reference)
    plain = _plain(results)
    ok = sorted((n for n in plain if not failures(plain[n], ref, th)), key=lambda n: _kl(plain[n]))
    if geometry and any(plain[n].info.kind == "format" for n in ok):
        # whole KV formats compete: the fewest bytes per token within the bar first (calib/evaluation/formats.py)
        first = [r.arm for r in kv_formats.order(kv_formats.rows({n: plain[n] for n in ok}, lambda e: [], *geometry))]
        ok = first + [n for n in ok if n not in first]
    skipped = sorted((n for n, e in results.items() if e.info.skip and not failures(e, ref, th)),
                     key=lambda n: (len(results[n].info.skip), _kl(results[n])))
    best_any = min(plain, key=lambda n: _kl(plain[n])) if plain else None
    dominant = dominant_layers(plain[best_any], th) if best_any else []
    numbers = {n: decisive(e).source for n, e in results.items()}
    arm, layers, flag = None, [], None

    def kl(n):
        nums = decisive(results[n])
        return f"{nums.label}: worst-bucket KL {nums.summary.max_bucket_kl:.3g}, ppl {100 * nums.summary.ppl_rel:+.2f}%"

    confirmed = [(n, skip_confirmed(results[n], results[n.rsplit(" skip ", 1)[0]])) for n in skipped]
    shippable_skips = [n for n, (c, _) in confirmed if c]
    length = capacity.longest(ref, bytes_model)
    # the reference first, then every plain arm (a candidate when within the threshold) and every confirmed skip
    rows = [capacity.capacity_row(ref, None, reference, True, bytes_model, length),
            *(capacity.capacity_row(ref, e, n, n in ok, bytes_model, length) for n, e in plain.items()),
            *(capacity.capacity_row(ref, results[n], n, True, bytes_model, length) for n in shippable_skips)]
    ref_row, cap = rows[0], capacity.by_capacity(rows, length)
    candidates = [*ok, *shippable_skips]
    win = cap.recommended if cap.recommended is not None else (candidates[0] if candidates else None)
    said = serving or reference
    capacity_notes = capacity.notes(cap, said, candidates) if candidates else []
    if win in ok:
        action, arm = "ship", win
        ok = [win, *(n for n in ok if n != win)]
        text = f"Ship `{arm}` ({kl(arm)}): {how_to_serve(plain[arm].info, target)}."
        text += " Also within the threshold: " + "; ".join(f"`{n}` ({kl(n)})" for n in ok[1:]) + "." if ok[1:] else ""
    elif win in shippable_skips:
        layers, flag, arm = _skip_trial(results, win)
        why = (f"the {results[win].info.skip_kind.replace('_', '-')} layers hold only their window, so keeping "
               "them costs little memory" if results[win].info.skip_kind else
               f"Those layers dominate the error (attention-output error {_errs(plain[arm], layers)})")
        action, text = "ship_with_skip", (
            f"Ship `{arm}` with layers {layers} kept in {said}: serve with `{flag}` (vLLM; recipe "
            f"`skip_layers: {layers}`). {why[0].upper() + why[1:]}; measured with them unquantised: {kl(win)}, "
            "confirmed by the engine.")
    elif candidates:            # within the bar, but none holds more requests than the reference beyond noise
        action, text = "keep_reference", (
            f"Keep {said.upper()} KV: no arm within the threshold has a capacity gain over it beyond noise "
            f"({'; '.join(f'`{n}` {capacity.ratio_text(cap, n)}' for n in candidates)}), so FP8 KV buys no room for "
            "more requests here.")
    elif confirmed:
        best, (_, why) = confirmed[0]
        layers, flag, arm = _skip_trial(results, best)
        row = capacity.capacity_row(ref, results[best], best, True, bytes_model, length)
        ratio, source = capacity.capacity_ratio(row, ref_row)
        brings = (f"Keeping layers {layers} in {said} brings `{arm}` within it ({kl(best)}; attention-output "
                  f"error {_errs(plain[arm], layers)}), {why}")
        failed = f"(best: `{best_any}`, {'; '.join(failures(plain[best_any], ref, th))})"
        if ratio is None or capacity.capacity_gain(row, ref_row):
            action, text = "skip_unconfirmed", (
                f"Keep {said.upper()} KV for now: no arm is within the threshold {failed}. {brings}. Before "
                f"serving with `{flag}`, measure it in the engine (`kvcalib eval --engine vllm`).")
        else:
            action, text = "keep_reference", (
                f"Keep {said.upper()} KV: no arm is within the threshold {failed}. {brings}, but it has no "
                f"capacity gain over {said.upper()} ({ratio:.2f}x its capacity at {length:,} tokens, "
                f"{capacity.source_words(source)}), so serving it buys nothing.")
            layers, flag, arm = [], None, None
    else:
        why = "; ".join(failures(plain[best_any], ref, th)) if best_any else "no quantised arm"
        tried = [n for n, e in results.items() if e.info.skip]
        extra = (f" Keeping layers {list(results[tried[-1]].info.skip)} unquantised was measured too and is still outside "
                 f"({kl(tried[-1])})." if tried else
                 " No small set of layers dominates the error, so no layer skip was measured (whether one helps "
                 "is unknown).")
        action, text = "keep_reference", (f"Keep {said.upper()} KV for this model: no arm is within the threshold "
                                          f"(best: `{best_any}`, {why}).{extra}")
    noise, saturated, notes = _honest(arm, numbers, ref, results, th)
    cands = []
    if bytes_model is not None and bytes_model.layers.hybrid:       # skips weighed by memory: hybrid models
        cands = [replace(c, capacity_gain=capacity.gains(
            capacity.capacity_row(ref, results[c.arm], c.arm, True, bytes_model, length), ref_row))
            for c in memory.candidates(bytes_model, results, ref.engine, ref.sample_tokens)]
        notes += ["Skips by quality regained per memory given back (measured): "      # best first; none: no claim
                  + "; ".join(c.line(bytes_model.model) for c in cands) + "."] if cands else []
    return Verdict(action, arm, tuple(layers), flag, tuple(ok), tuple(dominant), best_any, th, numbers,
                   " ".join([text, *capacity_notes, *notes]), noise, saturated, tuple(c.to_dict() for c in cands), cap)


def _honest(arm: str | None, numbers: Mapping[str, str], ref: Reference, results: Results,
            th: Thresholds) -> tuple[dict[str, Any] | None, dict[str, Any], list[str]]:
    """What the numbers do not say by themselves: calibration within noise (and why), saturating layers, which
    numbers decided, passkeys lower than the reference's but within noise (or too few to conclude), engine output
    implausible for its format; (the noise finding, the saturated layers per arm, the sentences saying so)."""
    extra = []
    noise = scales_within_noise(ref, results, ref.sample_tokens)
    if noise:
        extra.append(noise["text"])
    saturated = {}
    for name in dict.fromkeys(n for n in ("default", arm) if n in results):
        text = saturation_text(name, results[name], ref)
        if text:
            saturated[name] = saturated_layers(results[name])
            extra.append(text)
    used, emu = set(numbers.values()), ", ".join(f"`{n}`" for n, s in numbers.items() if s == EMULATION)
    extra.append("Decided on the engine's numbers." if used == {ENGINE} else
                 f"Decided on the engine's numbers where it ran; emulated numbers for {emu} (engine: not run, see the "
                 "engine table)." if ENGINE in used else
                 "Decided on emulated numbers: the engine ran no quantised arm (see the engine table)."
                 if any(e.engine is not None for e in results.values()) else
                 "Decided on emulated numbers (no engine run; `--engine vllm` measures the real engine).")
    pks = {n: passkey_decision(e, ref, th) for n, e in _plain(results).items()}
    extra += [f"`{n}` " + "; ".join(pk.notes) + "." for n, pk in pks.items() if pk and pk.notes]
    return noise, saturated, extra + [f"`{n}`: {implausible(e)}." for n, e in results.items() if implausible(e)]


def _errs(entry: ArmMetrics, layers: Sequence[int]) -> str:
    rows = entry.layers
    med = statistics.median(r["attn_rel_error"] for r in rows.values())
    return ", ".join(f"layer {i}: {rows[str(i)]['attn_rel_error']:.3g}" for i in layers) + f" vs median {med:.3g}"


def _skip_trial(results: Results, name: str) -> tuple[list[int], str, str]:
    """A skip trial's layers kept unquantised, the engine flag that serves them, and the arm it was cut from."""
    info = results[name].info
    layers = sorted(set(info.skip) | set(info.serve_skip))
    named = support.skip_order([info.skip_kind, *info.serve_skip]) if info.skip_kind else layers
    return layers, f"{SKIP_FLAG} {' '.join(map(str, named))}", name.rsplit(" skip ", 1)[0]


def int8_serving() -> str:
    """Where calibrated INT8 KV scales are served, from the support matrix (calib.recipe.support), and how
    kvcalib writes them for a build that applies them."""
    how = "; ".join(f"`kvcalib calibrate --dtype int8 --target {n} --engine-version {n}={b}` writes it for a "
                    f"{e.title} build with {b}" for n, e in support.ENGINES.items() for b in support.builds(n, "int8"))
    return f"{support.who_serves('int8')}" + (f" ({how})" if how else "")


def how_to_serve(info: ArmInfo, target: str | None = None) -> str:
    """How to serve an arm on `target` (None: vLLM, the engine eval measures), its flags from the one builder every
    command prints (calib.engine.command): never another engine's flag, never vLLM's for INT8; for a whole KV format,
    the attention backend that implements it (the support matrix, calib.recipe.support)."""
    # a skip of a layer kind is served by the kind's name, which covers exactly those layers
    kind = getattr(info, "skip_kind", None)
    skip = support.skip_order([kind, *info.serve_skip] if kind else [*info.serve_skip, *info.skip])
    engine, title = target or "vllm", support.ENGINES[target or "vllm"].title
    if info.dtype == "int8" and info.kind != "format":
        if info.kind == "stats":
            return f"calibrate with `granularity: {info.granularity}`, dtype int8, only for an engine that applies it: {int8_serving()}"
        where = f"`{info.source}`" if info.source else "INT8 KV with scale 1.0"
        return f"serve {where} only on an engine that applies its scales: {int8_serving()}"
    try:
        flags = " ".join(command.flags(engine, info.dtype, skip))
    except support.SupportError as e:
        if info.kind == "format":
            return f"{title} cannot serve it: {e}"
        flags, how = None, f"{title} cannot serve it as measured: {e}"
    if info.kind == "format":       # a whole KV format, no kvcalib scales
        how = ("scales are computed per token and head at the cache write, no calibration; only vLLM's Triton backend "
               "implements it" if info.dtype in support.DYNAMIC_FORMATS else "no scales, no calibration")
        return f"serve with `{flags}` ({title}; {how})"
    if flags is not None:
        how = (f"{title}: `{flags}`" if flags else
               f"{title}: `{' '.join(command.argv(engine, 'CKPT'))}`, the KV dtype read from the checkpoint")
    if info.kind == "default":
        return f"serve with FP8 KV and no scales ({how}); calibration is not needed"
    if info.kind == "stats":
        return f"calibrate with `granularity: {info.granularity}` on this data and serve the result ({how})"
    return f"serve `{info.source}` ({how})"
