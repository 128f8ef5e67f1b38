"""Stacking KV scales onto weight-quantized checkpoints: weights byte-identical, configs merged."""

import json

import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from calib.cli import main
from calib.verify import verify
from tiny import fp8_weight_checkpoint as _fp8_weight_checkpoint, modelopt_checkpoint, tiny_causal_lm
from helpers import sha256_file


def _modelopt_checkpoint(src, dst):
    dst.mkdir()
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    (dst / "config.json").write_text((src / "config.json").read_text())
    (dst / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.0"},
         "quantization": {"quant_algo": "W4A16_AWQ", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}))
    return dst


def _calibrate(*args):
    return CliRunner().invoke(main, ["calibrate", *[str(a) for a in args], "--seq-len", "32", "--samples", "8",
                                     "--device", "cpu"])


def test_kv_scales_onto_compressed_tensors_fp8_weights(tiny_llama_dir, token_data, tmp_path):
    q = _fp8_weight_checkpoint(tiny_llama_dir, tmp_path / "fp8")
    before = json.loads((q / "config.json").read_text())["quantization_config"]
    r = _calibrate("--model", tiny_llama_dir, "--into", q, "--data", token_data, "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    out = tmp_path / "out"
    assert sha256_file(out / "model.safetensors") == sha256_file(q / "model.safetensors")
    after = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: v for k, v in after.items() if k != "kv_cache_scheme"} == before
    assert after["kv_cache_scheme"]["type"] == "float" and after["kv_cache_scheme"]["num_bits"] == 8
    assert [p for p in verify(out, "vllm") if p.severity == "error"] == []
    scales = load_file(out / "kv_scales.safetensors")
    plain = tmp_path / "plain"
    assert _calibrate("--model", tiny_llama_dir, "--data", token_data, "--out", plain).exit_code == 0
    assert all(torch.equal(scales[k], v) for k, v in load_file(plain / "kv_scales.safetensors").items())


def test_kv_scales_onto_a_modelopt_checkpoint_for_trtllm(tiny_llama_dir, token_data, tmp_path):
    q = _modelopt_checkpoint(tiny_llama_dir, tmp_path / "awq")
    r = _calibrate("--model", tiny_llama_dir, "--into", q, "--data", token_data, "--out", tmp_path / "out",
                   "--target", "trtllm")
    assert r.exit_code == 0, r.output
    hq = json.loads((tmp_path / "out" / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "W4A16_AWQ" and hq["kv_cache_quant_algo"] == "FP8"
    assert sha256_file(tmp_path / "out" / "model.safetensors") == sha256_file(q / "model.safetensors")


def test_kv_scales_onto_a_modelopt_export_with_its_config_json_block(tiny_llama_dir, token_data, tmp_path):
    """A ModelOpt export names its quantization in config.json (`quant_method: modelopt`) as well as in
    hf_quant_config.json: the trtllm target takes it, through `calibrate --into` and through `export --stats`
    (same scales both ways), keeping config.json and the weights byte for byte; the vllm target, which writes
    compressed-tensors only, refuses it before any model loads."""
    q = modelopt_checkpoint(tiny_llama_dir, tmp_path / "mo")
    r = _calibrate("--model", tiny_llama_dir, "--into", q, "--data", token_data, "--out", tmp_path / "out",
                   "--target", "trtllm")
    assert r.exit_code == 0, r.output
    out = tmp_path / "out"
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "FP8" and hq["kv_cache_quant_algo"] == "FP8" and hq["exclude_modules"] == ["lm_head"]
    assert (out / "config.json").read_bytes() == (q / "config.json").read_bytes()
    assert sha256_file(out / "model.safetensors") == sha256_file(q / "model.safetensors")
    assert [p for p in verify(out, "trtllm") if p.severity == "error"] == []

    stats = tmp_path / "mo.stats.safetensors"      # statistics recorded on the ModelOpt checkpoint itself
    assert _calibrate("--model", q, "--data", token_data, "--out", tmp_path / "st", "--target", "",
                      "--stats-out", stats).exit_code == 0
    r = CliRunner().invoke(main, ["export", "--stats", str(stats), "--model", str(q), "--target", "trtllm",
                                  "--out", str(tmp_path / "exp")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "exp" / "hf_quant_config.json").read_text() == (out / "hf_quant_config.json").read_text()
    a, b = load_file(out / "kv_scales.safetensors"), load_file(tmp_path / "exp" / "kv_scales.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)

    r = _calibrate("--model", tiny_llama_dir, "--into", q, "--data", token_data, "--out", tmp_path / "v",
                   "--target", "vllm")
    assert r.exit_code == 1 and "use the trtllm target for ModelOpt checkpoints" in r.output
    assert "calibrating" not in r.output and not (tmp_path / "v").exists()


def test_into_refuses_another_model_and_existing_kv_scales(tiny_llama_dir, token_data, tmp_path):
    other = tmp_path / "other"
    tiny_causal_lm("llama", num_hidden_layers=2).save_pretrained(other)
    r = _calibrate("--model", tiny_llama_dir, "--into", other, "--data", token_data, "--out", tmp_path / "o1")
    assert r.exit_code == 1 and "not the same model" in r.output and "num_hidden_layers" in r.output
    done = tmp_path / "done"
    assert _calibrate("--model", tiny_llama_dir, "--data", token_data, "--out", done).exit_code == 0
    r = _calibrate("--model", tiny_llama_dir, "--into", done, "--data", token_data, "--out", tmp_path / "o2")
    assert r.exit_code == 1 and "--overwrite-kv-scales" in r.output and not (tmp_path / "o2").exists()


def test_overwrite_kv_scales_replaces_old_scales_and_keeps_weights(tiny_llama_dir, token_data, tmp_path):
    """An llm-compressor style checkpoint whose KV scales live inside its weight shard (bf16, stale values)."""
    q = _fp8_weight_checkpoint(tiny_llama_dir, tmp_path / "fp8")
    tensors = load_file(q / "model.safetensors")
    for i in range(3):
        for kv in "kv":
            tensors[f"model.layers.{i}.self_attn.{kv}_scale"] = torch.tensor([0.5], dtype=torch.bfloat16)
    from safetensors.torch import save_file
    save_file(tensors, str(q / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((q / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                     "dynamic": False, "symmetric": True}
    (q / "config.json").write_text(json.dumps(cfg))
    r = _calibrate("--model", tiny_llama_dir, "--into", q, "--data", token_data, "--out", tmp_path / "out",
                   "--overwrite-kv-scales")
    assert r.exit_code == 0, r.output
    out = tmp_path / "out"
    new_weights = load_file(out / "model.safetensors")
    assert not any(k.endswith(("k_scale", "v_scale")) for k in new_weights)
    for k, t in new_weights.items():  # every weight tensor keeps its dtype and exact values
        assert t.dtype == tensors[k].dtype and torch.equal(t.view(torch.uint8), tensors[k].view(torch.uint8)), k
    scales = load_file(out / "kv_scales.safetensors")
    assert all(float(v) != 0.5 and v.dtype == torch.float32 for v in scales.values())
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.self_attn.k_scale"] == "kv_scales.safetensors"
    assert [p for p in verify(out, "vllm") if p.severity == "error"] == []
