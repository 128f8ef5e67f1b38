"""The dynamic per-token-head caches (calib.evaluation.dynamic) against brute force: plain Python loops over
every (token, head), float32 rounding by struct, the FP8 e4m3 grid by enumerating its 256 bit patterns, and
the Hadamard matrix by Sylvester's construction. Each reference follows vLLM's kernel as its docstring states
it (the write kernels cited there), independently of the torch code under test."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from calib.evaluation import dynamic
from calib.evaluation.arms import Geometry, format_arms
from calib.evaluation.fakequant import fake_quant_terms
from calib.recipe import dtypes
from calib.recipe.dtypes import FP8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD, INT8_PER_TOKEN_HEAD

# vLLM 0.32 `_get_rht_signs(64, 0, "cpu")`, printed in its own environment (+ is +1)
VLLM_SIGNS_64 = "+-++----+--++-+-++--+++-+-+--++-+---++-++-+-++---------+-------+"


def f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def f32_bits(v: float) -> int:
    return struct.unpack("i", struct.pack("f", v))[0]


def from_bits(b: int) -> float:
    return struct.unpack("f", struct.pack("i", b))[0]


def e4m3_values() -> list[tuple[float, int]]:
    """(value, mantissa bits) of every finite non-negative e4m3fn pattern."""
    out = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue                        # NaN
            v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            out.append((v, m))
    return out


E4M3 = e4m3_values()


def e4m3_rne(v: float) -> float:
    a = min(abs(v), 448.0)
    best = min(E4M3, key=lambda vm: (abs(vm[0] - a), vm[1] % 2))      # nearest, ties to the even mantissa
    return math.copysign(best[0], v)


def tokens(x: torch.Tensor) -> list[list[float]]:
    """Every (token, head) vector of x [b, h, s, d] as Python floats."""
    b, h, s, d = x.shape
    return [x[i, j, t].tolist() for i in range(b) for j in range(h) for t in range(s)]


def brute_symmetric(vec: list[float], qmax: float, integer: bool) -> tuple[list[float], float]:
    amax = max(abs(v) for v in vec)
    scale = max(f32(amax / qmax), f32(1e-6))
    inv = f32(1.0 / scale)
    codes = []
    for v in vec:
        q = f32(v * inv)
        if integer:
            q = f32(q + 0.5) if q >= 0 else f32(q - 0.5)
            codes.append(float(math.trunc(max(-128.0, min(127.0, q)))))
        else:
            codes.append(e4m3_rne(max(-448.0, min(448.0, q))))
    return codes, scale


def sample(shape=(1, 2, 7, 16), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.tensor([0.01, 3.0]).reshape(1, 2, 1, 1)
    x[0, 0, 3] = 0.0                              # an all-zero vector: the 1e-6 floor
    x[0, 1, 4, 5] = 50.0                          # an outlier: every other value of that vector shrinks
    return x


@pytest.mark.parametrize("fmt,integer", [(FP8_PER_TOKEN_HEAD, False), (INT8_PER_TOKEN_HEAD, True)])
def test_fp8_and_int8_per_token_head_match_the_kernel_by_brute_force(fmt, integer):
    x = sample()
    codes_fn = dynamic.int8_codes if integer else dynamic.fp8_codes
    codes, scale = codes_fn(x)
    got_codes, got_scales = codes.reshape(-1, x.shape[-1]).tolist(), scale.reshape(-1).tolist()
    for n, vec in enumerate(tokens(x)):
        want, s = brute_symmetric(vec, fmt.qmax, integer)
        assert got_scales[n] == s, n
        assert got_codes[n] == want, n
    back = dynamic.read_back(x, fmt)
    assert torch.equal(back, codes * scale)
    assert scale.dtype == torch.float32


def test_int8_rounds_half_away_from_zero_not_to_even():
    # amax 127 -> scale 1.0 exactly: 2.5 -> 3, -2.5 -> -3 (torch.round would give 2, -2)
    x = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 1.5] + [0.0] * 2).reshape(1, 1, 1, 8)
    codes, scale = dynamic.int8_codes(x)
    assert scale.item() == 1.0
    assert codes.reshape(-1).tolist()[:6] == [127.0, 3.0, -3.0, 1.0, -1.0, 2.0]


def test_fp8_per_token_head_rounds_to_nearest_even_on_the_e4m3_grid():
    # amax 448 -> scale 1.0; spacing 1 in [8, 16): 9.5 -> 10 (mantissa 2, even), 10.5 -> 10, -11.5 -> -12
    x = torch.tensor([448.0, 9.5, 10.5, -11.5, 0.0, 17.0, 1e-9, 0.0]).reshape(1, 1, 1, 8)
    codes, scale = dynamic.fp8_codes(x)
    assert scale.item() == 1.0
    assert codes.reshape(-1).tolist() == [e4m3_rne(v) for v in x.reshape(-1).tolist()]
    assert codes.reshape(-1).tolist()[1:4] == [10.0, 10.0, -12.0]


def test_the_rotation_signs_are_vllms():
    assert "".join("+" if v > 0 else "-" for v in dynamic.rht_signs(64).tolist()) == VLLM_SIGNS_64


def sylvester(n: int) -> list[list[int]]:
    h = [[1]]
    while len(h) < n:
        h = [row + row for row in h] + [row + [-v for v in row] for row in h]
    return h


def brute_int4(vec: list[float]) -> tuple[list[float], list[float]]:
    """(codes, read-back in the original space) of one vector, rotation by the Sylvester matrix (d a power of 2)."""
    d = len(vec)
    h, signs = sylvester(d), dynamic.rht_signs(d).tolist()
    rot = [f32(sum(h[j][i] * signs[i] * vec[i] for i in range(d))) for j in range(d)]
    lo, hi = min(rot), max(rot)
    scale = max(f32(f32(hi - lo) / 15.0), f32(1e-6))
    t = f32(-lo / scale)
    zp = float(min(15, max(0, math.trunc(f32(t + 0.5) if t >= 0 else f32(t - 0.5)))))
    inv = f32(1.0 / scale)
    codes = []
    for v in rot:
        s = f32(v * inv + zp)
        codes.append(float(min(15, max(0, math.trunc(f32(s + 0.5) if s >= 0 else f32(s - 0.5))))))
    read = from_bits(f32_bits(scale) & ~0xF)
    deq = [f32((q - zp) * read) for q in codes]
    back = [signs[j] * sum(h[j][i] * deq[i] for i in range(d)) / d for j in range(d)]
    return codes, back


def test_int4_per_token_head_matches_the_kernel_by_brute_force():
    g = torch.Generator().manual_seed(1)
    # multiples of 1/8 below 8 in magnitude: every rotated sum is exact in float32, so the codes compare exactly
    x = (torch.randint(-64, 64, (1, 2, 5, 16), generator=g).float() / 8)
    x[0, 0, 2] = 0.0
    rotated = dynamic.rht(x)
    codes, zp, read = dynamic.int4_codes(rotated)
    back = dynamic.int4_per_token_head(x)
    for n, vec in enumerate(tokens(x)):
        want_codes, want_back = brute_int4(vec)
        assert codes.reshape(-1, 16)[n].tolist() == want_codes, n
        assert back.reshape(-1, 16)[n].tolist() == pytest.approx(want_back, rel=1e-6, abs=1e-6), n
    assert ((codes >= 0) & (codes <= 15)).all() and ((zp >= 0) & (zp <= 15)).all()
    # the zero point rides in the scale's low mantissa bits: the scale attention reads has them cleared
    assert (read.view(torch.int32) & 0xF).eq(0).all()


def test_int4_rotation_is_block_diagonal_for_head_dims_that_are_not_powers_of_two():
    x = torch.randn(2, 1, 3, 96)                 # 96 = 3 x 32
    y = dynamic.rht(x)
    for blk in range(3):
        part = x[..., 32 * blk:32 * (blk + 1)]
        assert torch.allclose(y[..., 32 * blk:32 * (blk + 1)], dynamic.rht(part), atol=1e-5)
    assert torch.allclose(dynamic.rht(y, inverse=True) / 32, x, atol=1e-5)


def test_int4_error_is_bounded_by_half_a_step_of_each_vectors_range():
    x = torch.randn(1, 2, 9, 64, dtype=torch.float32)
    back = dynamic.int4_per_token_head(x)
    rot = dynamic.rht(x)
    step = (rot.amax(-1, keepdim=True) - rot.amin(-1, keepdim=True)) / 15
    # the rotated-space error is at most one step per element (zero-point rounding adds up to half a step)
    err_rot = dynamic.rht(back) - rot
    assert (err_rot.abs() <= step * 1.0001 + 1e-6).all()


@pytest.mark.parametrize("fmt", [FP8_PER_TOKEN_HEAD, INT8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD])
def test_the_hook_reads_back_what_the_kernel_stores(fmt):
    x = sample((2, 2, 5, 32), seed=3)
    geo = Geometry((0,), 2, 32)
    (arm,) = format_arms(geo, [fmt.name])
    assert arm.dtype is fmt and arm.kind == "format"
    x_hat, terms = fake_quant_terms(x, arm.k[0], arm.dtype, None, True)
    assert torch.equal(x_hat, dynamic.read_back(x, fmt).to(x.dtype))
    sat, flush, nonzero, n, signal, noise = terms.tolist()
    assert sat == 0 and n == x.numel() and signal == pytest.approx(float((x.double() ** 2).sum()))
    assert noise == pytest.approx(float(((x.double() - x_hat.double()) ** 2).sum()))


def test_fewer_bits_lose_more():
    x = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(5))
    err = {f.name: float((dynamic.read_back(x, f) - x).pow(2).mean()) for f in
           (FP8_PER_TOKEN_HEAD, INT8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD)}
    assert err["int8_per_token_head"] < err["fp8_per_token_head"] < err["int4_per_token_head"]


def test_bytes_per_token_count_the_per_token_scales():
    # SmolLM2-135M: 3 KV heads of 64 per layer. By hand: K and V, 64 values each, per head, + 4-byte scales.
    heads, dim = 3, 64
    assert dtypes.model_bytes_per_token("bfloat16", heads, dim) == 3 * 128 * 2
    assert dtypes.FP8_E4M3.bytes_per_token(heads, dim) == 3 * 128
    assert dtypes.FP8_E5M2.bytes_per_token(heads, dim) == 3 * 128
    assert FP8_PER_TOKEN_HEAD.bytes_per_token(heads, dim) == 3 * (128 + 8)
    assert INT8_PER_TOKEN_HEAD.bytes_per_token(heads, dim) == 3 * (128 + 8)
    assert INT4_PER_TOKEN_HEAD.bytes_per_token(heads, dim) == 3 * (64 + 8)


def test_recipes_still_calibrate_only_static_dtypes():
    assert sorted(dtypes.KV_DTYPES) == ["fp8_e4m3", "int8"]
    assert set(dtypes.KV_DTYPES) < set(dtypes.KV_FORMATS)
    with pytest.raises(ValueError, match="accepted"):
        dtypes.kv_dtype("int4_per_token_head")
    assert dtypes.kv_format("int4_per_token_head") is INT4_PER_TOKEN_HEAD


def test_the_format_names_agree_with_the_support_matrix():
    from calib.recipe import support

    assert set(support.KV_FORMATS) == set(dtypes.KV_FORMATS)
    assert set(support.DYNAMIC_FORMATS) == {n for n, d in dtypes.KV_FORMATS.items() if d.dynamic}
