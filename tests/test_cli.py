"""The Click commands, driven with CliRunner: output the user reads, one-line errors, no torch on import."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from calib.cli import main


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_calibrate_then_inspect(tiny_llama_dir, token_data, tmp_path):
    out = tmp_path / "ckpt"
    r = _run("calibrate", "--model", tiny_llama_dir, "--data", token_data, "--out", out, "--samples", 8,
             "--seq-len", 32, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.output
    assert f"vllm serve {out} --kv-cache-dtype fp8" in r.output
    prov = json.loads((out / "kvcalib.json").read_text())
    table_rows = [ln.split() for ln in r.output.splitlines() if ln.strip()[:1].isdigit() and len(ln.split()) == 5]
    assert [int(row[0]) for row in table_rows] == [0, 1, 2]
    assert float(table_rows[2][2]) == pytest.approx(prov["layers"]["2"]["k_scale"], rel=1e-5)
    assert "8 used" in r.output

    r = _run("inspect", out)
    assert r.exit_code == 0, r.output
    assert "targets:    vllm" in r.output and "strategy=tensor" in r.output
    assert "8 samples" in r.output
    rows = [ln.split() for ln in r.output.splitlines() if ln.strip()[:1].isdigit() and len(ln.split()) == 5]
    assert float(rows[1][4]) == pytest.approx(prov["layers"]["1"]["v_scale"], rel=1e-5)


def test_inspect_plain_model_says_no_kv_quantization(tiny_llama_dir):
    r = _run("inspect", tiny_llama_dir)
    assert r.exit_code == 0 and "none (no KV cache quantization declared)" in r.output


@pytest.mark.parametrize("args, message", [
    (["--model", "./no-such-model"], "MODEL ./no-such-model not found"),
    (["--data", "./missing.jsonl"], "DATA ./missing.jsonl not found"),
    (["--samples", "0"], "'samples' = 0"),
    (["--seq-len", "4096"], "exceeds the model's context"),
])
def test_bad_input_is_one_line_error_and_no_output(args, message, tiny_llama_dir, token_data, tmp_path):
    base = {"--model": str(tiny_llama_dir), "--data": str(token_data)}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    out = tmp_path / "out"
    r = _run("calibrate", *sum(base.items(), ()), "--out", out, "--device", "cpu", *([] if "--seq-len" in args else ["--seq-len", "32"]))
    assert r.exit_code == 1
    err = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(err) == 1 and message in err[0], r.output
    assert not out.exists()


def test_recipe_file_errors_name_the_field(tmp_path, tiny_llama_dir, token_data):
    bad = tmp_path / "r.yaml"
    bad.write_text("headrom: 2\n")
    r = _run("calibrate", "--model", tiny_llama_dir, "--data", token_data, "--recipe", bad, "--out", tmp_path / "o")
    assert r.exit_code == 1 and "unknown field(s) 'headrom'" in r.output


def test_existing_output_needs_force(tiny_llama_dir, token_data, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    r = _run("calibrate", "--model", tiny_llama_dir, "--data", token_data, "--out", out, "--device", "cpu")
    assert r.exit_code == 1 and "--force" in r.output


def test_importing_the_cli_does_not_import_torch():
    code = "import sys, calib.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_eval_command_reports_a_verdict(tmp_path, token_data):
    from tiny import tiny_causal_lm
    src = tmp_path / "big"
    tiny_causal_lm("llama", scale_k=6000.0).save_pretrained(src)
    r = _run("calibrate", "--model", src, "--data", token_data, "--out", tmp_path / "cal", "--seq-len", "40",
             "--samples", "12", "--device", "cpu")
    assert r.exit_code == 0, r.output
    r = _run("eval", "--model", src, "--data", token_data, "--scales", tmp_path / "cal", "--buckets", "64",
             "--samples", "8", "--no-plots", "--passkey-trials", "0", "--device", "cpu", "--out", tmp_path / "ev")
    assert r.exit_code == 0, r.output
    assert "calibrated" in r.output.lower() and (tmp_path / "ev" / "report.md").is_file()
    doc = json.loads((tmp_path / "ev" / "report.json").read_text())
    arms = doc["arms"]
    # saturation at scale 1.0 dominates; the default emulation (vllm-cpu) truncates, which costs the calibrated arm too
    assert doc["emulation"]["mode"] == "vllm-cpu"
    assert arms["default"]["summary"]["kl"] > 4 * arms[f"calibrated:{tmp_path / 'cal'}"]["summary"]["kl"]


def test_inspect_reads_bf16_scales_of_other_tools(tiny_llama_dir, tmp_path):
    """llm-compressor stores KV scales in the model dtype (bf16): numpy cannot hold it, inspect must still read it."""
    import shutil

    import torch
    from safetensors.torch import save_file
    ck = tmp_path / "llmc"
    shutil.copytree(tiny_llama_dir, ck)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor([0.0153198], dtype=torch.bfloat16)},
              str(ck / "extra.safetensors"))
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}, "format": "dense",
                                  "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                      "dynamic": False, "symmetric": True}}
    (ck / "config.json").write_text(json.dumps(cfg))
    r = _run("inspect", ck)
    assert r.exit_code == 0, r.output
    row = next(ln.split() for ln in r.output.splitlines() if ln.strip().startswith("0 "))
    assert float(row[2]) == pytest.approx(float(torch.tensor(0.0153198, dtype=torch.bfloat16)), rel=1e-5)


def test_multi_target_output_and_inspect_of_both(tiny_llama_dir, token_data, tmp_path):
    out = tmp_path / "both"
    r = _run("calibrate", "--model", tiny_llama_dir, "--data", token_data, "--out", out, "--samples", 8,
             "--seq-len", 32, "--device", "cpu", "--target", "vllm,trtllm")
    assert r.exit_code == 0, r.output
    assert f"vllm serve {out / 'vllm'}" in r.output and f"trtllm-serve {out / 'trtllm'}" in r.output
    assert (out / "vllm" / "model.safetensors").stat().st_ino == (out / "trtllm" / "model.safetensors").stat().st_ino
    r = _run("inspect", out)
    assert r.exit_code == 0 and "targets:    vllm" in r.output and "targets:    trtllm" in r.output


def test_inspect_lists_every_target_variant_sglang_included(tiny_llama_dir, token_data, tmp_path):
    """`inspect` walks the export registry, not a fixed pair: an output with an SGLang variant shows it."""
    out = tmp_path / "three"
    r = _run("calibrate", "--model", tiny_llama_dir, "--data", token_data, "--out", out, "--samples", 8,
             "--seq-len", 32, "--device", "cpu", "--target", "vllm,sglang,trtllm")
    assert r.exit_code == 0, r.output
    r = _run("inspect", out)
    assert r.exit_code == 0, r.output
    shown = [ln.split(":", 1)[1].strip() for ln in r.output.splitlines() if ln.startswith("checkpoint:")]
    assert shown == [str(out / t) for t in ("vllm", "trtllm", "sglang")]


def test_cpu_dtype_sets_the_model_dtype_on_cpu(tmp_path, token_data):
    """A bf16 checkpoint runs in float32 on CPU by default (faster there), in bf16 with --cpu-dtype bfloat16;
    the K/V ranges differ only by bf16 rounding."""
    import torch

    from calib.model.load import Placement, load
    from tiny import tiny_causal_lm

    src = tmp_path / "bf16"
    tiny_causal_lm("llama").to(torch.bfloat16).save_pretrained(src)
    assert load(src, device="cpu").dtype == torch.float32
    assert load(src, placement=Placement(device="cpu", cpu_dtype="bfloat16")).dtype == torch.bfloat16
    amax = {}
    for dtype in ("float32", "bfloat16"):
        r = _run("calibrate", "--model", src, "--data", token_data, "--out", tmp_path / dtype, "--samples", 8,
                 "--seq-len", 32, "--device", "cpu", "--cpu-dtype", dtype)
        assert r.exit_code == 0, r.output
        assert f"{dtype} on cpu" in r.output
        amax[dtype] = json.loads((tmp_path / dtype / "kvcalib.json").read_text())["layers"]["1"]["k_amax"]
    assert amax["bfloat16"] == pytest.approx(amax["float32"], rel=2 ** -6)


@pytest.fixture
def short_docs(tiny_llama_dir, tok, tmp_path):
    """The tiny model with a word-level tokenizer, and a folder of .txt documents of short paragraphs
    (21 tokens each, 120 of them)."""
    tok.save_pretrained(tiny_llama_dir)
    folder = tmp_path / "docs"
    folder.mkdir()
    words = "the cat sat on the mat a dog ran far away from the cat".split()
    for d in range(6):
        paras = [" ".join(words[(d + p + i) % len(words)] for i in range(20)) for p in range(20)]
        (folder / f"doc{d}.txt").write_text("\n\n".join(paras) + "\n")
    return tiny_llama_dir, folder


def _hint(output):
    return [ln for ln in output.splitlines() if "--pack concatenates" in ln]


def test_short_samples_suggest_pack_in_calibrate_eval_and_tune(short_docs, token_data, tmp_path):
    """Paragraphs of 21 tokens against --seq-len 128 / a 128-token bucket: one warning line with the numbers;
    none once --pack fills the samples."""
    model, docs = short_docs
    r = _run("calibrate", "--model", model, "--data", docs, "--out", tmp_path / "c", "--samples", 16,
             "--seq-len", 128, "--device", "cpu")
    assert r.exit_code == 0, r.output
    (line,) = _hint(r.output)
    assert "samples average 21 tokens, 16% of --seq-len (128), 0% of the computed positions padding" in line
    r = _run("calibrate", "--model", model, "--data", docs, "--out", tmp_path / "c2", "--samples", 16,
             "--seq-len", 128, "--device", "cpu", "--pack")
    assert r.exit_code == 0 and not _hint(r.output), r.output

    ev = ("eval", "--model", model, "--data", docs, "--buckets", "32,128", "--samples", 8, "--no-plots",
          "--passkey-trials", 0, "--device", "cpu", "--no-progress", "--max-skip", 0)
    r = _run(*ev, "--out", tmp_path / "e")
    (line,) = _hint(r.output)
    assert "samples average 21 tokens, 16% of the largest bucket (128)" in line
    r = _run(*ev, "--out", tmp_path / "e2", "--pack")
    assert not _hint(r.output), r.output

    tu = ("tune", "--model", model, "--data", docs, "--eval-data", token_data, "--samples", 16, "--seq-len", 128,
          "--eval-samples", 4, "--buckets", "16,32", "--observers", "absmax", "--headrooms", "1.0",
          "--max-skip", 0, "--no-plots", "--no-progress", "--device", "cpu")
    r = _run(*tu, "--out", tmp_path / "t")
    assert r.exit_code == 0, r.output
    (line,) = _hint(r.output)
    assert "samples average 21 tokens, 16% of --seq-len (128)" in line
    r = _run(*tu, "--out", tmp_path / "t2", "--pack")
    assert r.exit_code == 0 and not _hint(r.output), r.output


def test_verify_with_errors_exits_1_without_a_traceback(tmp_path):
    """A checkpoint that declares a quantized KV cache but carries no scales: one ERROR line, exit 1 (the exit code
    once raised AttributeError: a local list named `errors` shadowed calib.errors)."""
    scheme = {"type": "float", "num_bits": 8}
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "quantization_config": {
        "kv_cache_scheme": scheme, "quant_method": "compressed-tensors"}}))
    r = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit), repr(r.exception)
    assert "ERROR [vllm]" in r.output
