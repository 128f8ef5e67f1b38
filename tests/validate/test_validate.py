"""`kvcalib validate` end to end with the fake engine runner (tests/fake_vllm_runner.py: quality with transformers)
and the fake server (tests/fake_vllm_cli.py: vLLM's capacity log lines, a simulated serving clock): quality from
the evaluation, one sweep per serve configuration (arms that differ only in scales share one), the decision by
goodput at the SLO, bad options as one line with nothing written. The real server is tested in
tests/engine/test_vllm_serving.py."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from calib.cli import main
from calib.engine import driver
from calib.evaluation.markdown import relative
from calib.load import server
from calib.validate.report import markdown
from helpers import SAMPLE_TEXT, calibrate_small, train_tokenizer
from tiny import tiny_causal_lm

FAKE = Path(__file__).resolve().parents[1] / "fake_vllm_runner.py"
FAKE_CLI = Path(__file__).resolve().parents[1] / "fake_vllm_cli.py"
VENV = Path(sys.executable).parent.parent


@pytest.fixture(autouse=True)
def fake_runner(monkeypatch):
    monkeypatch.setenv(driver.RUNNER_ENV, str(FAKE))
    monkeypatch.setenv(server.CLI_ENV, str(FAKE_CLI))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("validate")
    tok = train_tokenizer()
    m = tiny_causal_lm("llama", vocab_size=len(tok), max_position_embeddings=256)
    m.save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    return tmp / "model", SAMPLE_TEXT, calibrate_small(tmp / "model", SAMPLE_TEXT, tmp / "ckpt")


def _args(model, out, *extra):
    src, data, ckpt = model
    return ["validate", "--model", str(src), "--data", str(data), "--scales", str(ckpt), "--buckets", "32,64",
            "--samples", "6", "--pack", "--min-tokens", "8", "--passkey-trials", "0", "--device", "cpu", "--output-tokens", "4",
            "--max-concurrency", "8", "--max-kl", "1", "--max-ppl-increase", "1", "--no-progress", "--out", str(out),
            *extra]


def _run(args, **env):
    return CliRunner().invoke(main, args, env={"KVCALIB_VLLM_VENV": str(VENV), "FAKE_ENGINE": "fp8", **env})


# A pool of 170 tokens for the model dtype (1 GiB over this many bytes a token): 2 requests of the longest bucket
# (64 + 4 output + 16 margin = 84 tokens) fit with BF16 KV, 4 with FP8 — the batch is memory-bound.
TIGHT = str((1 << 30) // 170)


def _validate(model, tmp_path_factory, name, *extra, **env):
    out = tmp_path_factory.mktemp(name) / "v"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(driver.RUNNER_ENV, str(FAKE))
        mp.setenv(server.CLI_ENV, str(FAKE_CLI))
        r = _run(_args(model, out, *extra), **env)
    doc = json.loads((out / "validate.json").read_text())
    rec = doc["decision"]["overall"]["recommended"]
    # exit 0 only where a quantized arm is recommended: 3 when BF16 stays or nothing was measured (calib/errors.py)
    assert r.exit_code == (0 if rec not in (None, doc["reference"]) else 3), r.output
    summary = json.loads((out / "summary.json").read_text())        # calib/summary.py: one shape per command
    assert (summary["schema"], summary["command"], summary["headline"]["recommended"]) == \
        ("kvcalib.summary/1", "validate", rec)
    assert summary["decision"] == ("none" if rec is None else "keep_reference" if rec == doc["reference"] else "ship")
    assert summary["serve_command"] == doc["recommended_command"]
    return r, out, doc


@pytest.fixture(scope="module")
def roomy(model, tmp_path_factory):
    """A pool far larger than any batch: FP8's capacity cannot show and its 5 % slower steps decide."""
    return _validate(model, tmp_path_factory, "roomy")


@pytest.fixture(scope="module")
def tight(model, tmp_path_factory):
    return _validate(model, tmp_path_factory, "tight", "--no-plots", FAKE_BYTES_PER_TOKEN=TIGHT)


