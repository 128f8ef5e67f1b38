"""report.md opens with the decision: one headline line, one table (arm, decision, quality against the bar, KV
capacity, speed), the whole serve command from the one builder (calib.engine.command); paths relative to the
folder the command ran in; the reference named in the model's own dtype (BF16 from its config.json) even where it
was measured in FP32 (CPU); the per-layer tables last. From known numbers, and once through the command line on a
tiny BF16 model (its summary.json's serve command is the report's)."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from calib.cli import main
from calib.engine import command
from calib.engine.metrics import BucketRow, Summary
from calib.evaluation import report
from calib.evaluation.markdown import relative
from calib.evaluation.results import ArmInfo, ArmMetrics, KVRange, Reference, Seconds
from calib.evaluation.verdict import Thresholds, verdict
from tiny import random_sequences, tiny_causal_lm

ABSOLUTE = re.compile(r"(?<![\w.~/-])/[\w.-]+/")     # a path from the root: /tmp/..., /home/...


def _arm(name_source: str | None, ppl: float, kind: str = "default") -> ArmMetrics:
    row = BucketRow(2, 126, 0.004, 0.98, ppl, 10.0, ppl - 10.0, ppl / 10.0 - 1)
    info = ArmInfo(kind, "fp8_e4m3", "tensor", True, name_source, (), (), (),
                   {"k": {"0": 1.0}, "v": {"0": 1.0}, "q": {}})
    layers = {"0": {"k_saturated": 0.0, "k_flushed": 0.001, "k_snr_db": 30.0, "v_saturated": 0.0, "v_flushed": 0.0,
                    "v_snr_db": 31.0, "attn_rel_error": 0.01}}
    return ArmMetrics(info, {"64": row}, Summary(**row.to_dict(), max_bucket_kl=0.004), (141.0, 151.0), (0.2, 0.3),
                      layers, (), Seconds(2.0))


def _rep(model: Path, arms: dict[str, ArmMetrics], data: Path) -> report.Report:
    """A one-layer, one-bucket evaluation measured in float32 on CPU of a model whose config says bfloat16."""
    meta = {"model": str(model), "model_dtype": "float32", "device": "cpu", "layers": [0], "kv_heads": 2,
            "head_dim": 4, "data": {"source": str(data), "samples": 2, "tokens": 128,
                                    "held_out": {"checked_against": None, "note": "not checked"}},
            "buckets": [64], "notes": [], "reference": "fp32", "config": {"model": str(model), "data": str(data)}}
    ref_row = BucketRow(2, 126, 0.0, 1.0, 10.0, 10.0, 0.0, 0.0)
    ref = Reference({"64": ref_row}, Summary(**ref_row.to_dict(), max_bucket_kl=0.0), Seconds(1.0), (140.0, 150.0),
                    (63, 63), {"0": KVRange((3.0, 4.0), (1.0, 2.0))})
    return report.Report(meta, ref, arms, Thresholds(), verdict(ref, arms, Thresholds(), "fp32"))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """The user's folder (the working directory): a BF16 model and data inside it."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    (tmp_path / "d.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _decision_part(md: str) -> str:
    return md.split("## Verdict", 1)[0]


def _table(md: str) -> list[str]:
    lines = md.splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("|"))
    return lines[first:next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))]


def _serve_block(md: str) -> str:
    return md.split("```\n", 2)[1].rstrip("\n")


def test_a_kept_reference_is_named_bf16_with_its_serve_command_and_no_absolute_path(folder):
    rep = _rep(folder / "model", {"default": _arm(None, 10.2)}, folder / "d.jsonl")
    doc = report.write(folder / "out", rep, force=False, plots=False)
    md = (folder / "out" / "report.md").read_text()
    lines = md.splitlines()
    assert lines[0] == "# KV-cache evaluation: `model`"
    assert lines[2] == "**Keep BF16 KV**: no arm is within the quality bar (best: `default`, perplexity +2.00% > +1%)."
    assert _table(md) == [
        "| arm | decision | quality (worst-bucket KL <= 0.01, Δppl <= +1%) | KV capacity vs BF16 at 64 tokens | speed |",
        "|---|---|---|---|---|",
        "| BF16 KV (reference) | **recommended** | reference | – | not measured |",
        "| `default` | fails the quality bar | KL 0.004 <= 0.01, Δppl +2.00% > +1% (emulated) | – | not measured |"]
    # the whole command that serves the decision, from the one builder, the model relative to the user's folder
    assert _serve_block(md) == command.line("vllm", "model") == "vllm serve model"
    assert "FP32 KV" not in _decision_part(md) and "measured in FP32 (the CPU emulation runs float32)" in md
    assert not ABSOLUTE.findall(md) and str(folder) not in md and "`d.jsonl`" in md
    assert [x for x in lines if x.startswith("## ")][-1] == "## Per layer"          # per-layer detail last
    written = json.loads((folder / "out" / "report.json").read_text())
    assert written["schema"] == report.SCHEMA == "kvcalib.eval/1" and "kvcalib_eval" not in written
    assert written["serving_dtype"] == doc["serving_dtype"] == "bfloat16"
    assert written["model"] == str(folder / "model")                      # report.json keeps the path whole


