"""Engine emulation: exact FP8 conversions against independent references (torch's float8 casts, a brute-force
walk of the grid, a bit-level replay of vLLM's CPU kernel), FA3-style attention against plain attention, and
the modes wired through the evaluation hook, the report and the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from calib.evaluation import emulate
from calib.scales import fp8
from calib.evaluation.arms import Arm, Geometry, checkpoint_arms, default_arm
from calib.evaluation.fakequant import FakeQuantKV, cache_codes, fake_quant_kv
from calib.recipe.dtypes import FP8_E4M3, INT8
from calib.scales.quant import fake_quant
from tiny import random_sequences, tiny_causal_lm

TORCH_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def probe_values(fmt: fp8.Format) -> torch.Tensor:
    """Every grid value, every midpoint between neighbours and one float32 ulp either side of each, values past
    the largest finite one, values below the smallest subnormal, and a spread of random magnitudes; both signs."""
    g = fmt.grid().double()
    mids = (g[1:] + g[:-1]) / 2
    quantum = 2.0 ** (fmt.emin - fmt.man_bits)                          # the subnormal spacing
    pts = torch.cat([g, mids, torch.tensor([fmt.max * 1.03, fmt.max * 1.2, fmt.max * 4, 1e30,
                                            quantum / 2, quantum / 3, quantum * 0.99])]).float()
    near = torch.cat([torch.nextafter(pts, torch.tensor(math.inf)), torch.nextafter(pts, torch.tensor(0.0))])
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(20000, generator=gen) * 2.0 ** torch.randint(-20, 18, (20000,), generator=gen).float()
    v = torch.cat([pts, near, rand])
    return torch.cat([v, -v])


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_round_to_nearest_even_matches_torch_float8_bit_for_bit(name):
    fmt = getattr(fp8, name.upper())
    x = probe_values(fmt)
    got = fp8.round_fp8(x, fmt, fp8.RNE)
    want = x.clamp(-fmt.max, fmt.max).to(TORCH_DTYPE[name]).float()   # torch's cast, saturated explicitly
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))   # signed zeros included


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_round_toward_zero_is_the_largest_grid_value_not_above_x(name):
    fmt = getattr(fp8, name.upper())
    assert len(fmt.grid()) == {"e4m3": 127, "e5m2": 124}[name]       # finite non-negative codes
    x = probe_values(fmt)
    grid = fmt.grid().double()
    a = x.double().abs().clamp(max=fmt.max)
    want = grid[torch.searchsorted(grid, a, right=True) - 1] * torch.sign(x.double())
    got = fp8.round_fp8(x, fmt, fp8.RZ).double()
    assert torch.equal(got, want)
    assert (got.abs() <= x.double().abs()).all()
    assert (got != fp8.round_fp8(x, fmt, fp8.RNE).double()).float().mean() > 0.2   # the two really differ


def _vllm_cpu_bits(v: np.ndarray) -> np.ndarray:
    """vLLM CPU's e4m3 cache write replayed on the bits (numpy float32, IEEE subnormals): clamp to +-448,
    multiply by 2^-120, take bits 26..20 as the code, 0x7E at most, sign from bit 31."""
    v = np.clip(v.astype(np.float32), np.float32(-448), np.float32(448))
    bits = (v * np.float32(2.0 ** -120)).view(np.uint32)
    code = np.minimum((bits >> 20) & 0x7F, 0x7E)
    return np.where(v == 0, 0, code | ((bits >> 24) & 0x80)).astype(np.uint8)


def _decode_e4m3(codes: np.ndarray) -> np.ndarray:
    return torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()


def test_vllm_cpu_write_matches_a_bit_level_replay_of_the_kernel():
    x = probe_values(fp8.E4M3)
    # values a hair below a subnormal step: the kernel's float32-subnormal product rounds them up first
    steps = torch.arange(1, 9, dtype=torch.float32) * 2.0 ** -9
    hair = torch.cat([steps - 2.0 ** -30, steps - 2.0 ** -27, steps + 2.0 ** -30])
    x = torch.cat([x, hair, -hair])
    want = _decode_e4m3(_vllm_cpu_bits(x.numpy()))
    got = fp8.vllm_cpu_e4m3(x).numpy()
    assert np.array_equal(got, want)
    # the double rounding moves the values a hair below a step (16 of them here) up to plain truncation's next code
    plain = fp8.round_fp8(x, fp8.E4M3, fp8.RZ).numpy()
    tail = slice(len(x) - 2 * len(hair), None)
    assert (got[tail] != plain[tail]).sum() == 16


def test_scale_ops_follow_each_kernel():
    x = torch.tensor([[0.3, -5.0, 100.0, 1e-3, 7.77]], dtype=torch.float32)
    s = torch.tensor(0.37)
    assert torch.equal(fp8.quantize(x, s, scale_op="divide"), fp8.round_fp8(x / s))
    assert torch.equal(fp8.quantize(x, s, scale_op="reciprocal"), fp8.round_fp8(x * (1 / s)))
    xb = x.to(torch.bfloat16)
    inv_bf16 = (1 / s).to(torch.bfloat16)
    want = fp8.round_fp8((xb * inv_bf16).float())
    assert torch.equal(fp8.quantize(xb, s, scale_op="reciprocal-model", work_dtype=torch.bfloat16), want)
    with pytest.raises(ValueError, match="scale_op"):
        fp8.quantize(x, s, scale_op="nope")
    with pytest.raises(ValueError, match="rounding"):
        fp8.round_fp8(x, rounding="up")


# ------------------------------------------------------------------------------------------- registry

def test_registry_names_modes_and_sources():
    assert emulate.names() == ("vllm-cpu", "vllm-fa3", "trtllm", "kv-only")
    assert emulate.DEFAULT == "vllm-cpu"
    with pytest.raises(ValueError, match="accepted: vllm-cpu, vllm-fa3, trtllm, kv-only"):
        emulate.by_name("vllm")
    cpu, fa3 = emulate.by_name("vllm-cpu"), emulate.by_name("vllm-fa3")
    assert cpu.k.rounding == "rz-cpu" and cpu.q is None and cpu.p is None
    assert fa3.q and fa3.p and fa3.attention == "fa3" and fa3.k.rounding == "rne"
    for e in emulate.EMULATIONS.values():
        d = e.describe()
        assert {"mode", "engine", "description", "q", "k", "v", "p", "sources", "line"} <= set(d)
        assert json.loads(json.dumps(d)) == d
        assert e.name in d["line"]
        if e.name != "kv-only":
            assert all(any(ext in s for ext in (".cpp", ".hpp", ".cu", ".h", ".py")) for s in e.sources[:2])
    code = "import sys, calib.evaluation.emulate; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


# ------------------------------------------------------------------------------------------- the hook

class _Layer(torch.nn.Module):
    layer_idx = 0


def _spy_attend(mode: str, k: torch.Tensor, v: torch.Tensor, scale: float):
    seen = []

    def spy(module, query, key, value, mask, **kw):
        seen.append((key, value))
        return value.transpose(1, 2), None

    state = FakeQuantKV(emulate.by_name(mode))
    with state.applying(Arm("x", FP8_E4M3, {0: torch.tensor(scale)}, {0: torch.tensor(scale)})):
        state.attend(spy, _Layer(), torch.zeros(1, 2, k.shape[2], k.shape[3]), k, v, None)
    return seen[0]


def test_hook_quantises_kv_the_way_each_mode_says():
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(1, 2, 8, 16, generator=g) * 40 for _ in range(2))
    scale = 0.3
    k_cpu, _ = _spy_attend("vllm-cpu", k, v, scale)
    inv = np.float32(1) / np.float32(scale)
    want = _decode_e4m3(_vllm_cpu_bits(k.numpy() * inv)) * np.float32(scale)
    assert np.array_equal(k_cpu.numpy(), want)
    k_rn, _ = _spy_attend("kv-only", k, v, scale)
    assert torch.equal(k_rn, fake_quant(k, scale, FP8_E4M3))
    assert not torch.equal(k_rn, k_cpu) and (k_cpu.abs() <= k.abs() * 1.0001).all()   # truncation shrinks
    k_trt, _ = _spy_attend("trtllm", k.to(torch.bfloat16), v.to(torch.bfloat16), scale)
    inv_b = torch.tensor(1 / scale).to(torch.bfloat16)
    want_trt = (fp8.round_fp8((k.to(torch.bfloat16) * inv_b).float()) * scale).to(torch.bfloat16)
    assert torch.equal(k_trt, want_trt)


def test_int8_arms_round_to_nearest_in_every_mode():
    k = torch.randn(1, 2, 4, 16) * 3
    for mode in emulate.names():
        state = FakeQuantKV(emulate.by_name(mode))
        assert torch.equal(cache_codes(k, 0.05, INT8, state.emulation.k), torch.round(k / 0.05).clamp(-127, 127))


# ------------------------------------------------------------------------------------------- FA3-style attention

def _plain_attention(q, k, v, scaling, mask=None):
    rep = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) * scaling
    t = k.shape[2]
    causal = torch.ones(q.shape[2], t, dtype=torch.bool).tril(t - q.shape[2])
    m = causal if mask is None else causal & mask
    s = s.masked_fill(~m, -math.inf)
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)


def test_fp8_attention_without_q_and_p_rounding_is_plain_attention():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    got = fp8.fp8_attention(q, k, v, scaling=0.25, quant_q=False, quant_p=False, chunk=4)
    torch.testing.assert_close(got.double(), _plain_attention(q, k, v, 0.25), rtol=1e-5, atol=1e-6)
    pad = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    pad[1, ..., 6:] = False                         # a padded key never receives weight
    got = fp8.fp8_attention(q, k, v, scaling=0.25, mask=pad & torch.ones(9, 9, dtype=torch.bool).tril(),
                            quant_q=False, quant_p=False)
    torch.testing.assert_close(got.double(), _plain_attention(q, k, v, 0.25, pad), rtol=1e-5, atol=1e-6)


def test_fp8_attention_rounds_q_and_p_like_torch_float8_casts():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 2, 5, 8, generator=g) * 3, torch.randn(1, 1, 5, 8, generator=g), torch.randn(1, 1, 5, 8, generator=g)
    qs = 0.02
    got = fp8.fp8_attention(q, k, v, scaling=0.3, q_scale=qs)
    # independent path: torch's float8 casts, float64 arithmetic
    qq = (q * (1 / torch.tensor(qs))).clamp(-448, 448).to(torch.float8_e4m3fn).double() * qs
    s = (qq @ k.double().repeat_interleave(2, 1).transpose(-1, -2) * 0.3).masked_fill(
        ~torch.ones(5, 5, dtype=torch.bool).tril(), -math.inf)
    p = torch.exp(s - s.amax(-1, keepdim=True)) * 256
    p8 = p.float().to(torch.float8_e4m3fn).double()
    want = (p8 @ v.double().repeat_interleave(2, 1) / p.sum(-1, keepdim=True)).transpose(1, 2)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert (got.double() - _plain_attention(q, k, v, 0.3)).abs().max() > 1e-3    # the rounding is visible


def test_fa3_mode_in_a_real_model_matches_its_own_attention_when_q_and_p_stay_wide():
    """The FA3 path through transformers (mask, GQA, scaling, layout): with Q and P left unrounded it must give the
    model's own logits on the same quantised K/V, with and without padding."""
    model = tiny_causal_lm("llama")
    wide = emulate.Emulation("fa3-wide", "test", k=emulate.Cast("rne", "divide", "k_scale"),
                             v=emulate.Cast("rne", "divide", "v_scale"), attention="fa3")
    arm = Arm("a", FP8_E4M3, {i: torch.tensor(0.01) for i in range(3)}, {i: torch.tensor(0.01) for i in range(3)})
    seqs = random_sequences(2, lo=12, hi=13, seed=4)
    ids = torch.tensor(seqs)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    logits = {}
    for mode in (emulate.by_name("kv-only"), wide, emulate.by_name("vllm-fa3")):
        with fake_quant_kv(model, mode) as hook, torch.inference_mode(), hook.applying(arm):
            logits[mode.name] = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits["fa3-wide"][real], logits["kv-only"][real], rtol=1e-4, atol=1e-4)
    assert (logits["vllm-fa3"][real] - logits["kv-only"][real]).abs().max() > 1e-4


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_fa3_mode_takes_the_models_window_and_softcap_and_drops_the_mask_only_for_right_padding(
        arch, padding, monkeypatch):
    """With Q and P left unrounded the blockwise path must reproduce the model's own attention on the same
    quantised K/V (its sliding window of 8 and, for gemma2, its logit softcap, over 20 tokens): the window and
    softcap reach FA3 as the model declares them. A right-padded batch attends without the dense mask; a
    left-padded one keeps it."""
    from calib.evaluation import fa3
    model = tiny_causal_lm(arch)
    wide = emulate.Emulation("fa3-wide", "test", k=emulate.Cast("rne", "divide", "k_scale"),
                             v=emulate.Cast("rne", "divide", "v_scale"), attention="fa3")
    arm = Arm("a", FP8_E4M3, {i: torch.tensor(0.01) for i in range(3)}, {i: torch.tensor(0.01) for i in range(3)})
    ids = torch.tensor(random_sequences(2, lo=20, hi=21, seed=5))
    mask = torch.ones_like(ids)
    if padding == "right":
        mask[1, 14:] = 0
    else:
        mask[1, :6] = 0
    calls = []
    real_fa3 = fa3.fa3_attention

    def spy(*a, **kw):
        calls.append(kw)
        return real_fa3(*a, **kw)

    monkeypatch.setattr(fa3, "fa3_attention", spy)
    logits = {}
    for mode in (emulate.by_name("kv-only"), wide):
        with fake_quant_kv(model, mode) as hook, torch.inference_mode(), \
                hook.applying(arm, token_mask=mask.bool()):
            logits[mode.name] = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits["fa3-wide"][real], logits["kv-only"][real], rtol=1e-4, atol=1e-4)
    assert len(calls) == 3
    windows = {c["window_left"] for c in calls}
    assert windows == ({7, None} if arch == "gemma2" else {7})       # gemma2 alternates sliding / global
    assert {c["softcap"] for c in calls} == ({50.0} if arch == "gemma2" else {None})
    assert all((c["mask"] is None) == (padding == "right") and c["causal"] for c in calls)
    assert all(float(c["k_scale"]) == pytest.approx(0.01) for c in calls)