def test_a_sweep_per_serve_configuration_and_the_engines_capacity(roomy):
    r, out, doc = roomy
    assert {"validate.md", "validate.json", "validate.png", "eval"} <= {p.name for p in out.iterdir()}
    assert doc["schema"] == "kvcalib.validate/2" and doc["device"] == "CPU"
    ref = doc["reference"]
    ckpt = next(n for n in doc["arms"] if n not in (ref, "default"))
    # two serve configurations: the model dtype, and FP8 (the default arm and the checkpoint share it)
    assert [c["arms"] for c in doc["configs"]] == [[ref], ["default", ckpt]]
    assert doc["configs"][1]["flags"] == ["--kv-cache-dtype", "fp8"] and doc["configs"][0]["flags"] == []
    assert doc["arms"][ckpt]["shares_sweep_of"] == "default"
    for c in doc["configs"]:
        for b, e in c["buckets"].items():
            assert e["status"] == "ok", e
            length = e["max_model_len"]
            assert length == int(b) + 4 + 16
            pool = (1 << 30) // (1000 if c["flags"] == [] else 500)
            assert e["capacity"]["requests_fit"] == pool // length         # the engine's logged count
            assert [x["level"] for x in e["levels"]] == [1, 2, 4, 8] and e["repeat"]["level"] == e["best"]["level"]
            for x in e["levels"]:
                assert x["requests"] == x["completed"] == x["good"] == max(8, 2 * x["level"])
                assert x["goodput"] == pytest.approx(x["good"] / x["duration_s"])


def test_fp8_that_only_adds_work_keeps_bf16_and_says_so(roomy):
    r, out, doc = roomy
    overall = doc["decision"]["overall"]
    assert overall["recommended"] == doc["reference"] and "buys nothing" in overall["why"]
    assert r.exit_code == 3
    assert doc["arms"]["default"]["decision"] in ("no gain", "dominated")
    for b in ("32", "64"):
        assert doc["arms"]["default"]["buckets"][b]["vs_reference"] == pytest.approx(1 / 1.05, rel=0.02)
    md = (out / "validate.md").read_text()
    rows = _lead(md, doc)
    assert rows[2].startswith("| FP32 KV (reference) | **recommended** | reference | 1.00x (") and \
        rows[2].endswith(" requests, engine's count) | 1.00x |")                 # the tiny model is FP32 itself
    assert md.splitlines()[2].startswith("**Keep FP32 KV**: FP8 KV buys nothing for this workload")
    assert "TTFT <= 2000 ms and TPOT <= 100 ms" in md and "## The sweep per serve configuration" in md
    assert "decision: " in r.output and "buys nothing" in r.output


def test_when_the_pool_binds_fp8_serves_more_and_the_better_scales_are_recommended(tight):
    r, out, doc = tight
    assert r.exit_code == 0
    ref = doc["reference"]
    ckpt = next(n for n in doc["arms"] if n not in (ref, "default"))
    fits = {n: a["buckets"]["64"]["capacity"] for n, a in doc["arms"].items()}
    assert fits == {ref: 2, "default": 4, ckpt: 4}
    # kvcalib's bytes model beside it (its own number: the fake engine's bytes a token are not the model's)
    model_fit = {n: a["buckets"]["64"]["capacity_bytes_model"] for n, a in doc["arms"].items()}
    assert model_fit["default"] == model_fit[ckpt] >= 2 * model_fit[ref] > 0
    overall = doc["decision"]["overall"]
    ratio = overall["goodput_vs_reference"]
    assert ratio["default"] == ratio[ckpt] > 1.1            # one sweep: the same goodput
    # equal capacity and goodput: the better quality of the two stands, the other is dominated by it
    q = {n: doc["arms"][n]["quality"]["summary"]["ppl_rel"] for n in ("default", ckpt)}
    best, other = sorted(q, key=lambda n: (q[n], n != "default"))
    assert overall["recommended"] == best and overall["dominated"][other] == best
    assert doc["arms"][best]["decision"] == "recommended" and doc["arms"][other]["decision"] == "dominated"
    assert doc["recommended_command"].endswith("--kv-cache-dtype fp8")
    assert f"serve: vllm serve" in r.output
    rows = _lead((out / "validate.md").read_text(), doc)
    fits = doc["arms"][best]["buckets"]["64"]["capacity"]
    assert rows[2] == (f"| `{relative(best)}` | **recommended** | KL {_worst_kl(doc, best):.3g} <= 1, Δppl "
                       f"{100 * q[best]:+.2f}% <= +100% (engine) | 2.00x ({fits:,} requests, engine's count) | "
                       f"{ratio[best]:.2f}x |")
    # a BF16 model keeps BF16 KV by that name, never its FP32 CPU reference's
    md = markdown({**doc, "serving_dtype": "bfloat16", "decision": {**doc["decision"], "overall": {
        **overall, "recommended": doc["reference"]}}})
    assert md.splitlines()[2].startswith("**Keep BF16 KV**: ") and "FP32 KV" not in md.split("## ", 1)[0]