def test_a_shipped_checkpoint_is_served_by_its_relative_folder(folder):
    ck = folder / "ck"
    name = f"calibrated:{ck}"
    rep = _rep(folder / "model", {"default": _arm(None, 10.2), name: _arm(str(ck), 10.05, "checkpoint")},
               folder / "d.jsonl")
    assert rep.verdict.action == "ship" and rep.verdict.arm == name
    report.write(folder / "out", rep, force=False, plots=False)
    md = (folder / "out" / "report.md").read_text()
    assert md.splitlines()[2] == "**Ship `calibrated:ck`**: fp8_e4m3 KV within the quality bar."
    rows = _table(md)
    assert rows[2] == "| `calibrated:ck` | **recommended** | KL 0.004 <= 0.01, Δppl +0.50% <= +1% (emulated) | – | " \
                      "not measured |"
    assert rows[3].startswith("| BF16 KV (reference) | reference |")
    assert rep.serve_argv() == command.argv("vllm", str(ck), "fp8_e4m3")
    assert _serve_block(md) == command.line("vllm", "ck", "fp8_e4m3") == "vllm serve ck --kv-cache-dtype fp8"
    assert not ABSOLUTE.findall(md) and str(folder) not in md
    # an FP32 model keeps FP32 by its own name, and no note about a CPU reference
    (folder / "model" / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    rep = replace(rep, arms={"default": _arm(None, 10.2)},
                  verdict=verdict(rep.reference, {"default": _arm(None, 10.2)}, Thresholds(), "fp32"))
    report.write(folder / "out2", rep, force=False, plots=False)
    md = (folder / "out2" / "report.md").read_text()
    assert md.splitlines()[2].startswith("**Keep FP32 KV**") and "CPU emulation" not in md


def test_eval_on_a_bf16_model_opens_with_the_summary_serve_command(tmp_path, monkeypatch):
    """Through the command line on CPU: the model is BF16, the reference measured in FP32."""
    monkeypatch.chdir(tmp_path)
    tiny_causal_lm("llama").to(torch.bfloat16).save_pretrained(tmp_path / "model")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(12, lo=40, hi=70, seed=3)))
    r = CliRunner().invoke(main, ["eval", "--model", str(tmp_path / "model"), "--data", str(data), "--buckets", "64",
                                  "--samples", "6", "--passkey-trials", "0", "--no-plots", "--no-progress",
                                  "--device", "cpu", "--out", str(tmp_path / "ev")])
    assert r.exit_code in (0, 3), r.output
    md = (tmp_path / "ev" / "report.md").read_text()
    doc = json.loads((tmp_path / "ev" / "report.json").read_text())
    summary = json.loads((tmp_path / "ev" / "summary.json").read_text())
    assert doc["reference"] == "fp32" and doc["serving_dtype"] == "bfloat16"
    head = md.splitlines()[2]
    assert head.startswith("**Ship `default`**" if r.exit_code == 0 else "**Keep BF16 KV**"), head
    assert _table(md)[0].startswith("| arm | decision | quality (worst-bucket KL <= 0.01, Δppl <= +1%) | "
                                    "KV capacity vs BF16 at 64 tokens | speed |")
    assert _serve_block(md) == summary["serve_command"].replace(str(tmp_path / "model"), "model")
    assert "FP32 KV" not in _decision_part(md) and not ABSOLUTE.findall(md) and str(tmp_path) not in md
    assert os.path.isabs(summary["serve_command"].split()[2])            # summary.json keeps the whole path


def test_relative_rewrites_paths_and_nothing_else():
    base = Path("/srv/work")
    assert relative("vllm serve /srv/work/ck --kv-cache-dtype fp8", base) == "vllm serve ck --kv-cache-dtype fp8"
    assert relative("vllm serve '/srv/work/a b/ck'", base) == "vllm serve 'a b/ck'"
    assert relative("`calibrated:/srv/ck@tensor` and /srv/work/d.jsonl.", base) == \
        "`calibrated:../ck@tensor` and d.jsonl."
    kept = "||o - ô|| / ||o||, req/s, K/V, 1/k_scale, https://github.com/org/repo, ![a.png](a.png), `<route>/r.md`"
    assert relative(kept, base) == kept
