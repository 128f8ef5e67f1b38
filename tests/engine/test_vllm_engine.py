"""Real-engine check: vLLM loads the KV-cache scales of an exported checkpoint, exactly as exported.

Why compare loaded values instead of just "it loads": with a compressed-tensors `kv_cache_scheme` in
config.json, vLLM creates each attention layer's k/v scale placeholders initialised to 1.0 and keeps
that value for any scale tensor it does not read: one never written, or one in a shard that
`model.safetensors.index.json` does not list (vLLM only reads shards named in the index). Such a
checkpoint loads and generates without an error or warning, just with uncalibrated scales. So this test reads,
from inside the running engine, the floats the attention kernels receive, and compares them with the
tensors in the checkpoint files.

What the checkpoint's recipe asks for is checked as well, each test skipping when its feature is off, so
`make engine-test` runs this file on three checkpoints (one engine start each, plus the control on the first):
plain per-tensor scales; `--granularity head --q-scale` (vLLM strategy `attn_head`: per-head k/v buffers and
q_scale); `--skip-layers 1` (the probe passes kvcalib.json's `skipped_layers` to vLLM as
`kv_cache_dtype_skip_layers`, as `kvcalib calibrate` tells users to).

Hosts whose vLLM cannot hold an FP8 cache (the CPU build needs AVX-512 or AMX) still check every loaded
scale: the probe then serves the model-dtype cache, which loads the scales the same way (see vllm_probe.py),
and the tests that need an FP8 cache skip with vLLM's reason; `--require fp8-kv` turns that skip into a
failure, and `--min-passed N` fails a run in which fewer than N tests passed (conftest.py).

Runs in the vLLM venv (`make engine-test`), never imports `calib`: the engine is started by
`vllm_probe.py` in a subprocess of this same interpreter. Options: `--ckpt DIR`, and `--require per-head,...`
to fail instead of skip when the checkpoint lacks a feature (see conftest.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

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
_Q_SCALE_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(q)_scale$")
# Cache element types of an FP8 KV cache (vLLM allocates it as raw bytes: uint8).
_FP8_CACHE_TENSOR_DTYPES = {"uint8", "float8_e4m3fn", "float8_e5m2"}


class Stored(NamedTuple):
    shard: Path
    name: str
    values: torch.Tensor  # float32, flattened
    shape: tuple[int, ...]  # as stored


def run_probe(ckpt: Path, out: Path, cache_dtype: str, *extra: str) -> dict:
    """Start vLLM on `ckpt` in a subprocess and return the probe's json report."""
    cmd = [sys.executable, str(PROBE), str(ckpt), str(out), "--kv-cache-dtype", cache_dtype, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, env=dict(os.environ))
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-60:])
        pytest.fail(f"vllm_probe failed (rc={proc.returncode}) on {ckpt}:\n{tail}")
    return json.loads(out.read_text())


def scale_tensors(ckpt: Path, pattern: re.Pattern = _SCALE_RE) -> dict[tuple[int, str], Stored]:
    """{(layer, 'k'|'v'): Stored} for every KV scale (or, with `_Q_SCALE_RE`, q scale) in the directory's shards.

    Reads every `*.safetensors` file, whether or not the index lists it: what the exporter wrote, not
    what vLLM chose to read (the index test and the engine comparison check the latter).
    """
    found = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                match = pattern.search(name)
                if match:
                    key = (int(match.group(1)), match.group(2))
                    assert key not in found, f"layer {key[0]} {key[1]}_scale stored twice: {name}"
                    tensor = f.get_tensor(name)
                    found[key] = Stored(shard, name, tensor.to(torch.float32).flatten(), tuple(tensor.shape))
    return found


def kernel_value(values: torch.Tensor) -> float:
    """The float vLLM hands the attention kernel for one stored scale tensor.

    Per-tensor scales (shape [] or [1]) are used as stored. Per-head scales (strategy "attn_head") are
    reduced to their maximum by the compressed-tensors KV-cache method, since the CPU kernel takes one
    float per layer.
    """
    return float(values.max()) if values.numel() > 1 else float(values.item())


def text_config(ckpt: Path) -> dict:
    config = json.loads((ckpt / "config.json").read_text())
    if "num_hidden_layers" not in config and "text_config" in config:
        config = config["text_config"]
    return config


def num_hidden_layers(ckpt: Path) -> int:
    return int(text_config(ckpt)["num_hidden_layers"])


def head_counts(ckpt: Path) -> tuple[int, int]:
    """(query heads, KV heads) of the model."""
    config = text_config(ckpt)
    heads = int(config["num_attention_heads"])
    return heads, int(config.get("num_key_value_heads") or heads)


