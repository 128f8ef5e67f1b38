"""What each target's engine does with what kvcalib writes, through the CLI: the refusals (one line, non-zero exit,
nothing written), the warnings, and the serve lines — all read from the support matrix (calib.recipe.support)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from calib.cli import main
from calib.recipe import support
from calib.export import serve
from calib.recipe.recipe import Recipe
from helpers import k_beyond_fp8_model, save_model_and_data
from tiny import tiny_causal_lm


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _calibrate(model, data, out, *more):
    return _run("calibrate", "--model", model, "--data", data, "--out", out, "--samples", 8, "--seq-len", 32,
                "--device", "cpu", *more)


def _refused(r, out, before_work=True):
    """The one `Error:` line of a refused command, which left nothing at `out` (and, refused before any work, said
    nothing else: no model loaded)."""
    assert r.exit_code != 0 and not out.exists() and not list(out.parent.glob(f".{out.name}*")), r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("Error: ")]
    assert len(errors) == 1 and (len(lines) == 1 or not before_work), r.output
    return errors[0]


def test_int8_for_tensorrt_llm_is_refused_before_any_work(tiny_llama_dir, token_data, tmp_path):
    out = tmp_path / "int8"
    line = _refused(_calibrate(tiny_llama_dir, token_data, out, "--target", "trtllm", "--kv-cache-dtype", "int8"), out)
    assert "TensorRT-LLM 1.4 would not serve these scales" in line and "INT8 runs at scale 1.0" in line
    # the TensorRT-engine backend applies calibrated INT8 (calib.export.trtllm_engine), so that is the advice now
    assert "--engine-version trtllm=pr18953" in line and "--target trtllm-engine, which applies these scales" in line


def test_int8_for_a_stated_tensorrt_llm_build_that_applies_it(tiny_llama_dir, token_data, tmp_path):
    out = tmp_path / "int8"
    r = _calibrate(tiny_llama_dir, token_data, out, "--target", "trtllm", "--kv-cache-dtype", "int8",
                   "--engine-version", "trtllm=1.2+pr18953")
    assert r.exit_code == 0, r.output
    # the build applies one scale per layer shared by K and V, max(k, v): served, but not exactly as calibrated
    assert f"trtllm-serve {out}" in r.output
    assert ("warning: TensorRT-LLM 1.2+pr18953: int8 tensor scales applied as one scale shared by K and V per layer"
            in r.output)


def test_fp8_past_the_range_for_tensorrt_llm_is_refused_after_calibration(tmp_path):
    model, data = save_model_and_data(tmp_path, k_beyond_fp8_model(), "big-k")
    out = tmp_path / "trt"
    line = _refused(_calibrate(model, data, out, "--target", "trtllm"), out, before_work=False)
    assert "fp8_e4m3 tensor scales ignored, the cache runs at scale 1.0" in line and "saturate" in line
    assert "Use --target vllm or sglang" in line
    r = _calibrate(model, data, tmp_path / "vllm", "--target", "vllm")       # vLLM applies them: served as calibrated
    assert r.exit_code == 0, r.output
    assert "vLLM 0.34: the scales are applied as calibrated" in r.output and "warning" not in r.output


def test_fp8_inside_the_range_for_tensorrt_llm_is_written_with_a_warning(tiny_llama_dir, token_data, tmp_path):
    out = tmp_path / "trt"
    r = _calibrate(tiny_llama_dir, token_data, out, "--target", "trtllm")
    assert r.exit_code == 0, r.output
    assert "warning: TensorRT-LLM 1.4: fp8_e4m3 tensor scales ignored, the cache runs at scale 1.0" in r.output
    assert "behaves like the default scale" in r.output and "Consider INT8" not in r.output


def test_sglang_target_serve_command_and_the_per_head_warning(tiny_llama_dir, token_data, tmp_path):
    out = tmp_path / "sg"
    r = _calibrate(tiny_llama_dir, token_data, out, "--target", "sglang", "--granularity", "head")
    assert r.exit_code == 0, r.output
    assert f"python -m sglang.launch_server --model-path {out} --kv-cache-dtype fp8_e4m3" in r.output
    assert "SGLang 0.5.23: the scales are applied as calibrated" in r.output
    warn = [ln for ln in r.output.splitlines() if ln.startswith("warning: per-head scales on SGLang")]
    assert len(warn) == 1 and "runs at 1.0" in warn[0] and "max per layer" in warn[0]
    r = _run("verify", out, "--target", "sglang")
    assert r.exit_code == 0, r.output
    assert "SGLang 0.5.23: the scales are applied as calibrated" in r.output


def test_sglang_before_0_5_19_ignores_the_scales(tiny_llama_dir, token_data, tmp_path):
    r = _calibrate(tiny_llama_dir, token_data, tmp_path / "sg", "--target", "sglang", "--engine-version", "0.5.18")
    assert r.exit_code == 0, r.output
    assert "warning: SGLang 0.5.18: fp8_e4m3 tensor scales ignored" in r.output


def test_vllm_per_head_names_what_each_backend_does(tiny_llama_dir, token_data, tmp_path):
    r = _calibrate(tiny_llama_dir, token_data, tmp_path / "v", "--granularity", "head")
    assert r.exit_code == 0, r.output
    assert "warning: vLLM 0.34 (Triton, FlashInfer): fp8_e4m3 head scales refused" in r.output
    assert "warning: vLLM 0.34 (CPU): fp8_e4m3 head scales applied as one max over heads" in r.output


def test_a_bad_engine_version_is_one_line(tiny_llama_dir, token_data, tmp_path):
    out = tmp_path / "x"
    assert "unknown engine 'tgi'" in _refused(_calibrate(tiny_llama_dir, token_data, out, "--engine-version",
                                                         "tgi=1.0"), out)
    assert "name the engine" in _refused(_calibrate(tiny_llama_dir, token_data, out, "--target", "vllm,trtllm",
                                                    "--engine-version", "1.2"), out)


def test_export_from_statistics_refuses_as_calibrate_does(tiny_llama_dir, token_data, tmp_path):
    stats = tmp_path / "stats"
    r = _calibrate(tiny_llama_dir, token_data, stats, "--target", "")
    assert r.exit_code == 0, r.output
    out = tmp_path / "int8"
    line = _refused(_run("export", "--stats", stats / "stats.safetensors", "--model", tiny_llama_dir, "--kv-cache-dtype", "int8",
                         "--target", "trtllm", "--out", out), out)
    assert "TensorRT-LLM 1.4 would not serve these scales" in line


@pytest.mark.parametrize("targets,dtype,ratio,refused", [
    (("trtllm",), "int8", 0.1, ["trtllm"]),
    (("trtllm",), "fp8_e4m3", 2.0, ["trtllm"]),
    (("trtllm",), "fp8_e4m3", 0.5, []),
    (("vllm", "sglang"), "fp8_e4m3", 5.0, []),
])
def test_outcomes_follow_the_matrix(targets, dtype, ratio, refused):
    class _S:
        def __init__(self, amax):
            import torch
            self.k_amax = self.v_amax = torch.tensor([amax])
    recipe = Recipe(dtype=dtype, targets=targets)
    qmax = recipe.kv_dtype.qmax
    found = serve.outcomes(recipe, {0: _S(ratio * qmax)})
    assert [n for n, o in found.items() if o.refused] == refused
    for n, o in found.items():
        assert o.calibrated.amax_ratio == pytest.approx(ratio)
        assert o.refused == support.outcome(n, o.calibrated).refused


def test_a_skip_list_of_numbers_and_a_kind_name_reads_the_same_in_any_order():
    """The recipe's own skip entries, numbers and `sliding_window` in the order written, name one set."""
    found = [serve.outcomes(Recipe(skip_layers=skip, targets=("vllm",)))["vllm"].calibrated.skip_layers
             for skip in (("sliding_window", 10, 3), (3, "sliding_window", 10))]
    assert found[0] == found[1] == (3, 10, "sliding_window")


