"""The TensorRT-LLM TensorRT-engine target: a TensorRT-LLM checkpoint (config.json + rank{r}.safetensors, pp 2 x tp 2)
gets one kv_cache_scaling_factor per layer, local to the pipeline stage, the same on every tensor-parallel rank;
every other tensor keeps its bytes; the user's folder is never touched; what the engine cannot express is refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from calib import export
from calib.scales.stats import LayerStats
from calib.ckpt.source import ExportError
from calib.export import trtllm_engine as te
from calib.recipe import dtypes
from calib.recipe.granularity import by_name
from calib.scales import fold
from helpers import trtllm_engine_ckpt as make_ckpt

N_LAYERS = 5     # 5 over pp 2: stage 0 holds layers 0, 1, 2 and stage 1 holds 3, 4 (the first stage one more)


def scales_for(n: int = N_LAYERS, dtype: str = "fp8_e4m3"):
    stats = {i: LayerStats(torch.tensor([1.0 + i, 300.0 * (i % 2)]), torch.tensor([50.0 * (i + 1), 2.0]))
             for i in range(n)}
    return stats, fold.compute(stats, dtype=dtype, granularity="tensor")


def raw_bytes(path: Path) -> dict[str, bytes]:
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            out[k] = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return out


def tree_digest(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


@pytest.mark.parametrize("dtype, algo, qmax", [("fp8_e4m3", "FP8", 448.0), ("int8", "INT8", 127.0)])
def test_pp2_tp2_scales_local_to_the_stage_brute_force(tmp_path, dtype, algo, qmax):
    src = make_ckpt(tmp_path / "ckpt")
    before = tree_digest(src)
    stats, scales = scales_for(dtype=dtype)
    out = te.export_engine_checkpoint(src, tmp_path / "out", scales, {}, kv_algo=algo)
    assert tree_digest(src) == before                                 # the user's folder is untouched
    stage_layers = {0: [0, 1, 2], 1: [3, 4]}                          # torch.tensor_split(arange(5), 2)
    for r in range(4):
        f = f"rank{r}.safetensors"
        old, new = raw_bytes(src / f), raw_bytes(out / f)
        added = sorted(set(new) - set(old))
        layers = stage_layers[r // 2]
        assert added == sorted(f"transformer.layers.{j}.attention.kv_cache_scaling_factor" for j in range(len(layers)))
        assert {k: new[k] for k in old} == old                       # every other tensor byte-identical
        with safe_open(str(out / f), framework="pt") as h:
            for j, g in enumerate(layers):
                t = h.get_tensor(f"transformer.layers.{j}.attention.kv_cache_scaling_factor")
                assert t.dtype == torch.float32 and t.shape == (1,)
                s = stats[g]                                          # brute force: max over K, V and heads / qmax
                want = torch.maximum(s.k_amax.max(), s.v_amax.max()).float() / torch.tensor(qmax)
                assert float(t) == float(want)
            assert h.metadata() == {"format": "pt"}
    cfg_in, cfg_out = (json.loads((p / "config.json").read_text()) for p in (src, out))
    assert cfg_out["quantization"]["kv_cache_quant_algo"] == algo
    cfg_out["quantization"]["kv_cache_quant_algo"] = None
    assert cfg_out == cfg_in                                          # the rest of config.json untouched
    prov = json.loads((out / "kvcalib.json").read_text())
    assert prov["target"] == "trtllm-engine" and prov["kv_cache_quant_algo"] == algo


def test_every_tp_rank_of_a_stage_carries_the_same_value(tmp_path):
    src = make_ckpt(tmp_path / "ckpt", tp=2, pp=1, n=3)
    out = te.export_engine_checkpoint(src, tmp_path / "out", scales_for(3)[1], {})
    name = "transformer.layers.2.attention.kv_cache_scaling_factor"
    vals = []
    for r in range(2):
        with safe_open(str(out / f"rank{r}.safetensors"), framework="pt") as h:
            vals.append(float(h.get_tensor(name)))
    assert vals[0] == vals[1]


def test_the_target_is_registered_and_prepared_from_the_recipe(tmp_path):
    t = export.target("trtllm-engine")
    assert t is te.TARGET and set(t.dtypes) == {dtypes.FP8_E4M3, dtypes.INT8}
    assert not t.skips_layers and not t.reads_q_scale
    src = make_ckpt(tmp_path / "ckpt")
    how = export.WriteOptions(dtype=dtypes.INT8)
    prepared = t.prepare(src, tmp_path / "out", how)
    assert prepared.kv_algo == "INT8" and prepared.rank_layers == {0: [0, 1, 2], 1: [0, 1, 2], 2: [3, 4], 3: [3, 4]}
    t.write(prepared, tmp_path / "out", scales_for(dtype="int8")[1], {}, how)
    assert json.loads((tmp_path / "out/config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "INT8"
    assert "--backend tensorrt" in t.serve_command(str(tmp_path / "out"))


def test_refusals_one_line_each(tmp_path):
    src = make_ckpt(tmp_path / "ckpt")
    t = export.target("trtllm-engine")
    out = tmp_path / "out"
    cases = [
        (lambda: t.prepare(src, out, export.WriteOptions(granularity=by_name("head"))), "per-head scales"),
        (lambda: te.prepare_engine_checkpoint(src, out, q_scale=True), "reads no q_scale"),
        (lambda: te.export_engine_checkpoint(src, out, {i: s for i, s in scales_for()[1].items() if i != 3}, {}),
         r"layers \[3\] have no scales"),
        (lambda: te.export_engine_checkpoint(src, out, fold.compute(scales_for()[0], dtype="fp8_e4m3",
                                                                    granularity="head"), {}), "per-head"),
    ]
    for call, match in cases:
        with pytest.raises(ExportError, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    assert not out.exists()


def test_bad_checkpoints_one_line_each(tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    missing = make_ckpt(tmp_path / "missing")
    (missing / "rank3.safetensors").unlink()
    noquant = make_ckpt(tmp_path / "noquant")
    cfg = json.loads((noquant / "config.json").read_text())
    del cfg["quantization"]
    (noquant / "config.json").write_text(json.dumps(cfg))
    wrong_split = make_ckpt(tmp_path / "split", n=N_LAYERS)
    cfg = json.loads((wrong_split / "config.json").read_text())
    cfg["num_hidden_layers"] = 6                                      # 6 over 2 stages would be 3 + 3
    (wrong_split / "config.json").write_text(json.dumps(cfg))
    declared = make_ckpt(tmp_path / "declared", quant={"quant_algo": None, "kv_cache_quant_algo": "FP8"})
    for src, match in [(tiny_llama_dir, "not a TensorRT-LLM checkpoint"), (missing, "missing rank3.safetensors"),
                       (noquant, "no 'quantization' object"), (wrong_split, "the config and the weights disagree"),
                       (declared, "already declares kv_cache_quant_algo='FP8'")]:
        with pytest.raises(ExportError, match=match) as e:
            te.prepare_engine_checkpoint(src, out)
        assert "\n" not in str(e.value)


def test_overwrite_replaces_old_kv_scales_and_their_reciprocal(tmp_path):
    """A checkpoint converted with --fp8_kv_cache carries 1.0 (and maybe its reciprocal, which preprocess_weights
    would otherwise keep): --overwrite-kv-scales drops them and writes ours."""
    src = make_ckpt(tmp_path / "ckpt", tp=1, pp=1, n=2, quant={"quant_algo": None, "kv_cache_quant_algo": "FP8"})
    f = src / "rank0.safetensors"
    with safe_open(str(f), framework="pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    for j in range(2):
        tensors[f"transformer.layers.{j}.attention.kv_cache_scaling_factor"] = torch.ones(1)
        tensors[f"transformer.layers.{j}.attention.kv_cache_rcp_scaling_factor"] = torch.ones(1)
    save_file(tensors, str(f))
    with pytest.raises(ExportError, match="--overwrite-kv-scales"):
        te.prepare_engine_checkpoint(src, tmp_path / "out")
    prepared = te.prepare_engine_checkpoint(src, tmp_path / "out", overwrite_kv=True)
    out = te.export_engine_checkpoint(prepared, tmp_path / "out", scales_for(2)[1], {})
    with safe_open(str(out / "rank0.safetensors"), framework="pt") as h:
        keys = set(h.keys())
        assert not any("rcp" in k for k in keys)
        assert float(h.get_tensor("transformer.layers.1.attention.kv_cache_scaling_factor")) != 1.0


def test_failure_mid_export_leaves_nothing(tmp_path, monkeypatch):
    from calib.safety.outputs import OutputError

    src = make_ckpt(tmp_path / "ckpt")
    calls = []

    def boom(path, mode="w", **kw):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        return real(path, mode, **kw)
    real = te.files.open_new
    monkeypatch.setattr(te.files, "open_new", boom)
    with pytest.raises(OutputError, match=r"nothing was written"):
        te.export_engine_checkpoint(src, tmp_path / "out", scales_for()[1], {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_calibrate_into_a_tensorrt_llm_checkpoint_of_the_model(tmp_path, tiny_llama_dir, token_data):
    """`kvcalib calibrate --target trtllm-engine --into CKPT`: the checkpoint is recognised by its config.json,
    checked to be of the calibrated model by architecture and sizes, and gets one shared scale a layer equal to
    max(k, v) of the scales calibrate computes for that model (brute force: the vLLM variant of the same run)."""
    from calib import pipeline
    from calib.recipe import recipe as recipe_mod
    from helpers import SMALL_RECIPE

    ckpt = make_ckpt(tmp_path / "trt", tp=1, pp=2, n=3, extra={"num_attention_heads": 4})
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, vocab_size=257, head_size=16)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    r = recipe_mod.load(None).replace(**SMALL_RECIPE, targets=("trtllm-engine",))
    out = pipeline.calibrate(tiny_llama_dir, token_data, r, tmp_path / "out", device="cpu", into=ckpt).out
    ref = pipeline.calibrate(tiny_llama_dir, token_data, r.replace(targets=("vllm",)), tmp_path / "ref",
                             device="cpu").out
    from safetensors.torch import load_file

    want = load_file(str(ref / "kv_scales.safetensors"))
    for stage, layers in ((0, (0, 1)), (1, (2,))):
        part = load_file(str(out / f"rank{stage}.safetensors"))
        for j, i in enumerate(layers):
            k, v = want[f"model.layers.{i}.self_attn.k_scale"], want[f"model.layers.{i}.self_attn.v_scale"]
            got = part[f"transformer.layers.{j}.attention.kv_cache_scaling_factor"]
            assert got.dtype == torch.float32 and list(got.shape) == [1]
            assert got.item() == pytest.approx(max(k.max().item(), v.max().item()), rel=1e-6)
    assert json.loads((out / "config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "FP8"
    # the input checkpoint is untouched
    assert json.loads((ckpt / "config.json").read_text())["quantization"]["kv_cache_quant_algo"] is None


def test_calibrate_into_a_tensorrt_llm_checkpoint_of_another_model_is_one_line(tmp_path, tiny_llama_dir, token_data):
    from calib import pipeline
    from calib.export import ExportError
    from calib.recipe import recipe as recipe_mod
    from helpers import SMALL_RECIPE

    ckpt = make_ckpt(tmp_path / "trt", tp=1, pp=1, n=3)          # hidden 16, vocab 32: not the tiny Llama
    r = recipe_mod.load(None).replace(**SMALL_RECIPE, targets=("trtllm-engine",))
    with pytest.raises(ExportError, match="is not a TensorRT-LLM checkpoint of .*hidden_size"):
        pipeline.calibrate(tiny_llama_dir, token_data, r, tmp_path / "out", device="cpu", into=ckpt)
    assert not (tmp_path / "out").exists()
