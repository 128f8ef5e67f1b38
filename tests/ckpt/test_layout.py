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


@pytest.mark.parametrize("target", sorted(export.TARGETS))
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
    with pytest.raises(export.ExportError, match=r"unknown target 'sglang'; kvcalib writes \['trtllm', 'vllm'\]"):
        export.target("sglang")
