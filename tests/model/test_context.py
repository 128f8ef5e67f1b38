"""The model's context as vLLM derives it (calib/model/context.py), from config dicts written by hand."""

from __future__ import annotations

import json

from calib.model import context


def test_the_smallest_length_key_and_the_tokenizer_cap():
    assert context.declared({"max_position_embeddings": 8192}) == context.Context(8192, "max_position_embeddings 8192")
    assert context.declared({"n_positions": 1024}).tokens == 1024                       # GPT-2
    assert context.declared({"max_position_embeddings": 4096, "seq_length": 2048}).tokens == 2048
    assert context.declared({"max_position_embeddings": 4096}, tokenizer_max=1000).tokens == 1000
    assert context.declared({"max_position_embeddings": 4096}, tokenizer_max=1e30).tokens == 4096   # "no limit"
    assert context.declared({"hidden_size": 64}) is None
    nested = {"model_type": "llava", "text_config": {"max_position_embeddings": 32768}}
    assert context.declared(nested) == context.Context(32768, "text_config.max_position_embeddings 32768")


def test_rope_factor_multiplies_except_where_the_length_is_already_scaled():
    linear = {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert context.declared(linear) == context.Context(16384, "max_position_embeddings 4096 x rope factor 4")
    dynamic = {"max_position_embeddings": 2048, "rope_parameters": {"type": "dynamic", "factor": 2.0}}
    assert context.declared(dynamic).tokens == 4096
    for kind in ("yarn", "llama3", "longrope"):
        cfg = {"max_position_embeddings": 131072, "rope_parameters": {"rope_type": kind, "factor": 8.0,
                                                                      "original_max_position_embeddings": 8192}}
        assert context.declared(cfg).tokens == 131072, kind
    gemma3 = {"model_type": "gemma3_text", "max_position_embeddings": 131072,
              "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                                  "sliding_attention": {"rope_type": "default"}}}
    assert context.declared(gemma3).tokens == 131072
    per_type = {**gemma3, "model_type": "other"}
    assert context.declared(per_type).tokens == 131072 * 8
    assert context.declared({"max_position_embeddings": 512, "rope_parameters": {"rope_type": "default",
                                                                                 "rope_theta": 1e4}}).tokens == 512


def test_of_directory_reads_config_and_tokenizer_config(tmp_path):
    assert context.of_directory(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert context.of_directory(tmp_path).tokens == 2048
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    assert context.of_directory(tmp_path).tokens == 1024
    (tmp_path / "config.json").write_text("{not json")
    assert context.of_directory(tmp_path) is None
