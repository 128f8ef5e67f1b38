"""The fake-quant hook: bit-exact against the formats' definitions and torch's float8 cast, padding kept out of
every metric, the hook's switches set per batch and always off after (the arms it applies: test_arms.py)."""

from __future__ import annotations

import math

import pytest
import torch

from calib.evaluation import emulate
from calib.evaluation.arms import TOKEN, Arm, Geometry, default_arm
from calib.evaluation.fakequant import FakeQuantKV, Meter, fake_quant_kv, fake_quant_terms
from calib.recipe.dtypes import FP8_E4M3, INT8
from calib.scales.quant import fake_quant
from helpers import e4m3_nearest
from tiny import random_sequences, tiny_causal_lm


def _values() -> torch.Tensor:
    edge = [0.0, 1e-4, 2 ** -10, 1.5 * 2 ** -10, 2 ** -9, 3 * 2 ** -10, 2 ** -7 * 1.0625, 0.3, 1.0, 17.5, 447.0,
            448.0, 449.0, 464.0, 1000.0, 1e6]
    g = torch.Generator().manual_seed(0)
    rand = (torch.randn(2000, generator=g) * 2.0 ** torch.randint(-13, 11, (2000,), generator=g)).tolist()
    vals = edge + [-x for x in edge] + rand
    return torch.tensor(vals + [0.0] * (3200 - len(vals)), dtype=torch.float32)


@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0 ** -7])
def test_fp8_fake_quant_matches_bit_exact_emulation(scale):
    v = _values()                                   # in units of the scale: x / scale == v exactly
    x = (v * scale).reshape(2, 4, 25, 16)
    x_hat, terms = fake_quant_terms(x, torch.tensor(scale), FP8_E4M3, None, measure=True)
    want = torch.tensor([e4m3_nearest(float(t)) for t in v]) * scale
    assert torch.equal(x_hat.reshape(-1), want)
    # the same through torch's float8 type, clamped explicitly
    assert torch.equal(x_hat.reshape(-1), v.clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale)
    ref = [e4m3_nearest(float(t)) for t in v]
    sat = sum(abs(float(t)) > 448 for t in v)
    flushed = sum(float(t) != 0 and r == 0 for t, r in zip(v, ref))
    assert sat >= 10 and flushed >= 10          # the edge values alone hold 10 of each
    got = terms.tolist()
    assert got[:4] == [sat, flushed, int((v != 0).sum()), v.numel()]
    assert got[4] == pytest.approx(float((x.double() ** 2).sum()), rel=1e-6)
    assert got[5] == pytest.approx(float(((x.double() - want.reshape(x.shape).double()) ** 2).sum()), rel=1e-6)


def test_int8_fake_quant_rounds_half_to_even_and_saturates():
    v = torch.tensor([0.0, 0.4, 0.5, 1.5, 2.5, -2.5, 126.5, 127.0, 128.0, -300.0, 3.2, -0.6] + [0.0] * 4)
    x_hat, terms = fake_quant_terms(v.reshape(1, 1, 1, 16) * 0.25, torch.tensor(0.25), INT8, None, measure=True)
    want = torch.tensor([0, 0, 0, 2, 2, -2, 126, 127, 127, -127, 3, -1] + [0] * 4, dtype=torch.float32) * 0.25
    assert torch.equal(x_hat.reshape(-1), want)
    assert terms[:4].tolist() == [2, 2, 11, 16]     # saturated 128, -300; flushed 0.4, 0.5


def test_granularities_apply_per_head_per_channel_and_per_token():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 7, 8, generator=g) * torch.tensor([1.0, 300.0, 0.01]).view(1, 3, 1, 1)
    x[0, 1, 2, 3] = 5000.0                                          # one outlier
    head = torch.tensor([2.0, 0.5, 1e-4]).view(1, 3, 1, 1)
    channel = torch.rand(1, 3, 1, 8, generator=g) + 0.1
    for scale in (head, channel):
        got, _ = fake_quant_terms(x, scale, FP8_E4M3, None, measure=False)
        for h in range(3):
            assert torch.equal(got[:, h], fake_quant(x[:, h], scale[0, h], FP8_E4M3))
    got, terms = fake_quant_terms(x, TOKEN, FP8_E4M3, None, measure=True)
    for b in range(2):
        for h in range(3):
            for t in range(7):
                s = x[b, h, t].abs().max() / 448
                assert torch.equal(got[b, h, t], fake_quant(x[b, h, t], s, FP8_E4M3))
    assert terms[0] == 0                                            # a token's own max never saturates


