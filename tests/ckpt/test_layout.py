"""calib.ckpt: the names and config blocks the exporters write are the ones the readers parse back, and the
compressed-tensors block is what the compressed-tensors library itself serialises."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from calib import export
from calib.ckpt import formats, names
from calib.ckpt.kvinfo import read_kv_info
from helpers import made_up_scales


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_compressed_tensors_block_matches_the_library(strategy):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    lib = QuantizationConfig(config_groups={}, format="dense", ignore=[], quantization_status="compressed",
                             kv_cache_scheme=QuantizationArgs(num_bits=8, type="float", strategy=strategy,
                                                              dynamic=False, symmetric=True)).to_dict()

    def drop_none(d):
        return {k: drop_none(v) for k, v in d.items() if v is not None} if isinstance(d, dict) else d

    assert json.dumps(formats.ct_quantization_config(strategy), sort_keys=True) == \
        json.dumps(drop_none(lib), sort_keys=True)


def test_written_names_parse_back():
    for layer in (0, 7, 123):
        for kind in "kvq":
            assert names.parse_scale_name(names.vllm_scale_name(layer, kind)) == \
                names.ScaleName(layer, kind, "attn", None)
        k, v = names.trtllm_scale_names(layer)
        assert names.parse_scale_name(k) == names.ScaleName(layer, "k", "proj", "k")
        assert names.parse_scale_name(v) == names.ScaleName(layer, "v", "proj", "v")
    assert names.parse_scale_name("model.layers.3.self_attn.v_proj.output_scale") == \
        names.ScaleName(3, "v", "quark", "v")
    assert names.parse_scale_name("model.layers.3.self_attn.k_proj.weight") is None
    assert names.is_kv_scale("model.layers.3.self_attn.k_zero_point")
    assert not names.is_kv_scale("model.layers.3.mlp.down_proj.k_scale")


def test_modelopt_shapes_read_alike():
    legacy = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                                                  "exclude_modules": ["lm_head"]}}
    flat = {"producer": {"name": "modelopt"}, "quant_algo": "FP8", "ignore": ["lm_head"],
            "kv_cache_scheme": {"type": "float", "num_bits": 8}}
    assert formats.modelopt_quantization(legacy) == formats.modelopt_quantization(flat) == legacy["quantization"]
    assert formats.modelopt_quantization({**flat, "kv_cache_scheme": "int8"})["kv_cache_quant_algo"] == "INT8"
    assert formats.modelopt_quantization({"quant_algo": "FP8"}) is None          # no marker: not ModelOpt
    assert formats.modelopt_quantization({"quantization": [1]}) is None


# trtllm-engine writes TensorRT-LLM's own rank files (read by verify's trtllm_engine view, checked in
# tests/export/test_trtllm_engine_target.py), not a Hugging Face folder this reader reads
@pytest.mark.parametrize("target", sorted(set(export.TARGETS) - {"trtllm-engine"}))
def test_every_target_writes_what_the_reader_reads(tiny_llama_dir, tmp_path, target):
    out = export.target(target).write(tiny_llama_dir, tmp_path / target, made_up_scales(3), {"producer": "kvcalib"})
    info = read_kv_info(out)
    assert info.targets == [target]
    f32 = lambda x: float(torch.tensor(x))  # noqa: E731  (the scales are stored as float32)
    assert {i: (s["k"], s["v"]) for i, s in info.scales.items()} == \
        {i: ([f32(0.01 * (i + 1))], [f32(0.02 * (i + 1))]) for i in range(3)}


def test_trtllm_refuses_a_flat_modelopt_source_that_declares_kv_quantization(tiny_llama_dir, tmp_path):
    """The exporter reads ModelOpt's flat shape as verify does: a string or INT8 kv_cache_scheme counts."""
    src = tmp_path / "flat"
    shutil.copytree(tiny_llama_dir, src)
    for scheme in ("fp8", {"type": "int", "num_bits": 8}):
        (src / names.HF_QUANT_CONFIG).write_text(json.dumps({"producer": {"name": "modelopt"}, "quant_algo": None,
                                                             "kv_cache_scheme": scheme}))
        with pytest.raises(export.ExportError, match="already declares kv_cache_quant_algo"):
            export.export_trtllm(src, tmp_path / "out", made_up_scales(3), {})
    (src / names.HF_QUANT_CONFIG).write_text(json.dumps({"quant_algo": None}))
    with pytest.raises(export.ExportError, match="nor a ModelOpt marker"):
        export.export_trtllm(src, tmp_path / "out", made_up_scales(3), {})
    assert not (tmp_path / "out").exists()


