"""Conformance tests for `calib.verify`: good checkpoints of every known layout pass, and each engine rule,
broken on purpose in a copy of a good checkpoint, yields exactly the Problem that rule stands for.

Every rule test's docstring names the engine source file and function the rule restates (vLLM 0.32 paths
under `vllm/`, TensorRT-LLM paths under `tensorrt_llm/`, read 2026-12)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from calib import export
from calib.ckpt.names import TRTLLM_API_OPTIONS
from calib.ckpt.reader import Problem
from calib.export import trtllm
from calib.verify import verify
from helpers import made_up_scales

N_LAYERS, KV_HEADS, HEADS = 3, 2, 4
SCALES = export.SCALES_FILE
HQ = trtllm.HF_QUANT_CONFIG


@pytest.fixture(scope="module")
def built(source, tmp_path_factory):
    base = tmp_path_factory.mktemp("built")
    return {"vllm": export.export_vllm(source, base / "vllm", made_up_scales(), {"producer": "kvcalib"}),
            "trtllm": trtllm.export_trtllm(source, base / "trtllm", made_up_scales(), {"producer": "kvcalib"}),
            "trtllm-int8": trtllm.export_trtllm(source, base / "int8", made_up_scales(), {}, kv_algo="INT8")}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture
def vllm_ckpt(built, tmp_path):
    return _copy(built["vllm"], tmp_path / "vllm")


@pytest.fixture
def trt_ckpt(built, tmp_path):
    return _copy(built["trtllm"], tmp_path / "trtllm")


@pytest.fixture
def int8_ckpt(built, tmp_path):
    return _copy(built["trtllm-int8"], tmp_path / "int8")


def _edit_json(path: Path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _edit_shard(path: Path, fn):
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def _index_add(ckpt: Path, names, shard=SCALES):
    _edit_json(ckpt / export.INDEX_FILE, lambda d: d["weight_map"].update({n: shard for n in names}))


def _one(problems, engine, where, code, severity="error") -> Problem:
    hits = [p for p in problems if (p.engine, p.where, p.code, p.severity) == (engine, where, code, severity)]
    assert len(hits) == 1, f"want one {severity} {code} at {where}, got:\n" + "\n".join(map(str, problems))
    return hits[0]


def _kv(layer, kind):
    return f"model.layers.{layer}.self_attn.{kind}_scale"


def _trt(layer, kind):
    return f"model.layers.{layer}.self_attn.{kind}_proj.{kind}_scale"


# ----------------------------------------------------------------------------------------------- good ones

def test_kvcalib_variants_pass(built):
    for name, ckpt in built.items():
        if name != "trtllm-int8":
            assert verify(ckpt) == [], name
    assert verify(built["vllm"], "vllm") == []
    assert verify(built["trtllm"], "trtllm") == []
    # INT8 KV of an unquantized model: kv_cache_config.dtype int8, which only a build with PR 18953 accepts
    assert [(p.code, p.severity) for p in verify(built["trtllm-int8"], "trtllm")] == [("trtllm.int8-build",
                                                                                       "warning")]


def _llm_compressor(source, dst, strategy="tensor", shape=(1,), dtype=torch.float32):
    """llm-compressor's layout: the compressed-tensors block, `self_attn.{k,v}_scale` in the model dtype."""
    ckpt = _copy(source, dst)
    qc = export.vllm_quantization_config()
    qc["kv_cache_scheme"]["strategy"] = strategy
    _edit_json(ckpt / "config.json", lambda c: c.update(quantization_config=qc))
    tensors = {_kv(i, kv): torch.full(shape, 0.01 * (i + 1), dtype=dtype) for i in range(N_LAYERS) for kv in "kv"}
    save_file(tensors, str(ckpt / "model-kv.safetensors"))
    weights = load_file(str(ckpt / "model.safetensors"))
    index = {"metadata": {}, "weight_map": {**{n: "model.safetensors" for n in weights},
                                            **{n: "model-kv.safetensors" for n in tensors}}}
    (ckpt / export.INDEX_FILE).write_text(json.dumps(index))
    return ckpt


@pytest.mark.parametrize("strategy,shape", [("tensor", (1,)), ("tensor", ()), ("attn_head", (KV_HEADS, 1, 1)),
                                            ("attn_head", (KV_HEADS,))])
def test_llm_compressor_layout_passes(source, tmp_path, strategy, shape):
    assert verify(_llm_compressor(source, tmp_path / "lc", strategy, shape)) == []


