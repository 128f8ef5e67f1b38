"""Evaluation: fake quantisation is bit-exact, metrics count only real tokens, and the verdict follows the numbers.

Tiny random models need two adjustments to behave like real ones where it matters: the LM head is scaled up
(random init gives near-uniform next-token distributions, where no KV error can show), and where K is pushed
beyond FP8's range Q is scaled down by the same factor (so attention stays as sharp as a trained model's
instead of one-hot; real models' K outliers also sit in channels Q barely reads).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from calib import evaluate as ev
from calib import emulate, report
from calib.engine import verdict as honest
from calib.model import find_attention_layers
from calib.observe import capture_kv
from calib.quant import FP8_E4M3, INT8, fake_quant
from tiny import random_sequences, tiny_causal_lm
from helpers import SAMPLE_TEXT, boosted, calibrate_small, eval_config, k_beyond_fp8_model, save_model_and_data, train_tokenizer

PNG = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------ exact emulation of the formats

def e4m3_reference(v: float) -> float:
    """Round-to-nearest-even onto the float8 e4m3fn grid with saturation at ±448, from the format's definition:
    3 mantissa bits, exponent >= -6, subnormals spaced 2^-9 apart."""
    a = abs(v)
    if a == 0:
        return 0.0
    if a >= 448:
        return math.copysign(448.0, v)
    step = 2.0 ** (max(math.floor(math.log2(a)), -6) - 3)
    return math.copysign(round(a / step) * step, v)        # Python's round() is half-to-even


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
    x_hat, terms = ev.fake_quant_terms(x, torch.tensor(scale), FP8_E4M3, None, measure=True)
    want = torch.tensor([e4m3_reference(float(t)) for t in v]) * scale
    assert torch.equal(x_hat.reshape(-1), want)
    # the same through torch's float8 type, clamped explicitly
    assert torch.equal(x_hat.reshape(-1), v.clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale)
    ref = [e4m3_reference(float(t)) for t in v]
    sat = sum(abs(float(t)) > 448 for t in v)
    flushed = sum(float(t) != 0 and r == 0 for t, r in zip(v, ref))
    assert sat >= 10 and flushed >= 10          # the edge values alone hold 10 of each
    got = terms.tolist()
    assert got[:4] == [sat, flushed, int((v != 0).sum()), v.numel()]
    assert got[4] == pytest.approx(float((x.double() ** 2).sum()), rel=1e-6)
    assert got[5] == pytest.approx(float(((x.double() - want.reshape(x.shape).double()) ** 2).sum()), rel=1e-6)


def test_int8_fake_quant_rounds_half_to_even_and_saturates():
    v = torch.tensor([0.0, 0.4, 0.5, 1.5, 2.5, -2.5, 126.5, 127.0, 128.0, -300.0, 3.2, -0.6] + [0.0] * 4)
    x_hat, terms = ev.fake_quant_terms(v.reshape(1, 1, 1, 16) * 0.25, torch.tensor(0.25), INT8, None, measure=True)
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
        got, _ = ev.fake_quant_terms(x, scale, FP8_E4M3, None, measure=False)
        for h in range(3):
            assert torch.equal(got[:, h], fake_quant(x[:, h], scale[0, h], FP8_E4M3))
    got, terms = ev.fake_quant_terms(x, ev.TOKEN, FP8_E4M3, None, measure=True)
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
    _, masked = ev.fake_quant_terms(x, torch.tensor(1.0), FP8_E4M3, mask, measure=True)
    parts = [ev.fake_quant_terms(x[:1], torch.tensor(1.0), FP8_E4M3, None, True)[1],
             ev.fake_quant_terms(x[1:, :, :5], torch.tensor(1.0), FP8_E4M3, None, True)[1]]
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

    state = ev.FakeQuantKV(emulate.by_name("kv-only"))        # K/V rounded to nearest (test_emulate: other modes)
    assert state.attend(spy, _Layer(), q, k, v, None)[0] is not None and seen[-1][0] is k   # no arm: untouched
    state.arm = ev.Arm("x", FP8_E4M3, {0: torch.tensor(2.0)}, {0: torch.tensor(2 ** -12)})
    state.meter = ev.Meter()
    out, _ = state.attend(spy, _Layer(), q, k, v, None)
    k_hat, v_hat = fake_quant(k, 2.0, FP8_E4M3), fake_quant(v, 2 ** -12, FP8_E4M3)
    assert torch.equal(seen[-2][0], k_hat) and torch.equal(seen[-2][1], v_hat)      # quantised first ...
    assert seen[-1][0] is k and torch.equal(out, v_hat.transpose(1, 2))            # ... reference second
    row = state.meter.read()["0"]
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
        with ev.fake_quant_kv(model) as hook:
            same = model(input_ids=ids).logits
            hook.arm = ev.default_arm(ev.Geometry((0, 1, 2), 2, 16), FP8_E4M3)
            changed = model(input_ids=ids).logits
        with pytest.raises(RuntimeError, match="boom"), ev.fake_quant_kv(model):
            raise RuntimeError("boom")
    assert torch.equal(plain, same) and not torch.equal(plain, changed)
    assert model.config._attn_implementation == "sdpa" and set(ALL_ATTENTION_FUNCTIONS._global_mapping) == before


def test_batching_and_padding_do_not_change_the_numbers():
    model = boosted(tiny_causal_lm("llama", seed=1))
    seqs = random_sequences(6, lo=6, hi=30, seed=9)
    samples = tuple(ev.Sample(i, tuple(s), 32) for i, s in enumerate(seqs))
    arm = ev.default_arm(ev.Geometry((0, 1, 2), 2, 16), FP8_E4M3)
    runs = []
    with ev.fake_quant_kv(model) as hook, torch.inference_mode():
        for bs in (1, 4):
            s = ev.Session(model, hook, ev._Head(model), None, samples, (32,), batch_size=bs)
            runs.append(ev.measure(s, [arm])[1]["default"])
    one, four = runs
    assert one["summary"]["kl"] == pytest.approx(four["summary"]["kl"], rel=1e-4)
    assert one["summary"]["tokens"] == four["summary"]["tokens"] == sum(len(s) - 1 for s in seqs)
    for i in one["layers"]:
        for key in ("k_saturated", "v_flushed", "k_snr_db", "attn_rel_error"):
            assert one["layers"][i][key] == pytest.approx(four["layers"][i][key], rel=1e-4)


def test_checkpoint_arms_read_vllm_per_head_and_trtllm_int8_layouts(tmp_path):
    from safetensors.torch import save_file

    geo = ev.Geometry((0, 1), 2, 4)
    for name, extra, scales in (
            ("vllm", {"quantization_config": {"quant_method": "compressed-tensors",
                                              "kv_cache_scheme": {"type": "float", "num_bits": 8}}},
             {"model.layers.{i}.self_attn.k_scale": [[[0.5]], [[2.0]]], "model.layers.{i}.self_attn.v_scale": [[[1.0]], [[3.0]]]}),
            ("trt", {}, {"model.layers.{i}.self_attn.k_proj.k_scale": 0.25, "model.layers.{i}.self_attn.v_proj.v_scale": 0.125})):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"num_hidden_layers": 2, **extra}))
        save_file({k.format(i=i): torch.tensor(v) for i in (0, 1) for k, v in scales.items()}, str(d / "model.safetensors"))
    (tmp_path / "trt" / "hf_quant_config.json").write_text(json.dumps({"quantization": {"kv_cache_quant_algo": "INT8"}}))
    head, folded = ev.checkpoint_arms(str(tmp_path / "vllm"), geo)
    assert head.granularity == "head" and head.dtype is FP8_E4M3
    assert torch.equal(head.k[1], torch.tensor([0.5, 2.0]).view(1, 2, 1, 1))
    assert folded.name.endswith("@tensor") and float(folded.v[0]) == 3.0 and folded.k[0].dim() == 0
    # an emulated engine that reads one scale per layer (vLLM CPU, TensorRT-LLM) gets only the fold, by the
    # checkpoint's own name: that is what serving this checkpoint there applies
    (one,) = ev.checkpoint_arms(str(tmp_path / "vllm"), geo, per_head_kv=False)
    assert one.name == head.name and one.granularity == "tensor" and "folded" in one.notes[-1]
    assert float(one.k[1]) == 2.0 and float(one.v[0]) == 3.0 and one.k[0].dim() == 0
    (trt,) = ev.checkpoint_arms(str(tmp_path / "trt"), geo)
    assert trt.dtype is INT8 and float(trt.k[1]) == 0.25 and float(trt.v[0]) == 0.125
    (tmp_path / "vllm" / "kvcalib.json").write_text(json.dumps({"producer": "kvcalib", "skipped_layers": [1]}))
    skipping = ev.checkpoint_arms(str(tmp_path / "vllm"), geo)[0]      # calibrated with skip_layers: [1]
    assert list(skipping.k) == [0] and skipping.serve_skip == (1,) and skipping.skip == ()
    assert "--kv-cache-dtype-skip-layers 1" in honest.how_to_serve(skipping.describe())
    with pytest.raises(ev.EvalError, match="2 layers; this model has 3"):
        ev.checkpoint_arms(str(tmp_path / "vllm"), ev.Geometry((0, 1, 2), 2, 4))
    with pytest.raises(ev.EvalError, match="per KV head"):
        ev.checkpoint_arms(str(tmp_path / "vllm"), ev.Geometry((0, 1), 3, 4))


def test_buckets_beyond_the_context_are_dropped():
    assert ev.usable_buckets([8192, 512, 2048], 4096) == ((512, 2048), [8192])
    assert ev.usable_buckets([8192], 1024) == ((1024,), [8192])
    assert ev.usable_buckets([64, 16], None) == ((16, 64), [])


def test_markdown_table_rejects_ragged_rows():
    assert report.table(["a", "b"], [[1, "x|y"]])[2] == "| 1 | x\\|y |"
    with pytest.raises(ValueError, match="cells"):
        report.table(["a", "b"], [[1]])


# ------------------------------------------------------------------------------ end to end on tiny models

def pathological_layer(model, layer: int, factor: float = 1e3):
    """Same function, but in `layer` KV head 0's V is x factor and head 1's / factor (o_proj compensates), so a
    per-tensor scale fitted to head 0 flushes head 1 to zero: that layer alone breaks."""
    attn = model.model.layers[layer].self_attn
    d, group = attn.head_dim, model.config.num_attention_heads // model.config.num_key_value_heads
    with torch.no_grad():
        for kv, f in ((0, factor), (1, 1 / factor)):
            attn.v_proj.weight[kv * d:(kv + 1) * d] *= f
            attn.o_proj.weight[:, kv * group * d:(kv + 1) * group * d] /= f
    return model


@pytest.fixture(scope="module")
def k1000(tmp_path_factory):
    """One eval of the |K| ~ 2000 model: default, a calibrated vLLM checkpoint, and a statistics-only output."""
    tmp = tmp_path_factory.mktemp("k1000")
    src, data = save_model_and_data(tmp, k_beyond_fp8_model(), "model")
    ckpt = calibrate_small(src, data, tmp / "ckpt")
    stats = calibrate_small(src, data, tmp / "stats", targets="", granularity="channel")
    res = ev.run_eval(eval_config(src, data, tmp / "report", scales=(str(ckpt),), stats=str(stats)))
    return res, ckpt, stats, src, data


def test_model_k_really_exceeds_fp8_range(k1000):
    res, _, _, src, _ = k1000
    model = k_beyond_fp8_model()
    with capture_kv(model.model, find_attention_layers(model.model)) as cap, torch.no_grad():
        model.model(input_ids=torch.tensor(random_sequences(4, lo=40, hi=41, seed=3)))
    assert all(float(s.k_amax.max()) > 1000 for s in cap.stats().values())
    ranges = res.report["arms"][res.report["reference"]]["ranges"]
    assert all(max(r["k_amax"]) > 1000 for r in ranges.values())


def test_default_scale_saturates_and_calibrated_wins(k1000):
    res, ckpt, _, _, _ = k1000
    arms = res.report["arms"]
    default, cal = arms["default"], arms[f"calibrated:{ckpt}"]
    for i in default["layers"]:
        assert default["layers"][i]["k_saturated"] > 0.01            # a few % of K clipped at 448
        assert cal["layers"][i]["k_saturated"] < 0.001               # held-out data barely exceeds calibration
        assert cal["layers"][i]["k_snr_db"] > default["layers"][i]["k_snr_db"] + 10
    assert default["summary"]["kl"] >= 10 * cal["summary"]["kl"]
    assert default["summary"]["top1"] < cal["summary"]["top1"]
    assert not default["within_threshold"] and cal["within_threshold"]
    v = res.verdict
    assert v["action"] == "ship" and v["arm"] in {f"calibrated:{ckpt}", *(n for n in arms if n.startswith("per-"))}
    assert arms[v["arm"]]["shippable"] and "default" not in v["within_threshold"]
    assert v["text"].startswith(f"Ship `{v['arm']}`")


def test_identical_scales_give_identical_numbers(k1000):
    res, ckpt, stats, _, _ = k1000
    arms = res.report["arms"]
    a, b = arms[f"calibrated:{ckpt}"], arms[f"per-tensor:{stats}"]
    assert a["scales"] == b["scales"]
    for key in ("buckets", "summary", "layers"):
        assert a[key] == b[key]
    assert [f["mean_kl"] for f in a["failures"]] == [f["mean_kl"] for f in b["failures"]]


def test_finer_granularities_are_measured_but_never_shipped(k1000):
    res, _, stats, _, _ = k1000
    arms = res.report["arms"]
    for gran in ("tensor", "head", "channel", "token"):
        assert f"per-{gran}:{stats}" in arms
    assert not arms[f"per-channel:{stats}"]["shippable"] and not arms[f"per-token:{stats}"]["shippable"]
    assert arms[f"per-token:{stats}"]["summary"]["kl"] < arms["default"]["summary"]["kl"]


def test_held_out_samples_exclude_the_calibration_samples(k1000):
    res, ckpt, _, _, _ = k1000
    held = res.report["data"]["held_out"]
    assert held == {"checked_against": str(ckpt), "calibration_samples": 24, "reproduced_exactly": True,
                    "excluded_samples": 24}
    assert res.report["data"]["samples"] == 24


def test_report_files_are_well_formed(k1000):
    res, _, _, _, _ = k1000
    out = res.out
    doc = json.loads((out / "report.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))
    assert doc["verdict"] == json.loads(json.dumps(res.verdict))
    md = (out / "report.md").read_text()
    assert "## Verdict" in md and res.verdict["text"] in md
    blocks, current = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            current.append(len(re.split(r"(?<!\\)\|", line)) - 2)
        elif current:
            blocks.append(current)
            current = []
    assert len(blocks) == 2 + len(doc["arms"]) - 1              # arms, one per quantised arm, buckets
    for cells in blocks:
        assert len(set(cells)) == 1 and cells[0] >= 5
    from matplotlib.image import imread

    for name in report.PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG)
        img = imread(out / name)
        assert img.shape[0] > 100 and img.shape[1] > 100
        assert f"![{name}]({name})" in md


def test_tokenizer_less_model_runs_on_input_ids_without_passkey(k1000):
    res, _, _, _, _ = k1000
    assert any("passkey retrieval skipped: the model has no tokenizer" in n for n in res.report["notes"])
    assert "passkey" not in res.report["arms"]["default"]
    worst = res.report["arms"]["default"]["failures"]
    assert len(worst) == 3 and worst[0]["mean_kl"] >= worst[-1]["mean_kl"]
    assert re.fullmatch(r"[\d ]+", worst[0]["positions"][0]["context"])     # token ids, no tokenizer


def test_existing_output_is_refused_unless_forced(k1000):
    res, _, _, src, data = k1000
    from calib.outputs import OutputError

    with pytest.raises(OutputError, match="already exists"):
        ev.run_eval(eval_config(src, data, res.out))


def test_model_within_range_both_arms_close(tmp_path):
    src, data = save_model_and_data(tmp_path, boosted(tiny_causal_lm("llama")), "model")
    ckpt = calibrate_small(src, data, tmp_path / "ckpt")
    res = ev.run_eval(eval_config(src, data, tmp_path / "report", samples=16, scales=(str(ckpt),), plots=False))
    arms = res.report["arms"]
    default, cal = arms["default"]["summary"], arms[f"calibrated:{ckpt}"]["summary"]
    assert all(r["k_saturated"] == 0 for r in arms["default"]["layers"].values())
    assert 0 < default["kl"] < 0.01 and 0 < cal["kl"] < 0.01
    assert 0.5 < default["kl"] / cal["kl"] < 2
    v = res.verdict
    assert v["action"] == "ship" and set(v["within_threshold"]) == {"default", f"calibrated:{ckpt}"}
    assert "Also within the threshold" in v["text"] and all(f"`{n}`" in v["text"] for n in v["within_threshold"])
    assert not (tmp_path / "report" / "scales.png").exists()


def test_pathological_layer_is_named_with_the_skip_flag(tmp_path):
    model = pathological_layer(boosted(tiny_causal_lm("llama")), layer=1)
    src, data = save_model_and_data(tmp_path, model, "model")
    ckpt = calibrate_small(src, data, tmp_path / "ckpt")
    res = ev.run_eval(eval_config(src, data, tmp_path / "report", samples=16, scales=(str(ckpt),), plots=False))
    arms, v = res.report["arms"], res.verdict
    cal = arms[f"calibrated:{ckpt}"]
    assert cal["layers"]["1"]["v_flushed"] > 0.4 and cal["layers"]["0"]["v_flushed"] < 0.01
    assert not cal["within_threshold"]
    # measured in the emulation only: named with its flag, but not recommended until an engine confirms it
    assert v["action"] == "skip_unconfirmed" and v["skip_layers"] == [1] and v["dominant_layers"] == [1]
    assert "unconfirmed" in v["text"] and v["text"].startswith(f"Keep {res.report['reference'].upper()} KV for now")
    assert v["flag"] == "--kv-cache-dtype-skip-layers 1" and v["flag"] in v["text"]
    measured = arms[f"{v['arm']} skip 1"]                  # the skip was measured, not guessed
    assert measured["skip"] == [1] and "1" not in measured["layers"]
    assert measured["summary"]["max_bucket_kl"] <= 0.01 < arms[v["arm"]]["summary"]["max_bucket_kl"]
    md = (tmp_path / "report" / "report.md").read_text()
    assert "--kv-cache-dtype-skip-layers 1" in md


def test_text_model_with_tokenizer_runs_passkey_and_shows_failure_text(tmp_path):
    tok = train_tokenizer()
    model = tiny_causal_lm("llama", vocab_size=len(tok), max_position_embeddings=256)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    cfg = ev.EvalConfig(model=str(tmp_path / "model"), data=str(SAMPLE_TEXT), out=tmp_path / "report",
                        buckets=(64, 128, 256, 1024), samples=6, pack=True, batch_size=2, plots=False)
    res = ev.run_eval(cfg)
    doc = res.report
    assert doc["buckets"] == [64, 128, 256] and any("[1024]" in n for n in doc["notes"])
    assert {k: r["samples"] for k, r in doc["arms"]["default"]["buckets"].items()} == {"64": 2, "128": 2, "256": 2}
    for name in (doc["reference"], "default"):
        pk = doc["arms"][name]["passkey"]
        assert list(pk) == ["256"] and pk["256"]["total"] == 5          # 64 and 128 are too short for a prompt
    assert any("bucket 128 is too small" in n for n in doc["notes"])
    contexts = " ".join(p["context"] for f in doc["arms"]["default"]["failures"] for p in f["positions"])
    assert re.search(r"[a-z]{3}", contexts)                             # decoded text, not ids
    assert "## Passkey retrieval" in (tmp_path / "report" / "report.md").read_text()
