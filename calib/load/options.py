"""The load and SLO options, one definition for every command that serves (`validate`, `plan --serve`).

Why one home: options written twice drift (a flag missing on one command, a default that differs); here each is
declared once, with its default from `LoadSpec`, and `spec_from` builds the checked value from what Click parsed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from calib.load.spec import MIN_REQUESTS, LoadSpec

_OPTIONS = (
    click.option("--output-tokens", type=int, default=LoadSpec.output_tokens, show_default=True,
                 help="Tokens each served request generates (end-of-sequence ignored)."),
    click.option("--concurrency", "levels", help="Requests in flight to measure, comma-separated (e.g. 1,8,32). "
                 "Default: double from 1 until the server saturates and past the batch its KV pool holds."),
    click.option("--max-concurrency", type=int, default=LoadSpec.max_concurrency, show_default=True,
                 help="The highest level an automatic sweep tries."),
    click.option("--requests-per-level", type=int, default=LoadSpec.requests_per_level, show_default=True,
                 help=f"Requests sent at a level, as a multiple of the level (at least {MIN_REQUESTS})."),
    click.option("--slo-ttft-ms", type=float, default=LoadSpec.slo_ttft_ms, show_default=True,
                 help="SLO: time to first token (ms). Goodput counts requests meeting both bounds."),
    click.option("--slo-tpot-ms", type=float, default=LoadSpec.slo_tpot_ms, show_default=True,
                 help="SLO: mean time per output token after the first (ms)."),
    click.option("--speed-noise", type=float, default=LoadSpec.noise, show_default=True,
                 help="Smallest relative goodput gain over BF16 read as real (the measured repeat spread is added)."),
    click.option("--sweep-minutes", type=float, help="Bound each serve configuration's sweep per bucket (minutes)."),
    click.option("--prefix-caching/--no-prefix-caching", default=False, show_default=True,
                 help="Serve with vLLM's prefix caching (off: a repeated prompt costs a whole prefill)."),
)


def load_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Add every load option to a Click command (its function takes them as `spec_from`'s parameters)."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def spec_from(output_tokens: int, levels: str | None, max_concurrency: int, requests_per_level: int,
              slo_ttft_ms: float, slo_tpot_ms: float, speed_noise: float, sweep_minutes: float | None,
              prefix_caching: bool) -> LoadSpec:
    """The LoadSpec the options describe, checked (click.ClickException: one line naming the option)."""
    try:
        level_list = tuple(int(c) for c in (levels or "").split(",") if c.strip())
    except ValueError:
        raise click.ClickException(f"--concurrency {levels!r}: give whole numbers like 1,8,32") from None
    spec = LoadSpec(output_tokens, level_list, max_concurrency, requests_per_level, slo_ttft_ms, slo_tpot_ms,
                    speed_noise, budget_s=None if sweep_minutes is None else sweep_minutes * 60,
                    prefix_caching=prefix_caching)
    problems = spec.problems()
    if problems:
        raise click.ClickException(problems[0])
    return spec