def _modelopt(source, dst, quant_algo="FP8", kv="FP8"):
    """ModelOpt's layout: hf_quant_config.json (legacy shape) and `self_attn.{k,v}_proj.{k,v}_scale` scalars."""
    ckpt = _copy(source, dst)
    (ckpt / HQ).write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.29.0"},
                                       "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": kv,
                                                        "exclude_modules": ["lm_head"]}}))
    save_file({_trt(i, kv_): torch.tensor(0.01 * (i + 1)) for i in range(N_LAYERS) for kv_ in "kv"},
              str(ckpt / "model-kv.safetensors"))
    return ckpt


def test_modelopt_layout_passes_for_both_engines(source, tmp_path):
    ckpt = _modelopt(source, tmp_path / "mo")
    assert verify(ckpt) == []
    assert verify(ckpt, "vllm") == [] and verify(ckpt, "trtllm") == []


def _quark(source, dst, dtype="fp8_e4m3"):
    """AMD Quark's layout as vLLM reads it: quant_method quark, export.kv_cache_group, output_tensors spec,
    `self_attn.{k,v}_proj.output_scale` tensors."""
    ckpt = _copy(source, dst)
    out_spec = {"dtype": dtype, "qscheme": "per_tensor", "is_dynamic": False, "ch_axis": None, "group_size": None,
                "observer_cls": "PerTensorMinMaxObserver", "round_method": "half_even", "symmetric": True}
    qc = {"quant_method": "quark", "global_quant_config": {"weight": None, "input_tensors": None,
                                                           "output_tensors": None, "bias": None},
          "layer_quant_config": {"*k_proj": {"output_tensors": out_spec}, "*v_proj": {"output_tensors": out_spec}},
          "layer_type_quant_config": {}, "exclude": [],
          "export": {"kv_cache_group": ["*k_proj", "*v_proj"], "pack_method": "reorder",
                     "weight_format": "real_quantized", "min_kv_scale": 0.0}}
    _edit_json(ckpt / "config.json", lambda c: c.update(quantization_config=qc))
    save_file({f"model.layers.{i}.self_attn.{kv}_proj.output_scale": torch.tensor(0.01 * (i + 1))
               for i in range(N_LAYERS) for kv in "kv"}, str(ckpt / "model-kv.safetensors"))
    return ckpt


def test_quark_layout_passes(source, tmp_path):
    assert verify(_quark(source, tmp_path / "quark")) == []


# ----------------------------------------------------------------------------------------- vLLM rules

def test_vllm_dropped_scale_tensor(vllm_ckpt):
    """vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py:
    CompressedTensorsKVCacheMethod.create_weights: a scale the checkpoint lacks keeps its placeholder 1.0."""
    _edit_shard(vllm_ckpt / SCALES, lambda t: t.pop(_kv(1, "v")))
    problems = verify(vllm_ckpt)
    assert "silently use 1.0 for layer 1" in _one(problems, "vllm", _kv(1, "v"), "vllm.missing-scale").message
    _one(problems, "vllm", _kv(1, "v"), "vllm.index-entry")   # the index still promises it


def test_vllm_dropped_index_entries(vllm_ckpt):
    """vllm/model_executor/model_loader/weight_utils.py: filter_duplicate_safetensors_files: with an index,
    only the shards it names are read, so scales in an unnamed shard silently stay 1.0."""
    _edit_json(vllm_ckpt / export.INDEX_FILE,
               lambda d: d.update(weight_map={k: v for k, v in d["weight_map"].items() if v != SCALES}))
    problems = verify(vllm_ckpt)
    for i in range(N_LAYERS):
        for kind in "kv":
            p = _one(problems, "vllm", _kv(i, kind), "vllm.unindexed-shard")
            assert "never reads it and would silently use 1.0" in p.message
    _one(problems, "vllm", "config.json:quantization_config", "vllm.silent-default")


def test_vllm_one_dropped_index_entry_is_a_warning(vllm_ckpt):
    """vllm/model_executor/model_loader/weight_utils.py: filter_duplicate_safetensors_files filters files, not
    tensors: a tensor missing from weight_map in a named shard is still read."""
    _edit_json(vllm_ckpt / export.INDEX_FILE, lambda d: d["weight_map"].pop(_kv(0, "k")))
    problems = verify(vllm_ckpt)
    assert problems == [_one(problems, "vllm", _kv(0, "k"), "vllm.unindexed-tensor", "warning")]
    assert "vLLM reads it" in problems[0].message