def test_checkpoint_q_scale_reaches_the_arm(tmp_path):
    from safetensors.torch import save_file

    from tiny import tiny_config
    ck = tmp_path / "ck"
    ck.mkdir()
    tiny_config("llama").save_pretrained(ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                                  "ignore": [], "quantization_status": "compressed",
                                  "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                      "dynamic": False, "symmetric": True}}
    (ck / "config.json").write_text(json.dumps(cfg))
    t = {}
    for i in range(3):
        t[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5)
        t[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
        t[f"model.layers.{i}.self_attn.q_scale"] = torch.tensor([0.1, 0.3, 0.2, 0.1])
    save_file(t, str(ck / "model.safetensors"))
    geo = Geometry((0, 1, 2), 2, 16)
    (arm,) = checkpoint_arms(str(ck), geo)
    assert float(arm.q_scale(1)) == pytest.approx(0.3) and arm.info().scales["q"]["1"] == pytest.approx(0.3)
    assert any("q_scale folded" in n for n in arm.notes)
    assert default_arm(geo, FP8_E4M3).q_scale(0) == 1.0


def test_eval_cli_records_the_emulation(tmp_path, token_data):
    from click.testing import CliRunner

    from calib.cli import main
    src = tmp_path / "m"
    tiny_causal_lm("llama").save_pretrained(src)
    r = CliRunner().invoke(main, ["eval", "--model", str(src), "--data", str(token_data), "--buckets", "32",
                                  "--samples", "4", "--no-plots", "--passkey-trials", "0", "--device", "cpu",
                                  "--emulate", "vllm-fa3", "--out", str(tmp_path / "ev")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert doc["emulation"]["mode"] == "vllm-fa3" and doc["config"]["emulate"] == "vllm-fa3"
    assert doc["emulation"]["description"] == emulate.by_name("vllm-fa3").summary
    md = (tmp_path / "ev" / "report.md").read_text()
    assert f"Emulated engine: {emulate.by_name('vllm-fa3').line()}." in md
    r = CliRunner().invoke(main, ["eval", "--model", str(src), "--emulate", "sglang", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "sglang" in r.output and not (tmp_path / "x").exists()
