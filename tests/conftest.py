"""Shared fixtures (tiny checkpoints, data, a tokenizer). Tests import helpers from `helpers.py` and models
from `tiny.py`, never from another test module."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # calib.capture.kernels's Triton kernels are checked under the interpreter (tests/capture/test_kernels.py); Triton reads
    # this when it is first imported. On a CUDA machine the kernels run for real.
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture(scope="module")
def tok():
    """A word-level tokenizer (BOS added, chat markers as special tokens) over a tiny vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"])
    core.train_from_iterator(["the cat sat on the mat", "a dog ran far away from the cat",
                              "hello world this is calibration text"], trainer=trainer)
    bos = core.token_to_id("<s>")
    core.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                        special_tokens=[("<s>", bos)])
    t = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    t.chat_template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                       "{% endfor %}")
    return t
