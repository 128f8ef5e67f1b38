"""Passkey retrieval under one arm: generation with the cache stored as the arm would store it.

Why separate from `measure`: retrieval generates (no per-token metrics, no padding mask) and is scored by
`calib/evaluation/passkey.py`; only the hook's arm is set, for the whole generation. The engine's answers are
scored here too (`score_engine`), by the same rule: the engine returns the generated ids only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from calib.engine.metrics import EngineNumbers
from calib.evaluation import passkey
from calib.evaluation.arms import Arm
from calib.evaluation.results import PasskeyRow, passkey_rows
from calib.evaluation.session import Session, clock
from calib.progress import Progress, Stage


def run_passkey(s: Session, arm: Arm | None, prompts: Sequence[passkey.Prompt],
                stage: Stage | None = None) -> tuple[dict[str, PasskeyRow], float]:
    """Passkey accuracy per bucket under `arm` (None: the reference) and the seconds it took, the prompts decoded
    in batches of the session's batch size (`passkey.run`); `stage` is advanced after every prompt."""
    t0 = clock(s.device)
    on_done = None if stage is None else (lambda p: stage.advance(len(p.ids) + passkey.MAX_NEW_TOKENS,
                                                                 prompts=stage.counters["prompts"][0] + 1))
    with s.hook.applying(arm.to(s.device) if arm else None):
        outcomes = passkey.run(s.lm, s.tokenizer, prompts, on_done=on_done, batch_size=s.batch_size,
                               pad_id=s.pad_id)
    return passkey_rows(passkey.summarize(outcomes)), clock(s.device) - t0


def passkey_stage(progress: Progress, name: str, prompts: Sequence[passkey.Prompt], arms: int) -> Stage:
    """A stage of every passkey prompt under `arms` arms (prompt tokens plus the generated ones)."""
    per_arm = sum(len(p.ids) + passkey.MAX_NEW_TOKENS for p in prompts)
    return progress.stage(name, arms * per_arm, prompts=arms * len(prompts))


def score_engine(entries: Mapping[str, EngineNumbers], prompts: Sequence[passkey.Prompt],
                 tokenizer: Any) -> dict[str, EngineNumbers]:
    """Each engine entry with its passkey rows: the ids it generated per prompt, decoded and scored as the
    emulation's answers are; entries without answers (not run, no prompts) as they are."""
    def rows(answers: Sequence[Sequence[int]]) -> dict[str, PasskeyRow]:
        return passkey_rows(passkey.summarize([passkey.score(p, tokenizer.decode(ids, skip_special_tokens=True))
                                               for p, ids in zip(prompts, answers)]))
    return {n: replace(g, passkey=rows(g.passkey_ids)) if g.ok and prompts else g for n, g in entries.items()}
