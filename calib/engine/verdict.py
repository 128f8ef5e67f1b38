"""Which numbers decide, and the parts of the verdict that must not overclaim.

Why: an emulation that does not match the engine can ship what the engine degrades or refuse what it serves
fine (issue: +0.99 % emulated vs +2.72 % measured on one text). So every decision reads the engine's numbers
when the engine measured the arm, the emulation's otherwise, and the verdict says which. Three further
rules keep the advice honest:
- advice names the engine that serves the arm's KV dtype and its setting, never another engine's flag, and
  never an engine that would run the scales at 1.0 (the support matrix, calib.engine.support, says which);
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

from calib.engine import command, support
from calib.evaluation.results import ArmInfo, ArmMetrics, BucketRow, Reference, Summary, passkey_correct
from calib.load import decide
from calib.model.layer_kinds import engine_requests_fit

ENGINE, EMULATION = "engine", "emulation"
SKIP_FLAG = command.SKIP_FLAG


def int8_serving() -> str:
    """Where calibrated INT8 KV scales are served, from the support matrix (calib.engine.support), and how
    kvcalib writes them for a build that applies them."""
    builds = sorted({c.build for c in support.CELLS if c.engine == "trtllm" and c.build and "int8" in c.formats})
    how = "; ".join(f"`kvcalib calibrate --dtype int8 --target trtllm --engine-version trtllm={b}` writes it for a "
                    f"TensorRT-LLM build with {b}" for b in builds)
    return f"{support.who_serves('int8')}" + (f" ({how})" if how else "")
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0}


Entry = Reference | ArmMetrics


def engine_ok(entry: Entry) -> bool:
    return (entry.engine or {}).get("status") == "ok"


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
    g = entry.engine
    s = g.get("summary") or {}
    ppl, rel, kl = s.get("ppl"), s.get("ppl_rel"), s.get("kl")
    ratio = None if rel is None else 1.0 + rel
    bad = (ppl is None or not math.isfinite(ppl) or (ratio is not None and ratio > MAX_PPL_RATIO)
           or (kl is not None and (not math.isfinite(kl) or kl > MAX_KL)))
    emulated = 1.0 + entry.summary.ppl_rel
    if not bad or emulated > MAX_PPL_RATIO:
        return None
    fmt = g.get("kv_cache_dtype") or entry.info.dtype
    nums = ", ".join(x for x in (f"ppl x{ratio:.4g}" if ratio is not None else "", f"KL {kl:.3g}" if kl is not None
                                 else "") if x)
    return (f"engine output implausible for {fmt} on {g.get('engine')} {g.get('version')} ({nums} vs the reference; "
            f"emulated x{emulated:.4g}): not ranked")


@dataclass(frozen=True)
class Numbers:
    """The numbers a decision reads for one arm (`decisive`): per bucket, overall, passkey (correct, total) and
    per-sample NLL, with their source and how the verdict names them."""
    source: str
    label: str
    buckets: Mapping[str, BucketRow]
    summary: Summary
    passkey: tuple[int, int] | None
    sample_nll: tuple[float, ...]


def emulated(entry: Entry) -> Numbers:
    return Numbers(EMULATION, "emulated", entry.buckets, entry.summary, passkey_correct(entry.passkey),
                   tuple(entry.sample_nll))


def decisive(entry: Entry) -> Numbers:
    """The numbers that decide for this arm: the engine's where it measured the arm, the emulation's otherwise."""
    if not engine_ok(entry):
        return emulated(entry)
    g = entry.engine
    return Numbers(ENGINE, f"{g['engine']} {g['version']}, KL a lower bound",
                   {b: BucketRow.read(r) for b, r in g["buckets"].items()}, Summary.read(g["summary"]),
                   passkey_correct(g.get("passkey")), tuple(g.get("sample_nll") or ()))


def how_to_serve(info: ArmInfo, target: str | None = None) -> str:
    """How to serve an arm on `target` (None: vLLM, the engine eval measures), its flags from the one builder every
    command prints (calib.engine.command): never another engine's flag, never vLLM's for INT8."""
    skip = support.skip_order([*info.serve_skip, *info.skip])
    if getattr(info, "skip_kind", None):          # served by the kind's name, which covers exactly those layers
        skip = support.skip_order([info.skip_kind, *info.serve_skip])
    engine = target or "vllm"
    if info.kind == "format":
        return format_serving(info.dtype, skip, engine)
    if info.dtype == "int8":
        if info.kind == "stats":
            return f"calibrate with `granularity: {info.granularity}`, dtype int8, only for an engine that applies it: {int8_serving()}"
        where = f"`{info.source}`" if info.source else "INT8 KV with scale 1.0"
        return f"serve {where} only on an engine that applies its scales: {int8_serving()}"
    how = _on(engine, info.dtype, skip)
    if info.kind == "default":
        return f"serve with FP8 KV and no scales ({how}); calibration is not needed"
    if info.kind == "stats":
        return f"calibrate with `granularity: {info.granularity}` on this data and serve the result ({how})"
    return f"serve `{info.source}` ({how})"


def _on(engine: str, dtype: str | None, skip: Sequence[int | str]) -> str:
    """"vLLM: `--kv-cache-dtype fp8 ...`": the engine and its flags, or why it cannot take them."""
    title = support.ENGINES[engine].title
    try:
        flags = command.flags(engine, dtype, skip)
    except support.SupportError as e:
        return f"{title} cannot serve it as measured: {e}"
    if not flags:
        return f"{title}: `{' '.join(command.argv(engine, 'CKPT'))}`, the KV dtype read from the checkpoint"
    return f"{title}: `{' '.join(flags)}`"


def format_serving(fmt: str, skip: Sequence[int | str] = (), engine: str = "vllm") -> str:
    """How to serve a whole KV format (no kvcalib scales) on `engine`: its flags and, for the per-token-head caches,
    the attention backend that implements them (the support matrix, calib.engine.support)."""
    title = support.ENGINES[engine].title
    try:
        flags = " ".join(command.flags(engine, fmt, skip))
    except support.SupportError as e:
        return f"{title} cannot serve it: {e}"
    if fmt in support.DYNAMIC_FORMATS:
        return (f"serve with `{flags}` ({title}; scales are computed per token and head at the cache write, no "
                "calibration; only vLLM's Triton backend implements it)")
    return f"serve with `{flags}` ({title}; no scales, no calibration)"


def paired(a: Sequence[float], b: Sequence[float], tokens: Sequence[int]) -> tuple[float, float] | None:
    """(log ppl ratio a/b, its standard error) from per-sample NLL sums; None with fewer than 2 samples."""
    n, t = len(a), float(sum(tokens))
    if n < 2 or n != len(b) or n != len(tokens) or t <= 0:
        return None
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / t
    var = sum((di - ti * mean) ** 2 for di, ti in zip(d, tokens)) * n / (n - 1)
    return mean, math.sqrt(var) / t


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
        nd, na = decisive(default), decisive(e)
        if nd.source != na.source or not nd.sample_nll or not na.sample_nll:
            continue
        r = paired(na.sample_nll, nd.sample_nll, sample_tokens)
        if r is None:
            continue
        ratio, se = r
        if abs(ratio) <= 2 * se:
            same.append({"arm": name, "ppl_ratio": math.exp(ratio), "noise": 2 * se})
            source = na.source
    if not same:
        return None
    qmax = FP8_MAX.get(default.info.dtype or "", 448.0)
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
    worst = sorted(rows, key=lambda i: -max(rows[i].values()))[:top]
    return {i: rows[i] for i in worst}


def saturation_text(name: str, entry: ArmMetrics, ref: Reference) -> str | None:
    sat = saturated_layers(entry)
    if not sat:
        return None

    def amax(i: str, kind: str) -> str:
        r = ref.ranges.get(i)
        return f", max |{kind.upper()}| {max(r.k_amax if kind == 'k' else r.v_amax):.3g}" if r else ""
    parts = [f"layer {i} (K {100 * s['k']:.3g}%{amax(i, 'k')}, V {100 * s['v']:.3g}%{amax(i, 'v')})"
             for i, s in sat.items()]
    return f"`{name}` saturates: " + "; ".join(parts) + "."


def skip_confirmed(trial: ArmMetrics, base: ArmMetrics) -> tuple[bool, str]:
    """Whether the engine confirms that the skip trial beats its base arm (lower ppl), and why not."""
    if not engine_ok(trial):
        why = (trial.engine or {}).get("reason") or "no engine was run (`kvcalib eval --engine vllm`)"
        return False, f"unconfirmed: the engine did not measure it ({why})"
    t, b = trial.engine["summary"]["ppl"], base.engine["summary"]["ppl"] if engine_ok(base) else None
    if b is not None and t >= b:
        return False, (f"the engine does not confirm the gain (ppl {t:.4g} with the skip vs {b:.4g} without)")
    return True, "confirmed by the engine"


# ------------------------------------------------------------------------------------------- capacity

# `eval` measures quality, not speed; what FP8 KV buys a server is capacity (more requests of a length in one pool),
# and goodput rises with it at most in proportion, and only where the pool bounds the batch. So eval ranks the arms
# within the quality bar by capacity at the longest length asked, and calls a gain real only beyond both of:
# - CAPACITY_FLOOR of the reference's capacity: validate (calib/load/decide.py) reads a goodput difference under its
#   3 % floor (LoadSpec.noise) as noise, and a second run's spread adds to it, so a capacity gain of a few percent
#   could never be seen as goodput (the sliding-window skip of a hybrid model whose windowed layers the engine
#   reserves at window + tokens in flight keeps about BF16's capacity);
# - one request, where the engine counted requests: its count is whole requests (blocks // blocks a request
#   reserves), so one more is within the rounding of the count.
CAPACITY_FLOOR = 0.05
CAPACITY_REQUESTS = 1
BYTES_MODEL = "bytes model"
# an arm's label (the words of calib/validate/report.py where they mean the same)
RECOMMENDED, DOMINATED, NO_CAPACITY_GAIN, QUALITY, REFERENCE, LESS_CAPACITY = (
    "recommended", "dominated", "no capacity gain", "fails the quality bar", "reference", "less capacity")
NOT_MEASURED = decide.NOT_MEASURED
CAPACITY_RULE = (
    "Speed is not measured here: among arms within the quality bar, serve the one whose KV pool holds the most "
    f"requests of the longest length asked (the engine's own count where it ran the arm, else kvcalib's bytes model), "
    f"if that is more than {CAPACITY_REQUESTS} request and more than {CAPACITY_FLOOR:.0%} above the BF16 reference's; "
    "an arm another beats or equals on quality and capacity together is never recommended; otherwise keep BF16 KV. "
    "`kvcalib validate` measures goodput under load.")


@dataclass(frozen=True)
class CapacityRow:
    """One arm as the capacity rule reads it. `quality`: the verdict's quality key, lower is better (ties in
    capacity go to it, then to the earlier row); `requests`: requests of the rule's length the engine's KV pool held
    at once by its own count (`engine_requests`), None where the engine did not run the arm or said nothing;
    `model`: the same from kvcalib's bytes model per GiB of pool (calib/evaluation/memory.py), None where unknown."""
    name: str
    within_bar: bool
    quality: float
    requests: int | None
    model: float | None
    reference: bool = False


