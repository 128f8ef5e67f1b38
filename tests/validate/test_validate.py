"""`kvcalib validate` end to end with the fake engine runner (tests/fake_vllm_runner.py: transformers, a
simulated serving clock): quality from the evaluation, serving per serve configuration, arms that differ
only in scales sharing one measurement, go / no-go by the stated rule, bad options as one line with nothing
written. The real engine's serving phase is tested in tests/engine/test_vllm_serving.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from calib.cli import main
from calib.engine import driver
from helpers import calibrate_small, save_model_and_data
from tiny import tiny_causal_lm

FAKE = Path(__file__).resolve().parents[1] / "fake_vllm_runner.py"
VENV = Path(sys.executable).parent.parent


@pytest.fixture(autouse=True)
def fake_runner(monkeypatch):
    monkeypatch.setenv(driver.RUNNER_ENV, str(FAKE))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validate")
    src, data = save_model_and_data(tmp, tiny_causal_lm("llama"), "model")
    return src, data, calibrate_small(src, data, tmp / "ckpt")


def _args(model, out, *extra):
    src, data, ckpt = model
    return ["validate", "--model", str(src), "--data", str(data), "--scales", str(ckpt), "--buckets", "32,64",
            "--samples", "6", "--min-tokens", "8", "--device", "cpu", "--concurrency", "2", "--output-tokens", "4",
            "--max-kl", "1", "--max-ppl-increase", "1", "--no-progress", "--out", str(out), *extra]


def _run(args, **env):
    return CliRunner().invoke(main, args, env={"KVCALIB_VLLM_VENV": str(VENV), "FAKE_ENGINE": "fp8",
                                               "FAKE_SERVING": "", **env})


@pytest.fixture(scope="module")
def served(model, tmp_path_factory):
    """Every arm within a wide bar, nothing preempted: each arm goes."""
    out = tmp_path_factory.mktemp("served") / "v"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(driver.RUNNER_ENV, str(FAKE))
        r = _run(_args(model, out))
    assert r.exit_code == 0, r.output
    return r, out, json.loads((out / "validate.json").read_text())


@pytest.fixture(scope="module")
def strict(model, tmp_path_factory):
    """A zero KL bar and FP8 runs that report preemptions: the FP8 arms miss both halves of the rule."""
    out = tmp_path_factory.mktemp("strict") / "v"
    args = _args(model, out, "--no-plots", "--max-skip", "0")
    args[args.index("--max-kl") + 1] = "0"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(driver.RUNNER_ENV, str(FAKE))
        r = _run(args, FAKE_SERVING="preempt")
    assert r.exit_code == 0, r.output
    return out, json.loads((out / "validate.json").read_text())


def test_validate_reports_quality_and_speed_per_arm(served):
    r, out, doc = served
    assert {"validate.md", "validate.json", "validate.png", "eval"} <= {p.name for p in out.iterdir()}
    assert (out / "eval" / "report.json").is_file()
    arms = doc["arms"]
    ref, default = doc["reference"], arms["default"]
    ckpt = [a for n, a in arms.items() if n not in (ref, "default")]
    assert len(arms) == 3 and len(ckpt) == 1, list(arms)
    ckpt = ckpt[0]
    assert doc["device"] == "CPU" and doc["concurrency"] == 2 and "no preemption and no out-of-memory" in doc["rule"]
    # the reference and the default arm are timed; the checkpoint (same KV dtype, no skips) shares default's
    assert arms[ref]["serving"]["status"] == "ok" and arms[ref]["serving"]["config"] == "kv=auto skip=[]"
    assert default["serving"]["status"] == "ok" and default["serving"]["measured_by"] == "default"
    assert ckpt["serving"] == {"status": "shared", "config": "kv=fp8 skip=[]", "shared_with": "default"}
    assert ckpt["serving_shown"] == default["serving"]
    for b in ("32", "64"):
        g = default["serving"]["buckets"][b]
        assert g["requests"] == g["completed"] == 4 and g["output_tokens"] == 16 and g["max_running"] == 2
        # the fake clock: decode steps of 3 ms with FP8, 4 ms with the model dtype
        assert g["tpot_s"]["p50"] == pytest.approx(0.003)
        assert arms[ref]["serving"]["buckets"][b]["tpot_s"]["p50"] == pytest.approx(0.004)
    # quality comes from the evaluation unchanged
    ev = json.loads((out / "eval" / "report.json").read_text())
    assert default["quality"]["summary"]["ppl"] == pytest.approx(ev["arms"]["default"]["engine"]["summary"]["ppl"])
    assert default["quality"]["source"] == "engine"
    assert all(a["decision"] == "go" for a in arms.values()), {n: a["why"] for n, a in arms.items()}
    md = (out / "validate.md").read_text()
    assert "Speed measured on **CPU**" in md and "shares `default`'s measurement" in md
    assert "TPOT p50/p90/p99" in md and "**Rule.**" in md
    assert "default: go" in r.output


def test_a_quality_miss_or_preemption_is_no_go_with_failure_samples(strict):
    out, doc = strict
    default, ref = doc["arms"]["default"], doc["arms"][doc["reference"]]
    assert default["decision"] == "no-go" and "quality: KL" in default["why"]
    assert "speed: 2 preemption(s) at concurrency 2" in default["why"]
    assert ref["decision"] == "go"
    md = (out / "validate.md").read_text()
    assert "## Failure samples" in md and "text before:" in md
    assert not (out / "validate.png").exists()


@pytest.mark.parametrize("extra, message", [
    (["--concurrency", "0"], "--concurrency 0"),
    (["--output-tokens", "1"], "--output-tokens 1"),
    (["--requests", "-1"], "--requests -1"),
    (["--engine-kv-gib", "0"], "--engine-kv-gib"),
    (["--buckets", "x"], "--buckets 'x'"),
    (["--formats", "fp9"], "--formats 'fp9'"),
    (["--budget-minutes", "0"], "--budget-minutes 0"),
    (["--emulate-up-to", "-5"], "--emulate-up-to"),
])
def test_bad_options_are_one_line_and_nothing_is_written(model, tmp_path, extra, message):
    r = _run(_args(model, tmp_path / "bad", *extra))
    assert r.exit_code != 0 and message in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "bad").exists()


def test_validate_needs_the_engine(model, tmp_path):
    r = CliRunner().invoke(main, _args(model, tmp_path / "n"), env={"KVCALIB_VLLM_VENV": ""})
    assert r.exit_code != 0 and "--vllm-venv" in r.output and not (tmp_path / "n").exists()


def test_speed_against_the_reference_at_the_longest_bucket(served):
    """Each arm's TTFT / TPOT p50 over the reference's at the longest bucket both served (the fake clock: FP8
    decode steps 3 ms, the model dtype's 4 ms)."""
    _, out, doc = served
    ref = doc["arms"][doc["reference"]]["serving"]["buckets"]["64"]
    default = doc["arms"]["default"]
    v = default["vs_reference"]
    assert v["bucket"] == 64 and v["tpot"] == pytest.approx(0.75)
    assert v["ttft"] == pytest.approx(default["serving"]["buckets"]["64"]["ttft_s"]["p50"] / ref["ttft_s"]["p50"])
    md = (out / "validate.md").read_text()
    assert "## Speed against the reference" in md and "| `default` | <= 64 |" in md and "0.75x" in md


def test_a_go_arm_that_serves_far_slower_than_the_reference_is_named():
    """The H200 case: a dynamic per-token-head cache within the bar at 7.7x the reference's TTFT."""
    from calib.validate import report as vreport

    def served_at(ttft, tpot):
        return {"buckets": {"32768": {"ttft_s": {"p50": ttft}, "tpot_s": {"p50": tpot}}}}

    ref = served_at(1.82, 0.0455)
    fast, slow = served_at(1.78, 0.0363), served_at(14.0, 0.185)
    assert vreport.vs_reference(ref, slow, [8192, 32768]) == pytest.approx(
        {"bucket": 32768, "ttft": 14.0 / 1.82, "tpot": 0.185 / 0.0455})
    assert vreport.vs_reference(ref, None, [32768]) is None
    assert vreport.vs_reference(ref, {"buckets": {"8192": {}}}, [8192, 32768]) is None
    doc = {"reference": "bf16", "arms": {
        "bf16": {"decision": "go", "vs_reference": vreport.vs_reference(ref, ref, [32768])},
        "default": {"decision": "go", "vs_reference": vreport.vs_reference(ref, fast, [32768])},
        "int8_per_token_head": {"decision": "go", "vs_reference": vreport.vs_reference(ref, slow, [32768])},
        "fp8_e5m2": {"decision": "not run", "vs_reference": vreport.vs_reference(ref, slow, [32768])}}}
    assert vreport.slow_lines(doc) == [
        "- `int8_per_token_head` is within the bar but serves at 7.7x the reference's TTFT (p50) and 4.1x the "
        "reference's TPOT (p50) at <= 32768 tokens."]


def test_a_hybrid_models_capacity_is_the_engines_context_count_beside_its_pool():
    """The H100 run of a Gemma-3-4B-shaped model: the pool (52,428 blocks x 16) counts one group's blocks; the
    engine's own capacity at max_model_len 32,800 is 200,330 tokens. The cell says both; a model whose two numbers
    agree shows one."""
    from calib.validate import report as vreport

    hybrid = {"kv_capacity_tokens": 838848, "kv_context_tokens": 200330, "kv_context_max_model_len": 32800}
    assert vreport._capacity(hybrid) == "200,330 at max_model_len 32,800 (pool 838,848: one group's blocks)"
    assert vreport._capacity({**hybrid, "kv_context_tokens": 838848}) == "838,848"
    assert vreport._capacity({"kv_capacity_tokens": 4096}) == "4,096"