def kv_cache_strategy(ckpt: Path) -> str | None:
    """`strategy` of the compressed-tensors kv_cache_scheme in config.json: tensor, attn_head or None."""
    scheme = json.loads((ckpt / "config.json").read_text()).get("quantization_config", {}).get("kv_cache_scheme")
    return None if scheme is None else scheme.get("strategy")


def skip_reason(required: set[str], feature: str, reason: str) -> str:
    """`reason`, for skipping a test whose feature the checkpoint lacks; fails when `--require` names it."""
    if feature in required:
        pytest.fail(f"--require {feature}, but {reason}")
    return reason


def fp8_fallback_reason(report: dict) -> str | None:
    """Why the engine ran with a model-dtype cache instead of FP8 (None when the cache is FP8)."""
    return report.get("fp8_kv_unsupported")


def loaded_scales(report: dict) -> dict[int, tuple[float, float]]:
    return {int(i): (float(k), float(v)) for i, (k, v) in report["scales"].items()}


def mismatched_scales(report: dict, exported: dict, layers) -> list[str]:
    """Layers among `layers` whose loaded k/v floats or buffers differ from the stored tensors."""
    mismatches = []
    loaded = loaded_scales(report)
    for layer in sorted(layers):
        for kv, got in zip("kv", loaded[layer]):
            if (layer, kv) not in exported:
                mismatches.append(f"layer {layer} {kv}: {got} loaded but nothing exported")
                continue
            values = exported[(layer, kv)].values
            want = kernel_value(values)
            if got != pytest.approx(want, rel=1e-6):
                mismatches.append(f"layer {layer} {kv}: vLLM uses {got!r}, checkpoint has {want!r}")
            # The buffer behind the float must hold the stored tensor as well (per head, if per head).
            buffer = report["layers"][str(layer)][f"{kv}_scale_buffer"]
            if buffer != pytest.approx(values.tolist(), rel=1e-6):
                mismatches.append(f"layer {layer} {kv}: buffer {buffer} != stored {values.tolist()}")
    return mismatches


@pytest.fixture(scope="module")
def exported(ckpt):
    found = scale_tensors(ckpt)
    assert found, f"no k/v scale tensors in any *.safetensors file of {ckpt}"
    return found


@pytest.fixture(scope="module")
def provenance(ckpt) -> dict:
    """kvcalib.json of the checkpoint ({} for a checkpoint kvcalib did not write)."""
    path = ckpt / "kvcalib.json"
    return json.loads(path.read_text()) if path.is_file() else {}


@pytest.fixture(scope="module")
def skipped(provenance) -> set[int]:
    """Layers whose KV cache stays in the model dtype; their scales are loaded but never used."""
    return {int(i) for i in provenance.get("skipped_layers") or []}


@pytest.fixture(scope="module")
def fp8_layers(ckpt, skipped) -> list[int]:
    layers = [i for i in range(num_hidden_layers(ckpt)) if i not in skipped]
    assert layers, f"every layer is skipped ({sorted(skipped)}): nothing runs with an FP8 cache"
    return layers


@pytest.fixture(scope="module")
def report(ckpt, cache_dtype, probe_max_tokens, tmp_path_factory):
    return run_probe(ckpt, tmp_path_factory.mktemp("probe") / "report.json", cache_dtype,
                     "--max-tokens", str(probe_max_tokens))


def test_checkpoint_has_a_scale_pair_per_layer(exported, fp8_layers):
    missing = [f"{i}.{kv}_scale" for i in fp8_layers for kv in "kv" if (i, kv) not in exported]
    assert not missing, f"checkpoint lacks scales for {missing}"


def test_index_lists_every_scale(ckpt, exported):
    """vLLM reads only the shards named in model.safetensors.index.json; an unlisted shard is skipped."""
    index = ckpt / INDEX_NAME
    if not index.is_file():
        pytest.skip("no index: vLLM reads every *.safetensors file")
    weight_map = json.loads(index.read_text())["weight_map"]
    wrong = {s.name: weight_map.get(s.name) for s in exported.values() if weight_map.get(s.name) != s.shard.name}
    assert not wrong, f"index entries missing or pointing elsewhere (name: listed shard): {wrong}"


def test_vllm_sees_every_attention_layer(ckpt, report):
    assert sorted(loaded_scales(report)) == list(range(num_hidden_layers(ckpt)))


def test_loaded_scales_equal_exported(report, exported, fp8_layers):
    """Every layer with an FP8 cache (skipped layers keep the model dtype and read no scale)."""
    mismatches = mismatched_scales(report, exported, fp8_layers)
    assert not mismatches, "\n".join(mismatches)


