"""vLLM export: weights byte-identical, index and config valid, nothing half-written on failure."""

import json

import pytest
import torch
from safetensors import safe_open

from calib import export
from helpers import made_up_scales, sha256_file


def test_export_layout(tiny_llama_dir, tmp_path):
    out = export.export_vllm(tiny_llama_dir, tmp_path / "out", made_up_scales(3), {"producer": "kvcalib"})
    assert sha256_file(out / "model.safetensors") == sha256_file(tiny_llama_dir / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    src_cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"] == {} and qc["format"] == "dense"
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                     "symmetric": True}
    # the config block is one compressed-tensors itself accepts
    from compressed_tensors.quantization import QuantizationConfig
    assert QuantizationConfig.model_validate(qc).kv_cache_scheme.strategy == "tensor"
    index = json.loads((out / export.INDEX_FILE).read_text())
    with safe_open(tiny_llama_dir / "model.safetensors", "pt") as f:
        weights = set(f.keys())
    assert set(index["weight_map"]) == weights | {f"model.layers.{i}.self_attn.{kv}_scale" for i in range(3) for kv in "kv"}
    for name, shard in index["weight_map"].items():  # every entry resolves to a shard holding it
        with safe_open(out / shard, "pt") as f:
            assert name in f.keys()
    with safe_open(out / export.SCALES_FILE, "pt") as f:
        k1 = f.get_tensor("model.layers.1.self_attn.k_scale")
    assert k1.dtype == torch.float32 and k1.shape == () and float(k1) == pytest.approx(0.02)
    assert json.loads((out / "kvcalib.json").read_text())["target"] == "vllm"
    assert not list(tmp_path.glob(".*kvcalib-tmp*"))


def test_sharded_source_keeps_its_index_entries(tmp_path):
    from tiny import tiny_causal_lm
    src = tmp_path / "sharded"
    tiny_causal_lm("llama").save_pretrained(src, max_shard_size="100KB")
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    assert len(shards) > 1
    out = export.export_vllm(src, tmp_path / "out", made_up_scales(3), {})
    old = json.loads((src / export.INDEX_FILE).read_text())["weight_map"]
    new = json.loads((out / export.INDEX_FILE).read_text())["weight_map"]
    assert all(new[k] == v for k, v in old.items())
    assert all(sha256_file(out / s) == sha256_file(src / s) for s in shards)


def test_existing_output_is_refused_unless_forced(tiny_llama_dir, tmp_path):
    from calib.safety.outputs import MARKER, OutputError

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(OutputError, match="already exists"):
        export.export_vllm(tiny_llama_dir, out, made_up_scales(3), {})
    with pytest.raises(OutputError, match=r"holds files kvcalib did not write \(keep.txt\)"):
        export.export_vllm(tiny_llama_dir, out, made_up_scales(3), {}, force=True)
    assert (out / "keep.txt").read_text() == "user data"
    (out / "keep.txt").unlink()
    export.export_vllm(tiny_llama_dir, out, made_up_scales(3), {}, force=True)     # an empty folder is replaced
    assert (out / export.SCALES_FILE).is_file() and (out / MARKER).is_file()
    export.export_vllm(tiny_llama_dir, out, made_up_scales(3), {}, force=True)     # and so is our own output


def test_refuses_source_as_output_and_existing_scales(tiny_llama_dir, tmp_path):
    with pytest.raises(export.ExportError, match="source model directory"):
        export.export_vllm(tiny_llama_dir, tiny_llama_dir, made_up_scales(3), {}, force=True)
    out = export.export_vllm(tiny_llama_dir, tmp_path / "once", made_up_scales(3), {})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(export.ExportError, match="already carries KV scale"):
        export.export_vllm(out, tmp_path / "twice", made_up_scales(3), {})


def test_missing_shard_named_in_index_is_an_error(tmp_path):
    from tiny import tiny_causal_lm
    src = tmp_path / "sharded"
    tiny_causal_lm("llama").save_pretrained(src, max_shard_size="100KB")
    next(src.glob("model-*.safetensors")).unlink()
    with pytest.raises(export.ExportError, match="not in"):
        export.export_vllm(src, tmp_path / "out", made_up_scales(3), {})
    assert not (tmp_path / "out").exists()
