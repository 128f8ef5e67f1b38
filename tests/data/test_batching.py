"""Batching: every real token once, padding masked, budgets respected, prefetch transparent."""

import pytest
import torch

from calib.data.batching import PaddingStats, batches, pad, prefetch
from tiny import random_sequences


def _rows(batch_iter):
    out = []
    for ids, mask in batch_iter:
        for r in range(ids.shape[0]):
            out.append(ids[r][mask[r].bool()].tolist())
    return out


def test_pad_is_right_padding_with_mask():
    ids, mask = pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_plain_batches_keep_order_and_every_token():
    seqs = random_sequences(11, seed=3)
    got = list(batches(seqs, 4))
    assert [b[0].shape[0] for b in got] == [4, 4, 3]
    assert _rows(got) == seqs


def test_token_budget_groups_similar_lengths_and_cuts_padding():
    seqs = random_sequences(200, lo=4, hi=200, seed=5)
    plain, budget = PaddingStats(), PaddingStats()
    list(batches(seqs, 8, padding=plain))
    got = list(batches(seqs, 8, max_batch_tokens=800, window=64, padding=budget))
    assert sorted(map(tuple, _rows(got))) == sorted(map(tuple, seqs))  # same tokens, another order
    assert all(ids.numel() <= 800 or ids.shape[0] == 1 for ids, _ in got)
    assert all(ids.shape[0] <= 8 for ids, _ in got)
    assert budget.fraction < plain.fraction / 3
    assert plain.real == budget.real == sum(map(len, seqs))


def test_prefetch_is_transparent_and_reraises():
    assert list(prefetch(iter(range(50)), depth=3)) == list(range(50))

    def broken():
        yield 1
        raise ValueError("bad record 2")
    with pytest.raises(ValueError, match="bad record 2"):
        list(prefetch(broken()))


def test_prefetch_stops_its_thread_when_the_consumer_stops():
    import threading
    it = prefetch(iter(range(10_000)), depth=2)
    assert next(it) == 0
    it.close()
    assert not any(t.name == "kvcalib-prefetch" and t.is_alive() for t in threading.enumerate())


def test_bucketed_run_gives_the_same_scales(tiny_llama_dir, token_data, tmp_path):
    from calib import pipeline
    from calib.recipe.recipe import Recipe
    r = Recipe(samples=16, seq_len=40, min_tokens=8, batch_size=4)
    a = pipeline.calibrate(tiny_llama_dir, token_data, r, tmp_path / "a", device="cpu")
    b = pipeline.calibrate(tiny_llama_dir, token_data, r, tmp_path / "b", device="cpu",
                           options=pipeline.RunOptions(max_batch_tokens=64, prefetch=0))
    for i in a.scales:
        torch.testing.assert_close(a.scales[i].k_scale, b.scales[i].k_scale, rtol=1e-6, atol=0)
    assert b.padding <= a.padding
