"""Engine targets: found by module, each declaring what its engine reads; the recipe's rules and choices come
from those declarations, so a new engine is one new module."""

from __future__ import annotations

import sys
import textwrap

import pytest

from calib import export
from calib.ckpt.kvinfo import read_kv_info
from calib.recipe import recipe as R, dtypes
from calib.verify import verify
from helpers import made_up_scales


# trtllm-engine writes into a TensorRT-LLM checkpoint, not a model folder: its own test file checks this
@pytest.mark.parametrize("name", [t for t in export.TARGETS if t != "trtllm-engine"])
def test_failure_mid_export_leaves_nothing(name, tiny_llama_dir, tmp_path, monkeypatch):
    """Every target writes through the one write_variant: a failed write leaves no output and no temp folder."""
    import safetensors.torch

    from calib.safety.outputs import OutputError

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    monkeypatch.setattr(safetensors.torch, "save", boom)         # small files are serialized in memory first
    scales = made_up_scales(3, amax_per_layer=(4.48, 8.96))
    with pytest.raises(OutputError, match=r"writing failed \(disk full\); nothing was written"):
        export.TARGETS[name].write(tiny_llama_dir, tmp_path / "out", scales, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]


def test_targets_in_order_and_the_recipe_takes_their_names():
    assert list(export.TARGETS) == ["vllm", "trtllm", "sglang", "trtllm-engine"] == list(R.TARGETS)


@pytest.mark.parametrize("name", list(export.TARGETS))
def test_recipe_rules_are_the_targets_declarations(name):
    t = export.TARGETS[name]
    for d in dtypes.KV_DTYPES.values():
        data = {"dtype": d.name, "targets": [name]}
        if d in t.dtypes:
            R.from_dict(data)
        else:
            with pytest.raises(R.RecipeError, match=f"'dtype' = '{d.name}' with target {name}: "):
                R.from_dict(data)
    data = {"skip_layers": [1], "targets": [name]}
    if t.skips_layers:
        assert R.from_dict(data).skip_layers == (1,)
    else:
        with pytest.raises(R.RecipeError, match=f"'skip_layers' with target {name}: "):
            R.from_dict(data)
    data = {"q_scale": True, "targets": [name]}
    if t.reads_q_scale:
        assert R.from_dict(data).q_scale
    else:
        with pytest.raises(R.RecipeError, match="'q_scale' = true needs target vllm"):
            R.from_dict(data)


def test_a_new_engine_is_one_module(tmp_path, tiny_llama_dir, monkeypatch):
    pkg = tmp_path / "more_engines"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "sglang.py").write_text(textwrap.dedent('''
        from calib.export.target import Target
        from calib.export.vllm import export_vllm
        from calib.recipe.dtypes import FP8_E4M3


        class SGLangTarget(Target):
            """SGLang loads vLLM's compressed-tensors layout."""
            name = "sglang"
            order = 2
            dtypes = (FP8_E4M3,)

            def write(self, source, out, scales, provenance, options):
                return export_vllm(source, out, scales, provenance, force=options.force)


        TARGET = SGLangTarget()
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    found = export.discover([str(pkg)], "more_engines")
    assert list(found) == ["sglang"]
    out = found["sglang"].write(tiny_llama_dir, tmp_path / "out", made_up_scales(3), {}, export.WriteOptions())
    assert read_kv_info(out).targets == ["vllm"] and [p for p in verify(out) if p.severity == "error"] == []
    sys.modules.pop("more_engines.sglang", None)
    sys.modules.pop("more_engines", None)
