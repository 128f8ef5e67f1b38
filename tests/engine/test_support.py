"""The support matrix (calib.engine.support): every cell cited, every lookup answered by exactly one cell, the
known cells as read from the engines' source (or measured), and what a calibrated result becomes per engine.

Runs in `make test` (no engine marker): the matrix is plain data.
"""

from __future__ import annotations

import itertools
import re

import pytest

from calib.engine import support as s
from calib.engine.support import Calibrated, Effect, Measurement, Source, Version

# Versions around every boundary a cell names, plus one before and after the versions read.
PROBES = {"vllm": ["0.20", "0.23.9", "0.24", "0.31", "0.32", "0.32.1", "0.33.0", "0.34", "0.40"],
          "trtllm": ["1.0", "1.2", "1.3", "pr18953", "1.2+pr18953"],
          "trtllm-engine": ["1.1", "1.2", "1.2.1", "1.3.0rc20", "1.3.1", "1.4"],
          "sglang": ["0.5.10", "0.5.18", "0.5.19", "0.5.20", "0.5.23", "0.6"]}


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
        for v, b, f, a in itertools.product(PROBES[name], e.backends, s.KV_FORMATS, s.ASPECTS):
            c = s.cell(name, v, b, f, a)        # raises SupportError on a gap or an overlap
            assert c.engine == name and b in c.backends and f in c.formats and a in c.aspects


def test_the_gap_and_overlap_check_bites(monkeypatch):
    one = next(c for c in s.CELLS if c.engine == "sglang" and c.effect is Effect.APPLIED)
    monkeypatch.setattr(s, "CELLS", s.CELLS + (one,))
    with pytest.raises(s.SupportError, match="2 cells match"):
        s.cell("sglang", "0.5.23", "cuda", "fp8_e4m3", "tensor")
    monkeypatch.setattr(s, "CELLS", tuple(c for c in s.CELLS if c is not one))
    with pytest.raises(s.SupportError, match="0 cells match"):
        s.cell("sglang", "0.5.23", "cuda", "fp8_e4m3", "tensor")


@pytest.mark.parametrize("engine,version,backend,kv_format,aspect,want", [
    ("trtllm", "1.2", "pytorch", "int8", "tensor", Effect.IGNORED),
    ("trtllm", None, "pytorch", "fp8_e4m3", "tensor", Effect.IGNORED),
    ("trtllm", "1.2+pr18953", "pytorch", "int8", "tensor", Effect.APPLIED),
    ("trtllm", "pr18953", "pytorch", "int8", "head", Effect.MAX_OVER_HEADS),
    ("trtllm", "pr18953", "pytorch", "fp8_e4m3", "tensor", Effect.IGNORED),     # the PR is about INT8 only
    ("trtllm", "1.2", "pytorch", "fp8_e4m3", "skip_layers", Effect.IGNORED),
    ("vllm", "0.32", "cpu", "fp8_per_token_head", "tensor", Effect.BROKEN),
    ("vllm", "0.32.0", "cpu", "int8_per_token_head", "tensor", Effect.BROKEN),
    ("vllm", "0.33", "cpu", "fp8_per_token_head", "tensor", Effect.REFUSED),
    ("vllm", "0.34", "triton", "fp8_per_token_head", "tensor", Effect.IGNORED),
    ("vllm", "0.34", "fa3", "int8_per_token_head", "tensor", Effect.REFUSED),
    ("vllm", "0.24", "triton", "int4_per_token_head", "tensor", Effect.REFUSED),
    ("vllm", "0.34", "triton", "fp8_e4m3", "head", Effect.REFUSED),
    ("vllm", "0.34", "flashinfer", "fp8_e4m3", "head", Effect.REFUSED),
    ("vllm", "0.34", "fa3", "fp8_e4m3", "head", Effect.APPLIED),
    ("vllm", "0.34", "cpu", "fp8_e4m3", "head", Effect.MAX_OVER_HEADS),
    ("vllm", "0.34", "cpu", "fp8_e4m3", "q_scale", Effect.IGNORED),
    ("vllm", "0.34", "fa3", "fp8_e4m3", "q_scale", Effect.APPLIED),
    ("vllm", "0.34", "cpu", "int8", "tensor", Effect.REFUSED),
    ("vllm", "0.34", "cpu", "fp8_e4m3", "skip_layers", Effect.APPLIED),
    ("sglang", "0.5.18", "cuda", "fp8_e4m3", "tensor", Effect.IGNORED),
    ("sglang", "0.5.19", "cuda", "fp8_e4m3", "tensor", Effect.APPLIED),
    ("sglang", "0.5.23", "cuda", "fp8_e4m3", "head", Effect.IGNORED),
    ("sglang", "0.5.23", "cuda", "int8", "tensor", Effect.REFUSED),
    ("sglang", "0.5.23", "cpu", "fp8_e5m2", "tensor", Effect.REFUSED),
])
def test_known_cells(engine, version, backend, kv_format, aspect, want):
    assert s.effect(engine, version, backend, kv_format, aspect) is want


