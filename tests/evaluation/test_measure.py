"""A measuring pass: batching and padding do not change an arm's numbers."""

from __future__ import annotations

import pytest
import torch

from calib.evaluation.arms import Geometry, default_arm
from calib.evaluation.fakequant import fake_quant_kv
from calib.evaluation.head import Head
from calib.evaluation.measure import measure
from calib.evaluation.samples import Sample
from calib.evaluation.session import Session
from calib.recipe.dtypes import FP8_E4M3
from tiny import random_sequences, tiny_causal_lm
from helpers import boosted


def test_batching_and_padding_do_not_change_the_numbers():
    model = boosted(tiny_causal_lm("llama", seed=1))
    seqs = random_sequences(6, lo=6, hi=30, seed=9)
    samples = tuple(Sample(i, tuple(s), 32) for i, s in enumerate(seqs))
    arm = default_arm(Geometry((0, 1, 2), 2, 16), FP8_E4M3)
    runs = []
    with fake_quant_kv(model) as hook, torch.inference_mode():
        for bs in (1, 4):
            s = Session(model, hook, Head(model), None, samples, (32,), batch_size=bs)
            runs.append(measure(s, [arm])[1]["default"])
    one, four = runs
    assert one.summary.kl == pytest.approx(four.summary.kl, rel=1e-4)
    assert one.summary.tokens == four.summary.tokens == sum(len(s) - 1 for s in seqs)
    for i in one.layers:
        for key in ("k_saturated", "v_flushed", "k_snr_db", "attn_rel_error"):
            assert one.layers[i][key] == pytest.approx(four.layers[i][key], rel=1e-4)
