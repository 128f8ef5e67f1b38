"""Numbers that are not finite decide nothing: each measured quantity, made NaN or infinite on its own in an
evaluation that otherwise ships, turns the verdict into "cannot measure" naming the arm, the place and the
quantity; a model whose logits overflow ends eval and tune with one error, a non-zero exit and no "Ship"."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from click.testing import CliRunner

from calib.cli import main
from calib.evaluation import measurable
from calib.evaluation import verdict as report
from calib.evaluation.fakequant import Meter
from calib.evaluation.verdict import Thresholds
from calib.engine.metrics import BucketRow, Summary
from calib.evaluation.results import ArmInfo, ArmMetrics, KVRange, PasskeyRow, Reference, Seconds
from helpers import engine_numbers, overflowing_model
from tiny import random_sequences


def _ships():
    """(reference, {"default": numbers}) of a one-layer, one-bucket evaluation whose `default` arm ships."""
    ref_row = BucketRow(2, 126, 0.0, 1.0, 10.0, 10.0, 0.0, 0.0)
    ref = Reference({"64": ref_row}, Summary(**ref_row.to_dict(), max_bucket_kl=0.0), Seconds(1.0), (140.0, 150.0),
                    (63, 63), {"0": KVRange((3.0, 4.0), (1.0, 2.0))})
    row = BucketRow(2, 126, 0.004, 0.98, 10.05, 10.0, 0.05, 0.005)
    info = ArmInfo("default", "fp8_e4m3", "tensor", True, None, (), (), (), {"k": {"0": 1.0}, "v": {"0": 1.0}, "q": {}})
    layers = {"0": {"k_saturated": 0.0, "k_flushed": 0.001, "k_snr_db": 30.0, "v_saturated": 0.0, "v_flushed": 0.0,
                    "v_snr_db": math.inf, "attn_rel_error": 0.01}}
    results = {"default": ArmMetrics(info, {"64": row}, Summary(**row.to_dict(), max_bucket_kl=0.004), (141.0, 151.0),
                                     (0.2, 0.3), layers, (), Seconds(2.0))}
    assert report.verdict(ref, results, Thresholds(), "fp32").action == "ship"     # the baseline these tests break
    return ref, results


def _row(r: BucketRow, **kw) -> BucketRow:
    return replace(r, **kw)


def _engine_entry(kl: float):
    row = {"samples": 2, "tokens": 126, "kl": kl, "kl_unresolved_mass": 0.0, "top1": 1.0, "ppl": 10.0,
           "ppl_ref": 10.0, "ppl_delta": 0.0, "ppl_rel": 0.0}
    return engine_numbers(status="ok", buckets={"64": row}, sample_nll=[1.0, 2.0],
                          summary={**row, "max_bucket_kl": kl, "greedy": {"prefix": None}})


ARM_CASES = {
    "bucket KL": (lambda e: replace(e, buckets={"64": _row(e.buckets["64"], kl=math.nan)}), "bucket <= 64", "kl"),
    "top-1": (lambda e: replace(e, buckets={"64": _row(e.buckets["64"], top1=math.nan)}), "bucket <= 64", "top1"),
    "overall ppl": (lambda e: replace(e, summary=replace(e.summary, ppl_rel=math.inf)), "all buckets", "ppl_rel"),
    "worst bucket KL": (lambda e: replace(e, summary=replace(e.summary, max_bucket_kl=math.nan)), "all buckets",
                        "max_bucket_kl"),
    "sample NLL": (lambda e: replace(e, sample_nll=(1.0, math.nan)), "sample 1", "nll"),
    "sample KL": (lambda e: replace(e, sample_kl=(math.inf, 0.1)), "sample 0", "kl"),
    "SNR NaN": (lambda e: replace(e, layers={"0": {**e.layers["0"], "k_snr_db": math.nan}}), "layer 0", "k_snr_db"),
    "SNR -inf": (lambda e: replace(e, layers={"0": {**e.layers["0"], "v_snr_db": -math.inf}}), "layer 0", "v_snr_db"),
    "saturation": (lambda e: replace(e, layers={"0": {**e.layers["0"], "k_saturated": math.nan}}), "layer 0",
                   "k_saturated"),
    "attention error": (lambda e: replace(e, layers={"0": {**e.layers["0"], "attn_rel_error": math.inf}}), "layer 0",
                        "attn_rel_error"),
    "passkey": (lambda e: replace(e, passkey={"64": PasskeyRow(0, 0, {}, math.nan)}), "passkey bucket <= 64",
                "accuracy"),
    "engine KL": (lambda e: replace(e, engine=_engine_entry(math.nan)), "(vllm) bucket <= 64", "kl"),
}


@pytest.mark.parametrize("case", ARM_CASES)
def test_each_non_finite_arm_number_makes_the_verdict_cannot_measure(case):
    ref, results = _ships()
    edit, where, quantity = ARM_CASES[case]
    results = {"default": edit(results["default"])}
    with pytest.raises(measurable.CannotMeasure) as e:
        report.verdict(ref, results, Thresholds(), "fp32")
    msg = str(e.value)
    assert msg.startswith(f"cannot measure: `default` {where}: {quantity} ") and "Ship" not in msg
    assert report.skip_plan(ref, results, Thresholds()) == []        # nor are layers skipped on such numbers


def test_non_finite_reference_numbers_are_named_as_the_reference():
    ref, results = _ships()
    cases = [(replace(ref, ranges={"0": KVRange((math.inf, 4.0), (1.0, 2.0))}), "layer 0: max |K| inf"),
             (replace(ref, sample_nll=(math.nan, 1.0)), "sample 0: nll nan"),
             (replace(ref, summary=replace(ref.summary, ppl=math.inf)), "all buckets: ppl inf"),
             (replace(ref, engine=_engine_entry(math.inf)), "(vllm) bucket <= 64: kl inf")]
    for bad, where in cases:
        with pytest.raises(measurable.CannotMeasure, match=r"`fp32` \(the reference\) " + where.replace("(", r"\(")
                           .replace(")", r"\)").replace("|", r"\|")):
            report.verdict(bad, results, Thresholds(), "fp32")


def test_an_exact_layer_and_engine_entries_not_run_are_not_failures():
    ref, results = _ships()
    e = results["default"]
    assert e.layers["0"]["v_snr_db"] == math.inf          # stored exactly: no noise, a fact
    not_run = engine_numbers(status="not_run", reason="no FP8 here")
    results = {"default": replace(e, engine=not_run)}
    assert measurable.problems(ref, results) == []
    assert report.verdict(ref, results, Thresholds(), "fp32").action == "ship"


def test_the_message_groups_places_and_counts_the_rest():
    found = [measurable.Unmeasured("a", f"bucket <= {b}", q, math.nan) for b in (1, 2, 3, 4, 5) for q in ("kl", "ppl")]
    text = measurable.text(found)
    assert text.startswith("cannot measure: `a` bucket <= 1: kl nan, ppl nan; `a` bucket <= 2: kl nan, ppl nan; "
                           "`a` bucket <= 3: kl nan, ppl nan (and 2 more places); ")
    assert "\n" not in text


def test_meter_reads_nan_k_v_as_nan_not_as_exact():
    m = Meter()
    terms = torch.tensor([0, 0, 4, 4, math.nan, 1.0, 0, 0, 4, 4, 4.0, 0.0, math.inf, 2.0], dtype=torch.float64)
    m.add(0, terms)
    row = m.read()["0"]
    assert math.isnan(row["k_snr_db"]) and row["v_snr_db"] == math.inf and math.isnan(row["attn_rel_error"])
    m = Meter()
    m.add(0, torch.tensor([0, 0, 4, 4, 100.0, 1.0, 0, 0, 4, 4, 4.0, 0.0, 1.0, 4.0], dtype=torch.float64))
    row = m.read()["0"]
    assert row["k_snr_db"] == pytest.approx(20.0) and row["attn_rel_error"] == pytest.approx(0.5)


def test_a_perplexity_past_float64_is_infinite_not_a_traceback():
    row = BucketRow.of(tokens=2, kl=0.0, agree=2, nll=2000.0, ref_nll=2.0, samples=1)
    assert row.ppl == math.inf and row.ppl_ref == pytest.approx(math.e) and row.ppl_rel == math.inf


def test_eval_of_a_model_whose_logits_overflow_cannot_measure(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(8, lo=20, hi=40)))
    r = CliRunner().invoke(main, ["eval", "--model", str(overflowing_model(tmp_path)), "--data", str(data),
                                  "--samples", "4", "--buckets", "32", "--device", "cpu", "--no-plots",
                                  "--out", str(tmp_path / "rep")])
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    assert "Ship" not in r.output and "ship" not in r.output.replace("cannot measure", "")
    assert "Error: cannot measure: `fp32` (the reference) bucket <= 32: ppl inf" in r.output
    assert not (tmp_path / "rep").exists()


def test_tune_refuses_to_choose_on_a_non_finite_sensitivity_or_entry():
    from calib.tune import choose
    from calib.tune.search import Search

    ref, results = _ships()
    found = Search(candidates=[], entries=dict(results), ref=ref, sensitivity={0: 0.01, 1: 0.02})
    choose.check_measurable(found, "fp32")               # finite: no error
    found.sensitivity[1] = math.nan
    with pytest.raises(measurable.CannotMeasure, match=r"`sensitivity` layer 1 alone: kl nan"):
        choose.check_measurable(found, "fp32")
    found.sensitivity[1] = 0.02
    found.entries["default"] = replace(results["default"], sample_kl=(0.1, math.nan))
    with pytest.raises(measurable.CannotMeasure, match=r"`default` sample 1: kl nan; .*nothing was written"):
        choose.check_measurable(found, "fp32")
