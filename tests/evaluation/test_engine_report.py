"""The report's 'Emulation vs engine' section compares like with like: the emulation may cover only the buckets up to
--emulate-up-to while the engine measures every sample, so the side-by-side numbers are over the samples both
measured, checked here against brute force from per-sample numbers."""

from __future__ import annotations

import math

import pytest

from calib.evaluation import engine_report, markdown

# per sample: bucket, tokens, (reference NLL, arm NLL, arm KL, arm top-1 agreements) emulated, the same in the engine
SAMPLES = [
    (64, 50, (150.0, 160.0, 2.0, 45), (151.0, 163.0, 1.5, 44)),
    (64, 60, (170.0, 175.0, 3.0, 50), (172.0, 180.0, 2.5, 52)),
    (128, 100, (280.0, 300.0, 6.0, 90), (282.0, 306.0, 5.0, 88)),
    (256, 200, (900.0, 1000.0, 30.0, 120), (905.0, 1010.0, 25.0, 118)),   # only the engine measured it
    (256, 250, (1200.0, 1400.0, 40.0, 150), (1210.0, 1420.0, 38.0, 149)),
]
EMULATED_UP_TO = 128


def _row(picked, side):
    """A bucket (or summary) row from per-sample sums, as the emulation and the engine write it."""
    t = sum(s[1] for s in picked)
    ref, arm, kl, top1 = (sum(s[side][k] for s in picked) for k in range(4))
    ppl, ppl_ref = math.exp(arm / t), math.exp(ref / t)
    return {"samples": len(picked), "tokens": t, "kl": kl / t, "kl_unresolved_mass": 0.01, "top1": top1 / t,
            "ppl": ppl, "ppl_ref": ppl_ref, "ppl_delta": ppl - ppl_ref, "ppl_rel": ppl / ppl_ref - 1}


def _reference_row(row):
    return {**row, "kl": 0.0, "top1": 1.0, "ppl": row["ppl_ref"], "ppl_delta": 0.0, "ppl_rel": 0.0}


def _numbers(side, up_to=None):
    measured = [s for s in SAMPLES if up_to is None or s[0] <= up_to]
    buckets = {str(b): _row([s for s in measured if s[0] == b], side) for b in sorted({s[0] for s in measured})}
    summary = {**_row(measured, side), "max_bucket_kl": max(r["kl"] for r in buckets.values())}
    return buckets, summary


def _passkey(buckets):
    return {str(b): {"correct": 3 if b <= EMULATED_UP_TO else 0, "total": 4} for b in buckets}


def _doc(up_to=EMULATED_UP_TO):
    """report.json's reference and `default` arm: emulated over the buckets <= up_to, the engine over every one."""
    emu_b, emu_s = _numbers(2, up_to)
    emu_pk = _passkey(int(b) for b in emu_b)
    eng_b, eng_s = _numbers(3)
    engine = {"status": "ok", "engine": "vllm", "version": "0.0-test", "summary": {**eng_s, "greedy": {"prefix": 0.9}},
              "buckets": eng_b, "passkey": _passkey((64, 128, 256))}
    ref_engine = {**engine, "summary": _reference_row(eng_s), "buckets": {b: _reference_row(r) for b, r in eng_b.items()}}
    return {"reference": "bf16", "engine": {"name": "vllm", "version": "0.0-test", "top_k": 20},
            "verdict": {"numbers": {"default": "engine"}},
            "arms": {"bf16": {"summary": _reference_row(emu_s), "buckets": {b: _reference_row(r) for b, r in emu_b.items()},
                              "passkey": emu_pk, "engine": ref_engine},
                     "default": {"summary": emu_s, "buckets": emu_b, "passkey": emu_pk, "engine": engine}}}


