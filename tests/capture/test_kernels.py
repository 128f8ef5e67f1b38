"""calib.capture.kernels: the fused kernels give the torch reference's results, bit for bit.

The kernels run under Triton's interpreter on CPU tensors (a second copy of the module, loaded with
TRITON_INTERPRET=1, since Triton decides at decoration time); the references are the plain torch paths the
observers use on the CPU. The interpreter has no libdevice, so there the RoPE pair norm is sqrt(a²+b²)
instead of CUDA's hypot: within one float32 ulp (bit-identical on a GPU, where both call hypotf).
Skipped where Triton is not installed (CPU-only torch wheels do not ship it; `make test-fused` installs it).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from calib.capture import hook as observe, observers, kernels
from calib.model.load import find_attention_layers
from calib.pipeline import batches
from calib.recipe.dtypes import FP8_E4M3
from tiny import random_sequences, tiny_causal_lm

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def interp():
    """calib.capture.kernels with its Triton kernels interpreted on the CPU (conftest sets TRITON_INTERPRET=1 before
    anything imports Triton, on machines without CUDA)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET=1 was not set before Triton was imported (a CUDA machine?)")
    spec = importlib.util.spec_from_file_location("calib_reduce_interpreted", kernels.__file__)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod.KERNELS_ON_CPU = True
    assert mod.fused(torch.zeros(1, 1, 1, 1)) and not kernels.fused(torch.zeros(1, 1, 1, 1))
    yield mod
    sys.modules.pop(spec.name, None)


def _kv(seed: int, b=2, h=3, s=70, d=40, scale=50.0, transposed=True, dtype=torch.bfloat16):
    """A K/V-like tensor; `transposed` gives V's strides ([b, s, h, d] storage seen as [b, h, s, d])."""
    g = torch.Generator().manual_seed(seed)
    if transposed:
        return (torch.randn(b, s, h, d, generator=g) * scale).to(dtype).transpose(1, 2)
    return (torch.randn(b, h, s, d, generator=g) * scale).to(dtype)


def _mask(b=2, s=70, cut=50):
    m = torch.ones(b, s, dtype=torch.bool)
    m[1, cut:] = False
    return m


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("masked", [True, False])
def test_absmax_and_counts_match_torch(interp, dtype, masked):
    x = _kv(0, dtype=dtype)
    mask = _mask() if masked else None
    x[1, :, 60, :] = 1e4                      # beyond the mask: must not count when masked
    got = [torch.zeros(3), torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)]
    want = [t.clone() for t in got]
    for _ in range(2):                        # folds into running state
        interp.absmax_(x, mask, *got, limit=100.0)
        kernels.absmax_(x, mask, *want, limit=100.0)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    brute = x.float().abs().masked_fill(~mask[:, None, :, None], 0) if masked else x.float().abs()
    assert torch.equal(got[0], brute.amax(dim=(0, 2, 3)))
    assert int(got[1]) == 2 * int((brute > 100).sum())
    assert int(got[2]) == 2 * (int(mask.sum()) if masked else 2 * 70) * 3 * 40


