"""calib.evaluation.fa3_kernel: the fused Triton kernel against fa3.py's float32 reference.

Under Triton's interpreter on CPU (TRITON_INTERPRET=1, set by conftest before Triton is imported) the kernel's
dots run in float32 on the same codes (the interpreter's bf16 dot is broken), so kernel and reference agree up
to float32 summation order; the cases include whole key blocks (the mask-free path) between the diagonal and a
window's edge. The CUDA tests (bf16 tensor cores, FA3's real block sizes, every autotuned query-block size, the
hardware P cast and its self-check) skip here.
"""

from __future__ import annotations

import os

import pytest
import torch

from calib.evaluation import fa3, fa3_kernel
from calib.scales import fp8
from helpers import e4m3_nearest, fa3_case, fa3_inputs, softmax_attention

CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------- the Triton kernel

needs_interpreter = pytest.mark.skipif(fa3_kernel.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                                       reason="needs Triton's interpreter (TRITON_INTERPRET=1 before import)")


@needs_interpreter
def test_kernel_rounds_p_like_the_format():
    edges = [0.0, 2.0 ** -10, 1.5 * 2 ** -10, 2.0 ** -9, 2.5 * 2 ** -9, 3 * 2 ** -10, 2.0 ** -6, 1.0625, 1.1875,
             17.0, 19.0, 255.0, 256.0, 440.0, 447.9]
    x = torch.cat([torch.tensor(edges), torch.rand(3000, generator=torch.Generator().manual_seed(0)) *
                   2.0 ** torch.randint(-14, 9, (3000,), generator=torch.Generator().manual_seed(1))])
    got = fa3_kernel.round_e4m3_triton(x)
    assert torch.equal(got, fp8.round_fp8(x))
    assert got[:len(edges)].tolist() == [e4m3_nearest(e) for e in edges]


KERNEL_CASES = {
    "causal-gqa-padding": dict(mask="bool"),
    "additive-bidirectional": dict(mask="additive", causal=False),
    "prefill-chunk": dict(s=19),
    "window-softcap": dict(window_left=12, softcap=4.0),
    "long-window": dict(window_left=40),          # whole key blocks between the diagonal and the window's edge
}


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")     # finfo.min * log2(e) is -inf
@pytest.mark.parametrize("block_n", [16, 28])                  # 28 = 16 + 8 + 4: three tiles, 45 = 28 + 17
@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_equals_reference_under_the_interpreter(name, block_n):
    q, k, v, ks, vs, cfg = fa3_case(KERNEL_CASES[name], seed=4)
    q, k, v = q[:, :2], k[:, :1], v[:, :1]                        # 2 query heads on 1 KV head
    cfg = {**cfg, "mask": cfg["mask"][:, :1]} if "mask" in cfg else cfg
    kw = dict(scaling=0.25, q_scale=0.05, k_scale=ks[:1], v_scale=vs[:1], block_n=block_n, **cfg)
    want = fa3.blockwise_reference(q, k, v, **kw)
    got = fa3.fa3_attention_triton(q, k, v, block_m=16, **kw)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()


@needs_interpreter
def test_kernel_float32_path_without_scales():
    """K/V that are not codes times a per-head scale (k_scale None, values off the grid), no FP8 at all:
    plain softmax attention up to float32 rounding."""
    q, k, v, _, _ = fa3_inputs(5, b=1, h=2, kvh=1, s=37, t=37, d=24, dv=8)
    got = fa3.fa3_attention_triton(q, k * 1.1, v, scaling=0.2, quant_q=False, quant_p=False, block_n=16,
                                   block_m=16)
    want = softmax_attention(q, k * 1.1, v, 0.2)
    assert (got.double() - want).abs().max() <= 2e-6 * want.abs().max()


@needs_interpreter
def test_dispatcher_takes_the_kernel_only_where_it_can(monkeypatch, capsys):
    q, k, v, ks, vs = fa3_inputs(6, b=1, h=2, kvh=1, s=20, t=20)
    kw = dict(scaling=0.25, q_scale=0.05, k_scale=ks, v_scale=vs, block_n=16)
    want = fa3.blockwise_reference(q, k, v, **kw)
    assert not fa3.fused(q) and torch.equal(fa3.fa3_attention(q, k, v, **kw), want)      # CPU tensors
    monkeypatch.setattr(fa3_kernel, "KERNELS_ON_CPU", True)
    monkeypatch.setattr(fa3, "_failed", {})
    reference = fa3._reference
    calls = []
    monkeypatch.setattr(fa3, "_reference", lambda *a: calls.append("reference") or reference(*a))
    got = fa3.fa3_attention(q, k, v, **kw)
    assert not calls and (got - want).abs().max() <= 2e-6 * want.abs().max()

    def broken(*a):                           # what Triton does where it cannot build or fit the kernel
        calls.append("kernel")
        raise RuntimeError("out of resources: shared memory")
    monkeypatch.setattr(fa3, "_kernel", broken)
    for _ in range(2):
        assert torch.equal(fa3.fa3_attention(q, k, v, **kw), want)
    assert calls == ["kernel", "reference", "reference"]           # one try per configuration, said once
    assert capsys.readouterr().err.count("unavailable") == 1


