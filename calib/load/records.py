"""One load level's numbers, from the per-request records `vllm bench serve --save-detailed` writes.

Why recompute what the load generator already prints: its file is untrusted input (another process, another
version: vLLM 0.24 and 0.32 write different keys), so every field is typed and bounded here before a number
reaches a metric, and goodput is counted from the records themselves — a request is good when it succeeded,
generated every token asked, and met both SLO bounds — so it does not depend on how a version configured its
own `--goodput`. The generator's own goodput, where it wrote one, is kept beside ours as a cross-check.

Definitions (vLLM bench serve's): TTFT = first token - request sent (server queueing and prefill included; a
request waiting for a free slot at the client is not yet sent); TPOT per request = (latency - TTFT) / (output
tokens - 1), 0 for a one-token answer; ITL = every gap between two streamed chunks; E2E = latency; throughput
over the level's duration (first request sent to last answer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from calib.errors import KvcalibError
from calib.safety.readers import clean_text, items, number, raising, whole

MAX_TEXT = 300
MAX_SECONDS = 7 * 24 * 3600.0
PERCENTILES = (50, 90, 99)


class RecordsError(KvcalibError, ValueError):
    """A load generator's result that does not fit the level asked; the message names the field."""


@dataclass(frozen=True)
class Request:
    prompt_tokens: int
    output_tokens: int
    ttft: float | None
    itl: tuple[float, ...]
    latency: float | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.latency is not None

    @property
    def tpot(self) -> float | None:
        if not self.ok:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def met(self, r: Request, asked: int) -> bool:
        return r.ok and r.output_tokens >= asked and r.ttft <= self.ttft_s and r.tpot <= self.tpot_s


def _seconds(v: Any, where: str) -> float:
    return number(v, where, 0, MAX_SECONDS)


def _list(doc: Mapping[str, Any], key: str, n: int, required: bool = True) -> list[Any] | None:
    return None if doc.get(key) is None and not required else items(doc.get(key), f"'{key}'", n)


def parse(doc: Any, asked: int, output_tokens: int, max_prompt: int) -> tuple[list[Request], float, dict[str, Any]]:
    """(requests, duration in seconds, the generator's own summary numbers) from one level's result file: exactly
    `asked` requests, each at most `output_tokens` tokens and `max_prompt` prompt tokens (RecordsError otherwise)."""
    with raising(RecordsError):
        if not isinstance(doc, dict):
            raise RecordsError("expected a JSON object")
        duration = _seconds(doc.get("duration"), "'duration'")
        if duration <= 0:
            raise RecordsError("'duration' = 0: the level ran no request")
        n = len(doc["ttfts"]) if isinstance(doc.get("ttfts"), list) else -1
        if n != asked:
            raise RecordsError(f"'ttfts' holds {n if n >= 0 else 'no list'}; {asked} requests were sent "
                               "(run the load generator with --save-detailed)")
        ttfts, itls, outs, ins = (_list(doc, k, n) for k in ("ttfts", "itls", "output_lens", "input_lens"))
        errors = _list(doc, "errors", n, required=False) or [None] * n
        lat = _list(doc, "latencies", n, required=False)
        reqs = []
        for i in range(n):
            err = None if errors[i] in (None, "") else clean_text(str(errors[i]), MAX_TEXT) or "error"
            o = whole(outs[i], f"'output_lens'[{i}]", 0, output_tokens)
            gaps = tuple(_seconds(g, f"'itls'[{i}]") for g in items(itls[i], f"'itls'[{i}]", hi=output_tokens))
            ttft = None if err or ttfts[i] in (None, 0) else _seconds(ttfts[i], f"'ttfts'[{i}]")
            latency = None if err else (_seconds(lat[i], f"'latencies'[{i}]") if lat is not None
                                        else (None if ttft is None else ttft + sum(gaps)))
            if ttft is not None and latency is not None and latency + 1e-6 < ttft:
                raise RecordsError(f"request {i}: latency {latency:.3g} s is shorter than its TTFT {ttft:.3g} s")
            reqs.append(Request(whole(ins[i], f"'input_lens'[{i}]", 0, max_prompt), o, ttft, gaps, latency, err))
        own = {k: doc.get(k) for k in ("request_goodput", "request_throughput", "output_throughput",
                                       "max_concurrent_requests")
               if isinstance(doc.get(k), (int, float)) and not isinstance(doc.get(k), bool) and math.isfinite(doc[k])}
        return reqs, duration, own


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between order statistics (numpy's default, so a number
    kvcalib prints can be checked against numpy on the same values); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean and p50 / p90 / p99 of `values` (seconds), as vLLM bench serve reports them; None where there is
    nothing to measure."""
    return {"mean": sum(values) / len(values) if values else None,
            **{f"p{q}": percentile(values, q) for q in PERCENTILES}}


def summarize(reqs: Sequence[Request], duration: float, output_tokens: int, slo: SLO) -> dict[str, Any]:
    """One level's throughput, goodput and latency distributions from its checked requests."""
    ok = [r for r in reqs if r.ok]
    good = sum(slo.met(r, output_tokens) for r in reqs)
    errors = sorted({r.error for r in reqs if r.error})
    return {
        "requests": len(reqs), "completed": len(ok), "failed": len(reqs) - len(ok),
        "complete_answers": sum(r.output_tokens >= output_tokens for r in ok), "good": good,
        "duration_s": duration,
        "request_throughput": len(ok) / duration, "goodput": good / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "prompt_tokens": distribution([float(r.prompt_tokens) for r in ok]),
        "ttft_s": distribution([r.ttft for r in ok]),
        "tpot_s": distribution([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_s": distribution([g for r in ok for g in r.itl]),
        "e2e_s": distribution([r.latency for r in ok]),
        "errors": errors[:3],
    }
