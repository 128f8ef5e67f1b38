"""Passkey retrieval: can the model still find one fact deep in a long context when its KV cache is FP8?

Why it is in the evaluation: next-token KL averages over every position, most of which need only the last few
tokens; retrieval needs one key stored thousands of positions earlier to survive quantisation of its K and V,
so it catches long-context damage that the averages dilute.

The generator is ours (no dataset needed): filler sentences repeated to a target token length, one line
"The pass key is NNNNN. Remember it." at a chosen depth of the filler (0 = first line, 1 = last line), then
a question. The answer is scored by exact match of the first number in at most `MAX_NEW_TOKENS` greedily
generated tokens. Meaningful on trained models; on random test models only the mechanics are checked.

Retrieval runs apart from `measure` (`run_passkey`): it generates (no per-token metrics, no padding mask) under
one arm set for the whole generation. The engine's answers are scored here too (`score_engine`), by the same rule:
the engine returns the generated ids only.
"""

from __future__ import annotations

import inspect
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from calib.engine.metrics import EngineNumbers
from calib.evaluation.arms import Arm
from calib.evaluation.plan import batch_indices
from calib.evaluation.results import PasskeyRow, passkey_rows
from calib.evaluation.session import Session, clock
from calib.progress import Progress, Stage

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_NEW_TOKENS = 8
INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it.\n"
QUESTION = "What is the pass key? The pass key is"
_NUMBER = re.compile(r"\d+")


@dataclass(frozen=True)
class Prompt:
    """One retrieval prompt: token ids (special tokens included), the key, where the needle sits."""
    ids: tuple[int, ...]
    key: str
    depth: float
    bucket: int
    needle_token: int     # index of the first token of the needle line (approximate at token merges)
    filler_lines: int     # filler sentences in the prompt (needle inserted after round(depth * lines))


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text)["input_ids"])


def _text(key: str, lines: int, depth: float) -> tuple[str, str]:
    """(full prompt, the part before the needle)."""
    before = INTRO + FILLER * round(depth * lines)
    return before + NEEDLE.format(key=key) + FILLER * (lines - round(depth * lines)) + QUESTION, before


