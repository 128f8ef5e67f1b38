"""Conformance tests for `verify --target sglang`: the SGLang variant passes, and each SGLang loader rule, broken on
purpose in a copy of it, yields exactly the Problem that rule stands for.

Each test's docstring names the SGLang source it restates (sgl-project/sglang 0.5.23, paths under
`python/sglang/srt/`; compressed-tensors KV scales load since 0.5.19)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from calib import export
from calib.export import sglang, trtllm
from calib.scales.fold import LayerScales
from calib.verify import Problem, verify
from helpers import made_up_scales

N_LAYERS = 3
SCALES = export.SCALES_FILE


@pytest.fixture(scope="module")
def built(source, tmp_path_factory):
    base = tmp_path_factory.mktemp("built")
    return {"sglang": sglang.export_sglang(source, base / "sglang", made_up_scales(), {"producer": "kvcalib"}),
            "head": export.export_vllm(source, base / "head", made_up_scales(), {}, strategy="attn_head"),
            "trtllm": trtllm.export_trtllm(source, base / "trtllm", made_up_scales(), {})}


@pytest.fixture
def ckpt(built, tmp_path):
    return Path(shutil.copytree(built["sglang"], tmp_path / "sglang"))


def _edit_json(path: Path, fn):
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def _edit_shard(path: Path, fn):
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def _kv(layer, kind):
    return f"model.layers.{layer}.self_attn.{kind}_scale"


def _one(problems, where, code, severity="error") -> Problem:
    hits = [p for p in problems if (p.engine, p.where, p.code, p.severity) == ("sglang", where, code, severity)]
    assert len(hits) == 1, f"want one {severity} {code} at {where}, got:\n" + "\n".join(map(str, problems))
    return hits[0]


def test_the_sglang_variant_passes_and_declares_sglang(built):
    assert verify(built["sglang"], "sglang") == []
    assert verify(built["sglang"]) == []                      # all: the engines it declares (kvcalib.json: sglang)
    prov = json.loads((built["sglang"] / export.PROVENANCE_FILE).read_text())
    assert prov["target"] == "sglang"


def test_the_variant_is_vllms_per_tensor_layout_with_heads_folded(source, tmp_path):
    """SGLang takes only per-tensor scales (compressed_tensors.py: CompressedTensorsKVCacheMethod
    .is_supported_scheme), so per-head scales are written as their max per layer, q_scale dropped."""
    scales = {i: LayerScales(torch.tensor([0.1, 0.3]), torch.tensor([0.5, 0.2]), torch.ones(2), torch.ones(2),
                             q_scale=torch.tensor([0.7, 0.9, 0.8, 0.6])) for i in range(N_LAYERS)}
    out = sglang.export_sglang(source, tmp_path / "out", scales, {})
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                     "symmetric": True}
    assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"] == {}
    t = load_file(str(out / SCALES))
    assert set(t) == {_kv(i, kv) for i in range(N_LAYERS) for kv in "kv"}
    assert t[_kv(1, "k")].shape == () and float(t[_kv(1, "k")]) == pytest.approx(0.3)
    assert float(t[_kv(1, "v")]) == pytest.approx(0.5) and t[_kv(1, "v")].dtype == torch.float32


def test_per_head_scheme_runs_at_one_with_a_warning(built):
    """compressed_tensors.py: CompressedTensorsConfig.get_quant_method drops a non-per-tensor scheme ("Ignoring
    compressed-tensors kv_cache_scheme ...: only static symmetric per-tensor FP8 scales are supported")."""
    p = _one(verify(built["head"], "sglang"), "config.json:quantization_config.kv_cache_scheme",
             "sglang.kv-scheme-ignored", "warning")
    assert "per-head KV scales at 1.0" in p.message


def test_dynamic_or_asymmetric_scheme_is_ignored(ckpt):
    """compressed_tensors.py: CompressedTensorsKVCacheMethod.is_supported_scheme (dynamic false or absent,
    symmetric true or absent)."""
    _edit_json(ckpt / "config.json", lambda c: c["quantization_config"]["kv_cache_scheme"].update(dynamic=True))
    _one(verify(ckpt, "sglang"), "config.json:quantization_config.kv_cache_scheme", "sglang.kv-scheme-ignored",
         "warning")


def test_absent_symmetric_and_dynamic_keys_are_accepted(ckpt):
    """is_supported_scheme reads `symmetric` and `dynamic` with defaults (true / false)."""
    def drop(c):
        del c["quantization_config"]["kv_cache_scheme"]["symmetric"]
        del c["quantization_config"]["kv_cache_scheme"]["dynamic"]
    _edit_json(ckpt / "config.json", drop)
    assert verify(ckpt, "sglang") == []


def test_kv_only_modelopt_config_is_not_read(built):
    """configs/model_config.py: ModelConfig._parse_modelopt_quant_config answers None for quant_algo null, so
    the TensorRT-LLM variant's scales are 'not loaded' (model_loader/weight_utils.py: maybe_remap_kv_scale_name)."""
    p = _one(verify(built["trtllm"], "sglang"), "config.json", "sglang.scales-without-config", "warning")
    assert "no quantization config SGLang reads" in p.message and "1.0" in p.message


def test_a_scale_with_more_than_one_element_is_an_error(ckpt):
    """model_loader/weight_utils.py: default_weight_loader asserts unless both sides have one element."""
    _edit_shard(ckpt / SCALES, lambda t: t.update({_kv(1, "k"): torch.tensor([0.1, 0.2])}))
    _one(verify(ckpt, "sglang"), _kv(1, "k"), "sglang.shape")


@pytest.mark.parametrize("value,why", [(0.0, "as not loaded and uses 1.0"), (-0.5, "as not loaded"),
                                       (float("nan"), "non-finite"), (1e-45, "below the smallest normal float32")])
def test_bad_values(ckpt, value, why):
    """layers/quantization/kv_cache.py: BaseKVCacheMethod.process_weights_after_loading (<= 0: not loaded)."""
    _edit_shard(ckpt / SCALES, lambda t: t.update({_kv(2, "v"): torch.tensor(value)}))
    assert why in _one(verify(ckpt, "sglang"), _kv(2, "v"), "sglang.value").message


def test_one_scale_of_a_layer_is_used_for_both(ckpt):
    """kv_cache.py: BaseKVCacheMethod.process_weights_after_loading copies max(k, v) when one is not loaded;
    neither: 1.0."""
    _edit_shard(ckpt / SCALES, lambda t: t.pop(_kv(0, "v")))
    problems = verify(ckpt, "sglang")
    assert "uses the k_scale for both" in _one(problems, _kv(0, "v"), "sglang.missing-scale", "warning").message
    _edit_shard(ckpt / SCALES, lambda t: t.pop(_kv(0, "k")))
    _one(verify(ckpt, "sglang"), "model.layers.0.self_attn", "sglang.missing-scale")


def test_declared_without_any_scale_runs_at_one(ckpt):
    """kv_cache.py: BaseKVCacheMethod.create_weights / process_weights_after_loading (nothing loaded: 1.0)."""
    _edit_shard(ckpt / SCALES, lambda t: [t.pop(_kv(i, k)) for i in range(N_LAYERS) for k in "kv"] and
                t.update(dummy=torch.zeros(1)))
    _one(verify(ckpt, "sglang"), "config.json:quantization_config", "sglang.silent-default")


def test_q_scale_is_ignored_and_out_of_range_layers_never_load(ckpt):
    """models/llama.py: LlamaForCausalLM._legacy_load_weights (q_scale: "not found in params_dict");
    weight_utils.py: maybe_remap_kv_scale_name (no parameter for a layer that does not exist)."""
    def add(t):
        t[_kv(0, "q")] = torch.tensor(0.5)
        t[_kv(7, "k")] = torch.tensor(0.5)
    _edit_shard(ckpt / SCALES, add)
    _edit_json(ckpt / export.INDEX_FILE, lambda d: d["weight_map"].update({_kv(0, "q"): SCALES, _kv(7, "k"): SCALES}))
    problems = verify(ckpt, "sglang")
    _one(problems, _kv(0, "q"), "sglang.q-scale-ignored", "warning")
    _one(problems, _kv(7, "k"), "sglang.layer-range")


def test_a_scale_in_a_shard_the_index_does_not_name_is_never_read(ckpt):
    """model_loader/weight_utils.py: filter_duplicate_safetensors_files (only indexed shards are read)."""
    save_file({_kv(0, "k"): torch.tensor(0.5)}, str(ckpt / "stray.safetensors"))
    _one(verify(ckpt, "sglang"), _kv(0, "k"), "sglang.unindexed-shard")


@pytest.mark.parametrize("arch, warned", [("Qwen2ForCausalLM", True), ("Qwen3MoeForCausalLM", True),
                                          ("MixtralForCausalLM", True), ("LlamaForCausalLM", False)])
def test_a_model_whose_loader_drops_the_scales_is_warned(ckpt, arch, warned):
    """models/qwen2.py, models/qwen3_moe.py, models/mixtral.py: load_weights never calls
    maybe_remap_kv_scale_name, so `self_attn.k_scale` finds no parameter and the layer runs at 1.0 (sglang issue
    39942); llama (and mistral, qwen3, gemma3) remap it. One warning from the loader rule, none from the
    support-matrix line after it (verify counts a model's dropped scales once)."""
    _edit_json(ckpt / "config.json", lambda c: c.update(architectures=[arch]))
    problems = verify(ckpt, "sglang")
    hits = [p for p in problems if p.code == "sglang.model-drops-scales"]
    assert len(hits) == int(warned) and all(p.severity == "warning" and arch in p.message for p in hits)
    assert [p for p in problems if p.severity == "error"] == []
    from calib.ckpt.reader import CheckpointFiles
    from calib.verify.applied import applied, differs_problem

    o = applied(CheckpointFiles(ckpt), "sglang")
    assert o.calibrated.architecture == arch and (o.severity != "same") == warned
    assert differs_problem("sglang", o, problems) is None          # the loader rule already warned