def test_the_broken_cpu_cell_cites_the_measurement():
    c = s.cell("vllm", "0.32", "cpu", "fp8_per_token_head", "tensor")
    assert any(isinstance(e, Measurement) and "224,275" in e.what for e in c.evidence)


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
    assert "TensorRT-LLM 1.2" in o.refusal() and "INT8 runs at scale 1.0" in o.refusal()
    built = s.outcome("trtllm", cal, "1.2+pr18953")
    assert not built.refused and built.severity == s.SAME


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
    assert "(FlashAttention-3" not in text and "FlashAttention-3," not in text   # it serves both as calibrated
    assert s.outcome("vllm", Calibrated("fp8_e4m3", "head"), backend="triton").refused
    assert s.outcome("vllm", Calibrated("fp8_e4m3", "head"), backend="fa3").severity == s.SAME


def test_sglang_per_head_runs_at_one_and_refuses_past_the_range():
    warn = s.outcome("sglang", Calibrated("fp8_e4m3", "head", amax_ratio=0.9))
    assert warn.severity == s.DIFFERS and "fp8_e4m3 head scales ignored" in warn.summary()
    assert s.outcome("sglang", Calibrated("fp8_e4m3", "head", amax_ratio=2.0)).refused
    assert s.outcome("sglang", Calibrated("fp8_e4m3", "tensor"), "0.5.19").severity == s.SAME
    assert s.outcome("sglang", Calibrated("fp8_e4m3", "tensor", amax_ratio=2.0), "0.5.18").refused


def test_skipped_layers_an_engine_cannot_express_are_refused():
    o = s.outcome("sglang", Calibrated("fp8_e4m3", skip_layers=(0, 3)))
    assert o.refused and "skip_layers [0, 3]" in o.refusal()
    assert s.outcome("vllm", Calibrated("fp8_e4m3", skip_layers=(0, "sliding_window"))).severity == s.SAME


# ------------------------------------------------------------------------------ the README table

def test_markdown_has_a_row_per_cell_and_numbers_every_source():
    text = s.markdown()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "**" in ln]
    assert len(rows) == len(s.CELLS)
    cited = {int(n) for n in re.findall(r"\[(\d+)\]", text)}
    listed = [int(m) for m in re.findall(r"^(\d+)\. ", text, flags=re.M)]
    assert sorted(cited) == listed == list(range(1, len(listed) + 1))
    assert len(listed) == len({e for c in s.CELLS for e in c.evidence})


def test_the_readme_table_is_the_module():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start, end = "<!-- support-matrix:start -->\n", "<!-- support-matrix:end -->"
    assert readme.count(start) == readme.count(end) == 1
    block = readme.split(start, 1)[1].split(end, 1)[0]
    assert block == s.markdown(), "regenerate the README block with `python -m calib.engine.support`"


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