def _brute(side, up_to=None):
    """Perplexity of the reference and the arm, Δppl, KL and top-1 over the samples of buckets <= up_to."""
    picked = [s for s in SAMPLES if up_to is None or s[0] <= up_to]
    t = sum(s[1] for s in picked)
    ref, arm, kl, top1 = (sum(s[side][k] for s in picked) for k in range(4))
    return {"ref_ppl": math.exp(ref / t), "ppl": math.exp(arm / t), "ppl_rel": math.exp((arm - ref) / t) - 1,
            "kl": kl / t, "top1": top1 / t, "samples": len(picked)}


def _cells(lines, header_start, arm):
    """{column: cell} of `arm`'s row in the table whose header starts with `header_start`."""
    at = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {header_start}"))
    header = [c.strip() for c in lines[at].strip("|").split("|")]
    row = next(ln for ln in lines[at + 2:] if ln.startswith(f"| {arm} |"))
    return dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))


def _pct(cell):
    return float(cell.rstrip("%")) / 100


def test_emulated_and_engine_numbers_side_by_side_are_over_the_samples_both_measured():
    lines = markdown.engine_lines(_doc())
    emu, eng = _brute(2, EMULATED_UP_TO), _brute(3, EMULATED_UP_TO)
    assert _brute(3)["ppl"] > 1.2 * eng["ppl"]             # the engine over every sample is far from the shared ones
    ref = _cells(lines, "arm | numbers", "bf16")
    assert float(ref["ppl emulated"]) == pytest.approx(emu["ref_ppl"], rel=1e-4)
    assert float(ref["ppl engine"]) == pytest.approx(eng["ref_ppl"], rel=1e-4)
    arm = _cells(lines, "arm | numbers", "default")
    assert float(arm["ppl emulated"]) == pytest.approx(emu["ppl"], rel=1e-4)
    assert float(arm["ppl engine"]) == pytest.approx(eng["ppl"], rel=1e-4)
    assert _pct(arm["Δppl emulated"]) == pytest.approx(emu["ppl_rel"], rel=1e-2)
    assert _pct(arm["Δppl engine"]) == pytest.approx(eng["ppl_rel"], rel=1e-2)
    assert float(arm["KL emulated"]) == pytest.approx(emu["kl"], rel=1e-2)
    assert float(arm["KL engine (≥)"]) == pytest.approx(eng["kl"], rel=1e-2)
    assert _pct(arm["top-1 emulated"]) == pytest.approx(emu["top1"], rel=1e-2)
    assert _pct(arm["top-1 engine"]) == pytest.approx(eng["top1"], rel=1e-2)
    assert arm["passkey emulated"] == arm["passkey engine"] == "6/8"       # bucket 256's prompts: engine only
    text = "\n".join(lines)
    assert f"over the {emu['samples']} samples" in text and f"buckets <= {EMULATED_UP_TO}" in text
    # the engine over all its samples (what the verdict reads) is still shown, labelled as such
    every = _brute(3)
    whole = _cells(lines, "arm | samples", "default")
    assert int(whole["samples"]) == every["samples"] == len(SAMPLES)
    assert float(whole["ppl engine"]) == pytest.approx(every["ppl"], rel=1e-4)
    assert _pct(whole["Δppl engine"]) == pytest.approx(every["ppl_rel"], rel=1e-2)


def test_the_plot_compares_the_same_samples():
    shared = engine_report.side_by_side(_doc())
    emu, eng = _brute(2, EMULATED_UP_TO), _brute(3, EMULATED_UP_TO)
    assert shared.samples == emu["samples"]
    assert shared.arms["default"][0]["ppl_rel"] == pytest.approx(emu["ppl_rel"])
    assert shared.arms["default"][1]["ppl_rel"] == pytest.approx(eng["ppl_rel"])


def test_when_both_measured_every_sample_there_is_one_table():
    lines = markdown.engine_lines(_doc(up_to=None))
    every = _brute(3)
    assert not any(ln.startswith("| arm | samples") for ln in lines)
    assert f"over the {every['samples']} samples" in "\n".join(lines)
    assert float(_cells(lines, "arm | numbers", "default")["ppl engine"]) == pytest.approx(every["ppl"], rel=1e-4)