@dataclass(frozen=True)
class CapacityDecision:
    """The rule's outcome. `recommended`: the arm to serve, the reference's name where no arm within the bar has a
    real capacity gain, None where no capacity is known at all (then nothing was ranked); per arm its capacity over
    the reference's (`ratios`), whose count that is (`sources`: ENGINE or BYTES_MODEL), its label and why."""
    recommended: str | None
    length: int
    ratios: Mapping[str, float | None]
    sources: Mapping[str, str | None]
    labels: Mapping[str, str]
    why: Mapping[str, str]
    dominated: Mapping[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {"recommended": self.recommended, "length": self.length, "rule": CAPACITY_RULE,
                "floor": CAPACITY_FLOOR, "min_requests": CAPACITY_REQUESTS,
                "arms": [{"arm": n, "label": self.labels[n], "vs_reference": self.ratios[n],
                          "source": self.sources[n], "why": self.why[n]} for n in self.labels]}


def engine_requests(entry: Mapping[str, Any] | None, length: int) -> int | None:
    """Requests of `length` tokens the engine's KV pool holds at once by its own count: `engine_requests_fit` on the
    KV cache groups it reported (a hybrid model's pool in tokens counts one group's blocks), else its pool in tokens
    over the length; None where the engine did not run the arm or said neither."""
    g = entry or {}
    if g.get("status") != "ok" or length <= 0:
        return None
    groups = g.get("kv_groups")
    if groups and groups.get("groups") and groups.get("num_blocks") is not None:
        return engine_requests_fit(groups, length)
    cap = g.get("kv_capacity_tokens")
    return int(cap) // length if cap else None


def capacity_ratio(row: CapacityRow, ref: CapacityRow) -> tuple[float | None, str | None]:
    """(row's capacity over the reference's, whose count): the engine's where it counted both, else the bytes
    model's; (None, None) where neither knows both."""
    if row.requests is not None and ref.requests:
        return row.requests / ref.requests, ENGINE
    if row.model is not None and ref.model:
        return row.model / ref.model, BYTES_MODEL
    return None, None


def capacity_gain(row: CapacityRow, ref: CapacityRow, floor: float = CAPACITY_FLOOR) -> bool:
    """Whether `row` holds more than the reference beyond noise: more than `floor` above it, and, where the engine
    counted both, more than CAPACITY_REQUESTS request more (module comment above)."""
    ratio, source = capacity_ratio(row, ref)
    if ratio is None or row.reference:
        return False
    if source == ENGINE and (row.requests or 0) - (ref.requests or 0) <= CAPACITY_REQUESTS:
        return False
    return ratio > 1 + floor


def by_capacity(rows: Sequence[CapacityRow], length: int, floor: float = CAPACITY_FLOOR) -> CapacityDecision:
    """The arm to serve when speed was not measured (`eval`; `tune` with an engine applies `capacity_gain`), by
    CAPACITY_RULE.

    Why capacity and not quality alone: FP8 KV raises throughput only by letting more requests share the KV pool; an
    arm within the quality bar that holds about as many requests as BF16 (a sliding-window skip on a hybrid model)
    buys nothing for serving and costs the quantisation, so it is reported as "no capacity gain" and BF16 stays
    unless another arm within the bar gains for real (`capacity_gain`). Among the arms that gain, the most capacity
    wins (ties: the better quality, then the earlier row); an arm that another beats or equals on quality and
    capacity together (the reference included) is dominated and never recommended, as in calib/load/decide.py.
    `rows`: the reference and every arm, in the verdict's order."""
    ref = next((r for r in rows if r.reference), None)
    if ref is None:
        raise ValueError("the capacity rule needs the reference row")
    ratio = {r.name: capacity_ratio(r, ref) for r in rows}
    ratios = {n: (1.0 if n == ref.name else x[0]) for n, x in ratio.items()}
    sources = {n: x[1] for n, x in ratio.items()}
    sources[ref.name] = ENGINE if ref.requests else (BYTES_MODEL if ref.model else None)
    known = [r for r in rows if ratios[r.name] is not None and (r.within_bar or r.reference)]
    dominated: dict[str, str] = {}
    for j, a in enumerate(known):
        for k, b in enumerate(known):
            if b is a or a.reference:
                continue
            qa, qb, ca, cb = a.quality, b.quality, ratios[a.name], ratios[b.name]
            if qb <= qa and cb >= ca and (qb < qa or cb > ca or k < j or b.reference):
                dominated[a.name] = b.name
                break
    gain = [r for r in known if r.within_bar and capacity_gain(r, ref, floor)]
    order = {r.name: j for j, r in enumerate(rows)}
    win = min(gain, key=lambda r: (-ratios[r.name], r.quality, order[r.name]), default=None)
    recommended = win.name if win else (ref.name if sources[ref.name] else None)
    labels, why = {}, {}
    for r in rows:
        x, src = ratios[r.name], sources[r.name] or "unknown"
        said = f"{x:.2f}x the reference's capacity ({src})" if x is not None else "capacity not known"
        if r.reference:
            labels[r.name], why[r.name] = (RECOMMENDED if recommended == r.name else REFERENCE), "the reference"
        elif not r.within_bar:
            labels[r.name], why[r.name] = QUALITY, said
        elif x is None:
            labels[r.name], why[r.name] = NOT_MEASURED, said
        elif r.name == recommended:
            labels[r.name], why[r.name] = RECOMMENDED, said
        elif r not in gain:
            labels[r.name], why[r.name] = NO_CAPACITY_GAIN, f"{said}: within noise of the reference's"
        elif r.name in dominated:
            labels[r.name], why[r.name] = DOMINATED, (f"{said}; `{dominated[r.name]}` is as good or better on "
                                                       "quality and capacity together")
        else:
            labels[r.name], why[r.name] = LESS_CAPACITY, f"{said}, less than `{recommended}`'s"
    return CapacityDecision(recommended, length, ratios, sources, labels, why, dominated)
