"""The load a user's workload puts on the server, and the SLO it must meet: what `kvcalib validate` sweeps.

Why these defaults: FP8 KV can only raise throughput where the KV pool limits the batch, so a sweep that stops
at light load cannot show its gain (docs/design.md §12: at concurrency 4 nothing was memory-bound). The sweep
doubles the requests in flight from 1 until the engine saturates — throughput stops rising — and past the batch
its KV pool holds at that length; 256 output tokens a request (decode-heavy enough for the cache to matter).
The SLO defaults are an interactive service's: first token within 2 s, then at least 10 tokens/s per user
(TPOT <= 100 ms); the report states them, and goodput counts the requests that meet both.

Shape examples: LoadSpec() sweeps 1, 2, 4, ... up to 256 in flight; LoadSpec(concurrency=(8, 32)) measures
just those two levels; LoadSpec(output_tokens=32, slo_ttft_ms=500) is a short-answer, latency-bound service.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


# Requests a level sends at least: on the GPU, levels of 4 requests of 32K tokens repeated 23 % apart (best-level
# goodput measured twice, a 270M hybrid model); 8 keeps one slow request from being a quarter of the level.
MIN_REQUESTS = 8


@dataclass(frozen=True)
class LoadSpec:
    output_tokens: int = 256             # tokens each request generates (end-of-sequence ignored)
    concurrency: tuple[int, ...] = ()    # levels to measure; () = double from 1 until saturated / past the pool
    max_concurrency: int = 256           # the highest level an automatic sweep tries (vLLM's default max_num_seqs)
    requests_per_level: int = 2          # requests at a level = this x the level (at least MIN_REQUESTS)
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 100.0
    noise: float = 0.03                  # the smallest relative goodput difference a decision reads as real
    saturation: float = 0.05             # a doubling that raises throughput less than this is saturated
    repeat: bool = True                  # measure the best level twice: the run-to-run noise
    budget_s: float | None = None        # seconds of measuring per arm; None: unbounded
    prefix_caching: bool = False         # off: a repeated prompt costs a whole prefill, as a new user's would

    def problems(self) -> list[str]:
        """One line per bad field, naming its option and what to give instead."""
        out = []

        def whole(v, flag, lo, what):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                out.append(f"{flag} {v}: give a whole number >= {lo} ({what})")

        def finite(v, flag, lo, hi, what, zero=False):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or not (lo <= v if zero else lo < v) or v > hi:
                out.append(f"{flag} {v}: give a finite number in {'[' if zero else '('}{lo:g}, {hi:g}] ({what})")
        whole(self.output_tokens, "--output-tokens", 2, "TPOT excludes the first token, so one measures no decoding")
        whole(self.max_concurrency, "--max-concurrency", 1, "the highest number of requests kept in flight")
        whole(self.requests_per_level, "--requests-per-level", 1, "requests per level over the level")
        for c in self.concurrency:
            whole(c, "--concurrency", 1, "requests kept in flight")
        if len(set(self.concurrency)) != len(self.concurrency):
            out.append(f"--concurrency {','.join(map(str, self.concurrency))}: a level is given twice")
        finite(self.slo_ttft_ms, "--slo-ttft-ms", 0, 3.6e6, "the first token's deadline in ms")
        finite(self.slo_tpot_ms, "--slo-tpot-ms", 0, 3.6e6, "the mean time between output tokens in ms")
        finite(self.noise, "--speed-noise", 0, 1, "a relative margin such as 0.03", zero=True)
        finite(self.saturation, "--saturation", 0, 1, "a relative throughput gain such as 0.05")
        if self.budget_s is not None:
            finite(self.budget_s, "--sweep-minutes", 0, 7 * 24 * 3600, "minutes of measuring per arm")
        return out

    def requests(self, level: int) -> int:
        return max(MIN_REQUESTS, self.requests_per_level * level)

    def next_level(self, done: list[tuple[int, float]], fits: int | None, spent_s: float) -> int | None:
        """The next level of an automatic sweep after the levels `done` ([(level, request throughput)] in order),
        or None when the sweep is complete: past twice the batch the pool holds (`fits`) or the cap, saturated
        over two doublings (and past the pool where it is known and within reach), or out of budget (the next
        level predicted to take about twice the last one's time)."""
        if self.concurrency:
            left = [c for c in self.concurrency if c not in {d for d, _ in done}]
            return left[0] if left else None
        if not done:
            return 1
        level = done[-1][0]
        if level >= self.max_concurrency or (fits is not None and level > 2 * fits):
            return None
        gains = [b / a - 1 if a > 0 else math.inf for (_, a), (_, b) in zip(done, done[1:])]
        past_pool = fits is None or level > fits or 2 * fits > self.max_concurrency
        if len(gains) >= 2 and all(g < self.saturation for g in gains[-2:]) and past_pool:
            return None
        if self.budget_s is not None and spent_s * 2 > self.budget_s:
            return None
        return min(2 * level, self.max_concurrency)
