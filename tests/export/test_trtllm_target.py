"""TensorRT-LLM export: weights untouched, hf_quant_config.json + k_proj/v_proj scalars, refusals that TRT-LLM's
loader would otherwise turn into silent misbehaviour (see calib/export/trtllm.py for the engine source each rule
comes from)."""

import json
from functools import partial

import pytest
import torch
import yaml
from safetensors import safe_open

from calib import __version__, export
from calib.ckpt.names import TRTLLM_API_OPTIONS
from calib.export import trtllm
from calib.recipe import dtypes
from calib.scales.fold import LayerScales
from calib.verify import verify
from helpers import made_up_scales, sha256_file
from tiny import modelopt_checkpoint

# per-head ranges 448x the scales: the FP8 saturation report has numbers to show
_scales = partial(made_up_scales, amax_per_layer=(4.48, 8.96))


def test_export_layout(tiny_llama_dir, tmp_path):
    out = trtllm.export_trtllm(tiny_llama_dir, tmp_path / "out", _scales(3), {"producer": "kvcalib"})
    assert sha256_file(out / "model.safetensors") == sha256_file(tiny_llama_dir / "model.safetensors")
    # config.json is the source's, byte for byte: no quantization_config for TRT-LLM to trip over
    assert (out / "config.json").read_bytes() == (tiny_llama_dir / "config.json").read_bytes()
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    # an unquantized model: no hf_quant_config.json (TensorRT-LLM refuses one with quant_algo null), the KV dtype
    # in the serve-time options the serve command passes
    assert not (out / trtllm.HF_QUANT_CONFIG).exists()
    assert yaml.safe_load((out / TRTLLM_API_OPTIONS).read_text()) == {"kv_cache_config": {"dtype": "fp8"}}
    index = json.loads((out / export.INDEX_FILE).read_text())
    names = {n for i in range(3) for n in trtllm.trtllm_scale_names(i)}
    assert names == {f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale" for i in range(3) for kv in "kv"}
    with safe_open(tiny_llama_dir / "model.safetensors", "pt") as f:
        weights = set(f.keys())
    assert set(index["weight_map"]) == weights | names
    for name, shard in index["weight_map"].items():
        with safe_open(out / shard, "pt") as f:
            assert name in f.keys()
    with safe_open(out / export.SCALES_FILE, "pt") as f:
        assert set(f.keys()) == names
        for i in range(3):
            k, v = (f.get_tensor(n) for n in trtllm.trtllm_scale_names(i))
            assert k.dtype == v.dtype == torch.float32 and k.shape == v.shape == ()
            assert float(k) == pytest.approx(0.01 * (i + 1)) and float(v) == pytest.approx(0.02 * (i + 1))
    prov = json.loads((out / export.PROVENANCE_FILE).read_text())
    assert prov["target"] == "trtllm" and prov["kv_cache_quant_algo"] == "FP8" and prov["producer"] == "kvcalib"
    assert not list(tmp_path.glob(".*kvcalib-tmp*"))
    assert verify(out) == []


def test_per_head_scales_fold_to_their_max(tiny_llama_dir, tmp_path):
    scales = {i: LayerScales(torch.tensor([0.1, 0.3]), torch.tensor([0.5, 0.2]), torch.ones(2), torch.ones(2))
              for i in range(3)}
    out = trtllm.export_trtllm(tiny_llama_dir, tmp_path / "out", scales, {})
    with safe_open(out / export.SCALES_FILE, "pt") as f:
        k, v = (f.get_tensor(n) for n in trtllm.trtllm_scale_names(2))
    assert k.shape == () and float(k) == pytest.approx(0.3) and float(v) == pytest.approx(0.5)


def test_int8_writes_both_scales_and_records_the_shared_max(tiny_llama_dir, tmp_path):
    """The INT8 path under review (TensorRT-LLM PR 18953) reads k_scale and v_scale and uses their max."""
    out = trtllm.export_trtllm(tiny_llama_dir, tmp_path / "out", _scales(3), {}, kv_algo="INT8")
    assert not (out / trtllm.HF_QUANT_CONFIG).exists()      # PR 18953: KvCacheConfig(dtype="int8"), serve-time
    assert yaml.safe_load((out / TRTLLM_API_OPTIONS).read_text()) == {"kv_cache_config": {"dtype": "int8"}}
    prov = json.loads((out / export.PROVENANCE_FILE).read_text())
    assert prov["trtllm_int8_layer_scale"] == {str(i): pytest.approx(0.02 * (i + 1)) for i in range(3)}
    # merged TensorRT-LLM has no int8 kv_cache_config.dtype: a warning (the support matrix refuses it by version)
    assert [p.code for p in verify(out)] == ["trtllm.int8-build"]


def test_skipped_layers_are_refused(tiny_llama_dir, tmp_path):
    with pytest.raises(export.ExportError, match="cannot skip layers"):
        trtllm.export_trtllm(tiny_llama_dir, tmp_path / "out", _scales(3, skip=(1,)), {})
    assert not (tmp_path / "out").exists()
    with pytest.raises(export.ExportError, match="model has 3 layers"):
        trtllm.export_trtllm(tiny_llama_dir, tmp_path / "out", {**_scales(3), 5: _scales(1)[0]}, {})


def _with_quant_config(src, dst, quantization_config):
    import shutil
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_compressed_tensors_source_is_refused(tiny_llama_dir, tmp_path):
    src = _with_quant_config(tiny_llama_dir, tmp_path / "ct", export.vllm_quantization_config())
    with pytest.raises(export.ExportError, match="compressed-tensors quantization_config"):
        trtllm.export_trtllm(src, tmp_path / "out", _scales(3), {})
    assert not (tmp_path / "out").exists()


def test_other_weight_formats_in_config_json_are_refused(tiny_llama_dir, tmp_path):
    src = _with_quant_config(tiny_llama_dir, tmp_path / "fp8", {"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(export.ExportError, match="drops the kv_cache_quant_algo"):
        trtllm.export_trtllm(src, tmp_path / "out", _scales(3), {})


def _modelopt_source(tiny_llama_dir, tmp_path, **quantization):
    import shutil
    src = tmp_path / "modelopt"
    shutil.copytree(tiny_llama_dir, src)
    q = {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"], **quantization}
    (src / trtllm.HF_QUANT_CONFIG).write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.x"},
                                                          "quantization": q}))
    return src


def test_modelopt_weight_algo_and_exclusions_are_kept(tiny_llama_dir, tmp_path):
    src = _modelopt_source(tiny_llama_dir, tmp_path)
    out = trtllm.export_trtllm(src, tmp_path / "out", _scales(3), {})
    q = json.loads((out / trtllm.HF_QUANT_CONFIG).read_text())["quantization"]
    assert q == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    # the same serve-time options beside it: dtype fp8 agrees with the checkpoint's kv_cache_quant_algo
    assert yaml.safe_load((out / TRTLLM_API_OPTIONS).read_text()) == {"kv_cache_config": {"dtype": "fp8"}}
    assert verify(out) == []
    with pytest.raises(export.ExportError, match="unquantized FP16/BF16 projections"):
        trtllm.export_trtllm(src, tmp_path / "int8", _scales(3), {}, kv_algo="INT8")


def test_source_with_kv_quantization_or_scales_is_refused(tiny_llama_dir, tmp_path):
    src = _modelopt_source(tiny_llama_dir, tmp_path, kv_cache_quant_algo="FP8")
    with pytest.raises(export.ExportError, match="already declares kv_cache_quant_algo"):
        trtllm.export_trtllm(src, tmp_path / "out", _scales(3), {})
    once = trtllm.export_trtllm(tiny_llama_dir, tmp_path / "once", _scales(3), {})
    (once / TRTLLM_API_OPTIONS).unlink()
    with pytest.raises(export.ExportError, match="already carries KV scale tensors"):
        trtllm.export_trtllm(once, tmp_path / "twice", _scales(3), {})


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_non_positive_or_non_finite_scales_are_refused(tiny_llama_dir, tmp_path, bad):
    scales = _scales(3)
    scales[1] = LayerScales(torch.tensor(bad), scales[1].v_scale, scales[1].k_amax, scales[1].v_amax)
    with pytest.raises(export.ExportError, match="finite and > 0"):
        trtllm.export_trtllm(tiny_llama_dir, tmp_path / "out", scales, {})
    assert not (tmp_path / "out").exists()


def test_unknown_kv_algo_and_source_as_output_are_refused(tiny_llama_dir, tmp_path):
    with pytest.raises(export.ExportError, match="FP8"):
        trtllm.export_trtllm(tiny_llama_dir, tmp_path / "out", _scales(3), {}, kv_algo="NVFP4")
    with pytest.raises(export.ExportError, match="source model directory"):
        trtllm.export_trtllm(tiny_llama_dir, tiny_llama_dir, _scales(3), {}, force=True)


def test_sharded_source_keeps_its_shards_and_index_entries(tmp_path):
    from tiny import tiny_causal_lm
    src = tmp_path / "sharded"
    tiny_causal_lm("llama").save_pretrained(src, max_shard_size="100KB")
    shards = sorted(p.name for p in src.glob("model-*.safetensors"))
    assert len(shards) > 1
    out = trtllm.export_trtllm(src, tmp_path / "out", _scales(3), {})
    old = json.loads((src / export.INDEX_FILE).read_text())["weight_map"]
    new = json.loads((out / export.INDEX_FILE).read_text())["weight_map"]
    assert all(new[k] == v for k, v in old.items())
    assert all(sha256_file(out / s) == sha256_file(src / s) for s in shards)
    assert verify(out) == []


def test_existing_output_is_refused_unless_forced(tiny_llama_dir, tmp_path):
    from calib.safety.outputs import OutputError

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputError, match="already exists"):
        trtllm.export_trtllm(tiny_llama_dir, out, _scales(3), {})
    trtllm.export_trtllm(tiny_llama_dir, out, _scales(3), {}, force=True)
    assert (out / TRTLLM_API_OPTIONS).is_file()


