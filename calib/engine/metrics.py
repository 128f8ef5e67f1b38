"""The engine's numbers for one arm, from what its runner returned (calib/engine/protocol.py).

Why a lower bound for KL: an engine returns the top-k log-probabilities of each position (plus the actual
next token's), not the whole distribution. Merging every token whose probability is not known in both
runs into one "rest" outcome can only lower KL (the log-sum inequality), so

    KL_lb = sum_{t in S} p_t log(p_t / q_t) + p_rest log(p_rest / q_rest),
    S = tokens known in both runs (the reference's top-k and the actual token, where the arm reports them too)

is a true lower bound of KL(reference || arm), and `kl_unresolved_mass` (the reference's mean p_rest)
says how much of the distribution it could not resolve: near 0 the bound is tight. Perplexity and top-1
agreement need nothing beyond what the engine returns, so they are exact.

Positions: the engine scores token j of a sample from tokens < j for j = 1..n-1, exactly the positions the
emulation scores (`calib/evaluation/measure.py`), so token counts match one for one.

The numbers are typed once, here, from the runner's checked answer (`EngineNumbers`, built by calib/engine/run.py):
every reader after reads attributes. They stay raw: passkey answers are generated ids, scored by the evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from calib.engine.protocol import NOT_RUN, OK

MIN_P = 1e-30


def exp(x: float) -> float:
    """e**x, +inf past float64's range (a perplexity that overflows is reported, then refused as not finite
    by calib/evaluation/measurable.py, not a traceback)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class BucketRow:
    """One length bucket (or all of them) against the reference, as the emulation (calib/evaluation/measure.py) and
    the engine (`table`) measure it: tokens scored, mean KL, top-1 agreement, perplexity; the engine's rows also
    say the reference's mass its KL bound could not resolve (None in the emulation's, and left out of to_dict)."""
    samples: int
    tokens: int
    kl: float
    kl_unresolved_mass: float | None = field(default=None, kw_only=True)
    top1: float
    ppl: float
    ppl_ref: float
    ppl_delta: float
    ppl_rel: float

    @classmethod
    def of(cls, tokens: float, kl: float, agree: float, nll: float, ref_nll: float, samples: int,
           unresolved: float | None = None) -> "BucketRow":
        """From sums over the bucket's tokens: KL, top-1 agreements, NLL, the reference's NLL (and the unresolved
        mass)."""
        t = max(tokens, 1e-300)
        ppl, ppl_ref = exp(nll / t), exp(ref_nll / t)
        return cls(samples, int(t), kl / t, agree / t, ppl, ppl_ref, ppl - ppl_ref, ppl / ppl_ref - 1,
                   kl_unresolved_mass=None if unresolved is None else unresolved / t)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Summary(BucketRow):
    """Every bucket together and the worst bucket's KL (the threshold applies per bucket); the engine's also the
    greedy continuations against the reference's (`continuation_agreement`)."""
    max_bucket_kl: float = 0.0
    greedy: Mapping[str, Any] | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class EngineNumbers:
    """One arm in the engine: its numbers where it ran (`status` OK), else why not (`reason`). `serve`: the runner
    spec's fields that say how to serve the arm (kvcalib validate); `kv_groups`: the engine's KV cache groups
    (calib.engine.answer.kv_groups); `passkey_ids`: the ids generated per passkey prompt, which the evaluation
    scores into `passkey` (rows per bucket, calib.evaluation.passkey.score_engine)."""
    engine: str
    version: str
    status: str = NOT_RUN
    reason: str | None = None
    kv_cache_dtype: str | None = None
    buckets: Mapping[str, BucketRow] = field(default_factory=dict)
    summary: Summary | None = None
    sample_nll: tuple[float, ...] = ()
    kv_capacity_tokens: int | None = None
    kv_gib: int = 0
    seconds: Mapping[str, float] = field(default_factory=dict)
    serve: Mapping[str, Any] | None = None
    kv_groups: Mapping[str, Any] | None = None
    passkey_ids: tuple[tuple[int, ...], ...] = ()
    passkey: Mapping[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tokens_per_gib(self) -> float | None:
        """The engine's KV pool in tokens per GiB."""
        return self.kv_capacity_tokens / self.kv_gib if self.kv_capacity_tokens and self.kv_gib else None

    def to_dict(self) -> dict[str, Any]:
        """As report.json holds it (`bytes_per_token`: the engine's cache bytes per token, all layers)."""
        out: dict[str, Any] = {"engine": self.engine, "version": self.version, "status": self.status}
        if not self.ok:
            return {**out, "reason": self.reason}
        tpg = self.tokens_per_gib
        out.update(kv_cache_dtype=self.kv_cache_dtype, buckets={b: r.to_dict() for b, r in self.buckets.items()},
                   summary=self.summary.to_dict() if self.summary else None, sample_nll=list(self.sample_nll),
                   kv_capacity_tokens=self.kv_capacity_tokens, kv_gib=self.kv_gib, tokens_per_gib=tpg,
                   bytes_per_token=2 ** 30 / tpg if tpg else None, seconds=self.seconds, serve=self.serve)
        if self.kv_groups:
            out["kv_groups"] = self.kv_groups
        if self.passkey is not None:
            out["passkey"] = {b: r.to_dict() for b, r in self.passkey.items()}
        return out


def position_kl(ref_top: dict[int, float], arm_top: dict[int, float]) -> tuple[float, float]:
    """(KL lower bound, reference mass left unresolved) at one position, from {token: logprob} of each run."""
    known = [t for t in ref_top if t in arm_top]
    p = [math.exp(ref_top[t]) for t in known]
    q = [math.exp(arm_top[t]) for t in known]
    kl = sum(pi * (lp - lq) for pi, lp, lq in zip(p, (ref_top[t] for t in known), (arm_top[t] for t in known)))
    p_rest, q_rest = max(0.0, 1.0 - sum(p)), max(MIN_P, 1.0 - sum(q))
    if p_rest > MIN_P:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(0.0, kl), p_rest


def _known(row: dict[str, Any], j: int, target: int) -> dict[int, float]:
    d = dict(zip(row["top_ids"][j], row["top_logprobs"][j]))
    d[target] = row["target"][j]
    return d


def per_sample(ref: dict[str, Any], arm: dict[str, Any] | None, ids: Sequence[int]) -> dict[str, float]:
    """Sums over one sample's positions: tokens, nll, kl (lower bound), unresolved mass, top-1 agreements.
    `arm` None: the reference against itself."""
    n = len(ids) - 1
    rows = ref, (arm if arm is not None else ref)
    if any(len(r["target"]) != n for r in rows):
        raise ValueError(f"engine returned {[len(r['target']) for r in rows]} positions for a {len(ids)}-token sample")
    out = {"tokens": n, "nll": -sum(rows[1]["target"]), "kl": 0.0, "unresolved": 0.0, "top1": 0}
    for j in range(n):
        target = int(ids[j + 1])
        kl, rest = position_kl(_known(ref, j, target), _known(rows[1], j, target))   # the reference itself: KL 0
        out["kl"] += kl
        out["unresolved"] += rest
        top_r, top_a = ref["top_ids"][j][:1], rows[1]["top_ids"][j][:1]
        out["top1"] += int(top_r == top_a and bool(top_r))
    return out


def continuation_agreement(ref: Sequence[Sequence[int]], arm: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Greedy continuations against the reference's: mean share of tokens before the first difference, and the
    share of samples whose whole continuation is identical."""
    pairs = [(r, a) for r, a in zip(ref, arm) if r]
    if not pairs:
        return {"prefix": None, "identical": None, "samples": 0}
    prefix = []
    for r, a in pairs:
        k = next((i for i, (x, y) in enumerate(zip(r, a)) if x != y), min(len(r), len(a)))
        prefix.append(k / len(r))
    return {"prefix": sum(prefix) / len(pairs), "identical": sum(list(r) == list(a) for r, a in pairs) / len(pairs),
            "samples": len(pairs)}


def table(ref: dict[str, Any], arm: dict[str, Any] | None, samples: Sequence[Sequence[int]],
          buckets: Sequence[int], sample_buckets: Sequence[int]) -> dict[str, Any]:
    """An EngineNumbers' fields for one arm against the engine's reference run: per bucket and overall (the
    emulation's plus `kl_unresolved_mass`), per-sample NLL (for noise estimates) and greedy agreement."""
    keys = ("tokens", "nll", "kl", "unresolved", "top1", "ref_nll", "samples")
    by_b = {b: dict.fromkeys(keys, 0.0) for b in buckets}
    nll_samples = []
    for i, ids in enumerate(samples):
        s = per_sample(ref["samples"][i], None if arm is None else arm["samples"][i], ids)
        s.update(ref_nll=-sum(ref["samples"][i]["target"]), samples=1)
        for k in keys:
            by_b[sample_buckets[i]][k] += s[k]
        nll_samples.append(s["nll"])

    def row(s: dict[str, float]) -> BucketRow:
        return BucketRow.of(s["tokens"], s["kl"], s["top1"], s["nll"], s["ref_nll"], int(s["samples"]), s["unresolved"])
    rows = {str(b): row(by_b[b]) for b in buckets if by_b[b]["tokens"] > 0}
    total = row({k: sum(by_b[b][k] for b in buckets) for k in keys})
    total = Summary(**{**asdict(total), "max_bucket_kl": max(r.kl for r in rows.values()),
                       "greedy": continuation_agreement(ref["continuations"], (arm or ref)["continuations"])})
    return {"buckets": rows, "summary": total, "sample_nll": tuple(nll_samples)}
