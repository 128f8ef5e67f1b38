"""Every bad input ends in one line naming the file/field/layer and what to do, a non-zero exit, and no output.

`ROWS` is the source of the README's bad-input table (`make bad-input-table` regenerates it; a test below
fails when the README drifts from it). Each row builds its bad input in a temp dir and gives the CLI args.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from calib.cli import main
from tiny import random_sequences, tiny_causal_lm


@dataclass(frozen=True)
class Row:
    input: str                                   # what the user did (README column)
    setup: Callable[[Path], list[str]]           # builds the case under a temp dir, returns CLI args
    message: str                                 # substring of the one-line error


def _model(tmp: Path, **kw) -> Path:
    path = tmp / "model"
    if not path.exists():
        tiny_causal_lm("llama", **kw).save_pretrained(path)
    return path


def _tokens(tmp: Path, n: int = 12, lo: int = 20, hi: int = 40) -> Path:
    path = tmp / "tokens.jsonl"
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(n, lo=lo, hi=hi)))
    return path


def _base(tmp: Path, model: Path | None = None, data: Path | None = None) -> list[str]:
    return ["--model", str(model or _model(tmp)), "--data", str(data or _tokens(tmp)), "--seq-len", "32",
            "--samples", "8", "--device", "cpu", "--out", str(tmp / "out")]


def _write(tmp: Path, name: str, text: str | bytes) -> Path:
    path = tmp / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _config_only(tmp: Path, config: dict) -> Path:
    path = tmp / "cfgmodel"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def _bin_only(tmp: Path) -> Path:
    """A model whose weights are a pickle `pytorch_model.bin` (what older hub repos ship)."""
    path = tmp / "binmodel"
    model = tiny_causal_lm("llama")
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    return path


def _nan_layer(tmp: Path) -> Path:
    path = tmp / "nanmodel"
    model = tiny_causal_lm("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = math.nan
    model.save_pretrained(path)
    return path


def _sharded_missing(tmp: Path) -> Path:
    path = tmp / "sharded"
    tiny_causal_lm("llama").save_pretrained(path, max_shard_size="100KB")
    sorted(path.glob("model-*.safetensors"))[-1].unlink()
    return path


def _corrupt_index(tmp: Path) -> Path:
    path = tmp / "sharded"
    tiny_causal_lm("llama").save_pretrained(path, max_shard_size="100KB")
    (path / "model.safetensors.index.json").write_text("{not json")
    return path


def _recipe(tmp: Path, text: str) -> list[str]:
    return [*_base(tmp), "--recipe", str(_write(tmp, "r.yaml", text))]


ROWS = [
    Row("MODEL path does not exist", lambda t: [*_base(t), "--model", "./no-such-model"],
        "MODEL ./no-such-model not found"),
    Row("MODEL folder without config.json", lambda t: [*_base(t), "--model", str(t)], "has no config.json"),
    Row("MODEL with only pickle .bin weights", lambda t: _base(t, _bin_only(t)), "no .safetensors weights"),
    Row("MODEL with an MLA cache (DeepSeek-V3)", lambda t: _base(t, _config_only(t, {"model_type": "deepseek_v3"})),
        "multi-head latent attention"),
    Row("MODEL with state-space layers (Mamba)", lambda t: _base(t, _config_only(t, {"model_type": "mamba"})),
        "not plain K/V"),
    Row("MODEL with NaN weights in one layer", lambda t: _base(t, _nan_layer(t)), "layer 1: K holds NaN/Inf"),
    Row("MODEL index names a missing shard", lambda t: _base(t, _sharded_missing(t)), "names shard(s)"),
    Row("MODEL index is not valid JSON", lambda t: _base(t, _corrupt_index(t)), "not a valid safetensors index"),
    Row("DATA path does not exist", lambda t: [*_base(t), "--data", "./missing.jsonl"], "DATA ./missing.jsonl not found"),
    Row("DATA file is empty", lambda t: _base(t, data=_write(t, "empty.jsonl", "")), "the source holds no records"),
    Row("DATA has no usable column", lambda t: _base(t, data=_write(t, "d.jsonl", '{"body": "x"}\n')),
        "no usable column"),
    Row("DATA samples all shorter than min_tokens", lambda t: _base(t, data=_tokens(t, lo=3, hi=5)),
        "shorter than min_tokens=16"),
    Row("DATA file is not UTF-8", lambda t: _base(t, data=_write(t, "d.jsonl", b"\xff\xfe\x00bad\n")), "not UTF-8"),
    Row("DATA mixes formats", lambda t: _base(t, data=_write(
        t, "d.jsonl", "".join(json.dumps({"input_ids": list(range(20))}) + "\n" for _ in range(3)) + '{"text": "hi"}\n')),
        "all records of a DATA source must share one format"),
    Row("DATA line is not JSON", lambda t: _base(t, data=_write(t, "d.jsonl", "{oops\n")), "not valid JSON"),
    Row("DATA token ids beyond the vocabulary", lambda t: _base(t, data=_write(
        t, "d.jsonl", json.dumps({"input_ids": [5] * 19 + [99999]}) + "\n")), "token id out of range"),
    Row("DATA is text but the model has no tokenizer", lambda t: _base(t, data=_write(
        t, "d.jsonl", json.dumps({"text": "some words " * 20}) + "\n")), "the model has no tokenizer"),
    Row("SEQ_LEN larger than the model's context", lambda t: [*_base(t), "--seq-len", "4096"],
        "exceeds the model's context"),
    Row("SAMPLES 0", lambda t: [*_base(t), "--samples", "0"], "'samples' = 0"),
    Row("SAMPLES negative", lambda t: [*_base(t), "--samples", "-3"], "'samples' = -3"),
    Row("RECIPE with an unknown key", lambda t: _recipe(t, "headrom: 2\n"), "unknown field(s) 'headrom'"),
    Row("RECIPE field of the wrong type", lambda t: _recipe(t, "batch_size: four\n"), "has the wrong type"),
    Row("RECIPE asks INT8 for vLLM", lambda t: _recipe(t, "dtype: int8\n"), "vLLM reads only FP8"),
    Row("RECIPE exports a statistics-only granularity", lambda t: _recipe(t, "granularity: channel\n"),
        "cannot be exported"),
    Row("RECIPE skips a layer the model lacks", lambda t: [*_base(t), "--skip-layers", "7"], "has layer 7"),
    Row("OUT already exists", lambda t: [*_base(t), "--out", str(t)], "already exists; pass --force"),
    Row("OUT inside a path that is a file", lambda t: [*_base(t), "--out", str(_write(t, "f", "x") / "out")],
        "is a file, not a directory"),
]


def run_row(row: Row, tmp: Path) -> tuple[int, str, list[str]]:
    before = set(tmp.iterdir())
    args = row.setup(tmp)
    made_by_setup = set(tmp.iterdir()) - before
    result = CliRunner().invoke(main, ["calibrate", *args])
    left = sorted(p.name for p in set(tmp.iterdir()) - before - made_by_setup)
    return result.exit_code, result.output, left


@pytest.mark.parametrize("row", ROWS, ids=[r.input for r in ROWS])
def test_bad_input(row: Row, tmp_path: Path):
    code, output, left = run_row(row, tmp_path)
    errors = [ln for ln in output.splitlines() if ln.startswith("Error:")]
    assert code != 0 and "Traceback" not in output, output
    assert len(errors) == 1 and row.message in errors[0], output
    assert left == [], f"left behind: {left}"
    assert not list(tmp_path.rglob("*kvcalib-tmp*"))


def test_disk_too_small_is_refused_before_writing(tmp_path, monkeypatch):
    import calib.export as export
    monkeypatch.setattr(export.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    code, output, left = run_row(Row("disk", _base, ""), tmp_path)
    assert code == 1 and "GiB free but the export needs" in output and left == []


def markdown_table() -> str:
    lines = ["| input | error (one line, exit code 1, nothing written) |", "|---|---|"]
    lines += [f"| {r.input} | `...{r.message}...` |" for r in ROWS]
    return "\n".join(lines)


def test_readme_table_is_generated_from_these_rows():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert markdown_table() in readme, "README bad-input table is stale: run `make bad-input-table`"


if __name__ == "__main__":  # prints the README table
    print(markdown_table())


def test_pickle_weights_only_with_allow_pickle(tmp_path):
    model = _bin_only(tmp_path)
    args = _base(tmp_path, model)
    ok = CliRunner().invoke(main, ["calibrate", *args, "--allow-pickle", "--target", "", "--force"])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "out" / "stats.safetensors").is_file()
    shutil.rmtree(tmp_path / "out")
    r = CliRunner().invoke(main, ["calibrate", *args, "--allow-pickle"])
    assert r.exit_code == 1 and "no .safetensors weights" in r.output and not (tmp_path / "out").exists()
