"""What every measuring pass of one evaluation shares: the model, the installed hook, the head, the samples.

Why a value: `kvcalib eval` and `kvcalib tune` open one session inside `fake_quant_kv(lm)` and run many
passes over it (arms, skip trials, per-layer sensitivity on a subset via `dataclasses.replace`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from calib.evaluation.fakequant import FakeQuantKV
from calib.evaluation.head import Head
from calib.evaluation.samples import Sample


@dataclass(frozen=True)
class Session:
    """Everything a measuring pass needs; the hook stays installed for the whole evaluation."""
    lm: torch.nn.Module
    hook: FakeQuantKV
    head: Head
    tokenizer: Any
    samples: tuple[Sample, ...]
    buckets: tuple[int, ...]
    batch_size: int = 4
    pad_id: int = 0
    failures: int = 3

    @property
    def device(self) -> torch.device:
        return next(self.lm.parameters()).device


def open_session(lm: torch.nn.Module, hook: FakeQuantKV, tokenizer: Any, samples: Sequence[Sample],
                 buckets: Sequence[int], batch_size: int = 4, failures: int = 3) -> tuple[Session, str | None]:
    """A measuring session inside `fake_quant_kv(lm)` (the LM head checked once against the model's own
    logits) and the note when it had to fall back to full logits."""
    head = Head(lm)
    note = head.verify(samples[0].ids)
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    return Session(lm, hook, head, tokenizer, tuple(samples), tuple(buckets), batch_size, pad, failures), note


def clock(device: torch.device) -> float:
    """Seconds, after the device's queued work is done (so a pass's time is its own)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
