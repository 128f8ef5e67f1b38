"""`kvcalib tune` on the command line: a run on a tiny model, and bad inputs as one-line errors, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from calib.cli import main
from tiny import random_sequences, tiny_causal_lm


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tunecli")
    tiny_causal_lm("llama").save_pretrained(tmp / "m")
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(40, lo=16, hi=40, seed=1)))
    (tmp / "held.jsonl").write_text("".join(json.dumps({"input_ids": s}) + "\n"
                                            for s in random_sequences(20, lo=16, hi=40, seed=2)))
    return tmp, tmp / "m", data


def _args(src: Path, data: Path, out: Path, *extra: str) -> list[str]:
    held = data.parent / "held.jsonl"
    return ["tune", "--model", str(src), "--data", str(data), "--eval-data", str(held), "--out", str(out),
            "--observers", "absmax", "--headrooms", "1.0", "--samples", "8", "--seq-len", "32", "--eval-samples", "4",
            "--buckets", "16,32", "--max-skip", "1", "--no-plots", "--no-progress", *extra]


def test_tune_command_writes_checkpoint_and_record(inputs, tmp_path):
    _, src, data = inputs
    out = tmp_path / "out"
    r = CliRunner().invoke(main, _args(src, data, out, "--max-kl", "1", "--max-ppl-increase", "1"))
    assert r.exit_code == 0, r.output
    assert "candidates scored" in r.output and f"vllm serve {out} --kv-cache-dtype fp8" in r.output
    doc = json.loads((out / "tune.json").read_text())
    assert doc["choice"]["candidate"] == "fp8/tensor/absmax/h1"        # every backend, no skip, simplest
    assert len(doc["candidates"]) == 4 + 1 and all(c["scored"] for c in doc["candidates"])
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 0, r.output


BAD = [
    (["--bogus"], "No such option '--bogus'"),
    (["--max-skip", "-1"], "--max-skip = -1: expected a whole number in [0, "),
    (["--max-skip", "65"], "--max-skip 65: give 0 to 64"),
    (["--max-skip", "3"], "--max-skip 3: the model has 3 layers"),
    (["--target", "trtllm", "--max-skip", "1"], "TensorRT-LLM applies one KV dtype to every layer"),
    (["--observers", "absmax,histogram"], "--observers: unknown observer 'histogram'"),
    (["--headrooms", "0.5"], "--headrooms: 0.5 must be a number >= 1"),
    (["--headrooms", "x"], "--headrooms 'x': give a comma list of numbers"),
    (["--budget-minutes", "0"], "--budget-minutes = 0.0: expected a finite number > 0 and <= 527040"),
    (["--budget-minutes", "inf"], "--budget-minutes = inf: expected a finite number > 0 and <= 527040"),
    (["--budget-minutes", "1e308"], "--budget-minutes = 1e+308: expected a finite number > 0 and <= 527040"),
    (["--buckets", "16,4096"], "--buckets 4096: longer than the context of MODEL"),
    (["--eval-samples", "99999999999"], "--eval-samples = 99999999999: expected a whole number in [1, 2147483648]"),
    (["--eval-samples", "0"], "--eval-samples = 0: expected a whole number in [1, "),
    (["--stats", "no-such.safetensors"], "--stats no-such.safetensors not found"),
    (["--stats-dir", "s", "--stats", "x"], "--stats-dir with --stats"),
    (["--emulate", "vllm-cpu", "--target", "trtllm", "--max-skip", "0"], "score TensorRT-LLM candidates with --emulate trtllm"),
    (["--emulate", "nope"], "'nope' is not one of 'vllm-cpu'"),    # one --emulate choice list, as eval's
    (["--engine", "vllm"], "--engine vllm needs --vllm-venv PATH"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_one_line_and_writes_nothing(inputs, tmp_path, monkeypatch, extra, message):
    _, src, data = inputs
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVCALIB_VLLM_VENV", raising=False)
    out = tmp_path / "out"
    args = _args(src, data, out)
    # a later option wins in click: the bad value is appended after the defaults above
    r = CliRunner().invoke(main, args + extra)
    assert r.exit_code != 0
    errors = [ln for ln in r.output.splitlines() if ln.startswith("Error")]
    assert len(errors) == 1 and message in errors[0], r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
