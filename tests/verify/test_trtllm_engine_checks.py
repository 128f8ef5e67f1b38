"""verify's rules for a converted TensorRT-LLM checkpoint (calib/verify/trtllm_engine.py): a good one passes; a
missing scale, a bad value and ranks that disagree are each named with the file and layer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from calib import export, verify
from helpers import made_up_scales, trtllm_engine_ckpt


@pytest.fixture
def written(tmp_path):
    src = trtllm_engine_ckpt(tmp_path / "trt", tp=2, pp=2, n=5)
    return export.target("trtllm-engine").write(src, tmp_path / "out", made_up_scales(5), {"producer": "kvcalib"})


def _edit(path, name, value):
    t = load_file(str(path))
    if value is None:
        t.pop(name)
    else:
        t[name] = value
    save_file(t, str(path), metadata={"format": "pt"})


def test_a_written_checkpoint_passes_and_only_its_engine_is_checked(written):
    assert verify.verify(written, "all") == []


def test_a_converted_checkpoint_without_a_kv_algorithm_is_named(tmp_path):
    src = trtllm_engine_ckpt(tmp_path / "trt", tp=1, pp=1, n=2)
    found = [str(p) for p in verify.verify(src, "all")]
    assert found == ["ERROR [trtllm-engine] config.json: quantization.kv_cache_quant_algo = None: the engine builds "
                     "no quantized KV cache without one of ['FP8', 'INT8']"]


def test_a_missing_scale_a_bad_value_and_ranks_that_disagree(written):
    name = "transformer.layers.{}.attention.kv_cache_scaling_factor"
    _edit(written / "rank0.safetensors", name.format(1), None)                          # stage 0, layer 1
    _edit(written / "rank2.safetensors", name.format(0), torch.tensor([float("nan")]))  # stage 1, layer 3
    _edit(written / "rank1.safetensors", name.format(2), torch.tensor([0.5]))           # stage 0, layer 2 on tp 1
    found = [str(p) for p in verify.verify(written, "all")]
    assert any("rank0.safetensors: no kv_cache_scaling_factor for layer(s) [1]" in f for f in found), found
    assert any("rank2.safetensors: layer 3: kv_cache_scaling_factor = [nan]" in f for f in found), found
    assert any(f.startswith("WARNING [trtllm-engine] rank1.safetensors: layer 2") and "differs" in f for f in found)
    assert json.loads((written / "config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
