"""Scale folding: amax/448 in float32, max over heads, never zero/negative/non-finite."""

import pytest
import torch

from calib.capture.stats import LayerStats
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
