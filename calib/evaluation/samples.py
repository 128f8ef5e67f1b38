"""Held-out samples: which records an evaluation scores, cut to which length bucket.

Why its own module: `kvcalib eval` and `kvcalib tune` must score the same held-out text the same way, and
the rule that keeps calibration text out (a record whose first tokens appear in the calibration stream is
left out) is only trustworthy in one place.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from calib.data import sources as data_mod
from calib.evaluation.arms import EvalError
from calib.evaluation.config import EvalConfig
from calib.evaluation.results import bucket_of
from calib.model import load as model_mod
from calib.safety.files import expand_user

OVERLAP_WINDOW = 16        # tokens compared to recognise a calibration sample among the eval samples


@dataclass(frozen=True)
class Sample:
    index: int
    ids: tuple[int, ...]
    bucket: int          # the smallest bucket (token length) >= len(ids)


def usable_buckets(requested: Iterable[int], max_positions: int | None) -> tuple[tuple[int, ...], list[int]]:
    """(buckets within the model's context, dropped ones); the context itself when none fits."""
    req = sorted(set(int(b) for b in requested))
    if any(b < 2 for b in req):
        raise EvalError(f"buckets {req}: every bucket must be at least 2 tokens")
    kept = [b for b in req if not max_positions or b <= max_positions]
    return tuple(kept or [int(max_positions)]), [b for b in req if b not in kept]


def sample_length(bucket: int, context: int | None) -> int:
    """Tokens one sample of `bucket` holds: the bucket, or context - 1 for a bucket at the model's context. An
    engine generates at least one token after a prompt (vLLM refuses a prompt as long as max_model_len), and
    the emulation scores the same token ids, so both see the same sample."""
    return bucket if not context or bucket < context else context - 1


def _same_source(a: str, b: str) -> bool:
    pa, pb = expand_user(a), expand_user(b)
    return pa.resolve() == pb.resolve() if pa.exists() and pb.exists() else a == b


def calibration_windows(provenances: Sequence[tuple[str, dict | None]], data_src: str, tokenizer: Any,
                        vocab: int | None) -> tuple[set[int] | None, dict[str, Any]]:
    """Hashes of every OVERLAP_WINDOW-token window of the calibration samples of the first kvcalib output
    that calibrated on `data_src` (its recipe replays the same deterministic stream), and what was found."""
    for where, prov in provenances:
        src, recipe = (prov or {}).get("data", {}).get("source"), (prov or {}).get("recipe")
        if not src or not recipe or not _same_source(str(src), data_src):
            continue
        rep = data_mod.DataReport()
        seqs = list(data_mod.samples(src, tokenizer, seq_len=recipe["seq_len"], max_samples=recipe["samples"],
                                     min_tokens=recipe["min_tokens"], pack=recipe["pack"], seed=recipe["seed"],
                                     vocab_size=vocab, report=rep))
        flat = [t for s in seqs for t in s]
        windows = {hash(tuple(flat[i:i + OVERLAP_WINDOW])) for i in range(len(flat) - OVERLAP_WINDOW + 1)}
        exact = f"sha256:{rep.fingerprint}" == prov["data"].get("fingerprint")
        return windows, {"checked_against": where, "calibration_samples": len(seqs), "reproduced_exactly": exact}
    return None, {"checked_against": None, "note": "no kvcalib output calibrated on this DATA was given: eval "
                  "samples are not checked against calibration samples"}


def select_samples(cfg: EvalConfig, tokenizer: Any, vocab: int | None, buckets: Sequence[int],
                   windows: set[int] | None, context: int | None = None) -> tuple[list[Sample], data_mod.DataReport, int]:
    """Held-out samples (records whose first tokens appear in the calibration stream are left out), cut to the
    largest bucket or, with `pack`, concatenated into samples cycling through every bucket's length (a bucket
    at the model's `context` holds context - 1 tokens: `sample_length`)."""
    read = data_mod.DataReport()
    longest = sample_length(max(buckets), context)
    stream = data_mod.samples(cfg.data, tokenizer, seq_len=2 ** 31 if cfg.pack else longest, max_samples=2 ** 31,
                              min_tokens=cfg.min_tokens, pack=False, seed=cfg.seed, vocab_size=vocab, report=read)
    excluded = 0

    def held_out() -> Iterator[list[int]]:
        nonlocal excluded
        for ids in stream:
            if windows and len(ids) >= OVERLAP_WINDOW and hash(tuple(ids[:OVERLAP_WINDOW])) in windows:
                excluded += 1
                continue
            yield ids

    seqs: Iterator[list[int]] = held_out()
    if cfg.pack:
        seqs = _pack(seqs, [sample_length(b, context) for b in buckets])
    used, out = data_mod.DataReport(), []
    with model_mod.quiet_transformers():      # packing tokenizes whole records, beyond the model's length on purpose
        for ids in itertools.islice(seqs, cfg.samples):
            used.add(ids)
            out.append(Sample(len(out), tuple(ids), bucket_of(len(ids), buckets)))
    used.column, used.skipped_short = read.column, read.skipped_short
    if not out:
        raise EvalError(f"DATA {cfg.data}: no held-out samples left ({excluded} were calibration samples)")
    check_emulated(cfg, out, buckets)
    return out, used, excluded


def check_emulated(cfg: EvalConfig, samples: Sequence[Sample], buckets: Sequence[int]) -> None:
    """Refuse, before any measuring pass, a window of emulated buckets that holds no sample: every emulated number
    (the reference's included) would be a mean over nothing."""
    from calib.evaluation import plan

    limit = plan.emulation_limit(cfg.emulate_up_to, buckets, cfg.engine is not None)
    if limit is None or any(x.bucket <= limit for x in samples):
        return
    held = sorted({x.bucket for x in samples})
    why = f"--emulate-up-to {cfg.emulate_up_to}" if cfg.emulate_up_to is not None else \
        f"with an engine the emulation covers buckets up to {plan.SHORT_WINDOW} tokens by default, so"
    raise EvalError(f"{why}: no held-out sample lies in a bucket of at most {limit} tokens (they lie in buckets "
                    f"{', '.join(map(str, held))}); give --emulate-up-to {held[0]} or more, or shorter held-out data")


def pack_warning(cfg: EvalConfig, samples: Sequence[Sample], buckets: Sequence[int]) -> str | None:
    """`sources.pack_hint` for unpacked held-out samples against the largest bucket they could fill, with the share
    of padding positions when they are batched as a measuring pass does (sorted by length, `batch_size` at a time,
    each batch as wide as its longest)."""
    if cfg.pack:
        return None
    order, size = sorted(len(x.ids) for x in samples), cfg.batch_size
    computed = sum(len(g) * g[-1] for g in (order[i:i + size] for i in range(0, len(order), size)))
    return data_mod.pack_hint(len(order), sum(order), max(buckets), "the largest bucket",
                              1.0 - sum(order) / computed if computed else 0.0)


def _pack(seqs: Iterable[list[int]], lengths: Sequence[int]) -> Iterator[list[int]]:
    buf: list[int] = []
    cycle = itertools.cycle(sorted(lengths))
    want = next(cycle)
    for s in seqs:
        buf.extend(s)
        while len(buf) >= want:
            yield buf[:want]
            buf, want = buf[want:], next(cycle)