def test_no_scale_silently_left_at_default(report, exported, fp8_layers):
    loaded = loaded_scales(report)
    defaulted = [
        f"layer {layer} {kv}"
        for layer in fp8_layers
        for kv, got in zip("kv", loaded[layer])
        if got == 1.0 and (layer, kv) in exported and kernel_value(exported[(layer, kv)].values) != 1.0
    ]
    assert not defaulted, f"scales left at vLLM's default 1.0: {defaulted}"


def test_kv_cache_is_fp8(report, fp8_layers, required):
    reason = fp8_fallback_reason(report)
    if reason:
        pytest.skip(skip_reason(required, "fp8-kv", f"vLLM ran a model-dtype cache: {reason}"))
    assert report["kv_cache_dtype"].startswith("fp8"), report["kv_cache_dtype"]
    per_layer = {layer: report["layers"][str(layer)]["kv_cache_dtype"] for layer in fp8_layers}
    assert all(dtype.startswith("fp8") for dtype in per_layer.values()), per_layer
    tensors = {layer: report["layers"][str(layer)]["kv_cache_tensor_dtype"] for layer in fp8_layers}
    assert all(dtype in _FP8_CACHE_TENSOR_DTYPES for dtype in tensors.values()), tensors


def test_per_head_scales_load_per_head(ckpt, report, exported, fp8_layers, required):
    """`--granularity head` exports strategy `attn_head`, k/v scales of shape [kv_heads, 1, 1].

    vLLM's compressed-tensors KV-cache method sizes `k_scale`/`v_scale` as [num_kv_heads], flattens the stored
    [heads, 1, 1] tensor into them, keeps them as the `_k_scale`/`_v_scale` buffers and sets `_k_scale_float`
    / `_v_scale_float` (the one float the CPU kernel reads) to their max.
    """
    if kv_cache_strategy(ckpt) != "attn_head":
        pytest.skip(skip_reason(required, "per-head", f"kv_cache_scheme strategy is {kv_cache_strategy(ckpt)!r}, "
                                "not attn_head (--granularity head)"))
    _, kv_heads = head_counts(ckpt)
    loaded = loaded_scales(report)
    problems, heads_differ = [], False
    for layer in fp8_layers:
        details = report["layers"][str(layer)]
        if details["num_kv_heads"] != kv_heads:
            problems.append(f"layer {layer}: vLLM has {details['num_kv_heads']} KV heads, config.json {kv_heads}")
        for kv, got_float in zip("kv", loaded[layer]):
            stored = exported.get((layer, kv))
            if stored is None:
                problems.append(f"layer {layer} {kv}: no scale tensor in the checkpoint")
                continue
            if stored.shape != (kv_heads, 1, 1):
                problems.append(f"layer {layer} {kv}: stored shape {stored.shape}, want ({kv_heads}, 1, 1)")
            buffer = details[f"{kv}_scale_buffer"]
            if len(buffer) != kv_heads or buffer != pytest.approx(stored.values.tolist(), rel=1e-6):
                problems.append(f"layer {layer} {kv}: buffer {buffer} != per-head values {stored.values.tolist()}")
            if got_float != pytest.approx(float(stored.values.max()), rel=1e-6):
                problems.append(f"layer {layer} {kv}: float {got_float} != max of heads {float(stored.values.max())}")
            heads_differ |= bool(stored.values.max() != stored.values.min())
    assert not problems, "\n".join(problems)
    # Otherwise a loader that broadcast one value, or took any head for the float, would pass as well.
    assert heads_differ, "every layer's KV heads share one scale: this checkpoint cannot show per-head loading"


