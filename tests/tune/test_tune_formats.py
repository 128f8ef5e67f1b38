"""`kvcalib tune --formats`: the engine's own KV formats scored (emulated) next to the recipes, and tune.json / tune.md
say which has the fewest bytes per token within the bar and whether static calibration beat the dynamic caches."""

from __future__ import annotations

import json

from click.testing import CliRunner

from calib.cli import main
from calib.recipe import recipe as recipe_mod
from calib.tune import output, run, search
from tiny import random_sequences, tiny_causal_lm


def _records(path, seed):
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(48, lo=12, hi=33, seed=seed)))
    return path


def test_tune_scores_every_format_and_chooses_by_bytes(tmp_path):
    tiny_causal_lm("llama").save_pretrained(tmp_path / "m")
    base = recipe_mod.Recipe().replace(samples=12, seq_len=32, min_tokens=8, batch_size=8)
    cfg = search.TuneConfig(model=str(tmp_path / "m"), data=str(_records(tmp_path / "cal.jsonl", 3)),
                            eval_data=str(_records(tmp_path / "held.jsonl", 6)), out=tmp_path / "out", base=base,
                            observers=("absmax",), headrooms=(1.0,), eval_samples=8, buckets=(16, 32), min_tokens=8,
                            max_skip=0, plots=False,
                            formats=("fp8_e5m2", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head"))
    res = run.run(cfg)
    fm = res.doc["formats"]
    rows = {r["arm"]: r for r in fm["rows"]}
    assert {"fp8_e5m2", "fp8_per_token_head", "int8_per_token_head", "int4_per_token_head", search.BASELINE,
            res.chosen["name"]} == set(rows)
    # this tiny model: 2 KV heads x 16 per layer, float32 reference 256 bytes/token/layer
    assert rows["int4_per_token_head"]["bytes_per_token"] == 2 * (16 + 8)
    assert rows[res.chosen["name"]]["bytes_per_token"] == 2 * 32
    passing = [r for r in fm["rows"] if r["passes"]]
    assert fm["chosen"] == min(passing, key=lambda r: (r["bytes_per_token"], -r["served_by"], r["kl"]))["arm"]
    assert fm["static_vs_dynamic"] and fm["not_scored"] == []
    md = output.markdown(res.doc)
    assert "KV formats (`--formats`, emulated" in md and fm["text"] in md


def test_the_formats_option_names_its_choices():
    r = CliRunner().invoke(main, ["tune", "--formats", "fp8_e4m3,int3"])
    assert r.exit_code != 0 and "--formats 'fp8_e4m3,int3': unknown fp8_e4m3, int3; choose from fp8_e5m2" in r.output
