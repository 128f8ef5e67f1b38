"""Progress lines: counts, rate and time left follow the work done; an evaluation reports every pass."""

from __future__ import annotations

import json
import re

from click.testing import CliRunner

from calib.cli import main
from calib.evaluation.config import EvalConfig
from calib.evaluation.run import run_eval
from calib.progress import Progress, duration
from tiny import random_sequences, tiny_causal_lm


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_duration_formats():
    assert [duration(x) for x in (0, 42.4, 185, 3725)] == ["0s", "42s", "3m05s", "1h02m"]


def test_rate_and_time_left_follow_the_tokens_done():
    clock, lines = FakeClock(), []
    p = Progress(lines.append, every=5.0, clock=clock)
    with p.stage("emulation", 1000, samples=10, arms=2) as st:
        clock.t += 2.0
        st.advance(200, {"bucket": "bucket <= 512"}, samples=2, arms=1)   # within the throttle: no line
        clock.t += 3.0
        st.advance(300, samples=5, arms=2)                                 # 500 tokens in 5 s
        clock.t += 5.0
        st.advance(500, samples=10, arms=2)
    assert lines[0] == "eval emulation: samples 0/10 · arms 0/2"
    assert len(lines) == 4
    assert lines[1] == "eval emulation: samples 5/10 · arms 2/2 · bucket <= 512 · 100 tok/s · 5s left"
    assert lines[2].endswith("100 tok/s · 0s left")
    assert lines[3] == "eval emulation: samples 10/10 · arms 2/2 · bucket <= 512 · 100 tok/s · done in 10s"


def test_start_up_before_the_first_tokens_does_not_count_against_the_rate():
    clock, lines = FakeClock(), []
    with Progress(lines.append, every=0.0, clock=clock).stage("vllm `bf16`", 300, samples=3) as st:
        clock.t += 60.0                                   # the engine starts: no tokens for a minute
        st.advance(100, samples=1)
        clock.t += 2.0
        st.advance(100, samples=2)
    assert lines[2] == "eval vllm `bf16`: samples 2/3 · 50 tok/s · 2s left"


def test_silent_progress_writes_nothing_and_errors_leave_no_final_line():
    Progress(None).stage("x", 10).advance(10)
    lines = []
    try:
        with Progress(lines.append, every=0.0, clock=FakeClock()).stage("x", 10):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert lines == ["eval x: starting"]


def _model(tmp_path):
    tiny_causal_lm("llama").save_pretrained(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(12, lo=10, hi=40, seed=2)))
    return tmp_path / "m", data


def test_an_evaluation_reports_every_forward_pass(tmp_path):
    src, data = _model(tmp_path)
    lines = []
    cfg = EvalConfig(model=str(src), data=str(data), out=tmp_path / "r", buckets=(16, 64), samples=10,
                        min_tokens=8, batch_size=4, plots=False, passkey_trials=0)
    res = run_eval(cfg, progress=Progress(lines.append, every=0.0))
    tokens = res.report["data"]["tokens"]
    # 10 samples in 3 batches; per batch the reference then the default arm: a line each, plus the first one
    assert len(lines) == 1 + 3 * 2 + 1
    assert lines[0] == "eval emulation: samples 0/10 · arms 0/2"
    assert re.fullmatch(r"eval emulation: samples 10/10 · arms 2/2 · bucket <= 64 · [\d,]+ tok/s · done in \d+s",
                        lines[-1])
    assert all("bucket <= " in ln for ln in lines[1:])
    assert tokens > 0


def test_cli_progress_flag(tmp_path):
    src, data = _model(tmp_path)
    args = ["eval", "--model", str(src), "--data", str(data), "--buckets", "64", "--samples", "4", "--no-plots",
            "--passkey-trials", "0", "--device", "cpu", "--min-tokens", "8"]
    on = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "a")])
    off = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "b"), "--no-progress"])
    assert on.exit_code == 0 and off.exit_code == 0, on.output + off.output
    assert "eval emulation: samples 4/4" in on.output and "eval emulation" not in off.output
