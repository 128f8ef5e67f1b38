"""A bucket as long as the model's context, in the emulation and the engine (here tests/fake_vllm_runner.py,
which refuses a prompt that leaves no room for one generated token, as vLLM does); a bucket beyond the
context is one error before any model loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from calib.cli import main
from calib.engine import driver
from calib.engine.driver import EngineSpec
from calib.evaluation import run as run_mod
from calib.evaluation.arms import EvalError
from calib.evaluation.run import run_eval
from calib.evaluation.samples import sample_length
from helpers import eval_config, save_model_and_data
from tiny import tiny_causal_lm

FAKE = Path(__file__).resolve().parents[1] / "fake_vllm_runner.py"
VENV = Path(sys.executable).parent.parent
CONTEXT = 64


@pytest.fixture(autouse=True)
def fake_runner(monkeypatch):
    monkeypatch.setenv(driver.RUNNER_ENV, str(FAKE))
    monkeypatch.setenv("FAKE_ENGINE", "fp8")


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ctx")
    return save_model_and_data(tmp, tiny_causal_lm("llama", max_position_embeddings=CONTEXT), "model")


def _spec() -> EngineSpec:
    return EngineSpec("vllm", VENV, top_k=8, continuation_tokens=4)


def test_the_fake_engine_refuses_a_prompt_as_long_as_max_model_len(short_model):
    """The control: without the cut, the full-context bucket would not run in the engine."""
    src, _ = short_model
    req = {"protocol": 2, "arms": [{"name": "fp32", "model": str(src), "kv_cache_dtype": "auto", "skip_layers": [],
                                    "scales": None}],
           "samples": [list(range(1, CONTEXT + 1))], "continuation_tokens": 4, "passkey": [], "passkey_tokens": 1,
           "stop_token_ids": [], "top_k": 2, "kv_gib": 1, "max_model_len": CONTEXT, "dtype": "float32", "seed": 0,
           "chunk": 1}
    r = driver.run(_spec(), req)["arms"][0]
    assert r["status"] == "not_run" and "(length 64) plus the number of requested output tokens" in r["reason"]


def test_sample_length_at_the_context():
    assert [sample_length(b, CONTEXT) for b in (16, 63, 64)] == [16, 63, 63]
    assert sample_length(8192, None) == 8192


def test_a_bucket_at_the_context_runs_in_the_engine_on_the_emulations_tokens(short_model, tmp_path):
    src, data = short_model
    cfg = eval_config(src, data, tmp_path / "r", samples=4, engine=_spec(), pack=True, plots=False)
    cfg = type(cfg)(**{**vars(cfg), "buckets": (32, CONTEXT)})
    res = run_eval(cfg)
    arms = res.report["arms"]
    ref = arms[res.report["reference"]]
    for entry in (ref, arms["default"]):
        assert entry["engine"]["status"] == "ok", entry["engine"]
        emu, eng = entry["buckets"][str(CONTEXT)], entry["engine"]["buckets"][str(CONTEXT)]
        # packed samples alternate 32 and 63 tokens: two of 63 land in the context's bucket, 62 scored each
        assert emu["samples"] == eng["samples"] == 2
        assert emu["tokens"] == eng["tokens"] == 2 * (CONTEXT - 2)
    assert ref["engine"]["summary"]["ppl"] == pytest.approx(ref["summary"]["ppl"], rel=1e-5)
    assert arms["default"]["engine"]["summary"]["ppl"] == pytest.approx(arms["default"]["summary"]["ppl"], rel=1e-3)
    # the engine generated what room was left after a 63-token sample in a 64-token max_model_len
    assert ref["engine"]["summary"]["greedy"]["samples"] == 4


def test_a_bucket_beyond_the_context_is_one_error_before_the_model_loads(short_model, tmp_path, monkeypatch):
    src, data = short_model

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(run_mod, "load_causal_lm", no_load)
    cfg = eval_config(src, data, tmp_path / "r", samples=4)
    cfg = type(cfg)(**{**vars(cfg), "buckets": (32, 128, 256)})
    with pytest.raises(EvalError) as e:
        run_eval(cfg)
    assert str(e.value) == (f"--buckets 128,256: longer than the context of MODEL {src} (64 tokens: "
                            "max_position_embeddings 64); use buckets of at most 64")
    r = CliRunner().invoke(main, ["eval", "--model", str(src), "--data", str(data), "--buckets", "32,128",
                                  "--out", str(tmp_path / "o")])
    assert r.exit_code != 0 and r.output.strip().splitlines() == [
        f"Error: --buckets 128: longer than the context of MODEL {src} (64 tokens: max_position_embeddings 64); "
        "use buckets of at most 64"]
    assert not (tmp_path / "o").exists()


def test_default_buckets_beyond_the_context_are_dropped_with_a_note(short_model, tmp_path):
    src, data = short_model
    r = CliRunner().invoke(main, ["eval", "--model", str(src), "--data", str(data), "--samples", "2", "--min-tokens",
                                  "8", "--no-plots", "--passkey-trials", "0", "--device", "cpu",
                                  "--out", str(tmp_path / "r")])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "r" / "report.json").read_text())
    assert doc["buckets"] == [CONTEXT]
    assert "buckets [512, 2048, 8192] exceed the model's context (64 tokens: max_position_embeddings 64): dropped" \
        in doc["notes"]
