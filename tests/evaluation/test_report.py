"""The verdict and the report files from known numbers: each miss named with its number, the verdict's text,
report.md's table rows cell by cell and report.json's values (non-finite ones as null)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from calib.evaluation import markdown, report
from calib.evaluation.verdict import Thresholds, dominant_layers, failures, verdict
from calib.engine.metrics import BucketRow, Summary
from calib.evaluation.results import ArmInfo, ArmMetrics, KVRange, PasskeyRow, Reference, Seconds


def test_markdown_table_rejects_ragged_rows():
    assert markdown.table(["a", "b"], [[1, "x|y"]])[2] == "| 1 | x\\|y |"
    with pytest.raises(ValueError, match="cells"):
        markdown.table(["a", "b"], [[1]])


def _known(ppl: float) -> tuple[dict, Reference, dict[str, ArmMetrics]]:
    """(meta, reference, {"default": its numbers}) of a one-layer, one-bucket evaluation with round numbers."""
    meta = {"model": "m", "model_dtype": "float32", "device": "cpu", "layers": [0], "kv_heads": 2, "head_dim": 4,
            "data": {"source": "d.jsonl", "samples": 2, "tokens": 128,
                     "held_out": {"checked_against": None, "note": "not checked"}},
            "buckets": [64], "notes": [], "reference": "fp32"}
    ref_row = BucketRow(2, 126, 0.0, 1.0, 10.0, 10.0, 0.0, 0.0)
    ref = Reference({"64": ref_row}, Summary(**ref_row.to_dict(), max_bucket_kl=0.0), Seconds(1.0), (140.0, 150.0),
                    (63, 63), {"0": KVRange((3.0, 4.0), (1.0, 2.0))})
    row = BucketRow(2, 126, 0.004, 0.98, ppl, 10.0, ppl - 10.0, ppl / 10.0 - 1)
    info = ArmInfo("default", "fp8_e4m3", "tensor", True, None, (), (), (), {"k": {"0": 1.0}, "v": {"0": 1.0}, "q": {}})
    layers = {"0": {"k_saturated": 0.0, "k_flushed": 0.001, "k_snr_db": 30.0, "v_saturated": 0.0, "v_flushed": 0.0,
                    "v_snr_db": math.inf, "attn_rel_error": 0.01}}
    default = ArmMetrics(info, {"64": row}, Summary(**row.to_dict(), max_bucket_kl=0.004), (141.0, 151.0), (0.2, 0.3),
                         layers, (), Seconds(2.0))
    return meta, ref, {"default": default}


def _arm(buckets: dict[str, float], ppl_rel: float, passkey: tuple[int, int] | None = None, layers=None) -> ArmMetrics:
    rows = {b: BucketRow(1, 10, kl, 0.9, 10.0 * (1 + ppl_rel), 10.0, 10.0 * ppl_rel, ppl_rel) for b, kl in buckets.items()}
    total = Summary(**next(iter(rows.values())).to_dict(), max_bucket_kl=max(buckets.values()))
    pk = None if passkey is None else {"256": PasskeyRow(passkey[0], passkey[1], {}, passkey[0] / passkey[1])}
    info = ArmInfo("checkpoint", "fp8_e4m3", "tensor", True, "ck", (), (), (), {})
    return ArmMetrics(info, rows, replace(total, ppl_rel=ppl_rel), (), (), layers or {}, (), Seconds(1.0), pk)


def _report(meta, ref, results) -> report.Report:
    return report.Report(meta, ref, results, Thresholds(), verdict(ref, results, Thresholds(), "fp32"))


def test_failures_name_every_miss_with_its_number():
    entry = _arm({"64": 0.005, "256": 0.0234}, 0.0213, passkey=(3, 5))
    _, ref, _ = _known(10.0)
    ref = replace(ref, passkey={"256": PasskeyRow(5, 5, {}, 1.0)})
    assert failures(entry, ref, Thresholds()) == [
        "KL 0.0234 > 0.01 in bucket <= 256", "perplexity +2.13% > +1%", "passkey 3/5 < reference 5/5"]
    assert failures(entry, ref, Thresholds(max_kl=0.03, max_ppl_increase=0.03, passkey_drop=2)) == []


def test_dominant_layers_are_those_far_above_the_median():
    errs = {"0": 0.01, "1": 0.02, "2": 0.5, "3": 0.011, "4": 0.06}       # median 0.02: 3x is 0.06
    entry = _arm({"64": 0.1}, 0.0, layers={i: {"attn_rel_error": e} for i, e in errs.items()})
    assert dominant_layers(entry, Thresholds()) == [2, 4]
    assert dominant_layers(entry, Thresholds(max_skip=1)) == [2]
    assert dominant_layers(entry, Thresholds(dominance=30)) == []


def test_verdict_text_carries_the_deciding_numbers():
    meta, ref, results = _known(ppl=10.2)
    doc = _report(meta, ref, results).to_dict()
    assert doc["arms"]["default"]["misses"] == ["perplexity +2.00% > +1%"]
    assert doc["verdict"]["action"] == "keep_reference" and doc["verdict"]["text"] == (
        "Keep FP32 KV for this model: no arm is within the threshold (best: `default`, perplexity +2.00% > +1%). "
        "No small set of layers dominates the error, so no layer skip was measured (whether one helps is unknown). "
        "Decided on emulated "
        "numbers (no engine run; `--engine vllm` measures the real engine).")
    meta, ref, results = _known(ppl=10.05)
    v = verdict(ref, results, Thresholds(), "fp32")
    assert v.action == "ship" and v.text.startswith(
        "Ship `default` (emulated: worst-bucket KL 0.004, ppl +0.50%): serve with FP8 KV and no scales "
        "(vLLM: `--kv-cache-dtype fp8`); calibration is not needed.")


def test_verdict_names_the_serving_dtype_not_the_cpu_reference():
    """On CPU the reference arm is measured in float32; a BF16 model's user keeps BF16 KV, and the text says so."""
    meta, ref, results = _known(ppl=10.2)
    v = verdict(ref, results, Thresholds(), "fp32", serving="BF16")
    assert v.action == "keep_reference" and v.text.startswith("Keep BF16 KV for this model: no arm is within the threshold") and "FP32" not in v.text