def test_padding_never_reaches_a_metric():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 2, 9, 4, generator=g) * 600
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    _, masked = fake_quant_terms(x, torch.tensor(1.0), FP8_E4M3, mask, measure=True)
    parts = [fake_quant_terms(x[:1], torch.tensor(1.0), FP8_E4M3, None, True)[1],
             fake_quant_terms(x[1:, :, :5], torch.tensor(1.0), FP8_E4M3, None, True)[1]]
    torch.testing.assert_close(masked, parts[0] + parts[1], rtol=1e-9, atol=0)


class _Layer(torch.nn.Module):
    layer_idx = 0


def test_hook_hands_quantised_kv_to_the_models_attention_and_measures_it():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) * m for m in (1.0, 700.0, 0.001))
    seen = []

    def spy(module, query, key, value, mask, **kw):     # an "attention" whose output is V itself
        seen.append((key, value))
        return value.transpose(1, 2), None

    state = FakeQuantKV(emulate.by_name("kv-only"))        # K/V rounded to nearest (test_emulate: other modes)
    assert state.attend(spy, _Layer(), q, k, v, None)[0] is not None and seen[-1][0] is k   # no arm: untouched
    meter = Meter()
    with state.applying(Arm("x", FP8_E4M3, {0: torch.tensor(2.0)}, {0: torch.tensor(2 ** -12)}), meter=meter):
        out, _ = state.attend(spy, _Layer(), q, k, v, None)
    assert state.arm is None and state.meter is None                                # switched off after the batch
    k_hat, v_hat = fake_quant(k, 2.0, FP8_E4M3), fake_quant(v, 2 ** -12, FP8_E4M3)
    assert torch.equal(seen[-2][0], k_hat) and torch.equal(seen[-2][1], v_hat)      # quantised first ...
    assert seen[-1][0] is k and torch.equal(out, v_hat.transpose(1, 2))            # ... reference second
    row = meter.read()["0"]
    assert row["k_saturated"] == pytest.approx(float((k.abs() / 2 > 448).float().mean()))
    assert row["k_saturated"] > 0
    assert row["attn_rel_error"] == pytest.approx(float((v - v_hat).norm() / v.norm()), rel=1e-6)
    snr = 10 * math.log10(float((k.double() ** 2).sum() / ((k - k_hat).double() ** 2).sum()))
    assert row["k_snr_db"] == pytest.approx(snr, rel=1e-6)


def test_hook_is_transparent_without_an_arm_and_always_unhooks():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_causal_lm("llama")
    ids = torch.tensor(random_sequences(2, lo=12, hi=13, seed=5))
    before = set(ALL_ATTENTION_FUNCTIONS._global_mapping)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with fake_quant_kv(model) as hook:
            same = model(input_ids=ids).logits
            with hook.applying(default_arm(Geometry((0, 1, 2), 2, 16), FP8_E4M3)):
                changed = model(input_ids=ids).logits
        with pytest.raises(RuntimeError, match="boom"), fake_quant_kv(model):
            raise RuntimeError("boom")
    assert torch.equal(plain, same) and not torch.equal(plain, changed)
    assert model.config._attn_implementation == "sdpa" and set(ALL_ATTENTION_FUNCTIONS._global_mapping) == before


# ------------------------------------------------------------------------------ against brute force, one value at a time

