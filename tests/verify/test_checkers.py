"""Engines' checks are found by module, as export targets are: a new engine is one file in calib.export plus, when
kvcalib knows its loader rules, one in calib.verify."""

from __future__ import annotations

import sys
import textwrap

from calib import export, verify
from calib.ckpt.reader import CheckpointFiles
from helpers import made_up_scales, trtllm_engine_ckpt


def test_every_target_has_its_checks_in_the_targets_order():
    assert verify.ENGINES == tuple(export.TARGETS) == ("vllm", "trtllm", "sglang", "trtllm-engine")
    assert all(isinstance(c, verify.Checker) and c.rules for c in verify.CHECKERS.values())


def test_the_engines_a_checkpoint_declares_choose_the_checks(tiny_llama_dir, tmp_path):
    """`verify(..., "all")` runs the checks of the engines whose configs the checkpoint carries; each checker's
    own `check` gives exactly the problems `verify` reports for that engine."""
    for name in export.TARGETS:
        # the TensorRT-engine target writes into a converted TensorRT-LLM checkpoint, not a Hugging Face folder
        source = trtllm_engine_ckpt(tmp_path / "trt", tp=1, pp=1, n=3) if name == "trtllm-engine" else tiny_llama_dir
        out = export.target(name).write(source, tmp_path / name, made_up_scales(3), {"producer": "kvcalib"})
        ck = CheckpointFiles(out)
        assert [n for n, c in verify.CHECKERS.items() if c.declared(ck)] == [name]
        for engine, checker in verify.CHECKERS.items():
            assert verify.verify(out, engine) == list(dict.fromkeys(ck.read_problems + checker.check(ck)))


def test_a_new_engines_checks_are_one_module(tmp_path, tiny_llama_dir, monkeypatch):
    pkg = tmp_path / "more_checks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "notes.py").write_text("CHECKER = 'not a checker'\n")
    (pkg / "sglang.py").write_text(textwrap.dedent('''
        from calib.ckpt.reader import Problem
        from calib.verify.checker import Checker
        from calib.verify.vllm import vllm_declared, vllm_view


        def needs_q_scale(ck, view):
            """A made-up rule: this engine wants a q_scale for every layer."""
            have = {s.layer for s in view.scales if s.kind == "q"}
            for layer in sorted(set(range(ck.num_layers)) - have):
                yield Problem("sglang", f"layer {layer}", "no q_scale", code="sglang.q-scale")


        CHECKER = Checker("sglang", vllm_view, (needs_q_scale,), vllm_declared)
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        found = verify.discover([str(pkg)], "more_checks")
        assert list(found) == ["sglang"]
        out = export.export_vllm(tiny_llama_dir, tmp_path / "out", made_up_scales(3), {})
        assert [p.where for p in found["sglang"].check(CheckpointFiles(out))] == ["layer 0", "layer 1", "layer 2"]
    finally:
        for m in ("more_checks.sglang", "more_checks.notes", "more_checks"):
            sys.modules.pop(m, None)