def test_vllm_index_names_a_missing_shard(vllm_ckpt):
    """vllm/model_executor/model_loader/weight_utils.py: filter_duplicate_safetensors_files raises
    FileNotFoundError for a shard the index names that does not exist."""
    _index_add(vllm_ckpt, ["model.extra.weight"], shard="model-00009.safetensors")
    assert "FileNotFoundError" in _one(verify(vllm_ckpt), "vllm", export.INDEX_FILE,
                                       "vllm.index-missing-shard").message


@pytest.mark.parametrize("shape", [(2,), (1, 2)])
def test_vllm_per_tensor_shape(vllm_ckpt, shape):
    """vllm/model_executor/model_loader/weight_utils.py: default_weight_loader (a [1] placeholder takes one
    element only)."""
    _edit_shard(vllm_ckpt / SCALES, lambda t: t.update({_kv(2, "k"): torch.full(shape, 0.03)}))
    assert "one element" in _one(verify(vllm_ckpt), "vllm", _kv(2, "k"), "vllm.shape").message


def test_vllm_attn_head_shape(source, tmp_path):
    """vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py:
    CompressedTensorsKVCacheMethod.create_weights (_tp_aware_loader slices [kv_heads] after flatten)."""
    ckpt = _llm_compressor(source, tmp_path / "lc", "attn_head", (KV_HEADS, 1, 1))
    _edit_shard(ckpt / "model-kv.safetensors", lambda t: t.update({_kv(0, "v"): torch.full((3, 1, 1), 0.1)}))
    p = _one(verify(ckpt), "vllm", _kv(0, "v"), "vllm.shape")
    assert "[2, 1, 1] or [2]" in p.message


def test_vllm_bf16_scale_is_a_warning(vllm_ckpt):
    """vllm/model_executor/layers/quantization/kv_cache.py and compressed_tensors.py: float32 placeholders,
    `copy_` widens a bf16 value, which kept only ~3 digits."""
    _edit_shard(vllm_ckpt / SCALES, lambda t: t.update({_kv(0, "v"): torch.tensor(0.02, dtype=torch.bfloat16)}))
    problems = verify(vllm_ckpt)
    assert problems == [_one(problems, "vllm", _kv(0, "v"), "vllm.dtype", "warning")]


@pytest.mark.parametrize("bad,text", [(0.0, "holds 0.0"), (-0.5, "holds -0.5"), (float("nan"), "non-finite"),
                                      (float("inf"), "non-finite"),
                                      # subnormal float32: dividing K/V by it overflows, every value saturates
                                      (1e-45, "below the smallest normal float32"),
                                      (1e-39, "below the smallest normal float32")])
def test_vllm_scale_values(vllm_ckpt, bad, text):
    """vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py:
    CompressedTensorsKVCacheMethod.process_weights_after_loading uses the value as is."""
    _edit_shard(vllm_ckpt / SCALES, lambda t: t.update({_kv(1, "k"): torch.tensor(bad)}))
    assert text in _one(verify(vllm_ckpt), "vllm", _kv(1, "k"), "vllm.value").message


def test_vllm_bf16_zero_is_read_from_raw_bytes(vllm_ckpt):
    """Same rule on a bf16 tensor (numpy cannot hold bf16; verify decodes its bytes)."""
    _edit_shard(vllm_ckpt / SCALES, lambda t: t.update({_kv(1, "k"): torch.tensor(-2.0, dtype=torch.bfloat16)}))
    assert "holds -2.0" in _one(verify(vllm_ckpt), "vllm", _kv(1, "k"), "vllm.value").message


def test_vllm_layer_index_out_of_range(vllm_ckpt):
    """vllm/model_executor/models/utils.py: AutoWeightsLoader._load_module raises "There is no module or
    parameter named" for a scale of a layer the model does not have."""
    _edit_shard(vllm_ckpt / SCALES, lambda t: t.update({_kv(7, "k"): torch.tensor(0.1)}))
    _index_add(vllm_ckpt, [_kv(7, "k")])
    p = _one(verify(vllm_ckpt), "vllm", _kv(7, "k"), "vllm.layer-range")
    assert "num_hidden_layers = 3" in p.message


