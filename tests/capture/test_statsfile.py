"""Statistics files: merging two halves equals one run over both, bit for bit; export without the model."""

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from calib.capture import statsfile
from calib.cli import main


def _cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r


def _halves(token_data, tmp_path):
    lines = token_data.read_text().splitlines()
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(lines[:12]) + "\n")
    b.write_text("\n".join(lines[12:]) + "\n")
    return a, b


@pytest.mark.parametrize("recipe", ["stats-token", "fp8-percentile"])
def test_merged_halves_equal_one_run_over_both(tiny_llama_dir, token_data, tmp_path, recipe):
    a, b = _halves(token_data, tmp_path)
    common = ["--model", tiny_llama_dir, "--seq-len", "40", "--samples", "100", "--batch-size", "1",
              "--device", "cpu", "--recipe", recipe, "--target", ""]
    for name, data in (("a", a), ("b", b), ("all", token_data)):
        r = _cli("calibrate", *common, "--data", data, "--out", tmp_path / f"o-{name}",
                 "--stats-out", tmp_path / f"{name}.safetensors")
        assert r.exit_code == 0, r.output
    r = _cli("merge", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--out", tmp_path / "m.safetensors")
    assert r.exit_code == 0, r.output
    merged, whole = load_file(tmp_path / "m.safetensors"), load_file(tmp_path / "all.safetensors")
    assert merged.keys() == whole.keys()
    for k in merged:
        if k.endswith(".sums"):  # float64 per-bin sums: equal up to summation order
            torch.testing.assert_close(merged[k], whole[k], rtol=1e-12, atol=0)
        else:
            assert torch.equal(merged[k], whole[k]), k
    m = statsfile.load(tmp_path / "m.safetensors")
    whole_data = json.loads((tmp_path / "o-all" / "kvcalib.json").read_text())["data"]
    assert (m.header["data"]["samples"], m.header["data"]["tokens"]) == (whole_data["samples"], whole_data["tokens"])


def test_export_from_statistics_equals_calibrating_directly(tiny_llama_dir, token_data, tmp_path):
    base = ["--model", tiny_llama_dir, "--data", token_data, "--seq-len", "32", "--samples", "8", "--device", "cpu"]
    r = _cli("calibrate", *base, "--recipe", "fp8-head", "--out", tmp_path / "direct",
             "--stats-out", tmp_path / "s.safetensors")
    assert r.exit_code == 0, r.output
    r = _cli("export", "--stats", tmp_path / "s.safetensors", "--model", tiny_llama_dir, "--recipe", "fp8-head",
             "--out", tmp_path / "again")
    assert r.exit_code == 0, r.output
    direct, again = (load_file(tmp_path / d / "kv_scales.safetensors") for d in ("direct", "again"))
    assert direct.keys() == again.keys() and all(torch.equal(direct[k], again[k]) for k in direct)
    # another recipe from the same pass: INT8 for a TensorRT-LLM build that applies it, per tensor
    r = _cli("export", "--stats", tmp_path / "s.safetensors", "--model", tiny_llama_dir, "--recipe", "int8-tensor",
             "--out", tmp_path / "int8", "--engine-version", "trtllm=pr18953")
    assert r.exit_code == 0, r.output
    int8 = load_file(tmp_path / "int8" / "kv_scales.safetensors")
    k0 = int8["model.layers.0.self_attn.k_proj.k_scale"]
    assert float(k0) == pytest.approx(float(direct["model.layers.0.self_attn.k_scale"].max()) * 448 / 127, rel=1e-6)


def test_export_refuses_what_the_file_cannot_give(tiny_llama_dir, token_data, tmp_path):
    base = ["--model", tiny_llama_dir, "--data", token_data, "--seq-len", "32", "--samples", "8", "--device", "cpu"]
    assert _cli("calibrate", *base, "--out", tmp_path / "d", "--stats-out", tmp_path / "s.safetensors").exit_code == 0
    r = _cli("export", "--stats", tmp_path / "s.safetensors", "--model", tiny_llama_dir, "--recipe", "fp8-mse",
             "--out", tmp_path / "x")
    assert r.exit_code == 1 and "cannot give mse ranges" in r.output and not (tmp_path / "x").exists()
    r = _cli("export", "--stats", tmp_path / "s.safetensors", "--model", tiny_llama_dir, "--recipe", "fp8-head-q",
             "--out", tmp_path / "x")
    assert r.exit_code == 1 and "no Q statistics" in r.output
    other = tmp_path / "other"
    from tiny import tiny_causal_lm
    tiny_causal_lm("llama", num_hidden_layers=2).save_pretrained(other)
    r = _cli("export", "--stats", tmp_path / "s.safetensors", "--model", other, "--out", tmp_path / "x")
    assert r.exit_code == 1 and "another model" in r.output