def test_saturation_report_lists_layers_above_448():
    scales = {0: LayerScales(torch.tensor(1.0), torch.tensor(1.0), torch.tensor([10.0, 447.9]), torch.tensor([3.0, 2.0])),
              1: LayerScales(torch.tensor(1.0), torch.tensor(1.0), torch.tensor([500.0, 2.0]), torch.tensor([3.0, 2.0])),
              2: LayerScales(torch.tensor(1.0), torch.tensor(1.0), torch.tensor([1.0, 2.0]), torch.tensor([900.0, 1.0]))}
    lines = trtllm.saturation_report(scales)
    assert len(lines) == 2
    assert lines[0].startswith("layer 1: K amax 500 > 448") and "V amax" not in lines[0]
    assert lines[1].startswith("layer 2: V amax 900 > 448") and "clips these to ±448" in lines[1]
    with_data = trtllm.saturation_report(scales, {1: (0.0125, 0.0), 2: (0.0, 0.5)})
    assert "(1.25% of values)" in with_data[0] and "(50% of values)" in with_data[1]
    assert trtllm.saturation_report({0: scales[0]}) == []


def test_fp8_export_records_the_saturation_report(tiny_llama_dir, tmp_path):
    scales = _scales(3)
    scales[2] = LayerScales(torch.tensor(1.5), torch.tensor(1.0), torch.tensor([672.0, 1.0]), torch.tensor([1.0, 1.0]))
    out = trtllm.export_trtllm(tiny_llama_dir, tmp_path / "out", scales, {})
    prov = json.loads((out / export.PROVENANCE_FILE).read_text())
    assert prov["trtllm_fp8_saturation"] == trtllm.saturation_report(scales)
    assert prov["trtllm_fp8_saturation"][0].startswith("layer 2: K amax 672")


