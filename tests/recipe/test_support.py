"""The support matrix (calib.recipe.support): every cell cited, every lookup answered by exactly one cell, the
cells as read from the engines' source (vLLM wheels 0.18-0.34, SGLang wheels 0.5.18-0.5.23, TensorRT-LLM main
1.4.0rc) or measured, and what a calibrated result becomes per engine.

Runs in `make test` (no engine marker): the matrix is plain data.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from calib.recipe import support as s
from calib.recipe.support import Calibrated, Effect, Measurement, Source, Version, matrix

# Versions around every boundary a cell names, plus one before and after the versions read.
PROBES = {"vllm": ["0.10", "0.18", "0.19", "0.20", "0.21", "0.23.9", "0.24", "0.25", "0.31", "0.32", "0.32.1",
                   "0.33.0", "0.34", "0.40"],
          "trtllm": ["1.0", "1.2", "1.3", "1.4.0rc1", "pr18953", "1.2+pr18953"],
          "trtllm-engine": ["1.1", "1.2", "1.2.1", "1.3.0rc20", "1.3.1", "1.4"],
          "sglang": ["0.5.10", "0.5.18", "0.5.19", "0.5.20", "0.5.23", "0.6"]}
MODELS = [None, "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"]


def test_every_cell_has_a_source_or_a_measurement():
    for c in s.CELLS:
        assert c.evidence, c
        for e in c.evidence:
            if isinstance(e, Source):
                assert e.repo.count("/") == 1 and e.file and e.function and e.version, e
            else:
                assert isinstance(e, Measurement) and e.what and re.fullmatch(r"\d{4}-\d\d-\d\d", e.date), e
        assert c.note and c.backends and c.formats and c.aspects, c


def test_every_lookup_is_answered_by_exactly_one_cell():
    for name, e in s.ENGINES.items():
        for v, b, f, a, m in itertools.product(PROBES[name], e.backends, s.KV_FORMATS, s.ASPECTS, MODELS):
            c = s.cell(name, v, b, f, a, m)        # raises SupportError on a gap or an overlap
            assert c.engine == name and b in c.backends and f in c.formats and a in c.aspects


def test_the_gap_and_overlap_check_bites(monkeypatch):
    one = next(c for c in s.CELLS if c.engine == "sglang" and c.effect is Effect.APPLIED and c.models is None)
    monkeypatch.setattr(matrix, "CELLS", s.CELLS + (one,))
    with pytest.raises(s.SupportError, match="2 cells match"):
        s.cell("sglang", "0.5.23", "cuda", "fp8_e4m3", "tensor")
    monkeypatch.setattr(matrix, "CELLS", tuple(c for c in s.CELLS if c is not one))
    with pytest.raises(s.SupportError, match="0 cells match"):
        s.cell("sglang", "0.5.23", "cuda", "fp8_e4m3", "tensor")


E = Effect


@pytest.mark.parametrize("engine,version,backend,kv_format,aspect,want", [
    # vLLM: the per-token-head caches from 0.20 (fp8, int8) and 0.25 (int4), Triton only (issue 40: not 0.24 / 0.32)
    ("vllm", "0.19", "triton", "fp8_per_token_head", "tensor", E.REFUSED),
    ("vllm", "0.20", "triton", "fp8_per_token_head", "tensor", E.IGNORED),
    ("vllm", "0.20", "triton", "int8_per_token_head", "head", E.IGNORED),
    ("vllm", "0.24", "triton", "int4_per_token_head", "tensor", E.REFUSED),
    ("vllm", "0.25", "triton", "int4_per_token_head", "tensor", E.IGNORED),
    ("vllm", "0.34", "fa3", "int8_per_token_head", "tensor", E.REFUSED),
    # vLLM: --kv-cache-dtype-skip-layers (sliding_window too) from 0.19, not in every version
    ("vllm", "0.18", "fa3", "fp8_e4m3", "skip_layers", E.REFUSED),
    ("vllm", "0.19", "fa3", "fp8_e4m3", "skip_layers", E.APPLIED),
    ("vllm", "0.18", "flashinfer", "fp8_e5m2", "skip_layers", E.REFUSED),
    # vLLM CPU: no quantized cache before 0.21; FP8 from 0.21 (AVX-512 or AMX); per-token-head broken until 0.33
    ("vllm", "0.20", "cpu", "fp8_e4m3", "tensor", E.REFUSED),
    ("vllm", "0.20", "cpu", "fp8_per_token_head", "tensor", E.REFUSED),
    ("vllm", "0.21", "cpu", "fp8_e4m3", "tensor", E.APPLIED),
    ("vllm", "0.21", "cpu", "int8_per_token_head", "tensor", E.BROKEN),
    ("vllm", "0.32", "cpu", "fp8_per_token_head", "tensor", E.BROKEN),
    ("vllm", "0.33", "cpu", "fp8_per_token_head", "tensor", E.REFUSED),
    ("vllm", "0.34", "cpu", "fp8_e4m3", "head", E.MAX_OVER_HEADS),
    ("vllm", "0.34", "cpu", "int8", "tensor", E.REFUSED),
    ("vllm", "0.34", "cpu", "fp8_e4m3", "skip_layers", E.APPLIED),
    # vLLM per-head scales: FlashAttention >= 3 only; q_scale: FA3/Triton (FlashInfer only on Blackwell)
    ("vllm", "0.34", "fa3", "fp8_e4m3", "head", E.APPLIED),
    ("vllm", "0.34", "triton", "fp8_e4m3", "head", E.REFUSED),
    ("vllm", "0.34", "flashinfer", "fp8_e4m3", "head", E.REFUSED),
    ("vllm", "0.34", "fa3", "fp8_e4m3", "q_scale", E.APPLIED),
    ("vllm", "0.34", "triton", "fp8_e4m3", "q_scale", E.APPLIED),
    ("vllm", "0.34", "flashinfer", "fp8_e4m3", "q_scale", E.IGNORED),
    ("vllm", "0.34", "cpu", "fp8_e4m3", "q_scale", E.IGNORED),
    # a compressed-tensors checkpoint without q_scale: Q at 1.0 on FA3 / Triton
    ("vllm", "0.34", "fa3", "fp8_e4m3", "q_absent", E.IGNORED),
    ("vllm", "0.34", "triton", "fp8_e4m3", "q_absent", E.IGNORED),
    ("vllm", "0.34", "cpu", "fp8_e4m3", "q_absent", E.UNQUANTIZED),
    ("vllm", "0.34", "triton", "fp8_per_token_head", "q_absent", E.UNQUANTIZED),
    # SGLang: CUDA fp8_e5m2 applies the checkpoint's scales from 0.5.19 (it does not run at 1.0)
    ("sglang", "0.5.18", "cuda", "fp8_e5m2", "tensor", E.IGNORED),
    ("sglang", "0.5.19", "cuda", "fp8_e5m2", "tensor", E.APPLIED),
    ("sglang", "0.5.23", "cuda", "fp8_e5m2", "tensor", E.APPLIED),
    ("sglang", "0.5.18", "cuda", "fp8_e4m3", "tensor", E.IGNORED),
    ("sglang", "0.5.19", "cuda", "fp8_e4m3", "tensor", E.APPLIED),
    ("sglang", "0.5.23", "cuda", "fp8_e4m3", "head", E.IGNORED),
    ("sglang", "0.5.23", "cuda", "int8", "tensor", E.REFUSED),
    ("sglang", "0.5.19", "cpu", "fp8_e4m3", "tensor", E.IGNORED),
    ("sglang", "0.5.20", "cpu", "fp8_e4m3", "tensor", E.APPLIED),
    ("sglang", "0.5.19", "cpu", "fp8_e5m2", "tensor", E.IGNORED),
    ("sglang", "0.5.20", "cpu", "fp8_e5m2", "tensor", E.REFUSED),
    ("sglang", "0.5.23", "cuda", "fp8_e4m3", "q_absent", E.UNREAD),
    # TensorRT-LLM: the PR applies one max(k, v) per layer and refuses a per-head scale
    ("trtllm", "1.4", "pytorch", "int8", "tensor", E.IGNORED),
    ("trtllm", None, "pytorch", "fp8_e4m3", "tensor", E.IGNORED),
    ("trtllm", "1.2+pr18953", "pytorch", "int8", "tensor", E.SHARED_KV),
    ("trtllm", "pr18953", "pytorch", "int8", "head", E.REFUSED),
    ("trtllm", "pr18953", "pytorch", "fp8_e4m3", "tensor", E.IGNORED),     # the PR is about INT8 only
    ("trtllm", "1.2", "pytorch", "fp8_e4m3", "skip_layers", E.IGNORED),
    ("trtllm-engine", "1.2.1", "tensorrt", "int8", "tensor", E.APPLIED),
    ("trtllm-engine", "1.3.1", "tensorrt", "fp8_e4m3", "tensor", E.REFUSED),
])
def test_known_cells(engine, version, backend, kv_format, aspect, want):
    assert s.effect(engine, version, backend, kv_format, aspect) is want


@pytest.mark.parametrize("arch, want", [("Qwen2ForCausalLM", E.IGNORED), ("Qwen3MoeForCausalLM", E.IGNORED),
                                        ("MixtralForCausalLM", E.IGNORED), ("LlamaForCausalLM", E.APPLIED),
                                        ("Qwen3ForCausalLM", E.APPLIED), (None, E.APPLIED)])
def test_sglang_has_a_model_axis(arch, want):
    """SGLang applies per-tensor FP8 only where the model's loader remaps the scale names (sglang issue 39942);
    the model axis holds on CUDA (both FP8 caches) and on the x86 CPU backend, from 0.5.19 / 0.5.20."""
    for backend, fmt in (("cuda", "fp8_e4m3"), ("cuda", "fp8_e5m2"), ("cpu", "fp8_e4m3")):
        assert s.effect("sglang", "0.5.23", backend, fmt, "tensor", arch) is want
    assert s.effect("sglang", "0.5.18", "cuda", "fp8_e4m3", "tensor", arch) is E.IGNORED      # nothing loads before
    assert s.effect("sglang", "0.5.23", "cpu", "fp8_e5m2", "tensor", arch) is E.REFUSED       # refused on CPU anyway
    assert s.effect("vllm", None, "fa3", "fp8_e4m3", "tensor", arch) is E.APPLIED             # vLLM has no such axis
    dropped = s.cell("sglang", None, "cuda", "fp8_e4m3", "tensor", "Qwen2ForCausalLM")
    assert any(isinstance(x, Source) and "39942" in x.file for x in dropped.evidence)


def test_the_broken_cpu_cell_cites_the_measurement():
    c = s.cell("vllm", "0.32", "cpu", "fp8_per_token_head", "tensor")
    assert any(isinstance(e, Measurement) and "224,275" in e.what for e in c.evidence)


def test_tensorrt_llm_citations_point_at_main_1_4():
    """Main moved the attention backends under `_torch/attention/` and is 1.4.0rc: no cell cites the old paths."""
    assert s.ENGINES["trtllm"].current == Version.parse("1.4")
    files = {x.file for c in s.CELLS if c.engine == "trtllm" for x in c.evidence if isinstance(x, Source)}
    assert "tensorrt_llm/_torch/attention/backends/trtllm.py" in files
    assert "tensorrt_llm/_torch/attention/attention.py" in files
    assert not any("attention_backend/" in f or f == "tensorrt_llm/_torch/modules/attention.py" for f in files)


def test_every_versioned_cell_names_a_version_an_engine_read():
    """The boundaries are versions read (the wheels the engine's `read` names), not guesses."""
    for c in s.CELLS:
        for bound in (c.since, c.until):
            if bound is not None and c.engine in ("vllm", "sglang"):
                assert str(bound) in s.ENGINES[c.engine].read or f"{bound}.0" in s.ENGINES[c.engine].read, c


def test_versions_parse_and_compare():
    assert Version.parse("0.32.0") == Version.parse("0.32") == Version.parse("v0.32")
    assert Version.parse("0.33.1") > Version.parse("0.33") > Version.parse("0.32.9")
    assert Version.parse("0.5.19") > Version.parse("0.5.18")
    built = s.version_of("trtllm", "pr18953")
    assert built.numbers == s.ENGINES["trtllm"].current.numbers and built.builds == {"pr18953"}
    assert str(Version.parse("1.2+PR18953")) == "1.2+pr18953"
    with pytest.raises(ValueError, match="engine version"):
        Version.parse("newest!")


def test_unknown_names_are_one_line_errors_naming_the_choices():
    with pytest.raises(s.SupportError, match="unknown backend 'fa2'.*'fa3'"):
        s.effect("vllm", None, "fa2", "fp8_e4m3", "tensor")
    with pytest.raises(s.SupportError, match="unknown engine 'tgi'"):
        s.effect("tgi", None, "cuda", "fp8_e4m3", "tensor")
    with pytest.raises(s.SupportError, match="unknown KV format"):
        s.effect("sglang", None, "cuda", "nvfp4", "tensor")


# ------------------------------------------------------------------------------ what a calibrated result becomes

def test_int8_on_tensorrt_llm_is_refused_unless_the_build_applies_it():
    cal = Calibrated("int8", amax_ratio=0.3)
    o = s.outcome("trtllm", cal)
    assert o.refused and o.severity == s.REFUSE
    assert "TensorRT-LLM 1.4" in o.refusal() and "INT8 runs at scale 1.0" in o.refusal()
    built = s.outcome("trtllm", cal, "1.2+pr18953")
    assert not built.refused and built.severity == s.DIFFERS          # K and V share max(k, v)
    assert "one scale shared by K and V" in built.summary()
    assert s.outcome("trtllm", Calibrated("int8", "head"), "pr18953").refused


def test_fp8_on_tensorrt_llm_is_refused_only_past_the_range():
    past = s.outcome("trtllm", Calibrated("fp8_e4m3", amax_ratio=1.7))
    assert past.refused and "1.7x the fp8_e4m3 range saturate" in past.refusal()
    inside = s.outcome("trtllm", Calibrated("fp8_e4m3", amax_ratio=0.4))
    assert not inside.refused and inside.severity == s.DIFFERS
    assert "runs at scale 1.0" in inside.summary() and "no K/V value lies past the range" in inside.summary()
    unknown = s.outcome("trtllm", Calibrated("fp8_e4m3"))
    assert unknown.severity == s.DIFFERS


def test_vllm_per_tensor_is_served_as_calibrated_on_every_backend():
    o = s.outcome("vllm", Calibrated("fp8_e4m3", "tensor", amax_ratio=3.0))
    assert o.severity == s.SAME and o.lines() == [] and "applied as calibrated" in o.summary()
    assert [c.backend for c in o.per_backend] == ["fa3", "triton", "flashinfer", "cpu"]


def test_vllm_per_head_names_each_backend():
    o = s.outcome("vllm", Calibrated("fp8_e4m3", "head", q_scale=True))
    assert not o.refused and o.severity == s.DIFFERS
    text = "\n".join(o.lines())
    assert "(Triton, FlashInfer): fp8_e4m3 head scales refused" in text
    assert "(CPU): fp8_e4m3 head scales applied as one max over heads" in text
    assert "(CPU): q_scale ignored" in text
    assert "(FlashAttention 3/4" not in text and "FlashAttention 3/4," not in text   # it serves both as calibrated
    assert s.outcome("vllm", Calibrated("fp8_e4m3", "head"), backend="triton").refused
    assert s.outcome("vllm", Calibrated("fp8_e4m3", "head"), backend="fa3").severity == s.SAME
    # per tensor with q_scale: FlashInfer leaves Q in the model dtype outside Blackwell
    q = s.outcome("vllm", Calibrated("fp8_e4m3", "tensor", q_scale=True))
    assert [ln.split(":")[0] for ln in q.lines()] == ["vLLM 0.34 (FlashInfer)", "vLLM 0.34 (CPU)"]
    assert all("q_scale ignored" in ln for ln in q.lines())


def test_sglang_per_head_runs_at_one_and_refuses_past_the_range():
    warn = s.outcome("sglang", Calibrated("fp8_e4m3", "head", amax_ratio=0.9))
    assert warn.severity == s.DIFFERS and "fp8_e4m3 head scales ignored" in warn.summary()
    assert s.outcome("sglang", Calibrated("fp8_e4m3", "head", amax_ratio=2.0)).refused
    assert s.outcome("sglang", Calibrated("fp8_e4m3", "tensor"), "0.5.19", "cuda").severity == s.SAME
    assert s.outcome("sglang", Calibrated("fp8_e4m3", "tensor"), "0.5.19", "cpu").severity == s.DIFFERS   # 1.0 there
    assert s.outcome("sglang", Calibrated("fp8_e4m3", "tensor", amax_ratio=2.0), "0.5.18").refused


def test_sglang_on_a_model_whose_loader_drops_the_scales():
    qwen = Calibrated("fp8_e4m3", amax_ratio=0.5, architecture="Qwen2ForCausalLM")
    o = s.outcome("sglang", qwen, backend="cuda")
    assert o.severity == s.DIFFERS and "sglang issue 39942" in o.summary()
    assert s.outcome("sglang", Calibrated("fp8_e4m3", amax_ratio=2.0, architecture="MixtralForCausalLM")).refused
    assert s.outcome("sglang", Calibrated("fp8_e4m3", amax_ratio=2.0, architecture="LlamaForCausalLM"),
                     backend="cuda").severity == s.SAME


def test_skipped_layers_an_engine_cannot_express_are_refused():
    o = s.outcome("sglang", Calibrated("fp8_e4m3", skip_layers=(0, 3)))
    assert o.refused and "skip_layers [0, 3]" in o.refusal()
    assert s.outcome("vllm", Calibrated("fp8_e4m3", skip_layers=(0, "sliding_window"))).severity == s.SAME
    assert s.outcome("vllm", Calibrated("fp8_e4m3", skip_layers=(0,)), "0.18").refused


def test_what_each_engine_lacks_is_said_once():
    """"vLLM has no INT8 KV cache": one line, made from the registry (calib.recipe.dtypes) and the engine."""
    assert s.lacks_format("vllm", "int8").startswith("vLLM has no static INT8 KV cache (not a --kv-cache-dtype")
    assert s.lacks_format("sglang", "int8").startswith("SGLang has no static INT8 KV cache")
    assert s.lacks_format("vllm", "fp8_e4m3") is None and s.lacks_format("trtllm", "int8") is None
    assert s.lacks_skip("vllm") is None and "cannot skip layers" in s.lacks_skip("trtllm")
    assert s.q_scale_readers() == ("vllm",)
    assert s.cell("vllm", None, "cpu", "int8", "tensor").note.startswith("not a --kv-cache-dtype choice")


# ------------------------------------------------------------------------------ the README table

def test_markdown_has_a_row_per_cell_and_numbers_every_source():
    text = s.markdown()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "**" in ln]
    assert len(rows) == len(s.CELLS)
    cited = {int(n) for n in re.findall(r"\[(\d+)\]", text)}
    listed = [int(m) for m in re.findall(r"^(\d+)\. ", text, flags=re.M)]
    assert sorted(cited) == listed == list(range(1, len(listed) + 1))
    assert len(listed) == len({e for c in s.CELLS for e in c.evidence} | {x for _, x in s.NOTES})
    assert "get_kv_cache_dtype" in text                                 # 0.34's per-layer hook, read but not a cell


def test_the_documented_table_is_the_module():
    root = Path(__file__).resolve().parents[2]
    start, end = "<!-- support-matrix:start -->\n", "<!-- support-matrix:end -->"
    holders = [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if start in p.read_text()]
    assert len(holders) == 1, holders
    text = holders[0].read_text()
    assert text.count(start) == text.count(end) == 1
    block = text.split(start, 1)[1].split(end, 1)[0]
    assert block == s.markdown(), f"regenerate the block in {holders[0].name} with `python -m calib.recipe.support`"


def test_skip_by_layer_kind_per_engine():
    """vLLM names sliding-window layers in its skip option; TensorRT-LLM and SGLang say up front, in one line, that
    they cannot keep them at the model dtype."""
    assert s.skip_by_kind("vllm") is None
    for name in ("trtllm", "sglang"):
        line = s.skip_by_kind(name)
        assert line.startswith(f"{s.ENGINES[name].title} cannot keep sliding-window layers") and "\n" not in line


def test_skip_order_puts_numbers_in_order_then_names_once_each():
    assert s.skip_order(["sliding_window", 10, 3, 3]) == [3, 10, "sliding_window"]
    assert s.skip_order([]) == []
