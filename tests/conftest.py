"""Shared fixtures (tiny checkpoints and data). Tests import helpers from `tiny.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiny import random_sequences, tiny_causal_lm


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> Path:
    """A saved float32 Llama checkpoint (single safetensors file, no tokenizer)."""
    model = tiny_causal_lm("llama")
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    return path


@pytest.fixture
def token_data(tmp_path: Path) -> Path:
    """Pre-tokenized calibration data (input_ids column) for the tiny models' vocabulary."""
    path = tmp_path / "tokens.jsonl"
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(24, seed=7)))
    return path