def test_verify_warns_as_its_applies_line_says(tiny_llama_dir, token_data, tmp_path):
    """An SGLang output checked for a version that does not load the scales: the APPLIES line says so and the
    count has the warning (it said 0 warnings); for a version that loads them, no warning."""
    out = tmp_path / "sg"
    assert _calibrate(tiny_llama_dir, token_data, out, "--target", "sglang").exit_code == 0
    r = CliRunner().invoke(main, ["verify", str(out), "--target", "sglang", "--engine-version", "sglang=0.5.17"])
    assert r.exit_code == 0, r.output
    assert "APPLIES [sglang] SGLang 0.5.17: fp8_e4m3 tensor scales ignored" in r.output
    assert "WARNING [sglang] engine: not served as calibrated: SGLang 0.5.17" in r.output
    assert r.output.strip().endswith(f"{out}: 0 error(s), 1 warning(s)")
    r = CliRunner().invoke(main, ["verify", str(out), "--target", "sglang", "--engine-version", "0.5.23"])
    assert r.exit_code == 0 and r.output.strip().endswith("0 error(s), 0 warning(s)"), r.output


@pytest.mark.parametrize("text, targets, message", [
    ("vllm=0.34garbage", ["vllm"], "engine version '0.34garbage': give numbers"),
    ("0.5.18-final", ["sglang"], "engine version '0.5.18-final': give numbers"),
    ("vllm=0.32,vllm=0.33", ["vllm"], "vllm is given twice (vllm=0.32 too)"),
    ("0.32,vllm=0.33", ["vllm"], "vllm is given twice"),
    ("sglang=0.5.18", ["vllm"], "sglang is not a target here (vllm)"),
    ("trtllm=pr18953", ["vllm", "sglang"], "trtllm is not a target here (vllm, sglang)"),
    ("tensorrt=1.2", ["trtllm"], "unknown engine 'tensorrt'"),
])
def test_one_engine_version_grammar_refuses_garbage_duplicates_and_non_targets(text, targets, message):
    from calib.ckpt.source import ExportError

    with pytest.raises(ExportError) as e:
        serve.parse_versions(text, targets)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert serve.parse_versions("vllm=0.11.0rc1, sglang=0.5.18.post1", ["vllm", "sglang"]) == {
        "vllm": "0.11.0rc1", "sglang": "0.5.18.post1"}