@pytest.mark.parametrize("hf_quant_config", [True, False])
def test_each_target_prepares_a_modelopt_export_by_its_own_rules(tiny_llama_dir, tmp_path, hf_quant_config):
    """A ModelOpt export's config.json block (with or without hf_quant_config.json beside it) is what the trtllm
    target reads its weight quantization from; the vllm target, even for --into, refuses it naming the target
    that takes it. Nothing is written by either."""
    src = modelopt_checkpoint(tiny_llama_dir, tmp_path / "mo", hf_quant_config=hf_quant_config)
    into = export.WriteOptions(into=True)
    prepared = export.target("trtllm").prepare(src, tmp_path / "out", into)
    assert prepared.quantization == {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}
    assert prepared.num_layers == 3 and prepared.kv_algo == "FP8"
    assert prepared.shards == ("model.safetensors",) and not prepared.drop
    with pytest.raises(export.ExportError, match="use the trtllm target for ModelOpt checkpoints"):
        export.target("vllm").prepare(src, tmp_path / "out", into)
    with pytest.raises(export.ExportError, match="INT8 KV cache in TensorRT-LLM needs unquantized"):
        export.target("trtllm").prepare(src, tmp_path / "out", export.WriteOptions(dtype=dtypes.INT8))
    assert not (tmp_path / "out").exists()
    out = export.target("trtllm").write(prepared, tmp_path / "out", _scales(3), {})
    hq = json.loads((out / trtllm.HF_QUANT_CONFIG).read_text())["quantization"]
    assert hq["quant_algo"] == "FP8" and hq["kv_cache_quant_algo"] == "FP8"
    assert [p for p in verify(out, "trtllm") if p.severity == "error"] == []


