"""The sample data shipped in data/ and the embedded default model built from it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from calib import default_model

ROOT = Path(__file__).resolve().parent.parent
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


def test_cache_is_keyed_by_data_and_never_half_written(tmp_path, monkeypatch):
    """The caching logic alone, with training replaced by a stub that writes the files a build leaves."""
    builds: list[Path] = []

    def fake_build(out: Path, texts: list[str], log) -> dict:
        builds.append(out)
        if texts == ["boom"]:
            raise RuntimeError("training failed")
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("{}")
        return {}

    monkeypatch.setattr(default_model, "_build", fake_build)
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "one"}\n')
    build_dir = tmp_path / "build"
    first = default_model.ensure_default_model(build_dir, data, log=lambda _: None)
    assert first == build_dir / "default-model" and len(builds) == 1
    assert default_model.ensure_default_model(build_dir, data, log=lambda _: None) == first and len(builds) == 1
    data.write_text('{"text": "two"}\n')
    default_model.ensure_default_model(build_dir, data, log=lambda _: None)
    assert len(builds) == 2
    data.write_text('{"text": "boom"}\n')
    with pytest.raises(RuntimeError):
        default_model.ensure_default_model(build_dir, data, log=lambda _: None)
    assert sorted(p.name for p in build_dir.iterdir()) == ["default-model"]  # no temp directory left behind


@pytest.mark.slow
def test_default_model_builds_loads_and_caches(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logs: list[str] = []
    path = default_model.ensure_default_model(tmp_path, TEXT, log=logs.append)
    assert path == tmp_path / "default-model"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "build_info.json"):
        assert (path / name).is_file(), name
    assert [p.name for p in tmp_path.iterdir()] == ["default-model"]

    config = json.loads((path / "config.json").read_text())
    assert config["head_dim"] == 64 and config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    with safe_open(path / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.head_dim == 64 and model.config.num_key_value_heads == 2

    tokenizer = AutoTokenizer.from_pretrained(path)
    text = _records(TEXT)[0]["text"]
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    chat = tokenizer.apply_chat_template(_records(CHAT)[0]["messages"], tokenize=False, add_generation_prompt=True)
    assert chat.startswith(tokenizer.bos_token) and chat.endswith("<|assistant|>\n")

    losses = [float(m.rsplit(" ", 1)[1]) for m in logs if re.search(r"step \d+/\d+ loss ", m)]
    assert len(losses) >= 2 and losses[-1] < losses[0] - 1.0, logs

    logs.clear()
    start = time.perf_counter()
    assert default_model.ensure_default_model(tmp_path, TEXT, log=logs.append) == path
    assert time.perf_counter() - start < 1.0 and logs == []
