"""The LM head's chunked losses against an unchunked brute force, and the chunk sized for the device."""

from __future__ import annotations

import pytest
import torch

from calib.evaluation import head as head_mod
from calib.evaluation.head import Head, chunk_rows
from tiny import tiny_causal_lm


def _brute(model, h_ref, h_arm, tgt):
    """Every position at once, float64, straight from the output embeddings."""
    w = model.get_output_embeddings().weight.double()
    lr = torch.log_softmax(h_ref.double() @ w.T, -1)
    la = torch.log_softmax(h_arm.double() @ w.T, -1)
    kl = (lr.exp() * (lr - la)).sum(-1)
    return kl, la.argmax(-1) == lr.argmax(-1), -la.gather(-1, tgt[:, None])[:, 0], -lr.gather(-1, tgt[:, None])[:, 0]


@pytest.mark.parametrize("rows", [1, 3, 7, 23, None])
def test_chunked_losses_equal_the_unchunked_brute_force(rows):
    """Chunks that do not divide the 23 positions (and one chunk holding them all) give the same numbers."""
    model = tiny_causal_lm("llama")
    g = torch.Generator().manual_seed(1)
    h_ref = torch.randn(23, 64, generator=g) * 4
    h_arm = h_ref + torch.randn(23, 64, generator=g) * 0.5
    h_arm[5] = h_ref[5]                                       # one position the arm leaves alone: KL 0
    tgt = torch.randint(257, (23,), generator=g)
    head = Head(model, rows=rows)
    kl, agree, nll, top = head.losses(h_ref, h_arm, tgt)
    ref_nll, ref_top = head.losses(h_ref, None, tgt)
    want_kl, want_agree, want_nll, want_ref_nll = _brute(model, h_ref, h_arm, tgt)
    torch.testing.assert_close(kl.double(), want_kl.clamp_min(0), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(nll.double(), want_nll, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_nll.double(), want_ref_nll, rtol=1e-5, atol=1e-5)
    assert torch.equal(agree, want_agree) and kl[5] == 0
    assert torch.equal(top == ref_top, agree) and kl.shape == (23,) and kl.max() > 1e-3


def test_no_positions_give_empty_losses():
    head = Head(tiny_causal_lm("llama"), rows=4)
    kl, agree, nll, top = head.losses(torch.zeros(0, 64), torch.zeros(0, 64), torch.zeros(0, dtype=torch.long))
    assert kl.numel() == agree.numel() == nll.numel() == top.numel() == 0


def test_chunk_comes_from_free_device_memory():
    """CPU: the fixed budget (64 positions of a 262K vocabulary); a device: half its free bytes at 32 bytes a
    logit, bounded both ways."""
    assert chunk_rows(262144, None) == 64 and chunk_rows(49152, None) == 341
    assert chunk_rows(262144, 60 * 2 ** 30) == 60 * 2 ** 30 // 2 // (32 * 262144) == 3840
    assert chunk_rows(262144, 1000) == 1 and chunk_rows(257, 2 ** 40) == head_mod.MAX_ROWS


def test_head_sizes_its_chunk_when_called(monkeypatch):
    head = Head(tiny_causal_lm("llama"))
    assert head.chunk(torch.device("cpu")) == head_mod.MAX_ROWS      # 2^24 / 257 is more
    monkeypatch.setattr(head_mod, "free_bytes", lambda device: 257 * 32 * 2 * 5)
    assert head.chunk(torch.device("cpu")) == 5
    seen = []
    real = head.log_probs
    monkeypatch.setattr(head, "log_probs", lambda h: seen.append(h.shape[0]) or real(h))
    head.losses(torch.randn(12, 64), None, torch.zeros(12, dtype=torch.long))
    assert seen == [5, 5, 2]
