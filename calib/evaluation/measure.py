"""One measuring pass: every arm against the reference on every held-out sample.

Why one pass for all arms: per batch the reference runs once, then every arm on the same padded batch,
so the arms are compared on identical inputs; nothing but per-bucket sums (and per-sample NLL/KL for the
noise estimates) is kept, so memory does not grow with the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from calib.capture import hook as observe
from calib.data.batching import pad
from calib.engine.metrics import BucketRow, Summary
from calib.evaluation.arms import Arm
from calib.evaluation.fakequant import Meter
from calib.evaluation.results import ArmMetrics, Failure, KVRange, Position, Reference, Seconds
from calib.evaluation.samples import Sample
from calib.evaluation.session import Session, clock
from calib.progress import Stage

FAILURE_CONTEXT = 24       # tokens of text shown before a failure position


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids)) if tokenizer is not None else " ".join(map(str, ids))


class _Acc:
    """Running sums of one arm: per bucket [tokens, KL, top-1 agreements, NLL], per layer (Meter), the worst samples."""

    def __init__(self, buckets: int, device: torch.device, samples: int = 0) -> None:
        self.sums = torch.zeros(4, buckets, dtype=torch.float64, device=device)
        self.sample_nll = torch.zeros(samples, dtype=torch.float64, device=device)   # per sample (noise estimates)
        self.sample_kl = torch.zeros(samples, dtype=torch.float64, device=device)
        self.meter, self.seconds = Meter(), 0.0
        self.worst: list[Failure] = []

    def track(self, s: Session, group: Sequence[Sample], valid: torch.Tensor, kl: torch.Tensor,
              ref_top: torch.Tensor, arm_top: torch.Tensor) -> None:
        if s.failures <= 0:
            return
        dense = torch.zeros(valid.shape, dtype=kl.dtype, device=kl.device).masked_scatter_(valid, kl)
        counts = valid.sum(1).tolist()
        means = (dense.sum(1) / valid.sum(1).clamp_min(1)).tolist()
        tops = [torch.zeros(valid.shape, dtype=torch.long, device=kl.device).masked_scatter_(valid, t)
                for t in (ref_top, arm_top)]
        for r, sample in enumerate(group):
            floor = self.worst[-1].mean_kl if len(self.worst) >= s.failures else -1.0
            if counts[r] == 0 or means[r] <= floor:
                continue
            worst = dense[r].topk(min(2, counts[r])).indices.tolist()
            ids = sample.ids
            self.worst.append(Failure(sample.index, len(ids), sample.bucket, means[r], tuple(
                Position(p, float(dense[r, p]), _decode(s.tokenizer, ids[max(0, p - FAILURE_CONTEXT):p + 1]),
                         _decode(s.tokenizer, ids[p + 1:p + 2]), _decode(s.tokenizer, [int(tops[0][r, p])]),
                         _decode(s.tokenizer, [int(tops[1][r, p])])) for p in worst)))
            self.worst.sort(key=lambda w: -w.mean_kl)
            del self.worst[s.failures:]


def _bucket_table(s: Session, sums: torch.Tensor, ref_nll: torch.Tensor,
                  measured: Sequence[Sample]) -> tuple[dict[str, BucketRow], Summary]:
    """Per bucket and overall: tokens, KL, top-1 agreement, perplexity and its change against the reference."""
    per = sums.tolist()
    counts = [sum(1 for x in measured if x.bucket == b) for b in s.buckets]
    table = {str(b): BucketRow.of(per[0][j], per[1][j], per[2][j], per[3][j], float(ref_nll[j]), counts[j])
             for j, b in enumerate(s.buckets) if per[0][j] > 0}
    total = BucketRow.of(*(sum(x) for x in per), float(ref_nll.sum()), len(measured))
    return table, Summary(**total.to_dict(), max_bucket_kl=max(r.kl for r in table.values()))


def measure(s: Session, arms: Sequence[Arm], ranges: bool = False, stage: Stage | None = None,
            up_to: int | None = None) -> tuple[Reference, dict[str, ArmMetrics]]:
    """The reference's numbers and {arm name: its numbers} (per bucket, overall, per sample, per layer, worst
    samples, seconds). `stage` advances after every forward pass; `up_to`: only samples of buckets up to this
    many tokens (the rest keep 0 in the per-sample sums)."""
    dev, nb = s.device, len(s.buckets)
    arms = [a.to(dev) for a in arms]
    accs = {a.name: _Acc(nb, dev, len(s.samples)) for a in arms}
    ref_sums = torch.zeros(2, nb, dtype=torch.float64, device=dev)      # tokens, nll
    ref_sample_nll = torch.zeros(len(s.samples), dtype=torch.float64, device=dev)
    recorded: dict[int, tuple[observe.AbsMaxObserver, observe.AbsMaxObserver]] = {}
    ref_seconds = 0.0
    measured = [x for x in s.samples if up_to is None or x.bucket <= up_to]
    order = sorted(measured, key=lambda x: len(x.ids))
    groups = [order[i:i + s.batch_size] for i in range(0, len(order), s.batch_size)]
    done = 0
    for group in groups:
        t0 = clock(dev)
        n_tok, label = sum(len(x.ids) for x in group), {"bucket": f"bucket <= {group[-1].bucket}"}
        ids, mask = pad([list(x.ids) for x in group], s.pad_id)
        ids, mask = ids.to(dev), mask.to(dev)
        valid = (mask[:, 1:] * mask[:, :-1]).bool()
        rows = valid.nonzero()[:, 0]
        where = torch.tensor([s.buckets.index(x.bucket) for x in group], device=dev)[rows]
        which = torch.tensor([x.index for x in group], device=dev)[rows]
        tgt = ids[:, 1:][valid]
        with s.hook.applying(None, token_mask=mask.bool(), ranges=recorded if ranges else None):
            h_ref = s.head.features(ids, mask)[:, :-1][valid]
        ref_nll, ref_top = s.head.losses(h_ref, None, tgt)
        ref_sums.index_add_(1, where, torch.stack([torch.ones_like(ref_nll), ref_nll]).double())
        ref_sample_nll.index_add_(0, which, ref_nll.double())
        ref_seconds += clock(dev) - t0
        if stage is not None:
            stage.advance(n_tok, label, samples=done, arms=1)
        for j, arm in enumerate(arms):
            t0, acc = clock(dev), accs[arm.name]
            with s.hook.applying(arm, meter=acc.meter, token_mask=mask.bool()):
                h_arm = s.head.features(ids, mask)[:, :-1][valid]
            kl, agree, nll, top = s.head.losses(h_ref, h_arm, tgt)
            acc.sums.index_add_(1, where, torch.stack([torch.ones_like(kl), kl, agree.to(kl.dtype), nll]).double())
            acc.sample_nll.index_add_(0, which, nll.double())
            acc.sample_kl.index_add_(0, which, kl.double())
            acc.track(s, group, valid, kl, ref_top, top)
            acc.seconds += clock(dev) - t0
            if stage is not None:
                stage.advance(n_tok, label, samples=done + (len(group) if j == len(arms) - 1 else 0), arms=j + 2)
        done += len(group)
    zero = torch.zeros_like(ref_sums[0])   # the reference against itself: KL 0, top-1 agreement 1
    ref_table, ref_total = _bucket_table(s, torch.stack([ref_sums[0], zero, ref_sums[0], ref_sums[1]]), ref_sums[1],
                                        measured)
    ref = Reference(ref_table, ref_total, Seconds(ref_seconds), tuple(ref_sample_nll.tolist()),
                    tuple(len(x.ids) - 1 for x in s.samples),
                    {str(i): KVRange(tuple(o[0].amax().tolist()), tuple(o[1].amax().tolist()))
                     for i, o in sorted(recorded.items())})
    out = {}
    for arm in arms:
        acc = accs[arm.name]
        table, total = _bucket_table(s, acc.sums, ref_sums[1], measured)
        out[arm.name] = ArmMetrics(arm.info(), table, total, tuple(acc.sample_nll.tolist()),
                                   tuple(acc.sample_kl.tolist()), acc.meter.read(), tuple(acc.worst),
                                   Seconds(acc.seconds))
    return ref, out