def _worst_kl(doc, name):
    return max(b["kl"] for b in doc["arms"][name]["quality"]["buckets"].values())


def _lead(md: str, doc: dict) -> list[str]:
    """validate.md's opening checked: the title, the headline, the decision table (its rows returned) and the
    recommended serve command, relative to the user's folder; no absolute path anywhere."""
    lines = md.splitlines()
    assert lines[0] == f"# kvcalib validate: {relative(doc['model'])}" and lines[1] == ""
    rows = lines[4:4 + 2 + len(doc["arms"])]
    dtype = "FP32" if doc["serving_dtype"] == "float32" else "BF16"
    assert rows[0] == (f"| arm | decision | quality (worst-bucket KL <= 1, Δppl <= +100%) | KV capacity vs {dtype} at "
                       f"<= {doc['buckets'][-1]} tokens | speed (goodput at the SLO vs {dtype}) |")
    rec = doc["recommended_command"]
    if rec:
        assert lines[4 + 2 + len(doc["arms"]):][:4] == ["", "```", relative(rec), "```"]
        assert rec == doc["arms"][doc["decision"]["overall"]["recommended"]]["serve_command"]
    assert not re.findall(r"(?<![\w.~/-])/[\w.-]+/", md)            # relative: ../../tmp/..., never /tmp/...
    return rows


def test_a_server_that_does_not_start_is_not_measured_and_nothing_is_recommended(model, tmp_path_factory):
    r, out, doc = _validate(model, tmp_path_factory, "dies", "--no-plots", "--buckets", "64", FAKE_SERVE="die")
    assert doc["decision"]["overall"]["recommended"] is None and r.exit_code == 3
    assert all(a["decision"] == "not measured" for a in doc["arms"].values())
    assert "fake engine refused to start" in doc["arms"]["default"]["why"]
    assert "recommended" not in {a["decision"] for a in doc["arms"].values()}


def test_a_sweep_that_fails_at_a_level_keeps_what_ran_and_says_so(model, tmp_path_factory):
    r, out, doc = _validate(model, tmp_path_factory, "fails", "--no-plots", "--buckets", "64", FAKE_BENCH_FAIL_AT="4")
    for c in doc["configs"]:
        e = c["buckets"]["64"]
        assert [x["level"] for x in e["levels"]] == [1, 2, 4] and e["levels"][-1]["status"] == "failed"
        assert "concurrency 4: vllm bench serve exited 1: aiohttp" in e["error"] and e["best"]["level"] in (1, 2)
    assert all("its sweep stopped early" in a["why"] for a in doc["arms"].values())
    assert "failed: vllm bench serve exited 1" in (out / "validate.md").read_text()


@pytest.mark.parametrize("extra, message", [
    (["--concurrency", "0"], "--concurrency = 0"),
    (["--concurrency", "2,x"], "--concurrency '2,x'"),
    (["--output-tokens", "1"], "--output-tokens = 1"),
    (["--slo-ttft-ms", "nan"], "--slo-ttft-ms = nan"),
    (["--slo-tpot-ms", "0"], "--slo-tpot-ms = 0"),
    (["--speed-noise", "2"], "--speed-noise = 2"),
    (["--sweep-minutes", "inf"], "--sweep-minutes = inf"),
    (["--engine-kv-gib", "0"], "--engine-kv-gib"),
    (["--buckets", "x"], "--buckets 'x'"),
    (["--formats", "fp9"], "--formats 'fp9'"),
    (["--budget-minutes", "0"], "--budget-minutes = 0"),
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
