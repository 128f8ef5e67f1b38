"""Exit codes a pipeline can gate on (calib/errors.py) and the one summary.json per command (calib/summary.py), on
tiny models through the command line: ship exits 0, keep BF16 exits 3, a kvcalib error 1, a usage error 2, an
interrupt 130; each summary has the same keys, its decision agrees with the command's own report, and its serve
command is the one the command printed. validate's summary is checked beside its own tests
(tests/validate/test_validate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from calib.cli import main
from calib.safety.outputs import marker_files
from tiny import random_sequences, tiny_causal_lm

KEYS = ["schema", "command", "decision", "serve_command", "headline", "outputs"]


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _summary(folder: Path, command: str) -> dict:
    doc = json.loads((folder / "summary.json").read_text())
    assert list(doc) == KEYS and doc["schema"] == "kvcalib.summary/1" and doc["command"] == command
    assert "summary.json" in marker_files(folder)           # ours: a later --force replaces the folder whole
    assert doc["outputs"]["folder"] == str(folder)
    return doc


@pytest.fixture(scope="module")
def saturating(tmp_path_factory):
    """A model whose |K| reaches ~6000 (scale 1.0 saturates FP8) and a calibrated checkpoint of it."""
    tmp = tmp_path_factory.mktemp("summary")
    src = tmp / "model"
    tiny_causal_lm("llama", scale_k=6000.0).save_pretrained(src)
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(40, lo=20, hi=70, seed=1)))
    held = tmp / "held.jsonl"
    held.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(20, lo=20, hi=70, seed=2)))
    cal = tmp / "cal"
    r = _run("calibrate", "--model", src, "--data", data, "--out", cal, "--seq-len", 40, "--samples", 12,
             "--device", "cpu")
    assert r.exit_code == 0, r.output
    return tmp, src, data, held, cal, r


def test_calibrate_summary_has_no_decision_and_the_printed_serve_command(saturating):
    _, src, _, _, cal, r = saturating
    doc = _summary(cal, "calibrate")
    assert doc["decision"] is None
    assert doc["serve_command"] == f"vllm serve {cal} --kv-cache-dtype fp8" and f"  {doc['serve_command']}" in r.output
    prov = json.loads((cal / "kvcalib.json").read_text())
    h = doc["headline"]
    assert (h["targets"], h["kv_cache_dtype"], h["samples"], h["tokens"]) == \
        (["vllm"], "fp8_e4m3", prov["data"]["samples"], prov["data"]["tokens"])
    assert doc["outputs"]["checkpoint"] == "." and (cal / doc["outputs"]["provenance"]).is_file()


def _eval(src, data, cal, out, *bar):
    return _run("eval", "--model", src, "--data", data, "--scales", cal, "--buckets", 64, "--samples", 6,
                "--passkey-trials", 0, "--no-plots", "--no-progress", "--device", "cpu", "--out", out, *bar)


def test_eval_that_ships_exits_0_and_its_summary_serves_the_arm(saturating, tmp_path):
    _, src, _, held, cal, _ = saturating
    r = _eval(src, held, cal, tmp_path / "ev", "--max-kl", 1, "--max-ppl-increase", 1)
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    v = report["verdict"]
    doc = _summary(tmp_path / "ev", "eval")
    assert v["action"] == "ship" and doc["decision"] == "ship" and doc["headline"]["arm"] == v["arm"]
    served = cal if v["arm"] == f"calibrated:{cal}" else src
    assert doc["serve_command"] == f"vllm serve {served} --kv-cache-dtype fp8"
    summ = report["arms"][v["arm"]]["summary"]
    assert doc["headline"]["max_bucket_kl"] == pytest.approx(summ["max_bucket_kl"])
    assert doc["headline"]["ppl_rel"] == pytest.approx(summ["ppl_rel"]) and doc["headline"]["numbers"] == "emulation"


def test_eval_that_keeps_the_reference_exits_3_and_a_forced_rerun_replaces_it(saturating, tmp_path):
    _, src, _, held, cal, _ = saturating
    for _ in range(2):                     # the second run replaces the first (summary.json included) with --force
        r = _eval(src, held, cal, tmp_path / "ev", "--max-kl", 0, "--max-ppl-increase", 0, "--max-skip", 0, "--force")
        assert r.exit_code == 3, r.output
    assert json.loads((tmp_path / "ev" / "report.json").read_text())["verdict"]["action"] == "keep_reference"
    doc = _summary(tmp_path / "ev", "eval")
    assert doc["decision"] == "keep_reference" and doc["serve_command"] == f"vllm serve {src}"


def _tune(src, data, held, out, *bar):
    return _run("tune", "--model", src, "--data", data, "--eval-data", held, "--out", out, "--observers", "absmax",
                "--headrooms", "1.0", "--samples", 8, "--seq-len", 32, "--eval-samples", 4, "--buckets", "16,32",
                "--max-skip", 0, "--no-plots", "--no-progress", "--device", "cpu", *bar)


def test_tune_ships_0_and_keeps_3(saturating, tmp_path):
    _, src, data, held, _, _ = saturating
    r = _tune(src, data, held, tmp_path / "ship", "--max-kl", 1, "--max-ppl-increase", 1)
    assert r.exit_code == 0, r.output
    tune = json.loads((tmp_path / "ship" / "tune.json").read_text())
    assert tune["schema"] == "kvcalib.tune/1"
    doc = _summary(tmp_path / "ship", "tune")
    assert doc["decision"] == "ship" and doc["headline"]["candidate"] == tune["choice"]["candidate"]
    assert doc["serve_command"] == tune["choice"]["serve"] and f"  {doc['serve_command']}" in r.output
    assert doc["headline"]["scored"] == sum(1 for c in tune["candidates"] if c["scored"])

    r = _tune(src, data, held, tmp_path / "keep", "--max-kl", 0, "--max-ppl-increase", 0)
    assert r.exit_code == 3, r.output
    doc = _summary(tmp_path / "keep", "tune")
    assert doc["decision"] == "keep_reference" and doc["serve_command"] == f"vllm serve {src}"
    assert doc["outputs"]["checkpoint"] is None


@pytest.mark.parametrize("bar, code", [("{max_kl: 1.0, max_ppl_increase: 1.0}", 0), ("{max_kl: 0, max_ppl_increase: 0}", 3)])
def test_plan_exits_0_when_a_route_serves_fp8_and_3_when_every_route_keeps_bf16(saturating, tmp_path, bar, code):
    _, src, _, held, _, _ = saturating
    routes = tmp_path / "routes.yaml"
    routes.write_text(f"routes:\n  chat: {{data: {held}, buckets: [64], samples: 4, bar: {bar}}}\n")
    r = _run("plan", "--routes", routes, "--model", src, "--device", "cpu", "--max-skip", 0, "--passkey-trials", 0,
             "--no-plots", "--no-progress", "--out", tmp_path / "p")
    assert r.exit_code == code, r.output
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert plan["schema"] == "kvcalib.plan/1"
    doc = _summary(tmp_path / "p", "plan")
    chat = plan["routes"]["chat"]
    assert doc["decision"] == ("ship" if code == 0 else "keep_reference") and chat["decision"] == ("fp8" if code == 0
                                                                                                   else "bf16")
    assert doc["serve_command"] == chat["serve"] and doc["headline"]["routes"]["chat"]["decision"] == chat["decision"]


def test_errors_exit_1_usage_errors_2_and_interrupts_130(saturating, tmp_path, monkeypatch):
    _, src, _, held, cal, _ = saturating
    r = _run("eval", "--model", tmp_path / "none", "--out", tmp_path / "e")
    assert r.exit_code == 1 and r.output.startswith("Error: ") and len(r.output.splitlines()) == 1, r.output
    r = _run("eval", "--bogus")
    assert r.exit_code == 2 and "No such option" in r.output and "--bogus" in r.output
    from calib.evaluation import run as run_mod

    for raised, code in ((KeyboardInterrupt(), 130), (KeyboardInterrupt("signal 15"), 143)):
        def interrupted(*a, raised=raised, **k):
            raise raised
        monkeypatch.setattr(run_mod, "run_eval", interrupted)
        r = _eval(src, held, cal, tmp_path / "i")
        assert r.exit_code == code and r.output.strip().endswith("Aborted."), r.output
        assert not (tmp_path / "i").exists()
