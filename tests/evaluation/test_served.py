"""`kvcalib eval --target ENGINE`: the calibrated arm is evaluated with the scales that engine really uses (support
matrix), and the report says so."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from calib.cli import main
from calib.evaluation import served
from calib.evaluation.arms import Arm, EvalError
from calib.recipe.dtypes import FP8_E4M3, INT8


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _arm(granularity="head", dtype=FP8_E4M3, q=True):
    k = {0: torch.tensor([0.5, 2.0]).reshape(1, 2, 1, 1), 1: torch.tensor([0.25, 0.75]).reshape(1, 2, 1, 1)}
    return Arm("calibrated:ck", dtype, k, dict(k), kind="checkpoint", granularity=granularity, source="ck",
               q={0: torch.tensor(0.3)} if q else {})


def test_tensorrt_llm_runs_the_calibrated_arm_at_one():
    (arm,), note = served.as_served([_arm()], "trtllm", None, "trtllm")
    assert arm.name == "calibrated:ck" and all(float(s) == 1.0 for s in (*arm.k.values(), *arm.v.values()))
    assert arm.q == {} and "TensorRT-LLM 1.4" in note and "runs at scale 1.0" in arm.notes[-1]
    (built,), _ = served.as_served([_arm("tensor", INT8, q=False)], "trtllm", "pr18953", "trtllm")
    assert float(built.k[0].max()) == 2.0 and not built.notes          # a build that applies INT8 scales keeps them


def test_vllm_cpu_folds_heads_and_drops_q_fa3_keeps_both():
    (cpu,), _ = served.as_served([_arm()], "vllm", None, "vllm-cpu")
    assert cpu.k[0].shape == () and float(cpu.k[0]) == 2.0 and float(cpu.v[1]) == 0.75 and cpu.q == {}
    assert any("max over heads" in n for n in cpu.notes) and any("q_scale unused" in n for n in cpu.notes)
    (fa3,), _ = served.as_served([_arm()], "vllm", None, "vllm-fa3")
    assert fa3.k[0].shape == (1, 2, 1, 1) and float(fa3.q[0]) == pytest.approx(0.3) and not fa3.notes


def test_refused_arms_stay_but_are_not_shippable():
    (arm,), _ = served.as_served([_arm("tensor", INT8, q=False)], "sglang", None, "vllm-cpu")
    assert not arm.shippable and "refused" in arm.notes[-1]


def test_no_target_changes_nothing_and_bad_versions_are_one_line():
    arms = [_arm()]
    assert served.as_served(arms, None, None, "vllm-cpu") == (arms, None)
    with pytest.raises(EvalError, match="needs --target"):
        served.stated(None, "0.5.18")
    with pytest.raises(EvalError, match="engine version"):
        served.stated("sglang", "latest!")


def test_eval_target_trtllm_measures_the_calibrated_arm_as_the_default(tmp_path, token_data):
    """A model whose K leaves FP8's range: calibrated scales beat 1.0 by far — unless the engine ignores them, where
    the 'calibrated' arm is exactly the default arm (same scales 1.0, same numbers)."""
    from tiny import tiny_causal_lm
    src = tmp_path / "big"
    tiny_causal_lm("llama", scale_k=6000.0).save_pretrained(src)
    r = _run("calibrate", "--model", src, "--data", token_data, "--out", tmp_path / "cal", "--seq-len", "40",
             "--samples", "12", "--device", "cpu")
    assert r.exit_code == 0, r.output
    base = ["eval", "--model", src, "--data", token_data, "--scales", tmp_path / "cal", "--buckets", "64",
            "--samples", "6", "--no-plots", "--passkey-trials", "0", "--device", "cpu", "--no-progress"]
    name = f"calibrated:{tmp_path / 'cal'}"
    r = _run(*base, "--out", tmp_path / "plain")
    assert r.exit_code == 0, r.output
    plain = json.loads((tmp_path / "plain" / "report.json").read_text())["arms"]
    assert plain["default"]["summary"]["kl"] > 4 * plain[name]["summary"]["kl"]
    r = _run(*base, "--target", "trtllm", "--out", tmp_path / "trt")
    assert r.exit_code == 3, r.output             # at scale 1.0 nothing passes: keep the reference (no-go)
    doc = json.loads((tmp_path / "trt" / "report.json").read_text())
    arms = doc["arms"]
    assert arms[name]["summary"]["kl"] == pytest.approx(arms["default"]["summary"]["kl"], rel=1e-9)
    assert any("evaluated as TensorRT-LLM 1.4 serves them" in n for n in doc["notes"])
    md = (tmp_path / "trt" / "report.md").read_text()
    assert "this arm runs at scale 1.0" in md


@pytest.mark.parametrize("version, emulation, fmt, why", [
    ("0.32", "vllm-cpu", "fp8_per_token_head", "accepted but broken"),     # its skip_layers cell says "applied"
    ("0.32", "vllm-cpu", "int8_per_token_head", "accepted but broken"),
    ("0.33", "vllm-cpu", "fp8_per_token_head", "refused"),
    ("0.20", "vllm-fa3", "fp8_per_token_head", "refused"),                # the Triton backend the advice names, too
    ("0.30", "kv-only", "int4_per_token_head", "refused"),
])
def test_a_format_the_stated_version_breaks_or_refuses_is_never_shippable(version, emulation, fmt, why):
    from calib.evaluation.arms import Geometry, format_arms

    (arm,) = served.formats_as_served(format_arms(Geometry((0,), 2, 16), [fmt]), "vllm", version, emulation)
    assert not arm.shippable and why in arm.notes[-1] and f"vLLM {version} does not serve {fmt}" in arm.notes[-1]


def test_the_default_arm_of_a_format_the_target_refuses_is_not_shippable():
    default = Arm("default", INT8, {0: torch.tensor(1.0)}, {0: torch.tensor(1.0)}, kind="default")
    (arm,), _ = served.as_served([default], "vllm", None, "vllm-cpu")
    assert not arm.shippable and "vLLM 0.34 (CPU) does not serve int8: refused" in arm.notes[-1]
    (fp8,), _ = served.as_served([Arm("default", FP8_E4M3, {}, {}, kind="default")], "sglang", "0.5.17", "kv-only")
    assert fp8.shippable          # scale 1.0 is what the default arm is: an engine that ignores scales serves it


@pytest.mark.parametrize("dtype", [FP8_E4M3, INT8])
def test_trtllm_engine_shares_one_scale_per_layer_max_of_k_and_v(dtype):
    """TensorRT-LLM's TensorRT-engine backend applies one kv_cache_scaling_factor per layer, max(k, v): the calibrated
    arm is evaluated at that shared scale, checked against a brute-force saturating cast at it."""
    from calib.evaluation.fakequant import fake_quant_terms

    k = {0: torch.tensor(0.5), 1: torch.tensor(0.03125)}
    v = {0: torch.tensor(0.125), 1: torch.tensor(0.25)}
    arm0 = Arm("calibrated:ck", dtype, k, v, kind="checkpoint", granularity="tensor", source="ck",
               q={0: torch.tensor(0.3)})
    (arm,), note = served.as_served([arm0], "trtllm-engine", None, "trtllm")
    for i in (0, 1):
        want = max(float(k[i]), float(v[i]))
        assert float(arm.k[i]) == want and float(arm.v[i]) == want and arm.k[i].shape == ()
    assert arm.shippable and arm.q == {} and "TensorRT-LLM (TensorRT engine) 1.2.1" in note
    assert any("shared K/V scale (TensorRT-LLM engine)" in n for n in arm.notes)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 8, 16, generator=g) * 2.0 ** torch.randint(-12, 8, (1, 2, 8, 16), generator=g)
    for i in (0, 1):
        shared = max(float(k[i]), float(v[i]))
        got, _ = fake_quant_terms(x, arm.k[i], dtype, None, measure=False)
        units = (x / shared).clamp(-dtype.qmax, dtype.qmax)
        brute = (units.to(torch.float8_e4m3fn).float() if dtype is FP8_E4M3 else torch.round(units)) * shared
        assert torch.equal(got, brute)
        own, _ = fake_quant_terms(x, k[i], dtype, None, measure=False)
        if float(k[i]) != shared:
            assert not torch.equal(own, brute)    # the arm's own K scale would have measured something else
    (head,), _ = served.as_served([_arm("head", dtype, q=False)], "trtllm-engine", None, "trtllm")
    assert not head.shippable and "refused" in head.notes[-1]