def test_absmax_maps_nan_to_inf_so_the_capture_refuses_it(interp):
    x = _kv(1)
    x[0, 2, 5, 7] = float("nan")
    amax = torch.zeros(3)
    interp.absmax_(x, None, amax)
    assert amax[2] == float("inf") and torch.isfinite(amax[:2]).all()


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [40, 16])
def test_rope_pair_norms_match_torch(interp, interleaved, rot):
    x, mask = _kv(2), _mask()
    got = (torch.zeros(3, rot // 2), torch.zeros(3, 40 - rot))
    want = (got[0].clone(), got[1].clone())
    interp.pair_max_(x, mask, rot, interleaved, *got)
    kernels.pair_max_(x, mask, rot, interleaved, *want)
    torch.testing.assert_close(got[0], want[0], rtol=2 ** -23, atol=0)     # sqrt vs hypot: one ulp
    assert torch.equal(got[1], want[1])


def _fused_histogram(interp, batches_, bins=2048):
    h = batches_[0][0].shape[1]
    st = {"exponent": torch.full((h,), observers.E_MIN, dtype=torch.int64),
          "counts": torch.zeros(h, bins, dtype=torch.int64), "sums": torch.zeros(h, bins, dtype=torch.float64),
          "amax": torch.zeros(h)}
    scratch = interp.HistScratch(h, bins, torch.device("cpu"))
    for x, m in batches_:
        st = interp.histogram_(x, m, st, scratch, observers.E_MIN, observers.E_MAX)
    assert not scratch.counts.any() and not scratch.sum0.any()           # the fold empties the scratch
    return st


@pytest.mark.parametrize("bins", [256, 2048])
def test_histogram_matches_the_observer_bit_for_bit(interp, bins):
    """Growing range (the second batch is 10^4 larger), values in the underflow bin, padding, zeros."""
    small, big, tiny = _kv(3, scale=3.0), _kv(4, scale=1e4, transposed=False), _kv(5, scale=1e-3)
    tiny[0, 1, 3, 5] = 0.0
    seq = [(small, _mask()), (big, None), (tiny, _mask(cut=20))]
    for n in range(1, 4):
        ref = observers.PercentileObserver(99.9, bins=bins)
        for x, m in seq[:n]:
            ref.update(x, m)
        got = _fused_histogram(interp, seq[:n], bins)
        for key, want in ref.state_dict().items():
            assert torch.equal(got[key], want), (n, key)
    # and what the observers read from it is the same
    obs = observers.PercentileObserver(99.9, bins=bins)
    obs.load_state_dict(got)
    assert torch.equal(obs.amax(), ref.amax())


def test_capture_on_a_bf16_model_is_identical_through_the_kernels(interp, monkeypatch):
    """The whole capture (K/V absmax + overflow, Q, rope_bound, percentile, mse) through the kernels."""
    model = tiny_causal_lm("llama", scale_k=3000.0).to(torch.bfloat16)
    base = model.model
    seqs = random_sequences(5, seed=3)
    rotary = observers.RotaryLayout(16)
    specs = [observe.CaptureSpec(q=True, k_observer=lambda: observers.RopeBoundObserver(rotary),
                                 v_observer=lambda: observers.PercentileObserver(99.0)),
             observe.CaptureSpec(k_observer=lambda: observers.MSEObserver(FP8_E4M3, grid=20),
                                 v_observer=lambda: observers.MSEObserver(FP8_E4M3, grid=20))]

    def capture(spec):
        with observe.capture_kv(base, find_attention_layers(base), spec) as cap, torch.inference_mode():
            for ids, mask in batches(seqs, 2):
                with cap.masking(mask.bool()):
                    base(input_ids=ids, attention_mask=mask, use_cache=False)
        return cap.state_dict(), cap.stats()

    for spec in specs:
        want_state, want = capture(spec)
        with monkeypatch.context() as m:
            m.setattr(observe, "kernels", interp)
            m.setattr(observers, "kernels", interp)
            got_state, got = capture(spec)
        assert want_state.keys() == got_state.keys()
        for key in want_state:
            close = "pair_max" in key
            if close:
                torch.testing.assert_close(got_state[key], want_state[key], rtol=2 ** -23, atol=0)
            else:
                assert torch.equal(got_state[key], want_state[key]), key
        assert any(float(s.k_over) > 0 for s in want.values())              # the overflow count is exercised


def test_a_kernel_triton_cannot_build_falls_back_to_torch_once(interp, monkeypatch, capsys):
    """No C compiler for Triton's launcher, an unsupported GPU ...: one line on stderr, the same numbers."""
    class Unbuildable:
        def __getitem__(self, grid):
            def launch(*a, **k):
                raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")
            return launch

    monkeypatch.setattr(interp, "_absmax_kernel", Unbuildable())
    monkeypatch.setattr(interp, "_hist_kernel", Unbuildable())
    monkeypatch.setattr(interp, "_failed", [])
    x, mask = _kv(6), _mask()
    got, want = torch.zeros(3), torch.zeros(3)
    interp.absmax_(x, mask, got)
    kernels.absmax_(x, mask, want)
    assert torch.equal(got, want) and not interp.fused(x)
    assert capsys.readouterr().err.count("Triton kernels unavailable") == 1
    monkeypatch.setattr(interp, "_failed", [])
    st = {"exponent": torch.full((3,), observers.E_MIN, dtype=torch.int64),
          "counts": torch.zeros(3, 256, dtype=torch.int64), "sums": torch.zeros(3, 256, dtype=torch.float64),
          "amax": torch.zeros(3)}
    assert interp.histogram_(x, mask, st, interp.HistScratch(3, 256, torch.device("cpu")),
                             observers.E_MIN, observers.E_MAX) is None
