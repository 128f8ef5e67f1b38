"""calib.evaluation.fa3: FlashAttention-3's blockwise FP8 forward.

Checked against independent computations: without FP8 the reference is plain softmax attention (float64);
with FP8 it is a slow per-row loop of the same algorithm written from the description (numpy float32 scalars,
e4m3 rounding from the format's definition), on inputs whose Q . K sums are exact in any order; against the
global-max `fp8_attention` it stays inside the bound that e4m3 rounding of P allows both of them, and equals
it (up to float32 rounding) when one key block covers every key. The Triton kernel's tests are in
test_fa3_kernel.py.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from calib.evaluation import fa3

from calib.scales import fp8
from helpers import e4m3_nearest, fa3_case, fa3_inputs, fa3_padding, softmax_attention

LOG2E = math.log2(math.e)
CUDA = torch.cuda.is_available()


def _grid_codes(shape, g, lo=1.0, hi=15.0, zeros=0.1) -> torch.Tensor:
    """Random e4m3 values with |x| in [lo, hi] (random signs, some zeros)."""
    grid = fp8.E4M3.grid()
    grid = grid[(grid >= lo) & (grid <= hi)]
    x = grid[torch.randint(len(grid), shape, generator=g)] * (torch.randint(2, shape, generator=g) * 2 - 1)
    return torch.where(torch.rand(shape, generator=g) < zeros, 0.0, x)


def _rows_with_keys(mask: torch.Tensor | None, b, h, s) -> torch.Tensor:
    """[b, s, h] True where a query row attends to at least one key (an empty row is 0 in FA3)."""
    if mask is None:
        return torch.ones(b, s, h, dtype=torch.bool)
    return mask.expand(b, h, s, -1).any(-1).transpose(1, 2)


# ------------------------------------------------------------------------------- the reference

CASES = {
    "causal-gqa": dict(),
    "bidirectional": dict(causal=False),
    "padding": dict(mask="bool"),
    "additive": dict(mask="additive", causal=False),
    "prefill-chunk": dict(s=19),                                  # fewer queries than keys: bottom-right
    "window-softcap": dict(window_left=12, softcap=4.0),
    "long-window": dict(window_left=40),          # whole key blocks between the diagonal and the window's edge
}


@pytest.mark.parametrize("name", CASES)
def test_reference_without_fp8_is_softmax_attention(name):
    q, k, v, _, _, cfg = fa3_case(CASES[name])
    got = fa3.blockwise_reference(q, k, v, scaling=0.25, quant_q=False, quant_p=False, block_n=16, chunk=16,
                                  **cfg)
    want = softmax_attention(q, k, v, 0.25, **cfg)
    live = _rows_with_keys(cfg.get("mask") if isinstance(cfg.get("mask"), torch.Tensor)
                           and cfg["mask"].dtype == torch.bool else None, 2, 4, q.shape[2])
    err = (got.double() - want).abs().amax(-1)[live].max().item()
    assert err < 2e-6 * want.abs().max().item(), err


def _slow_fa3(qc, kc, vc, qd, kd, vd, scaling, block_n, mask):
    """The algorithm of FA3's FP8 forward, one query row at a time in numpy float32 scalars: every key block
    from the last to the first, running max, P = exp2(x - (max - 8)) rounded by `e4m3`, row sum of the
    unrounded P, accumulator rescaled by exp2(old max - new max)."""
    f = np.float32
    b, h, s, _ = qc.shape
    kvh, t, dv = kc.shape[1], kc.shape[2], vc.shape[-1]
    out = np.zeros((b, s, h, dv), dtype=np.float32)
    for bi in range(b):
        for hi in range(h):
            kh = hi // (h // kvh)
            c = f(f(scaling * LOG2E) * f(f(qd) * f(kd[kh])))
            for i in range(s):
                m, l, acc = f(-np.inf), f(0), np.zeros(dv, dtype=np.float32)
                for j in reversed(range(-(-t // block_n))):
                    cols = [n for n in range(j * block_n, min(t, (j + 1) * block_n))]
                    x = [f(f(float(qc[bi, hi, i].double() @ kc[bi, kh, n].double())) * c)
                         if mask[bi, 0, i, n] else f(-np.inf) for n in cols]
                    m_new = max(m, max(x))
                    alpha = np.exp2(f(m - (f(0) if m_new == -np.inf else m_new)))
                    off = f(0) if m_new == -np.inf else f(m_new - f(8))
                    p = [np.exp2(f(xi - off)) for xi in x]
                    l = f(l * alpha)
                    for pi in p:
                        l = f(l + pi)
                    acc = (acc * alpha).astype(np.float32)
                    for pi, n in zip(p, cols):
                        acc = (acc + f(e4m3_nearest(float(pi))) * vc[bi, kh, n].numpy()).astype(np.float32)
                    m = m_new
                out[bi, i, hi] = acc * f(f(1) / l) * f(vd[kh]) if l > 0 else 0
    return torch.from_numpy(out)


@pytest.mark.parametrize("causal", [True, False])
def test_reference_is_the_per_row_algorithm(causal):
    """Q and K codes in [1, 15] (quantum >= 2^-3): every Q . K sum is exact in float32, in any order."""
    g = torch.Generator().manual_seed(1)
    b, h, kvh, s, t, d = 1, 2, 1, 21, 21, 8
    qd, kd, vd = 0.25, torch.tensor([0.21]), torch.tensor([0.013])
    qc, kc = _grid_codes((b, h, s, d), g), _grid_codes((b, kvh, t, d), g)
    vc = _grid_codes((b, kvh, t, d), g, lo=2.0 ** -9, hi=448.0)
    mask = fa3_padding(b + 1, s, t, cut=4)[1:] if causal else torch.ones(b, 1, s, t, dtype=torch.bool)
    got = fa3.blockwise_reference(qc * qd, kc * kd, vc * vd, scaling=d ** -0.5, q_scale=qd, k_scale=kd,
                                  v_scale=vd, mask=mask, causal=causal, block_n=6, chunk=8)
    want = _slow_fa3(qc, kc, vc, qd, kd, vd, d ** -0.5, 6, mask)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def test_fp8_inputs_are_codes_times_scales():
    """prepare() recovers the cache's codes exactly from codes x per-head scale (bf16-exact, so the kernel can
    use tensor cores) and keeps other values as they are (per-channel scales: float32 dots)."""
    q, k, v, ks, vs = fa3_inputs(2)
    x = fa3.prepare(q, k, v, q_scale=0.05, k_scale=ks, v_scale=vs)
    assert x.bf16_exact
    assert torch.equal(x.k * ks.reshape(1, -1, 1, 1), k) and torch.equal(x.k, fp8.round_fp8(x.k))
    assert torch.equal(x.q, fp8.quantize(q, 0.05, fp8.E4M3, fp8.RNE, "reciprocal"))
    assert torch.equal(x.q_descale, torch.full((2, 2), 0.05))
    chan = torch.rand(1, 2, 1, 16) + 0.5
    assert not fa3.prepare(q, k * chan, v, q_scale=0.05, k_scale=ks, v_scale=vs).bf16_exact
    with pytest.raises(ValueError, match="k_scale has 3 values"):
        fa3.prepare(q, k, v, k_scale=torch.ones(3))
    with pytest.raises(ValueError, match="mask"):
        fa3.prepare(q, k, v, mask=torch.ones(2, 1, 7, 45, dtype=torch.bool))


def _p_rounding_bound(q, k, v, scaling, q_scale, mask):
    """Per output element, how far e4m3 rounding of P can move either implementation from exact attention:
    (2^-4 sum_k p_k |v_k| + 2^-10 sum_k |v_k|) / sum_k p_k with p = 2^8 exp(x - max) (half an e4m3 step is at
    most 2^-4 of a normal value and 2^-10 below 2^-6; a running max only scales P down, by alpha <= 1)."""
    rep = q.shape[1] // k.shape[1]
    qf = fp8.quantize(q, q_scale, fp8.E4M3, fp8.RNE, "reciprocal").double() * q_scale
    sc = qf @ k.double().repeat_interleave(rep, 1).transpose(-1, -2) * scaling
    sc = sc.masked_fill(~mask, -math.inf)
    p = torch.exp(sc - sc.amax(-1, keepdim=True)) * 256
    va = v.double().abs().repeat_interleave(rep, 1)
    bound = (2 ** -4 * (p @ va) + 2 ** -10 * (mask.double() @ va)) / p.sum(-1, keepdim=True)
    return bound.transpose(1, 2)


@pytest.mark.parametrize("block_n", [6, 16, 64])
def test_reference_against_global_max_fp8_attention(block_n):
    """The running max changes which e4m3 values P takes (round then rescale by a non-power of two is not
    round the rescaled value): both stay within the rounding bound of exact attention, so they differ by at
    most twice it. One block holding every key (block_n 64 >= 45) is the global max: equal up to float32."""
    q, k, v, ks, vs = fa3_inputs(3)
    mask = fa3_padding(2, 45, 45)
    ours = fa3.blockwise_reference(q, k, v, scaling=0.25, q_scale=0.05, k_scale=ks, v_scale=vs, mask=mask,
                                   block_n=block_n)
    glob = fp8.fp8_attention(q, k, v, scaling=0.25, q_scale=0.05, mask=mask)
    diff = (ours - glob).abs()
    bound = _p_rounding_bound(q, k, v, 0.25, 0.05, mask)
    assert (diff <= 2 * bound * 1.001 + 1e-6).all()
    if block_n >= 45:
        assert diff.max() <= 1e-5 * glob.abs().max()
    else:
        assert diff.max() > 1e-4 * glob.abs().max()        # the running max is visible
