"""The arms: a checkpoint's K/V scales read as vLLM and TensorRT-LLM lay them out (per head and its per-tensor
fold, INT8, a calibrated skip), scales shaped per tensor/head/channel with a one-line error otherwise, and an
arm's name and description after a skip."""

from __future__ import annotations

import json

import pytest
import torch

from calib.evaluation import verdict as honest
from calib.evaluation.arms import TOKEN, Arm, EvalError, Geometry, checkpoint_arms, reference_arm
from calib.recipe.dtypes import FP8_E4M3, INT8


def test_checkpoint_arms_read_vllm_per_head_and_trtllm_int8_layouts(tmp_path):
    from safetensors.torch import save_file

    geo = Geometry((0, 1), 2, 4)
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
    head, folded = checkpoint_arms(str(tmp_path / "vllm"), geo)
    assert head.granularity == "head" and head.dtype is FP8_E4M3
    assert torch.equal(head.k[1], torch.tensor([0.5, 2.0]).view(1, 2, 1, 1))
    assert folded.name.endswith("@tensor") and float(folded.v[0]) == 3.0 and folded.k[0].dim() == 0
    # an emulated engine that reads one scale per layer (vLLM CPU, TensorRT-LLM) gets only the fold, by the
    # checkpoint's own name: that is what serving this checkpoint there applies
    (one,) = checkpoint_arms(str(tmp_path / "vllm"), geo, per_head_kv=False)
    assert one.name == head.name and one.granularity == "tensor" and "folded" in one.notes[-1]
    assert float(one.k[1]) == 2.0 and float(one.v[0]) == 3.0 and one.k[0].dim() == 0
    (trt,) = checkpoint_arms(str(tmp_path / "trt"), geo)
    assert trt.dtype is INT8 and float(trt.k[1]) == 0.25 and float(trt.v[0]) == 0.125
    (tmp_path / "vllm" / "kvcalib.json").write_text(json.dumps({"producer": "kvcalib", "skipped_layers": [1]}))
    skipping = checkpoint_arms(str(tmp_path / "vllm"), geo)[0]      # calibrated with skip_layers: [1]
    assert list(skipping.k) == [0] and skipping.serve_skip == (1,) and skipping.skip == ()
    assert "--kv-cache-dtype-skip-layers 1" in honest.how_to_serve(skipping.info())
    with pytest.raises(EvalError, match="2 layers; this model has 3"):
        checkpoint_arms(str(tmp_path / "vllm"), Geometry((0, 1, 2), 2, 4))
    with pytest.raises(EvalError, match="per KV head"):
        checkpoint_arms(str(tmp_path / "vllm"), Geometry((0, 1), 3, 4))


def test_arms_name_skips_and_describe_their_scales():
    arm = Arm("x", FP8_E4M3, {0: torch.tensor(0.5), 1: torch.tensor([1.0, 2.0]).view(1, 2, 1, 1)},
              {0: torch.tensor(0.25), 1: TOKEN}, kind="checkpoint")
    info = arm.info()
    assert info.scales == {"k": {"0": 0.5, "1": 2.0}, "v": {"0": 0.25, "1": None}, "q": {}}
    assert (info.kind, info.dtype, info.skip) == ("checkpoint", "fp8_e4m3", ())
    assert info.to_dict()["skip"] == [] and info.to_dict()["scales"]["v"] == {"0": 0.25, "1": None}
    one = arm.skipping([1])
    assert one.name == "x skip 1" and list(one.k) == [0] and list(one.v) == [0] and one.skip == (1,)
    both = one.skipping([0])
    assert both.skip == (0, 1) and not both.k and not both.v
    assert [reference_arm(t).name for t in (torch.bfloat16, torch.float16, torch.float32)] == ["bf16", "fp16", "fp32"]


def test_geometry_shapes_scales_per_tensor_head_and_channel():
    geo = Geometry((0, 1), 2, 3)
    assert geo.shape(0.5, "w").shape == ()
    assert geo.shape([1.0, 2.0], "w").shape == (1, 2, 1, 1)
    per_channel = geo.shape(list(range(1, 7)), "w")
    assert per_channel.shape == (1, 2, 1, 3) and float(per_channel[0, 1, 0, 2]) == 6.0
    with pytest.raises(EvalError, match="layer 4: scales must be finite and at least the smallest normal float32"):
        geo.shape([1.0, -1.0], "layer 4")
    with pytest.raises(EvalError, match="4 scale values fit neither"):
        geo.shape([1.0] * 4, "w")