def test_report_files_hold_the_known_numbers(tmp_path):
    meta, ref, results = _known(ppl=10.2)
    doc = report.write(tmp_path / "r", _report(meta, ref, results), force=False, plots=False)
    md = (tmp_path / "r" / "report.md").read_text().splitlines()
    assert "| fp32 | reference | fp32 | – | 0 | 0 | 100% | 10 | – | – | reference | 1 |" in md
    assert "| default | default | fp8_e4m3 | tensor | 0.004 | 0.004 | 98% | 10.2 | 2% | – | no | 2 |" in md
    assert "| 0 | 1 | 1 | 0% | 0.1% | 30 | 0% | 0% | ∞ | 0.01 |" in md               # per layer
    assert "| default | 64 | 2 | 126 | 0.004 | 98% | 10.2 | 10 | 2% |" in md          # by context length
    assert doc["verdict"]["text"] in md and "- plots not requested" in md
    written = json.loads((tmp_path / "r" / "report.json").read_text())
    assert written["arms"]["default"]["layers"]["0"]["v_snr_db"] is None            # infinite: null, not Infinity
    assert written["arms"]["default"]["summary"] == pytest.approx(results["default"].summary.to_dict())
    assert written["verdict"]["text"] == doc["verdict"]["text"]
    assert report.finite({"a": [math.nan, -math.inf, 1.5], 2: math.inf}) == {"a": [None, None, 1.5], "2": None}


@pytest.mark.parametrize("declared, read", [("bfloat16", "bfloat16"), ("torch.float16", "float16"),
                                            ("<b>x</b>" * 1000, None), (7, None), ("float8_e4m3fn", None)])
def test_a_config_dtype_is_read_only_when_it_is_a_model_dtype(tmp_path, declared, read):
    """config.json is the user's file: a stale or hostile dtype never reaches a report's headline."""
    (tmp_path / "config.json").write_text(json.dumps({"dtype": declared}))
    assert report.declared_dtype(tmp_path) == read
