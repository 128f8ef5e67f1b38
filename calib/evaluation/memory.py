"""What each arm costs in KV memory at the evaluation's lengths, and skip decisions weighed by that memory.

Why: keeping layers at the model dtype buys back quality and gives back memory, and the two do not scale together. On a
hybrid model the sliding-window layers hold only their window: measured on a 270M model with 15 sliding (window 512) and
3 global layers, keeping them in BF16 halved FP8's perplexity loss at 32K for ~7 % of FP8's memory saving. A single
global layer kept in BF16 gives back more memory than all of them. So every skip candidate measured here (the
sliding-window group, the single layers of the skip trials) is ranked by the perplexity loss it regains per share of the
memory saving it gives back, at the longest length the user asked for, from its measured numbers (the engine's where it
ran). Bytes come from calib.model.layer_kinds, the one bytes model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from calib.engine.command import SKIP_FLAG
from calib.engine.metrics import EngineNumbers
from calib.evaluation.numbers import decisive, paired
from calib.evaluation.results import ArmInfo, ArmMetrics, bucket_of
from calib.model import layer_kinds as lk
from calib.recipe import dtypes

SERVE = "vllm serve {model} --kv-cache-dtype {dtype}"


@dataclass(frozen=True)
class Model:
    """The bytes model of one evaluated model: layer kinds, KV heads, head_dim, model dtype, the lengths asked."""
    layers: lk.Layers
    kv_heads: int
    head_dim: int
    model_dtype: str
    lengths: tuple[int, ...]
    model: str = "MODEL"

    def storage(self, info: ArmInfo | None) -> dict[int, lk.Storage]:
        """Per-layer storage of an arm: its KV dtype on the layers it holds scales for, the model dtype elsewhere
        (the reference: `info` None)."""
        n = len(self.layers.kinds)
        if info is None or info.dtype is None:
            return lk.storage_for(n, self.model_dtype, None, ())
        token = 4 if info.granularity == "token" else 0      # a float32 scale per token and head
        return lk.storage_for(n, self.model_dtype, info.dtype, (int(i) for i in info.scales.get("k", {})), token)

    def bytes(self, info: ArmInfo | None, length: int) -> int:
        return lk.kv_bytes(self.layers, self.kv_heads, self.head_dim, length, self.storage(info))

    def requests_per_gib(self, info: ArmInfo | None, length: int) -> float | None:
        """Sequences of `length` tokens one GiB of cache holds by the bytes model (the capacity the verdict ranks by
        where the engine did not count it); None for a KV format the bytes model does not know."""
        try:
            b: float | None = self.bytes(info, length)
        except lk.GeometryError:          # a whole KV format (INT4, per-token-head scales): its own bytes per token
            b = self.format_bytes(info, length)
        return 2 ** 30 / b if b else None

    def format_bytes(self, info: ArmInfo | None, length: int) -> float | None:
        """Bytes one sequence of `length` tokens takes in a KV format the per-layer storage cannot state (sub-byte
        elements, per-token scales): calib.recipe.dtypes' bytes per token on the layers the arm quantises, the model
        dtype elsewhere; None for a name neither knows."""
        if info is None or info.dtype is None or self.model_dtype not in lk.DTYPE_BYTES:
            return None
        try:
            narrow = dtypes.kv_format(info.dtype).bytes_per_token(self.kv_heads, self.head_dim)
        except ValueError:
            return None
        wide = lk.token_bytes(self.kv_heads, self.head_dim, lk.Storage(lk.DTYPE_BYTES[self.model_dtype]))
        q = {int(i) for i in info.scales.get("k", {})}
        return sum(k.held_tokens(length) * (narrow if i in q else wide) for i, k in enumerate(self.layers.kinds))


def table(m: Model, ref_name: str, results: Mapping[str, ArmMetrics],
          ref_engine: EngineNumbers | None = None) -> dict[str, Any]:
    """report.json's `memory`: per arm and length the bytes per sequence, tokens per GiB and share of the
    reference's bytes saved (the bytes model), next to the engine's capacity where it ran (`ref_engine`: the
    reference's engine entry, `Reference.engine`)."""
    rows: dict[str, Any] = {}
    for name, info, engine in [(ref_name, None, ref_engine), *((n, e.info, e.engine) for n, e in results.items())]:
        per = {}
        for L in m.lengths:
            b, r = m.bytes(info, L), m.bytes(None, L)
            per[str(L)] = {"bytes_per_sequence": b, "tokens_per_gib": L * 2 ** 30 / b, "saving": 1 - b / r}
        rows[name] = {"model": per, "engine_tokens_per_gib": engine.tokens_per_gib if engine else None,
                      "engine_capacity_tokens": engine.kv_capacity_tokens if engine else None}
        if engine and engine.kv_groups:
            rows[name]["engine_check"] = engine_check(m, info, engine.kv_groups)
    return {"layer_kinds": m.layers.describe(), "rows": rows,
            "note": ("bytes model: per layer min(length, window) tokens x KV heads x head_dim x 2 x bytes (kvcalib); "
                     "the engine's number is its pool in tokens (vLLM: blocks x block size), which for a hybrid model "
                     "counts one group's blocks, not context tokens")}


@dataclass(frozen=True)
class Candidate:
    """One measured skip: the arm it was cut from, what it keeps unquantised, the perplexity loss before and after
    (decisive numbers at `length`), and the share of the base arm's memory saving it gives back."""
    arm: str
    base: str
    label: str
    length: int
    loss_before: float
    loss_after: float
    saving_given_back: float
    numbers: str
    flag: str
    # the same share in the engine's own pool accounting (vLLM: bytes a request of max_model_len reserves, from the
    # capacity it reported for the reference, the base arm and the skip arm), and that max_model_len; None where
    # the engine did not report all three
    engine_given_back: float | None = None
    engine_max_model_len: int | None = None
    # the skip arm's perplexity against its base arm's, paired by sample (log of the ratio, and 2 standard errors of
    # it: `verdict.paired`) over `noise_over` (the samples of the candidate's bucket, or every sample where the
    # bucket has fewer than two); None with fewer than two samples measured alike
    change: float | None = None
    noise: float | None = None
    noise_over: str = ""
    # False where the capacity rule (calib.evaluation.capacity.capacity_gain) finds the skip arm holding no more requests
    # than the reference beyond noise: no serve command then; None where not weighed
    capacity_gain: bool | None = None

    @property
    def within_noise(self) -> bool:
        return self.noise is not None and self.change is not None and abs(self.change) <= self.noise

    @property
    def helps(self) -> bool:
        """Measured to regain quality: a lower loss, outside the paired noise where it could be estimated."""
        return self.regained > 0 and not self.within_noise

    @property
    def regained(self) -> float:
        return self.loss_before - self.loss_after

    @property
    def per_memory(self) -> float:
        """Loss regained per share of the saving given back (higher first)."""
        return self.regained / max(self.saving_given_back, 1e-9)

    def line(self, model: str) -> str:
        k = f"{self.length // 1024}K" if self.length >= 1024 and self.length % 1024 == 0 else str(self.length)
        text = (f"{self.label}: ppl loss {100 * self.loss_before:+.2f} % -> {100 * self.loss_after:+.2f} % for "
                f"{100 * self.saving_given_back:.0f} % of the memory saving at {k} ({self.numbers})")
        if self.engine_given_back is not None:
            text += (f", {100 * self.engine_given_back:.0f} % in the engine's own accounting at max_model_len "
                     f"{self.engine_max_model_len:,} (what it reserves per request)")
        if self.regained <= 0:
            return text + ": measured, and it does not help"
        if self.within_noise:
            return text + (f": measured, within noise (ppl x{math.exp(self.change):.4f} against `{self.base}` over "
                           f"{self.noise_over}, noise ±{100 * self.noise:.2g} %), so it does not help")
        if self.capacity_gain is False:
            return text + (": it has no capacity gain over the reference (it holds about as many requests), so no "
                           "serve command")
        return text + f"; serve: `{SERVE.format(model=model, dtype='fp8')} {self.flag}`"

    def to_dict(self) -> dict[str, Any]:
        return {"arm": self.arm, "base": self.base, "label": self.label, "length": self.length,
                "ppl_loss_before": self.loss_before, "ppl_loss_after": self.loss_after,
                "saving_given_back": self.saving_given_back, "numbers": self.numbers, "flag": self.flag,
                "engine_saving_given_back": self.engine_given_back, "engine_max_model_len": self.engine_max_model_len,
                "ppl_log_ratio_vs_base": self.change, "noise": self.noise, "noise_over": self.noise_over,
                "helps": self.helps, "capacity_gain": self.capacity_gain}


def _loss(entry: ArmMetrics, length: int) -> tuple[float, str] | None:
    nums = decisive(entry)
    row = nums.buckets.get(str(length))
    return (row.ppl_rel, nums.source) if row is not None else None


def _engine_bytes(engine: EngineNumbers | None) -> tuple[float, int] | None:
    """(bytes per context token, max_model_len) the engine reserves for a request of max_model_len: its pool over
    the capacity it reported in its own definition (vLLM's `kv_cache_size_tokens`); None where it did not say."""
    groups = (engine and engine.kv_groups) or {}
    size, gib, length = groups.get("size_tokens"), engine and engine.kv_gib, groups.get("max_model_len")
    return (gib * 2 ** 30 / size, int(length)) if size and gib and length else None


def _engine_share(ref: tuple[float, int] | None, base: tuple[float, int] | None,
                  skip: tuple[float, int] | None) -> tuple[float | None, int | None]:
    if ref is None or base is None or skip is None or len({ref[1], base[1], skip[1]}) != 1 or ref[0] <= base[0]:
        return None, None
    return (skip[0] - base[0]) / (ref[0] - base[0]), ref[1]


def _paired_at(arm: ArmMetrics, base: ArmMetrics, tokens: Sequence[int], buckets: Sequence[int],
               length: int) -> tuple[float | None, float | None, str]:
    """(log ppl ratio arm / base, 2 standard errors, which samples) on the decisive numbers, paired by sample over
    bucket `length`'s samples, or every sample where that bucket has fewer than two."""
    a, b = decisive(arm).sample_nll, decisive(base).sample_nll
    if len(a) != len(tokens) or len(b) != len(tokens):         # not measured per sample alike: no estimate
        return None, None, "every sample"
    idx = [i for i, t in enumerate(tokens) if t + 1 <= length and bucket_of(t + 1, buckets) == length]
    over = f"the {len(idx)} samples of bucket <= {length}"
    if len(idx) < 2:
        idx, over = list(range(len(tokens))), "every sample"
    pair = paired([a[i] for i in idx], [b[i] for i in idx], [tokens[i] for i in idx])
    return (pair[0], 2 * pair[1], over) if pair else (None, None, over)


def candidates(m: Model, results: Mapping[str, ArmMetrics], ref_engine: EngineNumbers | None = None,
               sample_tokens: Sequence[int] = ()) -> list[Candidate]:
    """Every measured skip arm against the arm it was cut from, at the longest length both measured with the same
    numbers (engine or emulation), best quality regained per memory given back first. The share given back is the
    bytes model's (what the layers hold at that length); where the engine reported its capacity for the reference,
    the base arm and the skip arm, its own share is stated too: vLLM reserves for a sliding-window layer its window
    plus the tokens in flight (up to max_num_batched_tokens), not the window alone, so its share can be far larger.
    A skip whose perplexity against its base arm is within the paired noise (2 standard errors, paired by sample over
    the samples of that length's bucket, or over every sample where the bucket has fewer than two) does not count as
    helping, and is ranked after those that do. `sample_tokens`: the reference's scored tokens per sample (its
    length - 1), which also give each sample's bucket."""
    out = []
    for name, e in results.items():
        base_name = name.rsplit(" skip ", 1)[0]
        base = results.get(base_name)
        if not e.info.skip or e.info.dtype is None or base is None:
            continue
        for L in sorted(m.lengths, reverse=True):
            a, b = _loss(e, L), _loss(base, L)
            if a is None or b is None or a[1] != b[1]:
                continue
            kept = m.bytes(base.info, L)
            saving = m.bytes(None, L) - kept
            back = (m.bytes(e.info, L) - kept) / saving if saving > 0 else 0.0
            kind, skip = e.info.skip_kind, e.info.skip
            label = f"skip {kind.replace('_', '-')} layers" if kind else \
                f"skip layer{'s' if len(skip) > 1 else ''} {', '.join(map(str, skip))}"
            flag = f"{SKIP_FLAG} {kind or ' '.join(map(str, skip))}"
            eng = _engine_share(_engine_bytes(ref_engine), _engine_bytes(base.engine), _engine_bytes(e.engine))
            change, noise, over = _paired_at(e, base, sample_tokens, m.lengths, L)
            out.append(Candidate(name, base_name, label, L, b[0], a[0], back, a[1], flag, *eng, change, noise, over))
            break
    return sorted(out, key=lambda c: (not c.helps, -c.per_memory))


def engine_check(m: Model, info: ArmInfo | None, groups: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's capacity next to the bytes model's, in the engine's own definition (vLLM: requests of
    max_model_len the pool holds x max_model_len, each group of layers reserving what its kind needs:
    calib.model.layer_kinds.engine_capacity_tokens), plus every layer whose kind or bytes per token the engine sees
    differently, and a grouping other than vLLM's rule as the bytes model applies it. `engine` is None where the
    engine did not say its capacity; no prediction where it did not say its tokens in flight."""
    st = m.storage(info)
    kinds, block, bytes_per_token, problems = m.layers.kinds, {}, {}, []
    for g in groups["groups"]:
        for i in g["layers"]:
            block[i] = g["block_size"]
            bytes_per_token[i] = g["page_bytes"] // g["block_size"]
            seen = lk.ENGINE_SPEC_KINDS.get(g["spec"], g["spec"])
            if i < len(kinds) and seen != kinds[i].kind:
                problems.append(f"layer {i}: kvcalib reads {kinds[i].kind}, the engine groups it as {g['spec']}")
    for i, k in enumerate(kinds):
        if k.kind == lk.SHARED:
            continue
        mine = lk.token_bytes(m.kv_heads, m.head_dim, st[i])
        if i not in block:
            problems.append(f"layer {i}: not in any engine KV cache group")
        elif bytes_per_token[i] != mine:
            problems.append(f"layer {i}: {bytes_per_token[i]} bytes per token in the engine, {mine} in the bytes model")
    if not problems:
        lay = lk.engine_layout(m.layers, m.kv_heads, m.head_dim, st, block)
        size = max(len(g["layers"]) for g in groups["groups"])
        if (len(groups["groups"]), size) != (len(lay.groups), lay.group_size):
            problems.append(f"the engine makes {len(groups['groups'])} KV cache groups of up to {size} layers, "
                            f"vLLM's grouping rule on kvcalib's layer kinds {len(lay.groups)} of {lay.group_size}")
    if groups["in_flight_tokens"] is None:
        problems.append("the engine did not say the tokens in flight a sliding or chunked layer reserves")
    if problems:
        return {"engine": groups["size_tokens"], "bytes_model": None, "problems": problems}
    pool = groups["num_blocks"] * max(sum(g["page_bytes"] for _ in g["layers"]) for g in groups["groups"])
    predicted = lk.engine_capacity_tokens(m.layers, m.kv_heads, m.head_dim, st, pool, groups["max_model_len"],
                                          groups["in_flight_tokens"], block)
    return {"engine": groups["size_tokens"], "bytes_model": predicted, "max_model_len": groups["max_model_len"],
            "problems": []}