def test_vllm_config_without_tensors(vllm_ckpt):
    """vllm/.../compressed_tensors.py: CompressedTensorsKVCacheMethod.create_weights: with a kv_cache_scheme
    and no tensors every layer runs FP8 with 1.0, silently."""
    (vllm_ckpt / SCALES).unlink()
    _edit_json(vllm_ckpt / export.INDEX_FILE,
               lambda d: d.update(weight_map={k: v for k, v in d["weight_map"].items() if v != SCALES}))
    problems = verify(vllm_ckpt)
    assert problems == [_one(problems, "vllm", "config.json:quantization_config", "vllm.silent-default")]
    assert "silently use 1.0" in problems[0].message


def test_vllm_tensors_without_config(vllm_ckpt):
    """vllm/model_executor/models/utils.py: AutoWeightsLoader.load_weights maps KV-scale names only through
    a quant config; without one, _load_module raises for them: vLLM refuses to load."""
    _edit_json(vllm_ckpt / "config.json", lambda c: c.pop("quantization_config"))
    p = _one(verify(vllm_ckpt, "vllm"), "vllm", "config.json", "vllm.scales-without-config")
    assert "refuses to load" in p.message
    assert p in verify(vllm_ckpt)   # nothing declares a target any more: both engines are checked


@pytest.mark.parametrize("key,value", [("num_bits", 4), ("type", "int"), ("strategy", "channel"),
                                       ("symmetric", False), ("dynamic", True)])
def test_vllm_kv_cache_scheme_fields(vllm_ckpt, key, value):
    """vllm/.../compressed_tensors/compressed_tensors.py: CompressedTensorsKVCacheMethod.validate_kv_cache_scheme
    (num_bits 8, type float, strategy tensor|attn_head, symmetric); `dynamic` must be false because that
    path only reads static scales."""
    _edit_json(vllm_ckpt / "config.json", lambda c: c["quantization_config"]["kv_cache_scheme"].update({key: value}))
    problems = verify(vllm_ckpt)
    p = _one(problems, "vllm", f"config.json:quantization_config.kv_cache_scheme.{key}", "vllm.kv-scheme")
    assert p.message.startswith(f"is {value!r}")
    assert problems == [p]


def test_vllm_config_groups_key(vllm_ckpt):
    """vllm/model_executor/model_loader/weight_utils.py: get_quant_config passes head counts (needed for
    attn_head scales) only when config_groups is present."""
    _edit_json(vllm_ckpt / "config.json", lambda c: c["quantization_config"].pop("config_groups"))
    assert verify(vllm_ckpt) == [Problem("vllm", "config.json:quantization_config.config_groups",
                                         "missing; write config_groups: {} for a KV-only checkpoint",
                                         code="vllm.config-groups")]


def test_vllm_skipped_layers_listed_in_provenance(source, tmp_path):
    """vLLM serves skipped layers in the model dtype (--kv-cache-dtype-skip-layers); their scales may be
    absent when kvcalib.json says so, otherwise CompressedTensorsKVCacheMethod.create_weights leaves 1.0."""
    ckpt = export.export_vllm(source, tmp_path / "skip", made_up_scales(skip=(2,)), {"recipe": {"skip_layers": [2]}})
    assert verify(ckpt) == []
    _edit_json(ckpt / export.PROVENANCE_FILE, lambda p: p.pop("recipe"))
    problems = verify(ckpt)
    _one(problems, "vllm", _kv(2, "k"), "vllm.missing-scale")
    _one(problems, "vllm", _kv(2, "v"), "vllm.missing-scale")


def test_vllm_two_names_for_one_scale(vllm_ckpt):
    """vllm/model_executor/layers/quantization/base_config.py: QuantizationConfig.get_cache_scale_mapper maps
    `self_attn.k_scale` and `self_attn.k_proj.k_scale` onto the same parameter: the last one read wins."""
    _edit_shard(vllm_ckpt / SCALES, lambda t: t.update({_trt(0, "k"): torch.tensor(0.5)}))
    _index_add(vllm_ckpt, [_trt(0, "k")])
    assert "stored 2 times" in _one(verify(vllm_ckpt), "vllm", _kv(0, "k"), "vllm.duplicate-scale").message


def _rename(ckpt: Path, old: str, new: str) -> None:
    """Store the tensor `old` of the scales shard under `new` (the index follows)."""
    _edit_shard(ckpt / SCALES, lambda t: t.update({new: t.pop(old)}))
    _edit_json(ckpt / export.INDEX_FILE, lambda d: d["weight_map"].update({new: d["weight_map"].pop(old)}))


