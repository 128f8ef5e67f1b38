"""Other tools' checkpoints with damaged configs: every reader answers with its own one-line error, never a crash.

Starting from good checkpoints of each layout (kvcalib's vLLM and TensorRT-LLM variants, llm-compressor's
compressed-tensors, ModelOpt, Quark), hypothesis replaces one node of one JSON file (config.json's
quantization_config, hf_quant_config.json, kvcalib.json, the index) with arbitrary JSON. Then every reader
of those files runs: `verify` (problems, never an exception), `read_kv_info` (what inspect and eval read:
ValueError), eval's `checkpoint_arms` (EvalError), `kvcalib inspect` (exit 0/1, one `Error:` line), and the
exporters' source checks (`prepare_source` for --into, the TensorRT-LLM variant: ExportError).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from calib import export
from calib.ckpt.kvinfo import read_kv_info
from calib.cli import main
from calib.evaluation.arms import EvalError, Geometry, checkpoint_arms
from calib.export import trtllm, vllm as export_vllm
from calib.verify import verify
from tiny import tiny_causal_lm
from helpers import made_up_scales

N = 3
GEO = Geometry(tuple(range(N)), 2, 16)
FILES = ("config.json", "hf_quant_config.json", "kvcalib.json", "model.safetensors.index.json")

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2**64) | st.floats(allow_nan=False) | st.text(max_size=12)
    | st.sampled_from(["FP8", "INT8", "compressed-tensors", "modelopt", "quark", "tensor", "attn_head", "float",
                       "model.safetensors", "kv_scales.safetensors", "../x", "sliding_window"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["quant_method", "kv_cache_scheme", "quantization", "kv_cache_quant_algo", "quant_algo",
                         "num_bits", "type", "strategy", "config_groups", "skipped_layers", "layers", "recipe",
                         "data", "weight_map", "metadata", "total_size", "export", "kv_cache_group",
                         "layer_quant_config", "num_hidden_layers", "text_config", "target", "producer"]),
        inner, max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("foreign")
    src = base / "src"
    tiny_causal_lm("llama").save_pretrained(src)
    out = {"vllm": export.export_vllm(src, base / "vllm", made_up_scales(), {"producer": "kvcalib", "skipped_layers": []}),
           "trtllm": trtllm.export_trtllm(src, base / "trtllm", made_up_scales(), {"producer": "kvcalib"})}
    mo = base / "modelopt"
    shutil.copytree(src, mo)
    (mo / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}))
    save_file({f"model.layers.{i}.self_attn.{k}_proj.{k}_scale": torch.tensor(0.5) for i in range(N) for k in "kv"},
              str(mo / "model-kv.safetensors"))
    quark = base / "quark"
    shutil.copytree(src, quark)
    cfg = json.loads((quark / "config.json").read_text())
    spec = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False}
    cfg["quantization_config"] = {"quant_method": "quark", "layer_quant_config": {"*k_proj": {"output_tensors": spec}},
                                  "export": {"kv_cache_group": ["*k_proj", "*v_proj"]}}
    (quark / "config.json").write_text(json.dumps(cfg))
    save_file({f"model.layers.{i}.self_attn.{k}_proj.output_scale": torch.tensor(0.5) for i in range(N) for k in "kv"},
              str(quark / "model-kv.safetensors"))
    return {**out, "modelopt": mo, "quark": quark}


def _replace(doc, path: list, value):
    """`doc` with the node at `path` (keys/indices, as far as they go) replaced by `value`."""
    if not path or not isinstance(doc, (dict, list)) or not doc:
        return value
    key = path[0]
    if isinstance(doc, dict):
        k = sorted(doc)[key % len(doc)]
        return {**doc, k: _replace(doc[k], path[1:], value)}
    i = key % len(doc)
    return doc[:i] + [_replace(doc[i], path[1:], value)] + doc[i + 1:]


def _readers_hold(ckpt: Path) -> None:
    problems = verify(ckpt)
    assert all("\n" not in str(p) for p in problems)
    try:
        read_kv_info(ckpt)
    except ValueError as e:
        assert "\n" not in str(e)
    try:
        checkpoint_arms(str(ckpt), GEO)
    except EvalError as e:
        assert "\n" not in str(e)
    r = CliRunner().invoke(main, ["inspect", str(ckpt)])
    assert r.exit_code in (0, 1) and not (r.exception and not isinstance(r.exception, SystemExit)), r.output
    assert r.exit_code == 0 or sum(ln.startswith("Error:") for ln in r.output.splitlines()) == 1, r.output


def _exporters_hold(ckpt: Path, tmp: Path) -> None:
    for call in (lambda: export_vllm.prepare_source(ckpt, tmp / "o1", quantized_ok=True),
                 lambda: trtllm.export_trtllm(ckpt, tmp / "o2", made_up_scales(), {})):
        try:
            call()
        except export.ExportError as e:
            assert "\n" not in str(e)
    for o in ("o1", "o2"):
        shutil.rmtree(tmp / o, ignore_errors=True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(st.sampled_from(["vllm", "trtllm", "modelopt", "quark"]), st.sampled_from(FILES),
       st.lists(st.integers(0, 7), max_size=4), json_values)
def test_any_damaged_config_is_a_one_line_answer(layouts, tmp_path, layout, name, path, value):
    ckpt = layouts[layout]
    file = ckpt / name
    original = file.read_bytes() if file.exists() else None
    doc = json.loads(original) if original is not None else {}
    if name == "config.json" and path:   # keep the model's own fields: damage the quantization part
        path = ["quantization_config", *path]
        doc.setdefault("quantization_config", {})
        new = dict(doc)
        new["quantization_config"] = _replace(doc["quantization_config"], path[1:], value)
    else:
        new = _replace(doc, path, value)
    try:
        file.write_text(json.dumps(new))
        _readers_hold(ckpt)
        _exporters_hold(ckpt, tmp_path)
    finally:
        if original is None:
            file.unlink(missing_ok=True)
        else:
            file.write_bytes(original)


@pytest.mark.parametrize("name, text", [("hf_quant_config.json", "{"), ("kvcalib.json", "[1, 2"),
                                        ("config.json", '{"a": 1, "a": 2}'), ("model.safetensors.index.json", "nul"),
                                        ("llm_api_options.yaml", "kv_cache_config: [1")])
def test_unparsable_files_are_named(layouts, name, text):
    ckpt = layouts["trtllm"] if name in ("hf_quant_config.json", "llm_api_options.yaml") else layouts["vllm"]
    file = ckpt / name
    original = file.read_bytes() if file.exists() else None
    try:
        file.write_text(text)
        assert any(name in p.where or name in p.message for p in verify(ckpt))
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            read_kv_info(ckpt)
        r = CliRunner().invoke(main, ["inspect", str(ckpt)])
        assert r.exit_code == 1 and name in r.output and "Traceback" not in r.output
    finally:
        if original is None:
            file.unlink()
        else:
            file.write_bytes(original)
