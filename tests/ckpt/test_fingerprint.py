"""Model fingerprints (calib/ckpt/fingerprint.py) against independent readings of the same files: a small
tensor's print is the hash of its dtype, shape and every byte as safetensors stores them; the weights digest
does not depend on how tensors are split into shards or on KV scales added beside them, and changes with one
sampled byte of one tensor."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from calib.ckpt import fingerprint
from tiny import tiny_causal_lm


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fp") / "m"
    tiny_causal_lm("llama").save_pretrained(path)
    return path


def _raw(path: Path, name: str) -> tuple[str, list[int], bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    e = json.loads(raw[8:8 + n])[name]
    a, b = e["data_offsets"]
    return e["dtype"], e["shape"], raw[8 + n + a:8 + n + b]


def test_a_small_tensor_is_hashed_whole(model):
    prints = fingerprint.tensor_prints(model)
    name = "model.norm.weight"
    dtype, shape, data = _raw(model / "model.safetensors", name)
    assert len(data) <= fingerprint.SAMPLES * fingerprint.CHUNK
    assert prints[name].digest == hashlib.sha256(f"{dtype}{shape}".encode() + data).hexdigest()


def test_a_large_tensor_is_sampled_at_fixed_keyed_offsets(model):
    name = "model.embed_tokens.weight"
    dtype, shape, data = _raw(model / "model.safetensors", name)
    assert len(data) > fingerprint.SAMPLES * fingerprint.CHUNK
    offsets = fingerprint._offsets(name, len(data))
    assert offsets[0] == 0 and offsets[-1] == len(data) - fingerprint.CHUNK and len(offsets) <= fingerprint.SAMPLES
    want = hashlib.sha256(f"{dtype}{shape}".encode() + b"".join(data[o:o + fingerprint.CHUNK] for o in offsets))
    assert fingerprint.tensor_prints(model)[name].digest == want.hexdigest()


def test_the_digest_ignores_sharding_and_kv_scales_and_sees_one_sampled_byte(model, tmp_path):
    base = fingerprint.weights_sha256(model)
    sharded = tmp_path / "sharded"
    tiny_causal_lm("llama").save_pretrained(sharded, max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1 and fingerprint.weights_sha256(sharded) == base

    with_scales = tmp_path / "scales"
    tiny_causal_lm("llama").save_pretrained(with_scales)
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, str(with_scales / "kv.safetensors"))
    assert fingerprint.weights_sha256(with_scales) == base

    edited = tmp_path / "edited"
    tiny_causal_lm("llama").save_pretrained(edited)
    tensors = load_file(edited / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    offset = fingerprint._offsets(name, tensors[name].numel() * 4)[1]
    tensors[name].view(-1)[offset // 4] += 1.0          # a float inside a sampled chunk
    save_file(tensors, str(edited / "model.safetensors"), metadata={"format": "pt"})
    assert fingerprint.weights_sha256(edited) != base
    differ, shape = fingerprint.same_weights(fingerprint.tensor_prints(model), fingerprint.tensor_prints(edited))
    assert differ == [name] and shape == []

    other = tmp_path / "other"
    tiny_causal_lm("llama", seed=1).save_pretrained(other)
    assert fingerprint.weights_sha256(other) != base