UNMAPPED = {"model.layers.01.self_attn.k_scale": "layer index '01' has a leading zero",
            "model.layers.\u0661.self_attn.k_scale": "layer index '\u0661' is not written in ASCII digits",
            "transformer.layers.0.self_attn.k_scale": "prefix 'transformer.'",
            "model.layers.0.attn.k_scale": "attention module 'attn'",
            "layers.0.self_attn.k_scale": "the checkpoint's weights have no module 'layers.0.self_attn' (this "
                                          "model's layer 0 attention is 'model.layers.0.self_attn')"}


@pytest.mark.parametrize("name", sorted(UNMAPPED))
def test_vllm_names_it_cannot_map(vllm_ckpt, name):
    """vllm/model_executor/models/utils.py: AutoWeightsLoader._groupby_prefix / _load_module walk a name one
    dotted part at a time to the child module of exactly that name and raise "There is no module or
    parameter named" when there is none; model_loader/weight_utils.py: maybe_remap_kv_scale_name (the
    models that use it) drops a scale whose remapped name is no parameter."""
    assert verify(vllm_ckpt) == []
    _rename(vllm_ckpt, _kv(0, "k"), name)
    p = _one(verify(vllm_ckpt), "vllm", name, "vllm.unmapped-name")
    assert p.message.startswith(UNMAPPED[name]) and "vLLM maps no attention layer" in p.message


def test_vllm_a_layout_kvcalib_does_not_know_is_a_warning(vllm_ckpt):
    """weight_utils.py: maybe_remap_kv_scale_name maps the deprecated `.kv_scale` onto `attn.k_scale`; kvcalib's
    layouts do not hold it, but its module is the model's attention: not checked, said so."""
    _edit_shard(vllm_ckpt / SCALES, lambda t: t.update({"model.layers.0.self_attn.kv_scale": torch.tensor(0.5)}))
    _index_add(vllm_ckpt, ["model.layers.0.self_attn.kv_scale"])
    problems = verify(vllm_ckpt)
    _one(problems, "vllm", "model.layers.0.self_attn.kv_scale", "vllm.unverified-name", "warning")
    assert [p for p in problems if p.severity == "error"] == []


def test_verify_cli_exits_non_zero_on_an_unmapped_name(vllm_ckpt):
    from click.testing import CliRunner

    from calib.cli import main
    _rename(vllm_ckpt, _kv(1, "v"), "model.layers.001.self_attn.v_scale")
    r = CliRunner().invoke(main, ["verify", str(vllm_ckpt)])
    assert r.exit_code == 1 and "ERROR [vllm] model.layers.001.self_attn.v_scale: layer index '001'" in r.output


def test_vllm_quark_kv_dtype(source, tmp_path):
    """vllm/model_executor/layers/quantization/quark/quark.py: QuarkKVCacheMethod.validate_kv_cache_config
    (dtype fp8_e4m3, qscheme per_tensor only)."""
    problems = verify(_quark(source, tmp_path / "q", dtype="int8"))
    assert problems == [Problem("vllm", "config.json:quantization_config.layer_quant_config.output_tensors.dtype",
                                "is 'int8'; vLLM supports 'fp8_e4m3' only", code="vllm.quark-kv")]


def test_vllm_modelopt_without_weight_algo_is_unquantized_for_vllm(source, tmp_path):
    """vllm/transformers_utils/model_arch_config_convertor.py: _normalize_quantization_config sets a ModelOpt
    quant_method only for a non-null FP8/NVFP4 quant_algo; KV-only ModelOpt is unquantized to vLLM."""
    ckpt = _modelopt(source, tmp_path / "mo", quant_algo=None)
    # made for TRT-LLM only, which refuses it too: llm_utils.py ModelLoader._update_from_hf_quant_config
    assert [p.code for p in verify(ckpt)] == ["trtllm.no-quant-algo"]
    _one(verify(ckpt, "vllm"), "vllm", "config.json", "vllm.scales-without-config")


# ------------------------------------------------------------------------------------- TRT-LLM rules

