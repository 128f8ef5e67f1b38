"""Real-engine check: vLLM loads the KV-cache scales of an exported checkpoint, exactly as exported.

Why compare loaded values instead of just "it loads": with a compressed-tensors `kv_cache_scheme` in
config.json, vLLM creates each attention layer's k/v scale placeholders initialised to 1.0 and keeps
that value for any scale tensor it does not read: one never written, or one in a shard that
`model.safetensors.index.json` does not list (vLLM only reads shards named in the index). Such a
checkpoint loads and generates without an error or warning, just with uncalibrated scales. So this test reads,
from inside the running engine, the floats the attention kernels receive, and compares them with the
tensors in the checkpoint files.

Runs in the vLLM venv (`make engine-test`), never imports `calib`: the engine is started by
`vllm_probe.py` in a subprocess of this same interpreter. Options: `--ckpt DIR` (see conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

pytestmark = pytest.mark.engine

PROBE = Path(__file__).resolve().parent / "vllm_probe.py"
INDEX_NAME = "model.safetensors.index.json"
PROBE_TIMEOUT_S = 900
# Checkpoint names vLLM maps onto the attention layer's k/v scales (kvcalib writes the first form).
_SCALE_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?([kv])_scale$")


def run_probe(ckpt: Path, out: Path, *extra: str) -> dict:
    """Start vLLM on `ckpt` in a subprocess and return the probe's json report."""
    cmd = [sys.executable, str(PROBE), str(ckpt), str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=dict(os.environ))
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-60:])
        pytest.fail(f"vllm_probe failed (rc={proc.returncode}) on {ckpt}:\n{tail}")
    return json.loads(out.read_text())


def scale_tensors(ckpt: Path) -> dict[tuple[int, str], tuple[Path, str, torch.Tensor]]:
    """{(layer, 'k'|'v'): (shard, tensor name, float32 values)} for every KV scale in the directory's shards.

    Reads every `*.safetensors` file, whether or not the index lists it: what the exporter wrote, not
    what vLLM chose to read (the index test and the engine comparison check the latter).
    """
    found = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                match = _SCALE_RE.search(name)
                if match:
                    key = (int(match.group(1)), match.group(2))
                    assert key not in found, f"layer {key[0]} {key[1]}_scale stored twice: {name}"
                    found[key] = (shard, name, f.get_tensor(name).to(torch.float32).flatten())
    return found


def kernel_value(values: torch.Tensor) -> float:
    """The float vLLM hands the attention kernel for one stored scale tensor.

    Per-tensor scales (shape [] or [1]) are used as stored. Per-head scales (strategy "attn_head") are
    reduced to their maximum by the compressed-tensors KV-cache method, since the CPU kernel takes one
    float per layer.
    """
    return float(values.max()) if values.numel() > 1 else float(values.item())


def num_hidden_layers(ckpt: Path) -> int:
    config = json.loads((ckpt / "config.json").read_text())
    if "num_hidden_layers" not in config and "text_config" in config:
        config = config["text_config"]
    return int(config["num_hidden_layers"])


def loaded_scales(report: dict) -> dict[int, tuple[float, float]]:
    return {int(i): (float(k), float(v)) for i, (k, v) in report["scales"].items()}


@pytest.fixture(scope="module")
def exported(ckpt):
    found = scale_tensors(ckpt)
    assert found, f"no k/v scale tensors in any *.safetensors file of {ckpt}"
    return found


@pytest.fixture(scope="module")
def report(ckpt, tmp_path_factory):
    return run_probe(ckpt, tmp_path_factory.mktemp("probe") / "report.json")


def test_checkpoint_has_a_scale_pair_per_layer(ckpt, exported):
    n = num_hidden_layers(ckpt)
    missing = [f"{i}.{kv}_scale" for i in range(n) for kv in "kv" if (i, kv) not in exported]
    assert not missing, f"checkpoint lacks scales for {missing}"