def build(tokenizer: Any, target_tokens: int, depth: float, key: str, bucket: int) -> Prompt | None:
    """The longest prompt of at most `target_tokens` tokens with the key at `depth`; None when even one
    filler line does not fit."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} must lie in [0, 1]")
    base = _count(tokenizer, _text(key, 0, depth)[0])
    per_line = max(1.0, (_count(tokenizer, FILLER * 16) - _count(tokenizer, "")) / 16)
    lines = max(0, int((target_tokens - base) / per_line))
    while lines > 0 and _count(tokenizer, _text(key, lines, depth)[0]) > target_tokens:
        lines -= 1
    while _count(tokenizer, _text(key, lines + 1, depth)[0]) <= target_tokens:
        lines += 1
    if lines == 0:
        return None
    full, before = _text(key, lines, depth)
    ids = tuple(tokenizer(full)["input_ids"])
    return Prompt(ids, key, depth, bucket, needle_token=_count(tokenizer, before), filler_lines=lines)


def prompts(tokenizer: Any, buckets: Sequence[int], trials: int, seed: int,
            depths: Sequence[float] = DEPTHS) -> tuple[list[Prompt], list[str]]:
    """`trials` prompts per depth for every bucket, each sized so prompt + answer lands in that bucket
    (longer than the previous bucket, at most the bucket minus MAX_NEW_TOKENS). Returns (prompts, notes
    about buckets too small for a prompt)."""
    rng = random.Random(seed)
    out: list[Prompt] = []
    notes: list[str] = []
    lower = 0
    for bucket in sorted(buckets):
        target = bucket - MAX_NEW_TOKENS
        made = [build(tokenizer, target, d, str(rng.randint(10000, 99999)), bucket)
                for d in depths for _ in range(trials)] if target > lower else [None]
        if any(p is None or len(p.ids) <= lower for p in made):
            notes.append(f"passkey: bucket {bucket} is too small for a prompt longer than {lower} tokens; skipped")
        else:
            out.extend(p for p in made if p is not None)
        lower = bucket
    return out, notes


def answer(text: str) -> str | None:
    """The first number in a generated answer (None if there is none)."""
    m = _NUMBER.search(text)
    return m.group(0) if m else None


def correct(text: str, key: str) -> bool:
    """Exact match: the first number generated is the key, all of it and nothing more."""
    return answer(text) == key


def greedy(model: torch.nn.Module, ids: Sequence[int], max_new_tokens: int = MAX_NEW_TOKENS,
           eos_id: int | None = None) -> list[int]:
    """Greedy continuation of one prompt with the model's KV cache (whatever attention hook is installed
    sees the whole cached K/V at every step, so fake quantisation covers the prompt too)."""
    return greedy_batch(model, [ids], max_new_tokens, eos_id)[0]


@torch.inference_mode()
def greedy_batch(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int = MAX_NEW_TOKENS,
                 eos_id: int | None = None, pad_id: int = 0) -> list[list[int]]:
    """Greedy continuations of several prompts decoded together, each as if alone: unequal prompts are left-padded
    (pads masked out, positions counted from each prompt's first real token), so every prompt ends at the same
    cache index and a sliding window covers the same real tokens as for the prompt alone. Why batched: a small
    model's decode step costs its kernel launches plus the emulation hook's; one step per batch divides that by
    the batch size. A row stops at `eos_id` (kept)."""
    device = next(model.parameters()).device
    # transformers renamed `past_key_values` to `cache` (5.2x): pass whichever the model takes
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    padded = min(lengths) < width
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if padded and getattr(cfg, "attention_chunk_size", None):
        # chunked-local attention (Llama 4) cuts chunks by cache index: left padding would move every boundary
        return [greedy_batch(model, [p], max_new_tokens, eos_id, pad_id)[0] for p in prompts]
    x = torch.tensor([[pad_id] * (width - n) + list(p) for p, n in zip(prompts, lengths)], device=device)
    extra: dict[str, torch.Tensor] = {}
    mask = None
    if padded:
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths], device=device)
        extra = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        first_new = torch.tensor(lengths, device=device)[:, None]     # each row's first generated position
    out = model(input_ids=x, use_cache=True, logits_to_keep=1, **extra)
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in range(max_new_tokens):
        toks = out.logits[:, -1].argmax(-1).tolist()
        for i, tok in enumerate(toks):
            if not done[i]:
                new[i].append(tok)
                done[i] = tok == eos_id
        if all(done) or step == max_new_tokens - 1:
            break
        cache = out.get("cache", None)
        cache = out.get("past_key_values", None) if cache is None else cache
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
            extra = {"attention_mask": mask, "position_ids": first_new + step}
        out = model(input_ids=torch.tensor([[t] for t in toks], device=device), use_cache=True, logits_to_keep=1,
                    **{kw: cache}, **extra)
    return new


@dataclass(frozen=True)
class Outcome:
    bucket: int
    depth: float
    key: str
    generated: str
    correct: bool


def run(model: torch.nn.Module, tokenizer: Any, items: Sequence[Prompt],
        on_done: Callable[[Prompt], Any] | None = None, batch_size: int = 1, pad_id: int = 0) -> list[Outcome]:
    """Outcomes of every prompt, in order, under the K/V treatment installed now, up to `batch_size` prompts of
    one bucket at a time (`greedy_batch`); `on_done` is called after each prompt (progress)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    out = []
    # the batches `calib.evaluation.plan.batch_indices` makes (one bucket each, at most `batch_size` prompts and
    # PASSKEY_BATCH_TOKENS tokens): the plan costs the same batches the run decodes
    for batch in batch_indices([(len(p.ids), p.bucket) for p in items], max(1, batch_size)):
        group = [items[i] for i in batch]
        for p, new in zip(group, greedy_batch(model, [p.ids for p in group], eos_id=eos, pad_id=pad_id)):
            out.append(score(p, tokenizer.decode(new, skip_special_tokens=True)))
            if on_done is not None:
                on_done(p)
    return out


def score(p: Prompt, generated: str) -> Outcome:
    """The outcome of one prompt given the text generated after it (by the emulation or by an engine)."""
    return Outcome(p.bucket, p.depth, p.key, generated, correct(generated, p.key))


def summarize(outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    """Per bucket: correct / total / accuracy, the same per depth, and each prompt's outcome in prompt order
    (`outcomes`: every arm answers the same prompts, so outcomes pair for calib/evaluation/significance.py)."""
    table: dict[str, dict[str, Any]] = {}
    for o in outcomes:
        b = table.setdefault(str(o.bucket), {"correct": 0, "total": 0, "by_depth": {}, "outcomes": []})
        b["outcomes"].append({"depth": o.depth, "correct": o.correct})
        d = b["by_depth"].setdefault(f"{o.depth:g}", {"correct": 0, "total": 0})
        for t in (b, d):
            t["correct"] += int(o.correct)
            t["total"] += 1
    for b in table.values():
        b["accuracy"] = b["correct"] / b["total"]
    return table


def run_passkey(s: Session, arm: Arm | None, prompts: Sequence[Prompt],
                stage: Stage | None = None) -> tuple[dict[str, PasskeyRow], float]:
    """Passkey accuracy per bucket under `arm` (None: the reference) and the seconds it took, the prompts decoded
    in batches of the session's batch size (`run`); `stage` is advanced after every prompt."""
    t0 = clock(s.device)
    on_done = None if stage is None else (lambda p: stage.advance(len(p.ids) + MAX_NEW_TOKENS,
                                                                 prompts=stage.counters["prompts"][0] + 1))
    with s.hook.applying(arm.to(s.device) if arm else None):
        outcomes = run(s.lm, s.tokenizer, prompts, on_done=on_done, batch_size=s.batch_size, pad_id=s.pad_id)
    return passkey_rows(summarize(outcomes)), clock(s.device) - t0


def passkey_stage(progress: Progress, name: str, prompts: Sequence[Prompt], arms: int) -> Stage:
    """A stage of every passkey prompt under `arms` arms (prompt tokens plus the generated ones)."""
    return progress.stage(name, arms * sum(len(p.ids) + MAX_NEW_TOKENS for p in prompts), prompts=arms * len(prompts))


def score_engine(entries: Mapping[str, EngineNumbers], prompts: Sequence[Prompt],
                 tokenizer: Any) -> dict[str, EngineNumbers]:
    """Each engine entry with its passkey rows: the ids it generated per prompt, decoded and scored as the
    emulation's answers are; entries without answers (not run, no prompts) as they are."""
    def rows(answers: Sequence[Sequence[int]]) -> dict[str, PasskeyRow]:
        return passkey_rows(summarize([score(p, tokenizer.decode(ids, skip_special_tokens=True))
                                       for p, ids in zip(prompts, answers)]))
    return {n: replace(g, passkey=rows(g.passkey_ids)) if g.ok and prompts else g for n, g in entries.items()}