# ------------------------------------------------------------------------------- on a GPU

needs_cuda = pytest.mark.skipif(not CUDA or fa3_kernel.triton is None, reason="needs CUDA and Triton")


@needs_cuda
@pytest.mark.parametrize("block_m", [None, 32, 128])      # None: the autotuned configuration
@pytest.mark.parametrize("d,block_n", [(64, 160), (128, 160), (128, 224), (256, 128)])
@pytest.mark.parametrize("name", ["causal-gqa-padding", "window-softcap", "prefill-chunk", "long-window"])
def test_kernel_equals_reference_on_cuda(name, d, block_n, block_m):
    q, k, v, ks, vs, cfg = fa3_case(KERNEL_CASES[name], seed=7, d=d)
    dev = torch.device("cuda")
    q, k, v = q.to(dev, torch.bfloat16), k.to(dev), v.to(dev)
    cfg = {n: (x.to(dev) if isinstance(x, torch.Tensor) else x) for n, x in cfg.items()}
    kw = dict(scaling=d ** -0.5, q_scale=0.05, k_scale=ks, v_scale=vs, block_n=block_n, **cfg)
    assert fa3.prepare(q, k, v, q_scale=0.05, k_scale=ks, v_scale=vs).bf16_exact          # tensor-core path
    want = fa3.blockwise_reference(q, k, v, **kw)
    try:
        got = fa3.fa3_attention_triton(q, k, v, block_m=block_m, **kw)
    except Exception as e:                 # a fixed query block too big for this GPU; the autotuner skips it
        if block_m is None or type(e).__name__ != "OutOfResources":
            raise
        pytest.skip(f"{block_m} queries at d {d}, kBlockN {block_n} do not fit here: {str(e)[:100]}")
    # float32 summation order, and the GPU's approximate exp2 moving an occasional P across an e4m3 midpoint
    diff, scale = (got - want).abs(), want.abs().max()
    assert (diff > 1e-4 * scale).float().mean() < 0.02 and diff.max() < 0.05 * scale


@needs_cuda
def test_hardware_p_cast_rounds_like_the_arithmetic_one():
    x = torch.rand(1 << 20, device="cuda") * 2.0 ** torch.randint(-14, 9, (1 << 20,), device="cuda")
    assert torch.equal(fa3_kernel.round_e4m3_triton(x), x.to(torch.float8_e4m3fn).float())
    assert torch.equal(fa3_kernel.round_e4m3_triton(x, hardware=True), x.to(torch.float8_e4m3fn).float())
    assert fa3_kernel.hw_cast_agrees(x.device)


def test_pipeline_fits_the_shared_memory_budget():
    """The stage / query-block choice: what ran on the H200 keeps two stages (d 64 and d 128 with kBlockN 160);
    what failed there (d 128 with 224, d 256 with 128: over 227 KB at two stages) drops to one stage, and the
    float32 path (4-byte tiles at d 256) also halves its queries."""
    assert fa3_kernel.pipeline(64, 160, 64, 64, 2, 2) == (64, 2)
    assert fa3_kernel.pipeline(64, 160, 128, 128, 2, 2) == (64, 2)
    assert fa3_kernel.pipeline(64, 224, 128, 128, 2, 2) == (64, 1)
    assert fa3_kernel.pipeline(64, 128, 256, 256, 2, 2) == (64, 1)
    bm, st = fa3_kernel.pipeline(32, 128, 256, 256, 4, 1)
    assert st == 1 and bm < 32
    for args in [(64, bn, d, d, e, 2) for bn in (64, 128, 160, 224) for d in (64, 128, 256) for e in (2, 4)]:
        bm, st = fa3_kernel.pipeline(*args)
        bn, d, e = args[1], args[2], args[4]
        assert st * bn * 2 * d * e + bm * d * e <= fa3_kernel.SMEM_BUDGET or (st == 1 and bm == 16)