def test_eval_reads_the_same_grammar():
    from calib.evaluation import served
    from calib.evaluation.arms import EvalError

    assert served.stated("sglang", "sglang=0.5.18") == served.stated("sglang", "0.5.18") == "0.5.18"
    assert served.stated("vllm", None) is None
    for text, message in (("vllm=0.32", "vllm is not a target here (sglang)"), ("0.5.18x", "give numbers"),
                          ("0.5.18,sglang=0.5.19", "given twice")):
        with pytest.raises(EvalError, match="--target sglang: --engine-version"):
            served.stated("sglang", text)
        with pytest.raises(EvalError, match=message.replace("(", r"\(").replace(")", r"\)")):
            served.stated("sglang", text)


@pytest.mark.parametrize("arch, warned", [("Qwen2ForCausalLM", True), ("MixtralForCausalLM", True),
                                          ("Qwen3MoeForCausalLM", True), ("LlamaForCausalLM", False), (None, False)])
def test_the_serve_lines_warn_for_a_model_whose_sglang_loader_drops_the_scales(tmp_path, arch, warned):
    """SGLang 0.5.19-0.5.23 applies per-tensor FP8 scales only where the model's weight loader remaps their names
    (sglang issue 39942): the serve lines read the written checkpoint's architecture and warn for Qwen2, Qwen3-MoE
    and Mixtral; vLLM, whose loader is the same for every model, is not warned for."""
    import json

    from calib.export import TARGETS

    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]} if arch else {}))
    recipe = Recipe(targets=("sglang", "vllm"))
    found = serve.outcomes(recipe, {0: type("S", (), {"k_amax": _t(100.0), "v_amax": _t(3.0)})()})
    sg = serve.serve_lines(TARGETS["sglang"], str(tmp_path), found["sglang"])
    assert any(ln.startswith(f"  warning: for {arch}: SGLang 0.5.23: fp8_e4m3 tensor scales ignored") for ln in sg) \
        == warned
    assert ("SGLang 0.5.23: the scales are applied as calibrated" in sg[-1]) != warned
    assert not any("warning" in ln for ln in serve.serve_lines(TARGETS["vllm"], str(tmp_path), found["vllm"]))
    # told the architecture up front, the outcome itself differs (the check refuses past the FP8 range)
    told = serve.outcomes(recipe, {0: type("S", (), {"k_amax": _t(900.0), "v_amax": _t(3.0)})()},
                          architecture=arch)
    assert told["sglang"].refused == warned and not told["vllm"].refused


def test_calibrate_for_sglang_reads_the_models_architecture_before_writing(tmp_path):
    """SGLang drops a Qwen2's k/v scales (sglang issue 39942). calibrate reads the model's architecture before it
    writes, as the serve lines do: inside the FP8 range the checkpoint is written with the warning; with |K| past
    448 (K at scale 1.0 saturates) nothing is written and vLLM is named instead. The control: a Llama of the same
    range is served by SGLang as calibrated."""
    small, data = save_model_and_data(tmp_path, tiny_causal_lm("qwen2"), "qwen2")
    r = _calibrate(small, data, tmp_path / "small", "--target", "sglang")
    assert r.exit_code == 0, r.output
    assert ("warning: SGLang 0.5.23: fp8_e4m3 tensor scales ignored, the cache runs at scale 1.0 (this model's weight "
            "loader never remaps self_attn.k_scale / v_scale" in r.output)
    assert "behaves like the default scale" in r.output
    assert "the scales are applied as calibrated" not in r.output
    big, _ = save_model_and_data(tmp_path, tiny_causal_lm("qwen2", scale_k=3000.0), "qwen2-big-k")
    out = tmp_path / "big"
    line = _refused(_calibrate(big, data, out, "--target", "sglang"), out, before_work=False)
    assert line.startswith("Error: SGLang 0.5.23 would not serve these scales: fp8_e4m3 tensor scales ignored") \
        and "saturate" in line and "Use --target vllm" in line
    llama, _ = save_model_and_data(tmp_path, k_beyond_fp8_model(), "llama-big-k")
    r = _calibrate(llama, data, tmp_path / "llama", "--target", "sglang")
    assert r.exit_code == 0 and "SGLang 0.5.23: the scales are applied as calibrated" in r.output, r.output


def _t(x: float):
    import torch
    return torch.tensor([x])
