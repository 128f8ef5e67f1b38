"""Scale folding: amax/448 in float32, max over heads, never zero/negative/non-finite."""

import pytest
import torch

from calib.scales.stats import LayerStats
from calib.scales import fold as scales


def test_per_tensor_scale_is_max_over_heads_over_448():
    stats = {0: LayerStats(torch.tensor([1.0, 896.0]), torch.tensor([0.5, 0.25])),
             3: LayerStats(torch.tensor([3.5]), torch.tensor([44.8]))}
    out = scales.per_tensor_fp8(stats)
    assert list(out) == [0, 3]
    assert out[0].k_scale.dtype == torch.float32 and out[0].k_scale.shape == ()
    assert float(out[0].k_scale) == 2.0
    assert float(out[0].v_scale) == pytest.approx(0.5 / 448, rel=1e-7)
    assert float(out[3].v_scale) == pytest.approx(0.1, rel=1e-7)


def test_headroom_multiplies_the_range():
    s = scales.amax_to_scale(torch.tensor(448.0), headroom=2.0)
    assert float(s) == 2.0


def test_zero_range_gets_the_documented_floor_not_zero():
    s = scales.amax_to_scale(torch.tensor([0.0, 1.0]))
    assert s[0] == scales.MIN_SCALE > 0 and torch.isfinite(1 / s).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_bad_ranges_are_errors(bad):
    with pytest.raises(ValueError):
        scales.amax_to_scale(torch.tensor([bad]))


def test_scaled_values_fit_fp8_exactly_at_the_max():
    """x / scale for the largest |x| lands on 448, FP8 e4m3's largest finite value (no saturation)."""
    x = torch.tensor([-1234.5, 3.0, 1234.5])
    s = scales.amax_to_scale(x.abs().max())
    q = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert q.abs().max() == 448.0
    assert torch.allclose(q * s, x, rtol=0.07)  # e4m3 has 3 mantissa bits: rel. error <= 2^-4


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=3e38, allow_nan=False, allow_infinity=False), min_size=1, max_size=8),
       st.floats(min_value=1e-3, max_value=1e3), st.sampled_from([448.0, 127.0]))
def test_scales_are_always_positive_finite_float32(amax, headroom, qmax):
    try:
        s = scales.amax_to_scale(torch.tensor(amax, dtype=torch.float32), headroom, qmax)
    except ValueError as e:  # only overflow of float32 may refuse, and it says so
        assert "overflow" in str(e)
        return
    assert s.dtype == torch.float32 and torch.isfinite(s).all() and (s > 0).all()
    big = torch.tensor(amax, dtype=torch.float32) > 0
    ref = (torch.tensor(amax, dtype=torch.float32).double() * headroom / qmax).clamp_min(scales.MIN_SCALE)
    assert torch.allclose(s[big].double(), ref[big], rtol=1e-6)


# ---------------------------------------------------------------- one scale shared by K and V (TensorRT engine)

def _observed(x, observer):
    observer.update(x, None)
    return observer.amax()


@pytest.mark.parametrize("dtype, qmax", [("fp8_e4m3", 448.0), ("int8", 127.0)])
def test_shared_kv_scale_is_the_joint_absmax_over_qmax_brute_force(dtype, qmax):
    """One scale per layer for K and V: max over K, V and heads of |x| (absmax observer), / 448 or / 127, float32
    [1]; brute force over the raw tensors, and the same number as max(k_scale, v_scale) of the per-tensor fold."""
    from calib.capture.observers import AbsMaxObserver

    g = torch.Generator().manual_seed(0)
    stats, raw = {}, {}
    for layer in range(3):
        k = torch.randn(2, 4, 16, 8, generator=g) * (layer + 1) * 3
        v = torch.randn(2, 4, 16, 8, generator=g) * (3 - layer) * 2
        raw[layer] = (k, v)
        stats[layer] = LayerStats(_observed(k, AbsMaxObserver()), _observed(v, AbsMaxObserver()))
    shared = scales.shared_kv_scales(stats, dtype=dtype)
    for layer, (k, v) in raw.items():
        brute = torch.maximum(k.abs().max(), v.abs().max()).to(torch.float32) / torch.tensor(qmax)
        assert shared[layer].dtype == torch.float32 and shared[layer].shape == (1,)
        assert float(shared[layer]) == float(brute)
    per_tensor = scales.compute(stats, dtype=dtype, granularity="tensor")
    assert {i: float(t) for i, t in scales.shared_from_scales(per_tensor).items()} == \
        {i: float(t) for i, t in shared.items()}


def test_shared_kv_scale_takes_the_observer_clip_of_k_and_v():
    """With a clipping observer the shared clip is the max over K and V (and heads) of the observer's value."""
    from calib.capture.observers import PercentileObserver

    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 2, 512, 16, generator=g)
    v = torch.randn(1, 2, 512, 16, generator=g) * 5
    v[0, 1, 3, 0] = 1000.0                                   # one outlier the percentile drops
    kc, vc = _observed(k, PercentileObserver(99.0)), _observed(v, PercentileObserver(99.0))
    stats = {0: LayerStats(k.abs().amax((0, 2, 3)), v.abs().amax((0, 2, 3)), k_clip=kc, v_clip=vc)}
    shared = float(scales.shared_kv_scales(stats, dtype="int8")[0])
    brute = max(torch.quantile(x[0, h].abs().flatten(), 0.99).item() for x in (k, v) for h in range(2)) / 127
    assert shared == pytest.approx(brute, rel=0.01)
    assert shared < 1000.0 / 127 / 10
