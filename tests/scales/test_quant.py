"""Fake quantisation equals an independent brute-force emulation of the engine's cache write."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from calib.recipe.dtypes import FP8_E4M3, INT8, kv_dtype
from calib.scales.quant import fake_quant, quantize


def saturation_fraction(x: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    """Fraction of all elements with |x / scale| > qmax: those the cache clips."""
    return ((x.to(torch.float32) / scale).abs() > dtype.qmax).float().mean()


def underflow_fraction(x: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    """Fraction of the nonzero elements that `quantize` stores as 0 (0 if none is nonzero)."""
    nonzero = x != 0
    return (nonzero & (quantize(x, scale, dtype) == 0)).sum().float() / nonzero.sum().clamp_min(1).float()


def _e4m3_table() -> tuple[np.ndarray, np.ndarray]:
    """All finite non-negative e4m3fn values (ascending) and their codes, from the 256 bit patterns."""
    codes = np.arange(256)
    sign, exp, man = codes >> 7, (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7.0))
    keep = (sign == 0) & ~((exp == 0xF) & (man == 0x7))                  # e4m3fn: S.1111.111 is NaN, no inf
    order = np.argsort(value[keep])
    return value[keep][order], codes[keep][order]


_VALUES, _CODES = _e4m3_table()


def _fp8_ref(x: np.ndarray, scale: np.ndarray | float) -> np.ndarray:
    """Brute force: q = f32(x) / f32(scale), nearest e4m3 value (ties to the even code), saturated at 448."""
    with np.errstate(over="ignore"):                                     # huge x / tiny scale -> inf -> 448
        q = np.float32(x) / np.float32(scale)
    mag = np.abs(q).astype(np.float64)
    hi = np.clip(np.searchsorted(_VALUES, mag), 1, len(_VALUES) - 1)
    lo = hi - 1
    d_lo, d_hi = mag - _VALUES[lo], _VALUES[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (_CODES[hi] % 2 == 0))
    r = np.where(pick_hi, _VALUES[hi], _VALUES[lo])
    r = np.where(mag >= _VALUES[-1], _VALUES[-1], r)
    return (np.sign(q) * r).astype(np.float32) * np.float32(scale)


def _int8_ref(x: np.ndarray, scale: np.ndarray | float) -> np.ndarray:
    q = np.float32(x) / np.float32(scale)
    return np.clip(np.rint(q), -127, 127).astype(np.float32) * np.float32(scale)


def _probe_values(scale: float) -> np.ndarray:
    """Random, heavy-tailed, subnormal-range, exact ties between neighbours, and out-of-range values."""
    rng = np.random.default_rng(0)
    mids = (_VALUES[1:] + _VALUES[:-1]) / 2                               # every e4m3 tie point
    parts = [
        rng.normal(size=4000) * 50,
        rng.standard_t(1, size=4000),
        rng.uniform(-2.0 ** -5, 2.0 ** -5, size=4000),
        np.concatenate([_VALUES, mids, np.nextafter(mids, 0), np.nextafter(mids, 1)]),
        rng.uniform(448, 1e6, size=500) * rng.choice([-1, 1], size=500),
        np.array([448.0, 464.0, 479.9, 480.0, 1e30, 2.0 ** -10, 2.0 ** -10 * 1.01, 3 * 2.0 ** -11]),
    ]
    v = np.concatenate(parts)
    return (np.concatenate([v, -v]) * scale).astype(np.float32)


@pytest.mark.parametrize("scale", [1.0, 0.37, 2.0 ** -7, 1234.5])
def test_fp8_matches_brute_force_e4m3(scale: float) -> None:
    x = _probe_values(scale)
    got = fake_quant(torch.from_numpy(x), scale, FP8_E4M3).numpy()
    np.testing.assert_array_equal(got, _fp8_ref(x, scale))


def test_fp8_per_head_scale_broadcasts() -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_t(2, size=(2, 3, 5, 8)) * 10).astype(np.float32)
    scale = np.array([0.01, 0.5, 3.0], dtype=np.float32)[:, None, None]
    got = fake_quant(torch.from_numpy(x), torch.from_numpy(scale), FP8_E4M3).numpy()
    want = np.stack([_fp8_ref(x[:, h], scale[h, 0, 0]) for h in range(3)], axis=1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("scale", [1.0, 0.37, 55.0])
def test_int8_matches_numpy(scale: float) -> None:
    rng = np.random.default_rng(2)
    ties = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.5, 128.0, 1e9])
    x = np.concatenate([rng.normal(size=3000) * 80, rng.standard_t(1, size=3000) * 30, ties]) * scale
    x = x.astype(np.float32)
    got = fake_quant(torch.from_numpy(x), scale, INT8).numpy()
    np.testing.assert_array_equal(got, _int8_ref(x, scale))


def test_default_scale_saturates_and_flushes() -> None:
    x = torch.tensor([1000.0, -1000.0, 1e-4, -1e-4, 2.0 ** -10, 2.0 ** -9])
    assert fake_quant(x, 1.0, FP8_E4M3).tolist() == [448.0, -448.0, 0.0, 0.0, 0.0, 2.0 ** -9]
    assert fake_quant(x, 1.0, INT8).tolist() == [127.0, -127.0, 0.0, 0.0, 0.0, 0.0]


def test_returns_input_dtype_computed_in_float32() -> None:
    x = torch.randn(64) * 30
    got = fake_quant(x.to(torch.bfloat16), 0.1, FP8_E4M3)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, fake_quant(x.to(torch.bfloat16).float(), 0.1, FP8_E4M3).to(torch.bfloat16))
    assert quantize(x, 0.1, INT8).dtype == torch.float32


@settings(max_examples=300, deadline=None)
@given(q=st.floats(2.0 ** -6, 448.0), sign=st.sampled_from([-1.0, 1.0]), scale=st.floats(1e-3, 1e3))
def test_fp8_relative_error_of_normal_values(q: float, sign: float, scale: float) -> None:
    x = torch.tensor([sign * q * scale], dtype=torch.float32)
    ratio = float(x.abs() / torch.tensor(scale, dtype=torch.float32))
    assume(2.0 ** -6 <= ratio <= 448.0)
    rel = float((fake_quant(x, scale, FP8_E4M3) - x).abs() / x.abs())
    assert rel <= 2.0 ** -4


@settings(max_examples=300, deadline=None)
@given(x=st.floats(width=32, allow_nan=False, allow_infinity=False), scale=st.floats(2.0 ** -13, 2.0 ** 13, width=32))
def test_fp8_any_float_matches_brute_force(x: float, scale: float) -> None:
    got = fake_quant(torch.tensor([x], dtype=torch.float32), scale, FP8_E4M3).numpy()
    np.testing.assert_array_equal(got, _fp8_ref(np.array([x], dtype=np.float32), scale))


def test_saturation_fraction_counts_values_beyond_qmax() -> None:
    x = torch.tensor([1000.0, 200.0, -500.0, 0.0, 1.0, 448.0, -127.0])
    assert saturation_fraction(x, 1.0, FP8_E4M3).item() == pytest.approx(2 / 7)
    assert saturation_fraction(x, 1.0, INT8).item() == pytest.approx(4 / 7)
    assert saturation_fraction(x, 10.0, FP8_E4M3).item() == 0.0


@pytest.mark.parametrize("dtype", [FP8_E4M3, INT8])
def test_underflow_fraction_matches_brute_force(dtype) -> None:
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-2.0 ** -7, 2.0 ** -7, 5000), rng.normal(size=500), np.zeros(300)])
    x = x.astype(np.float32)
    scale = 4.0 if dtype is FP8_E4M3 else 0.01                           # |x / scale| reaches 2^-9 / 0.78
    ref = _fp8_ref(x, scale) if dtype is FP8_E4M3 else _int8_ref(x, scale)
    want = np.sum((x != 0) & (ref == 0)) / np.sum(x != 0)
    got = underflow_fraction(torch.from_numpy(x), scale, dtype).item()
    assert got == pytest.approx(want, abs=1e-7)
    assert 0.3 < got < 1.0


def test_underflow_fraction_fp8_edges() -> None:
    x = torch.tensor([2.0 ** -10, 2.0 ** -10 * 1.01, 1e-4, 0.0, 1.0])   # tie to 0, rounds up, flushed, -, kept
    assert underflow_fraction(x, 1.0, FP8_E4M3).item() == pytest.approx(2 / 4)
    assert underflow_fraction(torch.zeros(5), 1.0, FP8_E4M3).item() == 0.0


def test_by_name() -> None:
    assert kv_dtype("fp8_e4m3") is FP8_E4M3 and kv_dtype("int8") is INT8
    assert (FP8_E4M3.qmax, INT8.qmax) == (448.0, 127.0)
    with pytest.raises(ValueError, match="fp16.*fp8_e4m3.*int8"):
        kv_dtype("fp16")