def test_unquantized_model_writes_no_quant_algo_null_file(tiny_llama_dir, tmp_path):
    """The rule (NVIDIA/TensorRT-LLM `tensorrt_llm/llmapi/llm_utils.py` `ModelLoader._update_from_hf_quant_config`,
    main at commit 0066b2a5 and the older form with the TensorRT-engine branch, 1.0-1.2; called by
    `CachedModelLoader.__call__` on the PyTorch backend before any weight loads): an hf_quant_config.json whose
    `quant_algo` is null, without `quantized_layers`, raises ValueError("Pre-quantized checkpoint must have
    quant_algo."). Run on kvcalib's outputs from a fetched copy (2026-12): the old BF16 output was refused; this
    layout (no hf_quant_config.json, `kv_cache_config.dtype: fp8` in the options file) loads with
    kv_cache_quant_algo FP8 (`_torch/pyexecutor/model_loader.py` `validate_and_set_kv_cache_quant`). What the
    rule refuses, verify reports; the serve command passes the options file."""
    out = trtllm.export_trtllm(tiny_llama_dir, tmp_path / "out", _scales(3), {})
    assert not (out / trtllm.HF_QUANT_CONFIG).exists()
    options = yaml.safe_load((out / TRTLLM_API_OPTIONS).read_text())
    assert options["kv_cache_config"]["dtype"] in ("fp8", "nvfp4", "auto")     # _VALID_KV_CACHE_DTYPES (main)
    prov = json.loads((out / export.PROVENANCE_FILE).read_text())
    assert "serve-time" in prov["trtllm_kv_declared_by"]
    assert trtllm.TARGET.serve_command(str(out)) == (
        f"trtllm-serve {out} --extra_llm_api_options {out}/{TRTLLM_API_OPTIONS}")
    # the layout kvcalib wrote before: verify says TensorRT-LLM would not start
    (out / trtllm.HF_QUANT_CONFIG).write_text(json.dumps({"producer": {"name": "kvcalib"}, "quantization": {
        "quant_algo": None, "kv_cache_quant_algo": "FP8", "exclude_modules": []}}))
    assert "trtllm.no-quant-algo" in [p.code for p in verify(out) if p.severity == "error"]
