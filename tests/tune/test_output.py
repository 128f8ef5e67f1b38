"""tune.md opens with the decision: one headline line, one table (the chosen candidate first, the reference, scale
1.0; quality against the bar, KV capacity, speed not measured) and the whole serve command — the chosen
checkpoint's (the target's builder), or the model as it is where nothing is chosen; the reference named in the
model's own dtype (BF16 from its config.json, whatever tune loaded it in); paths relative to the user's folder."""

from __future__ import annotations

import json
import re

import torch

from calib.engine import command
from calib.tune import output, run
from helpers import tune_config as _config
from helpers import tune_data as _data
from tiny import tiny_causal_lm

ABSOLUTE = re.compile(r"(?<![\w.~/-])/[\w.-]+/")


def _bf16_model(path, boost: float | None = None):
    """A tiny Llama saved in bfloat16 (logits sharpened like a trained model's); with `boost`, layer 1's K reaches
    ~boost (beyond FP8's 448 at scale 1.0) with the same attention pattern."""
    model = tiny_causal_lm("llama", num_hidden_layers=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
        if boost:
            attn = model.model.layers[1].self_attn
            attn.k_proj.weight.mul_(boost)
            attn.q_proj.weight.div_(boost / 60)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def _lines(md: str) -> tuple[list[str], list[str], str | None]:
    """(all lines, the first table, the first code block)."""
    lines = md.splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith("|"))
    end = next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))
    block = lines[end + 2] if lines[end + 1:end + 2] == ["```"] else None
    return lines, lines[first:end], block


def test_tune_md_opens_with_the_chosen_checkpoint_and_its_serve_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = _bf16_model(tmp_path / "m", boost=3000.0)
    res = run.run(_config(src, _data(tmp_path), tmp_path / "out", max_skip=0, observers=("absmax",)))
    doc = res.doc
    assert doc["serving_dtype"] == "bfloat16" and doc["kv_bytes_reference"] == 2 and res.chosen is not None
    md = (tmp_path / "out" / output.MD).read_text()
    lines, rows, block = _lines(md)
    row = res.chosen
    assert lines[0] == "# kvcalib tune: m for vllm"
    assert lines[2].startswith(f"**Ship `{row['name']}`**: {row['support']}; KV memory saved 50.0%")
    assert rows[0] == "| arm | decision | quality (worst-bucket KL <= 0.01, Δppl <= +1%) | KV capacity vs BF16 | speed |"
    s = row["summary"]
    assert rows[2] == (f"| `{row['name']}` | **recommended** | KL {s['max_bucket_kl']:.3g} <= 0.01, Δppl "
                       f"{100 * s['ppl_rel']:+.2f}% <= +1% (emulated) | 2.00x (bytes model) | not measured |")
    assert rows[3] == "| BF16 KV (reference) | reference | reference | 1.00x | not measured |"
    assert rows[4].startswith("| `default (scale 1.0)` | fails the quality bar | KL ")
    # the chosen checkpoint's serve command from the target's builder, the folder relative to the user's
    assert res.serve == command.line("vllm", str(tmp_path / "out"), "fp8_e4m3")
    assert block == command.line("vllm", "out", "fp8_e4m3") == "vllm serve out --kv-cache-dtype fp8"
    assert "FP32" not in md.split("## Candidates", 1)[0] and not ABSOLUTE.findall(md) and str(tmp_path) not in md
    assert "## Candidates" in md and f"| {row['name']} **(chosen)** |" in md


def test_tune_md_that_keeps_bf16_serves_the_model_as_it_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = _bf16_model(tmp_path / "m")
    res = run.run(_config(src, _data(tmp_path), tmp_path / "out", budget_minutes=1e-9))     # nothing scored
    assert res.chosen is None and res.headline.startswith("keep BF16 KV: nothing qualifies under the quality bar")
    md = (tmp_path / "out" / output.MD).read_text()
    lines, rows, block = _lines(md)
    assert lines[2] == "**Keep BF16 KV**: nothing qualifies under the quality bar (max KL 0.01, ppl +1%)."
    assert rows[2] == "| BF16 KV (reference) | **recommended** | reference | 1.00x | not measured |"
    assert block == command.line("vllm", "m") == "vllm serve m"
    summary = output.serve_line(res.doc)
    assert summary == command.line("vllm", str(tmp_path / "m"))       # tune.json keeps the whole path
    assert "FP32 KV" not in md and not ABSOLUTE.findall(md)
    assert json.loads((tmp_path / "out" / output.JSON).read_text())["serving_dtype"] == "bfloat16"
