"""The typed results: rows computed from sums as the definitions say, report.json's form (keys in order), and
passkey outcomes counted per bucket and depth."""

from __future__ import annotations

import math

import pytest

from calib.engine.metrics import BucketRow, Summary
from calib.evaluation import passkey
from calib.evaluation.results import (ArmInfo, ArmMetrics, Failure, PasskeyRow, Position, Seconds, passkey_correct,
                                      passkey_rows, with_passkey)


def test_a_bucket_row_is_its_sums_divided_by_its_tokens():
    row = BucketRow.of(tokens=4, kl=0.2, agree=3, nll=8.0, ref_nll=6.0, samples=1)
    assert (row.samples, row.tokens, row.kl, row.top1) == (1, 4, 0.05, 0.75)
    assert row.ppl == pytest.approx(math.e ** 2) and row.ppl_ref == pytest.approx(math.e ** 1.5)
    assert row.ppl_delta == pytest.approx(math.e ** 2 - math.e ** 1.5)
    assert row.ppl_rel == pytest.approx(math.exp(0.5) - 1)
    assert list(row.to_dict()) == ["samples", "tokens", "kl", "top1", "ppl", "ppl_ref", "ppl_delta", "ppl_rel"]
    total = Summary(**row.to_dict(), max_bucket_kl=0.07)
    assert list(total.to_dict())[-1] == "max_bucket_kl"


def test_passkey_outcomes_are_counted_per_bucket_and_depth():
    outs = [passkey.Outcome(256, d, "1", "1" if ok else "2", ok) for d, ok in ((0.0, True), (0.5, False), (0.5, True))]
    outs.append(passkey.Outcome(512, 1.0, "1", "", False))
    rows = passkey_rows(passkey.summarize(outs))
    assert rows["256"].correct == 2 and rows["256"].total == 3 and rows["256"].accuracy == pytest.approx(2 / 3)
    assert {d: (c.correct, c.total) for d, c in rows["256"].by_depth.items()} == {"0": (1, 1), "0.5": (1, 2)}
    assert passkey_correct(rows) == (2, 4) and passkey_correct(None) is None
    assert rows["512"].to_dict() == {"correct": 0, "total": 1, "by_depth": {"1": {"correct": 0, "total": 1}},
                                     "accuracy": 0.0, "outcomes": [{"depth": 1.0, "correct": False}]}
    assert rows["256"].outcomes == ((0.0, True), (0.5, False), (0.5, True))


def test_an_arms_report_entry_keeps_report_jsons_keys_in_order():
    row = BucketRow.of(10, 0.1, 9, 20.0, 19.0, 2)
    info = ArmInfo("stats", "int8", "head", True, "s", (1,), (), ("n",), {"k": {"0": 0.5}, "v": {"0": 0.25}, "q": {}})
    fail = Failure(3, 12, 16, 0.02, (Position(5, 0.04, "a b", "c", "d", "e"),))
    e = ArmMetrics(info, {"16": row}, Summary(**row.to_dict(), max_bucket_kl=0.01), (20.0,), (0.1,),
                   {"0": {"k_saturated": 0.0}}, (fail,), Seconds(2.5))
    d = with_passkey(e, {"16": PasskeyRow(1, 1, {}, 1.0)}, 0.5).to_dict()
    assert list(d) == ["kind", "dtype", "granularity", "shippable", "source", "skip", "serve_skip", "notes", "scales",
                       "buckets", "summary", "sample_nll", "sample_kl", "layers", "failures", "seconds", "passkey"]
    assert d["skip"] == [1] and d["notes"] == ["n"] and d["seconds"] == {"metrics": 2.5, "passkey": 0.5}
    assert d["failures"] == [{"sample": 3, "tokens": 12, "bucket": 16, "mean_kl": 0.02, "positions": [
        {"position": 5, "kl": 0.04, "context": "a b", "next": "c", "reference_predicts": "d", "arm_predicts": "e"}]}]
    assert Seconds(2.5, 0.5).total == 3.0 and "passkey" not in e.to_dict()
