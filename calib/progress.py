"""Progress lines for long evaluations: what is done, how fast, and how long is left.

Why: an evaluation of three arms with passkey at 8K tokens on a small CPU runs for tens of minutes, in the
emulation and again in the engine. Without a line of output the user cannot tell a slow run from a hung
one, nor decide whether to wait. Every stage of the evaluation counts its work in tokens (the quantity
its cost follows) and in the units a user recognises — arms, samples and their length bucket, passkey
prompts — and this module turns those counts into one throttled line:

    eval emulation: arm 2/4 · samples 24/64 (bucket <= 2048) · 1,234 tok/s · 1m05s left

Lines, not a redrawn bar: the output stays readable in logs and CI, and the throttle (`every` seconds)
keeps it short. A stage always prints its first and its last line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Write = Callable[[str], Any]


def duration(seconds: float) -> str:
    """A short human duration: 42s, 3m05s, 1h02m."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Stage:
    """One stage of work: `total` tokens, and named counters shown as done/total (e.g. samples 24/64).
    `advance` adds tokens and updates counters; a line is written at most every `every` seconds."""

    def __init__(self, owner: "Progress", name: str, total_tokens: int, counters: dict[str, int]) -> None:
        self.owner, self.name, self.total, self.tokens = owner, name, max(0, int(total_tokens)), 0
        self.counters = {k: [0, int(v)] for k, v in counters.items()}
        self.labels: dict[str, str] = {}
        self.start = owner.clock()
        self.last: float | None = None
        self.first: tuple[float, int] | None = None      # (time, tokens) of the first report with tokens
        self.finished = False

    def rate(self) -> float | None:
        """Tokens/s since the first tokens arrived (an engine's start-up is not work on tokens); until a
        second report, since the stage began."""
        if self.first is not None and self.tokens > self.first[1]:
            elapsed, done = self.owner.clock() - self.first[0], self.tokens - self.first[1]
        else:
            elapsed, done = self.owner.clock() - self.start, self.tokens
        return done / elapsed if elapsed > 0 and done > 0 else None

    def line(self) -> str:
        parts = [f"{k} {d}/{t}" for k, (d, t) in self.counters.items()] + list(self.labels.values())
        r = self.rate()
        if r is not None:
            parts.append(f"{r:,.0f} tok/s")
        if self.finished:
            parts.append(f"done in {duration(self.owner.clock() - self.start)}")
        elif r is not None:
            parts.append(f"{duration(max(0.0, self.total - self.tokens) / r)} left")
        return f"eval {self.name}: " + (" · ".join(parts) or "starting")

    def advance(self, tokens: int = 0, labels: dict[str, str] | None = None, **counters: int) -> None:
        """Add `tokens` of work; `counters` set done counts (absolute), `labels` replace free-text parts."""
        self.tokens += int(tokens)
        if self.first is None and self.tokens > 0:
            self.first = (self.owner.clock(), self.tokens)
        for k, v in counters.items():
            self.counters.setdefault(k, [0, 0])[0] = int(v)
        if labels is not None:
            self.labels = dict(labels)
        now = self.owner.clock()
        if self.last is None or now - self.last >= self.owner.every:
            self.emit(now)

    def emit(self, now: float | None = None) -> None:
        self.last = self.owner.clock() if now is None else now
        self.owner.write(self.line())

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.emit()

    def __enter__(self) -> "Stage":
        self.emit()
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if exc_type is None:
            self.finish()


class Progress:
    """Makes stages. `write` None (the `--no-progress` case) makes every stage silent."""

    def __init__(self, write: Write | None, every: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.write = write or (lambda _line: None)
        self.every, self.clock = every, clock

    def stage(self, name: str, total_tokens: int, **counters: int) -> Stage:
        return Stage(self, name, total_tokens, counters)


SILENT = Progress(None)