def test_trt_compressed_tensors_config_in_trt_variant(trt_ckpt):
    """tensorrt_llm/_torch/model_config.py: ModelConfig.from_pretrained falls back to config.json's block when
    hf_quant_config.json sets no quant_algo; tensorrt_llm/models/quant_config_utils.py:
    update_quant_config_from_compressed_tensors raises ValueError for empty config_groups."""
    _edit_json(trt_ckpt / "config.json", lambda c: c.update(quantization_config=export.vllm_quantization_config()))
    p = _one(verify(trt_ckpt, "trtllm"), "trtllm", "config.json:quantization_config", "trtllm.ct-config")
    assert "config_groups is empty" in p.message


def _hq(ckpt, **quantization):
    """A ModelOpt-shaped hf_quant_config.json (weight quant_algo FP8 unless given) in a kvcalib TRT-LLM variant."""
    (ckpt / HQ).write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": [], **quantization}}))
    return ckpt


def test_trt_quant_algo_null_is_refused(trt_ckpt):
    """tensorrt_llm/llmapi/llm_utils.py: ModelLoader._update_from_hf_quant_config (main, commit 0066b2a5; and the
    older form, 1.0-1.2) raises ValueError("Pre-quantized checkpoint must have quant_algo.") for a null quant_algo
    without quantized_layers, on the PyTorch backend too; with quantized_layers main falls back to config.json."""
    _hq(trt_ckpt, quant_algo=None)
    p = _one(verify(trt_ckpt, "trtllm"), "trtllm", f"{HQ}:quantization.quant_algo", "trtllm.no-quant-algo")
    assert "Pre-quantized checkpoint must have quant_algo" in p.message
    _hq(trt_ckpt, quant_algo=None, quantized_layers={"model.layers.0.mlp.down_proj": {"quant_algo": "FP8"}})
    assert "trtllm.no-quant-algo" not in [p.code for p in verify(trt_ckpt, "trtllm")]


@pytest.mark.parametrize("text,code", [("kv_cache_config:\n  dtype: fp16\n", "trtllm.kv-algo"),
                                       ("kv_cache_config: [1\n", "trtllm.api-options"),
                                       ("kv_cache_config: fp8\n", "trtllm.api-options"),
                                       ("kv_cache_config:\n  dtype: auto\n", "trtllm.no-kv-quant")])
def test_trt_api_options(trt_ckpt, text, code):
    """tensorrt_llm/_torch/pyexecutor/model_loader.py: validate_and_set_kv_cache_quant (_VALID_KV_CACHE_DTYPES
    fp8, nvfp4, auto; another dtype raises ValueError; auto keeps the checkpoint's, none here)."""
    (trt_ckpt / TRTLLM_API_OPTIONS).write_text(text)
    assert code in [p.code for p in verify(trt_ckpt, "trtllm") if p.severity == "error"]


def test_trt_other_weight_format_in_config_json(trt_ckpt):
    """tensorrt_llm/_torch/model_config.py: ModelConfig.from_pretrained replaces the whole quant config with
    config.json's when it sets a weight algo and hf_quant_config.json does not."""
    _hq(trt_ckpt, quant_algo=None)
    _edit_json(trt_ckpt / "config.json",
               lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}))
    p = _one(verify(trt_ckpt, "trtllm"), "trtllm", "config.json:quantization_config", "trtllm.config-overrides")
    assert "kv_cache_quant_algo is dropped" in p.message


@pytest.mark.parametrize("algo", ["fp8", "FP16", "INT4"])
def test_trt_bad_kv_cache_quant_algo(trt_ckpt, algo):
    """tensorrt_llm/_torch/model_config.py: ModelConfig._build_modelopt_quant_config (QuantAlgo(...), exact
    member names); tensorrt_llm/quantization/mode.py: KV_CACHE_QUANT_ALGO_LIST = FP8, INT8, NVFP4."""
    _hq(trt_ckpt)
    _edit_json(trt_ckpt / HQ, lambda d: d["quantization"].update(kv_cache_quant_algo=algo))
    problems = verify(trt_ckpt)
    p = _one(problems, "trtllm", f"{HQ}:quantization.kv_cache_quant_algo", "trtllm.kv-algo")
    assert p.message.startswith(f"is {algo!r}")


def test_trt_null_kv_cache_quant_algo(trt_ckpt):
    """tensorrt_llm/_torch/model_config.py: ModelConfig._build_modelopt_quant_config (null: no KV quant)."""
    _hq(trt_ckpt)
    (trt_ckpt / TRTLLM_API_OPTIONS).unlink()
    _edit_json(trt_ckpt / HQ, lambda d: d["quantization"].update(kv_cache_quant_algo=None))
    _one(verify(trt_ckpt), "trtllm", f"{HQ}:quantization.kv_cache_quant_algo", "trtllm.no-kv-quant")