def test_unknown_target_is_an_error_naming_the_known_ones():
    with pytest.raises(export.ExportError, match=r"unknown target 'tensorrt'; kvcalib writes \['sglang', 'trtllm', 'trtllm-engine', 'vllm'\]"):
        export.target("tensorrt")


def _with_configs(src, dst, *, qc=None, hf_quant=None):
    """A copy of `src` whose config.json carries `qc` and/or whose hf_quant_config.json is `hf_quant`."""
    shutil.copytree(src, dst)
    if qc is not None:
        cfg = json.loads((dst / names.CONFIG_FILE).read_text())
        (dst / names.CONFIG_FILE).write_text(json.dumps({**cfg, "quantization_config": qc}))
    if hf_quant is not None:
        (dst / names.HF_QUANT_CONFIG).write_text(json.dumps(hf_quant))
    return dst


QUARK_OUT = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}
CONFIGS = {   # name: (config.json quantization_config, hf_quant_config.json, inspect's targets, its KV algorithm)
    "ct": ({**formats.ct_quantization_config(), "quant_method": "compressed_tensors"}, None, ["vllm"], None),
    "ct-no-kv": ({"quant_method": "compressed-tensors", "config_groups": {}}, None, [], None),
    "quark": ({"quant_method": "quark", "layer_quant_config": {"*k_proj": {"output_tensors": QUARK_OUT}},
               "export": {"kv_cache_group": ["*k_proj", "*v_proj"]}}, None, ["vllm"], None),
    "quark-no-kv": ({"quant_method": "quark", "export": {"kv_cache_group": []}}, None, [], None),
    "modelopt-legacy": (None, {"producer": {"name": "modelopt"}, "quantization": {"kv_cache_quant_algo": "INT8"}},
                        ["trtllm"], "INT8"),
    "modelopt-flat": (None, {"producer": {"name": "modelopt"}, "kv_cache_scheme": {"type": "float", "num_bits": 8}},
                      ["trtllm"], "FP8"),
    "no-marker": (None, {"kv_cache_quant_algo": "FP8"}, [], None),   # TensorRT-LLM cannot read this file
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_inspect_reads_each_format_as_verify_does(tiny_llama_dir, tmp_path, name):
    """inspect's KV declaration comes from calib.ckpt.formats, as verify's engine views do: compressed-tensors in
    either spelling, Quark's kv_cache_group, both ModelOpt shapes, and no algorithm from a file without a marker."""
    from calib.ckpt.reader import CheckpointFiles
    from calib.verify.trtllm import trt_view
    from calib.verify.vllm import vllm_view

    qc, hf_quant, targets, algo = CONFIGS[name]
    ckpt = _with_configs(tiny_llama_dir, tmp_path / name, qc=qc, hf_quant=hf_quant)
    info = read_kv_info(ckpt)
    assert info.targets == targets and info.kv_cache_quant_algo == algo
    ck = CheckpointFiles(ckpt)
    if qc is not None:                     # config.json's block: vLLM reads it
        assert vllm_view(ck).kv_declared == ("vllm" in targets)
        assert (info.kv_scheme is not None) == (name == "ct")
    else:                                  # hf_quant_config.json: TensorRT-LLM reads it
        assert trt_view(ck).kv_algo == algo


def test_a_scheme_of_the_wrong_shape_is_no_algorithm():
    """A list where ModelOpt's flat kv_cache_scheme names its type: no algorithm (it used to raise TypeError)."""
    flat = {"producer": {"name": "modelopt"}, "kv_cache_scheme": {"type": ["float"], "num_bits": 8}}
    assert formats.modelopt_kv_cache_algo(flat) is None
    assert formats.modelopt_kv_algo({"type": "float", "num_bits": 8.0}) == "FP8"
