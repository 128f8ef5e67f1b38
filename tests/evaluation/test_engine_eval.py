"""Engine arms in `kvcalib eval`: metrics from top-k log-probabilities, the runner protocol and driver, and the
report / verdict reading the engine's numbers. The engine here is tests/fake_vllm_runner.py (transformers in
this venv); tests/engine/test_vllm_eval.py runs the real vLLM runner."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from calib.cli import main
from calib.engine import driver, metrics, protocol
from calib.engine.driver import EngineSpec
from calib.evaluation import numbers as honest
from calib.evaluation import verdict as report
from calib.evaluation.run import run_eval
from tiny import tiny_causal_lm
from helpers import arm_metrics, calibrate_small, engine_numbers, eval_config, k_beyond_fp8_model, reference_metrics, save_model_and_data

FAKE = Path(__file__).resolve().parents[1] / "fake_vllm_runner.py"
VENV = Path(sys.executable).parent.parent


@pytest.fixture(autouse=True)
def fake_runner(monkeypatch):
    monkeypatch.setenv(driver.RUNNER_ENV, str(FAKE))


def _spec(**kw) -> EngineSpec:
    return EngineSpec("vllm", VENV, top_k=kw.pop("top_k", 8), continuation_tokens=kw.pop("continuation_tokens", 4), **kw)


# ------------------------------------------------------------------------------ metrics against brute force

def _dist(g: torch.Generator, n: int, sharp: float) -> torch.Tensor:
    return torch.log_softmax(torch.randn(n, generator=g, dtype=torch.float64) * sharp, -1)


def test_kl_from_the_whole_vocabulary_is_exact_and_from_top_k_a_lower_bound():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        p, q = _dist(g, 40, 3.0), _dist(g, 40, 3.0)
        exact = float((p.exp() * (p - q)).sum())
        full, rest = metrics.position_kl(dict(enumerate(p.tolist())), dict(enumerate(q.tolist())))
        assert full == pytest.approx(exact, rel=1e-9, abs=1e-12) and rest == pytest.approx(0, abs=1e-12)
        k = 1 + trial % 10
        tp, tq = p.topk(k).indices.tolist(), q.topk(k).indices.tolist()
        target = trial % 40
        lb, rest = metrics.position_kl({t: float(p[t]) for t in {*tp, target}}, {t: float(q[t]) for t in {*tq, target}})
        known = {*tp, target} & {*tq, target}
        assert 0 <= lb <= exact + 1e-12
        assert rest == pytest.approx(1 - float(p[list(known)].exp().sum()), abs=1e-9)


def test_per_sample_counts_positions_like_the_emulation():
    ids = [5, 1, 2, 3]
    row = {"target": [-1.0, -2.0, -0.5], "top_ids": [[1, 7], [9, 2], [3, 4]], "top_logprobs": [[-1.0, -2.0]] * 3}
    arm = {"target": [-1.5, -2.0, -0.5], "top_ids": [[7, 1], [9, 2], [3, 4]], "top_logprobs": [[-1.0, -1.5]] * 3}
    s = metrics.per_sample(row, arm, ids)
    assert s["tokens"] == 3 and s["nll"] == pytest.approx(4.0) and s["top1"] == 2
    with pytest.raises(ValueError, match="positions"):
        metrics.per_sample(row, arm, ids + [1])
    assert metrics.continuation_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == {"prefix": 0.5, "identical": 0.0,
                                                                            "samples": 1}


# ------------------------------------------------------------------------------ end to end with the fake runner

@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """|K| beyond FP8's range. The fake engine refuses the default arm with vLLM's AVX2 message (as real vLLM
    does on this CPU) and runs the calibrated checkpoint through kvcalib's fake quantisation."""
    tmp = tmp_path_factory.mktemp("measured")
    src, data = save_model_and_data(tmp, k_beyond_fp8_model(), "model")
    ckpt = calibrate_small(src, data, tmp / "ckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(driver.RUNNER_ENV, str(FAKE))
        mp.setenv("FAKE_ENGINE", "refuse-default")
        res = run_eval(eval_config(src, data, tmp / "report", samples=8, scales=(str(ckpt),), engine=_spec(top_k=20)))
    return res, ckpt


def test_engine_reference_matches_the_emulation(measured):
    res, _ = measured
    ref = res.report["arms"][res.report["reference"]]
    assert ref["engine"]["status"] == "ok"
    for key in ("tokens", "ppl", "ppl_rel", "kl", "top1"):
        assert key in ref["summary"] and key in ref["engine"]["summary"]
    # a second code path (full forward + protocol + metrics) gives the emulation's reference perplexity
    assert ref["engine"]["summary"]["tokens"] == ref["summary"]["tokens"]
    assert ref["engine"]["summary"]["ppl"] == pytest.approx(ref["summary"]["ppl"], rel=1e-5)
    assert ref["engine"]["summary"]["kl"] == 0 and ref["engine"]["summary"]["top1"] == 1
    assert ref["engine"]["kv_capacity_tokens"] == 2 ** 30 // (3 * 2 * 2 * 16 * 4) // 16 * 16
    assert res.report["engine"]["version"] == "0.0-fake"


def test_a_refused_arm_is_not_run_with_the_engines_reason(measured):
    res, _ = measured
    default = res.report["arms"]["default"]
    assert default["engine"] == {"engine": "vllm", "version": "0.0-fake", "status": "not_run",
                                 "reason": "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."}
    assert default["summary"]["tokens"] > 0                       # the emulation still measured it
    md = (res.out / "report.md").read_text()
    assert "## Emulation vs engine" in md and "- `default`: not run: NotImplementedError: FP8 KV cache" in md
    # every sample emulated: one side-by-side table, and the arms table says its numbers are the emulation's
    assert "side by side are over the 8 samples both measured" in md and "| arm | samples |" not in md
    assert "Emulated numbers, over the 8 samples the emulation measured" in md


def test_engine_numbers_decide_where_the_engine_ran(measured):
    res, ckpt = measured
    arms, v = res.report["arms"], res.verdict
    cal, default = arms[f"calibrated:{ckpt}"], arms["default"]
    assert cal["engine"]["status"] == "ok"
    # the same quantisation in both paths: the same perplexity, and KL's lower bound below the exact KL
    assert cal["engine"]["summary"]["ppl"] == pytest.approx(cal["summary"]["ppl"], rel=1e-3)
    assert 0 < cal["engine"]["summary"]["kl"] <= cal["summary"]["kl"] * 1.001
    assert 0 <= cal["engine"]["summary"]["kl_unresolved_mass"] < 1
    assert cal["engine"]["summary"]["greedy"]["samples"] == 8
    ref_cap = arms[res.report["reference"]]["engine"]["kv_capacity_tokens"]
    assert cal["engine"]["kv_capacity_tokens"] == pytest.approx(4 * ref_cap, rel=1e-4)   # fp8 vs fp32 elements
    assert v.numbers == {"default": "emulation", f"calibrated:{ckpt}": "engine"}
    assert v.action == "ship" and v.arm == f"calibrated:{ckpt}"
    assert "vllm 0.0-fake, KL a lower bound" in v.text
    assert "Decided on the engine's numbers where it ran; emulated numbers for `default`" in v.text
    assert "`default` saturates: layer" in v.text and v.saturated["default"]
    md = (res.out / "report.md").read_text()
    assert "KV-cache capacity measured by the engine" in md and "![engine_vs_emulation.png]" in md
    assert (res.out / "engine_vs_emulation.png").read_bytes().startswith(b"\x89PNG")


def test_a_crashing_or_hanging_engine_costs_only_its_arm(tmp_path, monkeypatch):
    src, _ = save_model_and_data(tmp_path, tiny_causal_lm("llama"), "model")
    req = {"protocol": 2, "arms": [{"name": "default", "model": str(src), "kv_cache_dtype": "fp8", "skip_layers": [],
                                    "scales": None}],
           "samples": [[1, 2, 3]], "continuation_tokens": 1, "passkey": [], "passkey_tokens": 1, "stop_token_ids": [],
           "top_k": 2, "kv_gib": 1, "max_model_len": 8, "dtype": "float32", "seed": 0, "chunk": 1}
    monkeypatch.setenv("FAKE_ENGINE", "crash")
    r = driver.run(_spec(), req)["arms"][0]
    assert r["status"] == "not_run" and r["reason"].startswith("runner exited with code 3")
    assert r["reason"].endswith("RuntimeError: fake engine crashed")
    monkeypatch.setenv("FAKE_ENGINE", "hang")
    r = driver.run(_spec(timeout=3), req)
    assert r == protocol.answer([protocol.not_run("timed out after 3 s", "vllm", "", 1)])


def test_an_unusable_engine_environment_is_one_line_before_any_work(tmp_path, token_data):
    r = CliRunner().invoke(main, ["eval", "--engine", "vllm", "--data", str(token_data), "--out", str(tmp_path / "o")],
                           env={"KVCALIB_VLLM_VENV": ""})
    assert r.exit_code != 0 and "--engine vllm needs --vllm-venv PATH" in r.output
    r = CliRunner().invoke(main, ["eval", "--engine", "vllm", "--vllm-venv", str(tmp_path), "--model", "x",
                                  "--data", str(token_data), "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and "no bin/python there" in r.output and "Traceback" not in r.output
    src, data = save_model_and_data(tmp_path, tiny_causal_lm("llama"), "model")
    r = CliRunner().invoke(main, ["eval", "--engine", "vllm", "--vllm-venv", str(VENV), "--model", str(src),
                                  "--data", str(data), "--out", str(tmp_path / "o")], env={"FAKE_ENGINE": "missing"})
    assert r.exit_code != 0 and r.output.strip().endswith("cannot run: ModuleNotFoundError: No module named 'vllm'")
    assert not (tmp_path / "o").exists()


def test_cli_engine_eval(tmp_path):
    src, data = save_model_and_data(tmp_path, tiny_causal_lm("llama"), "model")
    r = CliRunner().invoke(main, ["eval", "--model", str(src), "--data", str(data), "--buckets", "64", "--samples", "4",
                                  "--min-tokens", "8", "--no-plots", "--passkey-trials", "0", "--device", "cpu",
                                  "--engine", "vllm", "--engine-top-k", "5", "--out", str(tmp_path / "r")],
                           env={"KVCALIB_VLLM_VENV": str(VENV), "FAKE_ENGINE": "refuse"})
    assert r.exit_code == 0, r.output
    assert "eval vllm `fp32`: samples 4/4" in r.output
    assert "eval vllm `default`: samples 0/4 · prompts 0/0 · arm 2/2 · not run: NotImplementedError: FP8" in r.output
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["config"]["engine"]["top_k"] == 5 and doc["arms"]["fp32"]["engine"]["status"] == "ok"


# ------------------------------------------------------------------------------ honest verdicts

def _entry(kind="checkpoint", dtype="fp8_e4m3", **kw):
    return arm_metrics(kind, dtype, **kw)


def _engine(entry, **kw):
    """An engine entry (what calib/engine/run.py returns) holding `entry`'s buckets and summary."""
    d = entry.to_dict()
    return engine_numbers(status="ok", version="x", buckets=d["buckets"], summary={**d["summary"], **kw})


def test_int8_advice_says_which_engine_applies_it_never_vllms_fp8_flag():
    """Merged TensorRT-LLM runs INT8 KV at scale 1.0 (calib.recipe.support): the advice says so and names the build
    that applies calibrated INT8, never a plain `trtllm-serve`."""
    th = report.Thresholds()
    for e in (_entry(dtype="int8"), _entry(kind="stats", dtype="int8", granularity="head", source=None),
              _entry(kind="default", dtype="int8", source=None)):
        v = report.verdict(reference_metrics(), {"a": e}, th, "bf16")
        assert v.action == "ship" and "run at scale 1.0 by TensorRT-LLM 1.4" in v.text
        assert "--engine-version trtllm=pr18953" in v.text and "not served by vLLM" in v.text
        assert "--kv-cache-dtype" not in v.text
    v = report.verdict(reference_metrics(), {"a": _entry()}, th, "bf16")
    assert "vLLM: `--kv-cache-dtype fp8`" in v.text


def test_calibrated_within_noise_of_default_says_why():
    tokens = [100] * 6
    ref = reference_metrics(tokens, {"0": ([20.0, 3.0], [5.0, 1.0])})
    nll = [200.0, 210.0, 190.0, 205.0, 195.0, 200.0]
    results = {"default": _entry(kind="default", source=None, sample_nll=nll),
               "calibrated:ck": _entry(sample_nll=[x + (0.3 if i % 2 else -0.3) for i, x in enumerate(nll)]),
               "calibrated:far": _entry(sample_nll=[x + 5 for x in nll])}
    noise = honest.scales_within_noise(ref, results, tokens)
    assert [s["arm"] for s in noise["arms"]] == ["calibrated:ck"]
    assert "largest |K| 20, |V| 5 <= 448" in noise["text"] and "does not depend on the scale" in noise["text"]
    v = report.verdict(ref, results, report.Thresholds(), "bf16")
    assert v.scales_within_noise["arms"][0]["arm"] == "calibrated:ck" and noise["text"] in v.text


def test_skip_layers_are_recommended_only_when_the_engine_confirms():
    th = report.Thresholds()
    layers = {str(i): {"attn_rel_error": e, "k_saturated": 0, "v_saturated": 0} for i, e in enumerate([0.01] * 5 + [0.9])}
    base = _entry(kl=0.5, ppl_rel=0.2, ppl=12.0, layers=layers)
    trial = _entry(skip=[5])
    v = report.verdict(reference_metrics(), {"ck": base, "ck skip 5": trial}, th, "bf16")
    assert v.action == "skip_unconfirmed" and "unconfirmed" in v.text and "--kv-cache-dtype-skip-layers 5" in v.text
    eng_ok, eng_bad = _engine(trial), _engine(base)
    v = report.verdict(reference_metrics(engine={"status": "ok"}),
                       {"ck": replace(base, engine=eng_bad), "ck skip 5": replace(trial, engine=eng_ok)}, th, "bf16")
    assert v.action == "ship_with_skip" and "confirmed by the engine" in v.text
    worse = _engine(trial, ppl=13.0)
    ok, why = honest.skip_confirmed(replace(trial, engine=worse), replace(base, engine=eng_bad))
    assert not ok and "does not confirm the gain" in why
    assert math.isfinite(eng_ok.summary.ppl)


def test_implausible_engine_numbers_are_reported_and_never_ranked():
    """CPU vLLM 0.32 served fp8_per_token_head at perplexity 224,275 against 22.4 without a word: an engine arm that
    far off while its emulation is not is named, fails, and is never the arm shipped."""
    th = report.Thresholds()
    broken = _entry(ppl_rel=0.001)
    broken = replace(broken, engine=replace(_engine(broken, ppl=224275.0, ppl_rel=224275.0 / 22.4 - 1, kl=6.0),
                                            kv_cache_dtype="fp8", version="0.32.0"))
    fine = _entry(kl=0.002, ppl_rel=0.003)
    fine = replace(fine, engine=_engine(fine))
    why = honest.implausible(broken)
    assert why.startswith("engine output implausible for fp8 on vllm 0.32.0") and "x1.001e+04" in why
    assert honest.implausible(fine) is None
    assert report.failures(broken, reference_metrics(), th) == [why]
    v = report.verdict(reference_metrics(engine={"status": "ok"}), {"broken": broken, "fine": fine}, th, "bf16")
    assert v.arm == "fine" and "broken" not in v.within_threshold and why in v.text
    only = report.verdict(reference_metrics(engine={"status": "ok"}), {"broken": broken}, th, "bf16")
    assert only.action == "keep_reference" and only.arm is None


@pytest.mark.parametrize("engine_rel,engine_kl,emulated_rel,odd", [
    (0.5, 0.1, 0.4, False),           # a bad but believable arm
    (12.0, 0.5, 11.0, False),         # the emulation is as far off: the format is that bad, the engine is believed
    (0.01, 3.0, 0.01, True),          # KL past ln 10 nats
    (12.0, 0.5, 0.02, True),
])
def test_the_implausibility_bound(engine_rel, engine_kl, emulated_rel, odd):
    e = _entry(ppl_rel=emulated_rel)
    e = replace(e, engine=_engine(e, ppl_rel=engine_rel, kl=engine_kl, ppl=10.0 * (1 + engine_rel)))
    assert (honest.implausible(e) is not None) is odd
