"""The capacity rule (`by_capacity`): among the arms within the quality bar, serve the one whose KV pool holds the
most requests of the longest length asked, where that is a gain beyond noise.

Why a module of its own: `eval`'s verdict ranks by it and `tune` with an engine applies `capacity_gain`; both read
the engine's own count where it ran the arm, else kvcalib's bytes model (calib/evaluation/memory.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from calib.engine.metrics import EngineNumbers
from calib.evaluation.numbers import ENGINE, decisive
from calib.evaluation.results import ArmMetrics, Reference
from calib.load import decide
from calib.model.layer_kinds import engine_requests_fit

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


def engine_requests(entry: EngineNumbers | None, length: int) -> int | None:
    """Requests of `length` tokens the engine's KV pool holds at once by its own count: `engine_requests_fit` on the
    KV cache groups it reported (a hybrid model's pool in tokens counts one group's blocks), else its pool in tokens
    over the length; None where the engine did not run the arm or said neither."""
    if entry is None or not entry.ok or length <= 0:
        return None
    groups = entry.kv_groups
    if groups and groups.get("groups") and groups.get("num_blocks") is not None:
        return engine_requests_fit(groups, length)
    return entry.kv_capacity_tokens // length if entry.kv_capacity_tokens else None


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
    within_rounding = source == ENGINE and (row.requests or 0) - (ref.requests or 0) <= CAPACITY_REQUESTS
    return ratio is not None and not row.reference and not within_rounding and ratio > 1 + floor


def by_capacity(rows: Sequence[CapacityRow], length: int, floor: float = CAPACITY_FLOOR) -> CapacityDecision:
    """The arm to serve when speed was not measured (`eval`; `tune` with an engine applies `capacity_gain`), by
    CAPACITY_RULE (why capacity: the module comment). An arm within the bar that holds about as many requests as BF16
    (a sliding-window skip on a hybrid model) buys nothing for serving and costs the quantisation: "no capacity gain",
    and BF16 stays unless another arm gains for real (`capacity_gain`). Among those that gain, the most capacity wins
    (ties: the better quality, then the earlier row); an arm another beats or equals on quality and capacity together
    (the reference included) is dominated and never recommended, as in calib/load/decide.py. `rows`: the reference
    and every arm, in the verdict's order."""
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
        labels[r.name], why[r.name] = (
            ((RECOMMENDED if recommended == r.name else REFERENCE), "the reference") if r.reference
            else (QUALITY, said) if not r.within_bar else (NOT_MEASURED, said) if x is None
            else (RECOMMENDED, said) if r.name == recommended
            else (NO_CAPACITY_GAIN, f"{said}: within noise of the reference's") if r not in gain
            else (DOMINATED, f"{said}; `{dominated[r.name]}` is as good or better on quality and capacity together")
            if r.name in dominated else (LESS_CAPACITY, f"{said}, less than `{recommended}`'s"))
    return CapacityDecision(recommended, length, ratios, sources, labels, why, dominated)


def longest(ref: Reference, bytes_model: Any = None) -> int:
    """The longest length the evaluation asked for: the capacity rule's length (the longest requests bind).
    `bytes_model`: calib.evaluation.memory.Model, or None."""
    asked = [int(b) for b in ref.buckets] + [int(b) for b in (ref.engine.buckets if ref.engine else ())]
    asked += list(bytes_model.lengths) if bytes_model is not None else []
    return max(asked, default=0)


def capacity_row(ref: Reference, entry: ArmMetrics | None, name: str, candidate: bool,
                 bytes_model: Any, length: int) -> CapacityRow:
    """One arm (`entry` None: the reference) as the capacity rule reads it: the engine's count of requests of
    `length` tokens where it ran the arm, the bytes model's per GiB, and its KL as the quality key."""
    run = ref.engine if entry is None else entry.engine
    model = bytes_model.requests_per_gib(None if entry is None else entry.info, length) if bytes_model else None
    quality = 0.0 if entry is None else decisive(entry).summary.kl
    return CapacityRow(name, candidate, quality, engine_requests(run, length), model, entry is None)


def gains(row: CapacityRow, ref: CapacityRow) -> bool | None:
    """Whether `row` gains capacity over the reference beyond noise; None where neither count knows both."""
    return None if capacity_ratio(row, ref)[0] is None else capacity_gain(row, ref)


def source_words(source: str | None) -> str:
    return {ENGINE: "the engine's own count", BYTES_MODEL: "kvcalib's bytes model, not the engine's count"}.get(
        source or "", "not known")


def ratio_text(cap: CapacityDecision, name: str) -> str:
    x = cap.ratios.get(name)
    return "capacity not known" if x is None else f"{x:.2f}x"


def notes(cap: CapacityDecision, reference: str, candidates: Sequence[str]) -> list[str]:
    """The verdict's sentences on capacity and speed: what the ranking read, the arms within the threshold that gain
    nothing, and that speed was not measured."""
    ref = reference.upper()
    if cap.recommended is None:
        how = ("KV capacity was not counted (the engine did not run the reference and no bytes model applies), so "
               "the arms within the threshold are ranked by quality alone")
    else:
        used = sorted({source_words(cap.sources.get(n)) for n in candidates if cap.ratios.get(n) is not None})
        how = (f"Arms within the threshold are ranked by KV capacity at {cap.length:,} tokens (requests the KV pool "
               f"holds at once, over {ref}'s; {' and '.join(used) or 'not known'}), and an arm whose gain over "
               f"{ref} is within {CAPACITY_FLOOR:.0%} or {CAPACITY_REQUESTS} request is not recommended")
        where = [n for n in candidates if cap.labels.get(n) == RECOMMENDED]
        if where:
            how += f"; `{where[0]}`: {cap.why[where[0]]}"
        none = [n for n in candidates if cap.labels.get(n) == NO_CAPACITY_GAIN]
        if none:
            how += "; no capacity gain: " + ", ".join(f"`{n}` ({ratio_text(cap, n)})" for n in none)
    return [how + ".", "Speed was not measured: capacity is what FP8 KV buys a server, not measured throughput; "
            "`kvcalib validate` serves the arms under load and decides by goodput at your SLO."]