def test_index_lists_every_scale(ckpt, exported):
    """vLLM reads only the shards named in model.safetensors.index.json; an unlisted shard is skipped."""
    index = ckpt / INDEX_NAME
    if not index.is_file():
        pytest.skip("no index: vLLM reads every *.safetensors file")
    weight_map = json.loads(index.read_text())["weight_map"]
    wrong = {name: weight_map.get(name) for shard, name, _ in exported.values() if weight_map.get(name) != shard.name}
    assert not wrong, f"index entries missing or pointing elsewhere (name: listed shard): {wrong}"


def test_vllm_sees_every_attention_layer(ckpt, report):
    assert sorted(loaded_scales(report)) == list(range(num_hidden_layers(ckpt)))


def test_loaded_scales_equal_exported(report, exported):
    mismatches = []
    for layer, (k_loaded, v_loaded) in sorted(loaded_scales(report).items()):
        for kv, got in (("k", k_loaded), ("v", v_loaded)):
            if (layer, kv) not in exported:
                mismatches.append(f"layer {layer} {kv}: {got} loaded but nothing exported")
                continue
            values = exported[(layer, kv)][2]
            want = kernel_value(values)
            if got != pytest.approx(want, rel=1e-6):
                mismatches.append(f"layer {layer} {kv}: vLLM uses {got!r}, checkpoint has {want!r}")
            # The buffer behind the float must hold the stored tensor as well (per head, if per head).
            buffer = report["layers"][str(layer)][f"{kv}_scale_buffer"]
            if buffer != pytest.approx(values.tolist(), rel=1e-6):
                mismatches.append(f"layer {layer} {kv}: buffer {buffer} != stored {values.tolist()}")
    assert not mismatches, "\n".join(mismatches)


def test_no_scale_silently_left_at_default(report, exported):
    defaulted = [
        f"layer {layer} {kv}"
        for layer, pair in loaded_scales(report).items()
        for kv, got in zip("kv", pair)
        if got == 1.0 and (layer, kv) in exported and kernel_value(exported[(layer, kv)][2]) != 1.0
    ]
    assert not defaulted, f"scales left at vLLM's default 1.0: {defaulted}"


def test_kv_cache_is_fp8(report):
    assert report["kv_cache_dtype"].startswith("fp8"), report["kv_cache_dtype"]
    per_layer = {layer: d["kv_cache_dtype"] for layer, d in report["layers"].items()}
    assert all(dtype.startswith("fp8") for dtype in per_layer.values()), per_layer


def test_generates_tokens(report):
    assert len(report["generated_token_ids"]) >= 1


def test_control_loaded_value_follows_the_file(ckpt, exported, tmp_path):
    """Negative control: edit one k_scale in a copy of the checkpoint and see vLLM pick up the edit.

    Proves the comparison above reads what vLLM loaded and not the file. Costs one more engine start.
    """
    layer = max(i for i, _ in exported)
    shard, name, values = exported[(layer, "k")]
    edited = values * 1.75 + 0.001
    assert kernel_value(edited) not in (1.0, kernel_value(values))

    # Same directory, entries linked, except the shard holding the edited tensor, which is rewritten.
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for entry in ckpt.iterdir():
        if entry != shard:
            (copy / entry.name).symlink_to(entry)
    with safe_open(str(shard), framework="pt") as f:
        metadata = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    original = tensors[name]
    tensors[name] = edited.reshape(original.shape).to(original.dtype)
    save_file(tensors, str(copy / shard.name), metadata=metadata)
    want = kernel_value(scale_tensors(copy)[(layer, "k")][2])  # after the dtype round trip

    loaded = loaded_scales(run_probe(copy, tmp_path / "report.json", "--max-tokens", "0"))
    assert loaded[layer][0] == pytest.approx(want, rel=1e-6)
    assert loaded[layer][0] != pytest.approx(kernel_value(values), rel=1e-6)
    for other, (k_loaded, v_loaded) in loaded.items():
        assert v_loaded == pytest.approx(kernel_value(exported[(other, "v")][2]), rel=1e-6)
        if other != layer:
            assert k_loaded == pytest.approx(kernel_value(exported[(other, "k")][2]), rel=1e-6)
