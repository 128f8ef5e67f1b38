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


# ------------------------------------------------------------------- statistics bound to their model's weights

def _cli(*args):
    from click.testing import CliRunner

    from calib.cli import main
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Model A and model B (same config.json, other weights), A's statistics file, B's, and A's written as
    a kvcalib before fingerprints wrote it."""
    from calib.capture import statsfile
    from tiny import random_sequences

    tmp = tmp_path_factory.mktemp("bind")
    tiny_causal_lm("llama").save_pretrained(tmp / "a")
    tiny_causal_lm("llama", seed=1).save_pretrained(tmp / "b")
    assert (tmp / "a" / "config.json").read_bytes() == (tmp / "b" / "config.json").read_bytes()
    data = tmp / "t.jsonl"
    data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(8, lo=20, hi=40)))
    for m in "ab":
        r = _cli("calibrate", "--model", tmp / m, "--data", data, "--samples", "4", "--seq-len", "32", "--device",
                 "cpu", "--target", "", "--out", tmp / f"{m}-stats", "--stats-out", tmp / f"{m}.safetensors")
        assert r.exit_code == 0, r.output
    raw = statsfile.read(tmp / "a.safetensors")
    old = {k: v for k, v in raw.header.items() if k not in ("model_weights_sha256", "layers")}
    statsfile.save(tmp / "a-old.safetensors", statsfile.build_capture(raw), old)
    return tmp


def test_statistics_carry_their_weights_fingerprint(two_models):
    from calib.capture import statsfile

    got = statsfile.load(two_models / "a.safetensors").provenance.model_weights_sha256
    assert got == fingerprint.weights_sha256(two_models / "a") != fingerprint.weights_sha256(two_models / "b")
    record = json.loads((two_models / "a-stats" / "kvcalib.json").read_text())
    assert record["model_weights_sha256"] == got


def test_export_refuses_statistics_of_other_weights_naming_both(two_models, tmp_path):
    t = two_models
    a, b = (fingerprint.short(fingerprint.weights_sha256(t / m)) for m in "ab")
    r = _cli("export", "--stats", t / "a.safetensors", "--model", t / "b", "--target", "vllm", "--out", tmp_path / "o")
    assert r.exit_code == 1 and not (tmp_path / "o").exists()
    assert (f"statistics file {t / 'a.safetensors'} was recorded on other weights than --model {t / 'b'} (weights "
            f"{a} there, {b} here): it belongs to another model") in r.output
    r = _cli("export", "--stats", t / "a.safetensors", "--model", t / "a", "--target", "vllm", "--out", tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "o" / "kvcalib.json").read_text())["model_weights_sha256"] == \
        fingerprint.weights_sha256(t / "a")


def test_merge_refuses_statistics_of_two_models(two_models, tmp_path):
    t = two_models
    r = _cli("merge", t / "a.safetensors", t / "b.safetensors", "--out", tmp_path / "m.safetensors")
    assert r.exit_code == 1 and not (tmp_path / "m.safetensors").exists()
    assert f"statistics file {t / 'b.safetensors'} was recorded on other weights than {t / 'a.safetensors'}" in r.output


def test_old_statistics_are_accepted_with_one_line_saying_they_were_not_checked(two_models, tmp_path):
    t = two_models
    r = _cli("export", "--stats", t / "a-old.safetensors", "--model", t / "b", "--target", "vllm", "--out",
             tmp_path / "o")
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.output.splitlines() if "not checked" in ln]
    assert lines == [f"statistics file {t / 'a-old.safetensors'} carries no weights fingerprint (written by an older "
                     f"kvcalib): not checked against --model {t / 'b'}"]
    r = _cli("merge", t / "a-old.safetensors", t / "a.safetensors", "--out", tmp_path / "m.safetensors")
    assert r.exit_code == 0, r.output
    assert sum("not checked that every input was recorded on the same weights" in ln
               for ln in r.output.splitlines()) == 1