def test_trt_hf_quant_config_shape(trt_ckpt):
    """tensorrt_llm/quantization/modelopt_config.py: read_modelopt_quant_config raises ValueError without a
    'quantization' object or a ModelOpt marker."""
    (trt_ckpt / HQ).write_text(json.dumps({"producer": {"name": "kvcalib"}, "kv_cache_quant_algo": "FP8"}))
    _one(verify(trt_ckpt), "trtllm", HQ, "trtllm.hf-quant-config")


def test_trt_missing_hf_quant_config(trt_ckpt):
    """tensorrt_llm/_torch/model_config.py: ModelConfig.from_pretrained reads KV quantization only from
    hf_quant_config.json (or a compressed-tensors kv_cache_scheme in config.json) or the serve-time
    kv_cache_config.dtype (tensorrt_llm/_torch/pyexecutor/model_loader.py: validate_and_set_kv_cache_quant)."""
    (trt_ckpt / TRTLLM_API_OPTIONS).unlink()
    _one(verify(trt_ckpt, "trtllm"), "trtllm", HQ, "trtllm.no-hf-quant-config")


def test_trt_int8_missing_scale_is_an_error(int8_ckpt):
    """TensorRT-LLM pull request 18953 (calibrated INT8 KV cache): the fused QKV loader raises "both scales
    must be loaded together" unless each layer has k_scale and v_scale."""
    _edit_shard(int8_ckpt / SCALES, lambda t: t.pop(_trt(2, "v")))
    p = _one(verify(int8_ckpt), "trtllm", _trt(2, "v"), "trtllm.missing-scale")
    assert "refuses to load" in p.message


def test_trt_fp8_missing_scale_is_a_warning(trt_ckpt):
    """tensorrt_llm/_torch/attention_backend/trtllm.py: TrtllmAttention.__init__ (FP8 KV runs with 1.0 today,
    scales are not read yet)."""
    _edit_shard(trt_ckpt / SCALES, lambda t: t.pop(_trt(2, "v")))
    _one(verify(trt_ckpt, "trtllm"), "trtllm", _trt(2, "v"), "trtllm.missing-scale", "warning")


def test_trt_int8_with_quantized_weights(int8_ckpt):
    """TensorRT-LLM pull request 18953: INT8 KV only with unquantized FP16/BF16 projections."""
    _hq(int8_ckpt, kv_cache_quant_algo="INT8")
    _one(verify(int8_ckpt), "trtllm", f"{HQ}:quantization.quant_algo", "trtllm.int8-weights")


def test_trt_non_scalar_scale(int8_ckpt):
    """TensorRT-LLM pull request 18953: the INT8 loader rejects a multi-element scale (one factor per layer)."""
    _edit_shard(int8_ckpt / SCALES, lambda t: t.update({_trt(0, "k"): torch.tensor([0.1, 0.2])}))
    _one(verify(int8_ckpt), "trtllm", _trt(0, "k"), "trtllm.shape")


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_trt_scale_values(int8_ckpt, bad):
    """TensorRT-LLM pull request 18953: the INT8 loader rejects zero, negative and non-finite scales."""
    _edit_shard(int8_ckpt / SCALES, lambda t: t.update({_trt(1, "v"): torch.tensor(bad)}))
    _one(verify(int8_ckpt), "trtllm", _trt(1, "v"), "trtllm.value")


def test_trt_bf16_scale_is_a_warning(trt_ckpt):
    """tensorrt_llm/_torch/modules/linear.py: copy_weight converts to the float32 parameter's dtype."""
    _edit_shard(trt_ckpt / SCALES, lambda t: t.update({_trt(1, "v"): torch.tensor(0.04, dtype=torch.bfloat16)}))
    problems = verify(trt_ckpt)
    assert problems == [_one(problems, "trtllm", _trt(1, "v"), "trtllm.dtype", "warning")]