def expected_q_scale(stored: torch.Tensor, strategy: str | None, heads: int, kv_heads: int) -> torch.Tensor:
    """The `_q_scale` buffer vLLM 0.32 derives from a stored q_scale (values flattened).

    Per tensor: the value as stored. `attn_head`: `CompressedTensorsKVCacheMethod.create_weights` in
    vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py gives q_scale the
    shape [num_kv_heads] and loads it through `_tp_aware_loader`, which flattens the stored [heads, 1, 1]
    tensor and, for kind "q", reduces it per KV-head group ("FlashAttn expects [num_kv_heads] instead of
    [num_heads] for q_scale. We reduce by taking the max scale in each attention head group"):
    `torch.amax(loaded_weight.view(-1, total_num_heads // total_num_kv_heads), dim=1)`, i.e. consecutive
    query heads [g*G, (g+1)*G) form group g. `process_weights_after_loading` then sets `_q_scale_float`
    to the max of that buffer (`_to_scalar`).
    """
    if strategy == "attn_head":
        return torch.amax(stored.view(-1, heads // kv_heads), dim=1)
    return stored


def test_q_scale_loaded_as_vllm_derives_it(ckpt, report, provenance, fp8_layers, required):
    """`--q-scale` (recipe `q_scale: true`) exports `self_attn.q_scale`; vLLM keeps it as `_q_scale` and
    `_q_scale_float` (see `expected_q_scale` for the exact derivation).

    The CPU backend does not quantize queries, so on this machine the values are loaded but unused;
    GPU backends with FP8 attention (e.g. FlashAttention 3) read `_q_scale`.
    """
    q_exported = scale_tensors(ckpt, _Q_SCALE_RE)
    recipe_q = bool((provenance.get("recipe") or {}).get("q_scale"))
    if not (recipe_q or q_exported):
        pytest.skip(skip_reason(required, "q-scale", "no q_scale exported (recipe q_scale is false)"))
    strategy = kv_cache_strategy(ckpt)
    heads, kv_heads = head_counts(ckpt)
    want_shape = (heads, 1, 1) if strategy == "attn_head" else ()
    problems = []
    for layer in fp8_layers:
        if (layer, "q") not in q_exported:
            problems.append(f"layer {layer}: recipe has q_scale but the checkpoint has no q_scale tensor")
            continue
        stored = q_exported[(layer, "q")]
        if stored.shape != want_shape:
            problems.append(f"layer {layer} q: stored shape {stored.shape}, want {want_shape} for strategy {strategy}")
            continue
        want = expected_q_scale(stored.values, strategy, heads, kv_heads)
        details = report["layers"][str(layer)]
        if details["q_scale_buffer"] != pytest.approx(want.tolist(), rel=1e-6):
            problems.append(f"layer {layer} q: buffer {details['q_scale_buffer']} != {want.tolist()} "
                            f"(from stored {stored.values.tolist()})")
        if details["q_scale_float"] != pytest.approx(float(want.max()), rel=1e-6):
            problems.append(f"layer {layer} q: float {details['q_scale_float']} != {float(want.max())}")
    assert not problems, "\n".join(problems)


def test_skipped_layers_keep_the_model_dtype(report, skipped, exported, fp8_layers, required):
    """`--skip-layers` (kvcalib.json `skipped_layers`): served with `kv_cache_dtype_skip_layers`, those
    layers get kv_cache_dtype "auto" and a cache in the model dtype; every other layer keeps an FP8 cache
    with the exported scales."""
    if not skipped:
        pytest.skip(skip_reason(required, "skip-layers", "kvcalib.json lists no skipped_layers"))
    assert set(report["kv_cache_dtype_skip_layers"]["engine"]) == {str(i) for i in skipped}, report[
        "kv_cache_dtype_skip_layers"]
    model_dtype = report["model_dtype"]
    fallback = fp8_fallback_reason(report)  # then every layer has the model-dtype cache, not just the skipped
    per_layer = {int(i): (d["kv_cache_dtype"], d["impl_kv_cache_dtype"], d["kv_cache_tensor_dtype"])
                 for i, d in report["layers"].items()}
    for layer, (dtype, impl_dtype, tensor_dtype) in sorted(per_layer.items()):
        if layer in skipped:
            assert (dtype, impl_dtype, tensor_dtype) == ("auto", "auto", model_dtype), (layer, per_layer)
        elif fallback:  # the probe asked for the model dtype by name
            assert (dtype, impl_dtype, tensor_dtype) == (model_dtype, model_dtype, model_dtype), (layer, per_layer)
        else:
            assert dtype.startswith("fp8") and impl_dtype == dtype, (layer, per_layer)
            assert tensor_dtype in _FP8_CACHE_TENSOR_DTYPES, (layer, per_layer)
    mismatches = mismatched_scales(report, exported, fp8_layers)
    assert not mismatches, "\n".join(mismatches)


def test_generates_tokens(report):
    assert len(report["generated_token_ids"]) >= 1


def test_control_loaded_value_follows_the_file(ckpt, exported, fp8_layers, cache_dtype, tmp_path):
    """Negative control: edit one k_scale in a copy of the checkpoint and see vLLM pick up the edit.

    Proves the comparison above reads what vLLM loaded and not the file. Costs one more engine start
    (`make engine-test` runs it on the plain checkpoint only).
    """
    layer = max(fp8_layers)
    shard, name, values, _ = exported[(layer, "k")]
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
    want = kernel_value(scale_tensors(copy)[(layer, "k")].values)  # after the dtype round trip

    loaded = loaded_scales(run_probe(copy, tmp_path / "report.json", cache_dtype, "--max-tokens", "0"))
    assert loaded[layer][0] == pytest.approx(want, rel=1e-6)
    assert loaded[layer][0] != pytest.approx(kernel_value(values), rel=1e-6)
    for other in fp8_layers:
        k_loaded, v_loaded = loaded[other]
        assert v_loaded == pytest.approx(kernel_value(exported[(other, "v")].values), rel=1e-6)
        if other != layer:
            assert k_loaded == pytest.approx(kernel_value(exported[(other, "k")].values), rel=1e-6)
