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
MAX_LEVEL = 1 << 20        # requests in flight or per level: beyond any server's max_num_seqs
MAX_MS = 3.6e6             # an SLO bound of an hour


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
        """One line per bad field, naming its option and what to give (calib.safety.options, the one checker)."""
        from calib.safety import options

        checks = [lambda: options.whole("--output-tokens", self.output_tokens, 2),   # TPOT excludes the first token
                  lambda: options.whole("--max-concurrency", self.max_concurrency, 1, MAX_LEVEL),
                  lambda: options.whole("--requests-per-level", self.requests_per_level, 1, MAX_LEVEL),
                  *(lambda c=c: options.whole("--concurrency", c, 1, MAX_LEVEL) for c in self.concurrency),
                  lambda: options.number("--slo-ttft-ms", self.slo_ttft_ms, 0, MAX_MS, above=True),
                  lambda: options.number("--slo-tpot-ms", self.slo_tpot_ms, 0, MAX_MS, above=True),
                  lambda: options.number("--speed-noise", self.noise, 0, 1),
                  lambda: options.number("--saturation", self.saturation, 0, 1, above=True),
                  lambda: options.number("--sweep-minutes", None if self.budget_s is None else self.budget_s / 60, 0,
                                         options.MAX_MINUTES, above=True)]
        out = []
        for check in checks:
            try:
                check()
            except options.OptionError as e:
                out.append(str(e))
        if len(set(self.concurrency)) != len(self.concurrency):
            out.append(f"--concurrency {','.join(map(str, self.concurrency))}: a level is given twice")
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