def test_trt_vllm_names_are_not_read(source, tmp_path):
    """tensorrt_llm/_torch/models/modeling_utils.py: _load_weights_impl gives the fused qkv_proj the k_proj /
    v_proj sub-dicts only: `self_attn.k_scale` is never seen."""
    ckpt = _llm_compressor(source, tmp_path / "lc")
    (ckpt / HQ).write_text(json.dumps({"producer": {"name": "kvcalib"}, "quantization": {
        "quant_algo": None, "kv_cache_quant_algo": "FP8", "exclude_modules": []}}))
    _edit_json(ckpt / "config.json", lambda c: c.pop("quantization_config"))
    problems = verify(ckpt, "trtllm")
    _one(problems, "trtllm", HQ, "trtllm.no-scales", "warning")
    p = _one(problems, "trtllm", _kv(0, "k"), "trtllm.ignored-name", "warning")
    assert _trt(0, "k") in p.message


def test_trt_cannot_skip_layers(trt_ckpt):
    """tensorrt_llm/_torch/models/modeling_utils.py: DecoderModelForCausalLM.apply_quant_config_exclude_modules
    keeps kv_cache_quant_algo for excluded modules: no per-layer KV exclusion."""
    _edit_json(trt_ckpt / export.PROVENANCE_FILE, lambda p: p.update(recipe={"skip_layers": [0, "sliding_window"]}))
    _one(verify(trt_ckpt), "trtllm", export.PROVENANCE_FILE, "trtllm.skip-layers")


def test_trt_consolidated_file_is_skipped(trt_ckpt):
    """tensorrt_llm/_torch/models/checkpoints/hf/weight_loader.py: HfWeightLoader.load_weights skips
    '*consolidated*' files when other shards exist."""
    (trt_ckpt / SCALES).rename(trt_ckpt / "consolidated.safetensors")
    problems = verify(trt_ckpt)
    _one(problems, "trtllm", _trt(0, "k"), "trtllm.skipped-file")
    _one(problems, "trtllm", HQ, "trtllm.no-scales", "warning")


def test_trt_layer_out_of_range_and_misfiled_scale(trt_ckpt):
    """tensorrt_llm/_torch/models/modeling_utils.py: _load_weights_impl (filter_weights by module name: a
    layer the model lacks is never read; a v scale under k_proj lands in the k shard)."""
    _edit_shard(trt_ckpt / SCALES, lambda t: t.update({_trt(9, "k"): torch.tensor(0.1),
                                                       "model.layers.0.self_attn.k_proj.v_scale": torch.tensor(0.1)}))
    problems = verify(trt_ckpt)
    _one(problems, "trtllm", _trt(9, "k"), "trtllm.layer-range")
    _one(problems, "trtllm", "model.layers.0.self_attn.k_proj.v_scale", "trtllm.name")


@pytest.mark.parametrize("name,why", [("model.layers.00.self_attn.k_proj.k_scale", "layer index '00' has a leading zero"),
                                      ("model.layers.\u0969.self_attn.k_proj.k_scale", "layer index '\u0969' is not"),
                                      ("model.layers.0.attention.k_proj.k_scale", "attention module 'attention'"),
                                      ("layers.0.self_attn.k_proj.k_scale", "the checkpoint's weights have no module")])
def test_trt_names_it_never_reads(trt_ckpt, name, why):
    """tensorrt_llm/_torch/models/modeling_utils.py: _load_weights_impl / filter_weights select a module's
    tensors by its exact name as prefix: any other spelling of the layer or module is never read."""
    _edit_shard(trt_ckpt / SCALES, lambda t: t.update({name: t.pop(_trt(0, "k"))}))
    problems = verify(trt_ckpt, "trtllm")
    p = _one(problems, "trtllm", name, "trtllm.unmapped-name")
    assert p.message.startswith(why) and "never reads this one" in p.message


# ------------------------------------------------------------------------------------------ mechanics

def test_problem_prints_one_line():
    p = Problem("vllm", "x.safetensors", "two\nlines", "warning", "c")
    assert str(p) == "WARNING [vllm] x.safetensors: two lines"


def test_bad_arguments_and_non_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="engine"):
        verify(tmp_path, "tgi")
    assert [p.code for p in verify(tmp_path)] == ["checkpoint.config"]


def test_unreadable_shard_is_reported(vllm_ckpt):
    (vllm_ckpt / SCALES).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    problems = verify(vllm_ckpt)
    _one(problems, "checkpoint", SCALES, "checkpoint.shard")


def test_verify_imports_no_torch(built):
    code = ("import sys; from calib.verify import verify; "
            f"assert verify({str(built['vllm'])!r}) == []; assert verify({str(built['trtllm'])!r}) == []; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=60)
