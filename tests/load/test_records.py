"""One load level's numbers from `vllm bench serve --save-detailed` records (calib/load/records.py): goodput
against a direct count, the generator's own goodput as a second path, and hostile files refused with the field."""

from __future__ import annotations

import random

import pytest

from calib.load import records

OUT = 8


def _doc(n=40, seed=0, duration=12.5, latencies=True):
    rng = random.Random(seed)
    ttfts = [rng.uniform(0.05, 3.0) for _ in range(n)]
    itls = [[rng.uniform(0.01, 0.2) for _ in range(OUT - 1)] for _ in range(n)]
    doc = {"duration": duration, "ttfts": ttfts, "itls": itls, "output_lens": [OUT] * n,
           "input_lens": [rng.randint(100, 900) for _ in range(n)], "errors": [""] * n}
    if latencies:
        doc["latencies"] = [t + sum(g) for t, g in zip(ttfts, itls)]
    return doc


def test_goodput_is_the_direct_count_of_requests_meeting_both_bounds_over_the_duration():
    doc = _doc()
    reqs, duration, _ = records.parse(doc, 40, OUT, 1000)
    slo = records.SLO(ttft_s=1.5, tpot_s=0.1)
    got = records.summarize(reqs, duration, OUT, slo)
    good = 0
    for t, gaps in zip(doc["ttfts"], doc["itls"]):
        tpot = sum(gaps) / (OUT - 1)                  # (latency - ttft) / (out - 1), latency = ttft + gaps
        good += t <= 1.5 and tpot <= 0.1
    assert got["good"] == good and 0 < good < 40
    assert got["goodput"] == pytest.approx(good / 12.5)
    assert got["request_throughput"] == pytest.approx(40 / 12.5)
    assert got["output_throughput"] == pytest.approx(40 * OUT / 12.5)
    xs = sorted(doc["ttfts"])
    assert got["ttft_s"]["p50"] == pytest.approx((xs[19] + xs[20]) / 2)


def test_latency_falls_back_to_ttft_plus_the_gaps_when_the_version_writes_none():
    a = records.summarize(*records.parse(_doc(), 40, OUT, 1000)[:2], OUT, records.SLO(1.5, 0.1))
    b = records.summarize(*records.parse(_doc(latencies=False), 40, OUT, 1000)[:2], OUT, records.SLO(1.5, 0.1))
    assert a["good"] == b["good"] and a["e2e_s"]["p50"] == pytest.approx(b["e2e_s"]["p50"])


def test_failed_and_short_requests_are_not_good():
    doc = _doc(n=4)
    doc["ttfts"] = [0.1] * 4
    doc["itls"] = [[0.01] * (OUT - 1)] * 4
    doc["latencies"] = [0.1 + 0.01 * (OUT - 1)] * 4
    doc["errors"][1] = "Internal Server Error"
    doc["output_lens"][2] = OUT - 3
    got = records.summarize(*records.parse(doc, 4, OUT, 1000)[:2], OUT, records.SLO(1.0, 1.0))
    assert (got["completed"], got["good"], got["failed"]) == (3, 2, 1)
    assert got["errors"] == ["Internal Server Error"]


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(duration=float("nan")), "'duration'"),
    (lambda d: d.update(duration=0), "'duration' = 0"),
    (lambda d: d["ttfts"].pop(), "'ttfts' holds 39"),
    (lambda d: d["output_lens"].__setitem__(0, 10 ** 9), "'output_lens'[0]"),
    (lambda d: d["input_lens"].__setitem__(3, -1), "'input_lens'[3]"),
    (lambda d: d["itls"].__setitem__(2, [0.1] * 100), "'itls'[2]"),
    (lambda d: d["latencies"].__setitem__(5, 0.0), "request 5"),
    (lambda d: d.pop("input_lens"), "'input_lens'"),
])
def test_a_hostile_result_file_is_one_error_naming_the_field(edit, field):
    doc = _doc()
    edit(doc)
    with pytest.raises(records.RecordsError, match=field.replace("[", r"\[").replace("]", r"\]")):
        records.parse(doc, 40, OUT, 1000)