def test_per_head_fake_quant_matches_a_per_element_float8_cast():
    """Each value divided by its head's scale, cast alone through torch's float8_e4m3fn (saturated at 448),
    multiplied back: the tensor path must give exactly that, and count exactly those saturated values."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 3, 5, 8, generator=g) * torch.tensor([0.02, 3.0, 900.0]).view(1, 3, 1, 1)
    scale = torch.tensor([0.001, 0.05, 1.0]).view(1, 3, 1, 1)
    got, terms = fake_quant_terms(x, scale, FP8_E4M3, None, measure=True)
    want, saturated, flushed = torch.empty_like(x), 0, 0
    for b, h, t, d in torch.cartesian_prod(*(torch.arange(n) for n in x.shape)).tolist():
        s = float(scale[0, h, 0, 0])
        q = torch.tensor(float(x[b, h, t, d]) / s, dtype=torch.float32)
        saturated += abs(float(q)) > 448
        code = float(q.clamp(-448, 448).to(torch.float8_e4m3fn).float())
        flushed += code == 0 and float(x[b, h, t, d]) != 0
        want[b, h, t, d] = code * s
    assert torch.equal(got, want)
    assert saturated > 0 and terms[0] == saturated and terms[1] == flushed
    assert terms[3] == x.numel()


def test_meter_reads_shares_snr_and_attention_error_from_its_sums():
    """Two batches' sums of one layer: shares over all values seen, SNR and attention error from the totals."""
    meter = Meter()
    #             sat flush nonzero n   signal noise | V: sat flush nonzero n  signal noise | attn err, ref
    first = [2, 1, 90, 100, 50.0, 0.5, 0, 0, 100, 100, 8.0, 0.0, 0.04, 4.0]
    second = [1, 0, 10, 100, 50.0, 0.5, 0, 3, 100, 100, 2.0, 0.0, 0.05, 5.0]
    meter.add(3, torch.tensor(first, dtype=torch.float64))
    meter.add(3, torch.tensor(second, dtype=torch.float64))
    row = meter.read()["3"]
    assert row["k_saturated"] == 3 / 200 and row["k_flushed"] == 1 / 100
    assert row["k_snr_db"] == pytest.approx(10 * math.log10(100.0 / 1.0))
    assert row["v_saturated"] == 0 and row["v_flushed"] == 3 / 200 and row["v_snr_db"] == math.inf
    assert row["attn_rel_error"] == pytest.approx(math.sqrt(0.09 / 9.0))
    assert list(meter.read()) == ["3"]


def test_applying_switches_the_hook_off_after_the_batch_even_on_error():
    hook = FakeQuantKV()
    arm, meter, mask = Arm("x", FP8_E4M3, {0: torch.tensor(1.0)}), Meter(), torch.ones(1, 4, dtype=torch.bool)
    with hook.applying(arm, meter=meter, token_mask=mask, ranges={}) as h:
        assert h is hook and hook.arm is arm and hook.meter is meter and hook.token_mask is mask and hook.ranges == {}
    assert (hook.arm, hook.meter, hook.token_mask, hook.ranges) == (None, None, None, None)
    with pytest.raises(RuntimeError, match="boom"), hook.applying(arm):
        raise RuntimeError("boom")
    assert hook.arm is None


@pytest.mark.parametrize("case", ["causal", "causal-scaled", "window", "padding-mask"])
def test_long_prefill_reads_the_attention_error_on_its_last_queries(monkeypatch, case):
    """Past DIAG_QUERIES queries the reference attention runs for the last DIAG_QUERIES only: those rows equal the
    same rows of a full reference call (transformers' SDPA with the full mask), and the metric reads them alone."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from calib.evaluation import fakequant

    monkeypatch.setattr(fakequant, "DIAG_QUERIES", 8)
    g = torch.Generator().manual_seed(5)
    b, h, kvh, n, d = 2, 4, 2, 29, 8
    q = torch.randn(b, h, n, d, generator=g)
    k, v = torch.randn(b, kvh, n, d, generator=g), torch.randn(b, kvh, n, d, generator=g)
    layer = _Layer()
    layer.is_causal, layer.num_key_value_groups = True, h // kvh
    rows, cols = torch.arange(n)[:, None], torch.arange(n)[None, :]
    full = (cols <= rows)[None, None].expand(b, 1, n, n).clone()
    mask, kwargs = None, {}
    if case == "causal-scaled":
        kwargs = {"scaling": 0.3}
    if case == "window":
        kwargs = {"sliding_window": 6}
        full &= cols > rows - 6
    if case == "padding-mask":
        full[0, :, :, :3] = False                    # a left-padded row, as a 4-D mask hands it over
        full[0, :, :3, 0] = True
        mask = full
    out = torch.randn(b, n, h, d, generator=g)
    token_mask = torch.ones(b, n, dtype=torch.bool)
    ref, got, m = fakequant._reference_output(sdpa_attention_forward, layer, q, k, v, mask, kwargs, out, token_mask)
    want = sdpa_attention_forward(layer, q, k, v, full, **kwargs)[0][:, -8:]
    assert ref.shape == want.shape == got.shape and torch.allclose(ref, want, atol=1e-6)
    assert torch.equal(got, out[:, -8:]) and m.shape == (b, 8)
    short = fakequant._reference_output(sdpa_attention_forward, layer, q[:, :, :8], k[:, :, :8], v[:, :, :8], None, {},
                                        out[:, :8], token_mask[:, :8])
    assert short[0].shape == (b, 8, h, d) and short[1] is not None          # up to DIAG_QUERIES: every query
