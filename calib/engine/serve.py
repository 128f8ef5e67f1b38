"""Serve configurations: which engine arms can share one engine start, and the KV scales each must hold.

Why: an engine start costs about a minute on a GPU (docs/design.md §11) and an evaluation has up to eight
arms, most of which differ only in their KV scales: FP8 with the default scale 1.0 and each `--scales`
checkpoint of the same model. Those share one start: the runner loads the first and sets the others' scales
in place (calib/engine/protocol.py). Everything else the engine fixes at start-up splits them:
- the weights: a checkpoint kvcalib wrote carries its model's weights plus scales; two folders share a start
  only when their weights fingerprints (calib/ckpt/fingerprint.py) and their config.json, less its
  `quantization_config`, are equal; a folder whose weights cannot be read is its own configuration;
- the KV cache dtype and the skipped layers (`--kv-cache-dtype-skip-layers`);
- the scale layout: vLLM builds per-head scale tensors ([kv_heads]) and, on FlashAttention-3, a per-group
  query quantizer for an `attn_head` checkpoint, per-tensor ones otherwise (vLLM's
  compressed_tensors.CompressedTensorsKVCacheMethod.create_weights, layers/attention/attention.py):
  a tensor cannot change its shape in place, so each layout has its own start.

The scales an arm must hold are read from its checkpoint (calib.ckpt.kvinfo), as vLLM's compressed-tensors
loader stores them: per-head k/v flattened, q reduced to its max per KV-head group (per tensor: one value),
1.0 where the checkpoint has none; the default arm holds 1.0 everywhere.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from calib.ckpt import fingerprint, integrity
from calib.ckpt.kvinfo import read_kv_info
from calib.recipe.support import skip_order

ONE = [1.0]


def held_q(q: list[float], n: int) -> list[float]:
    """The q scales an engine with `n` per layer (KV heads; 1 per tensor) holds for a layer that stores `q`: one
    per query head is reduced to the max of each KV head's group of consecutive query heads, as vLLM's
    compressed-tensors loader does (CompressedTensorsKVCacheMethod.create_weights, _tp_aware_loader). With one KV
    head (MQA) or per tensor, every query head is in the one group: its max. A length that is no multiple of `n`
    is sent as stored, so the read-back names the layer."""
    if len(q) == n or len(q) % n:
        return list(q)
    g = len(q) // n
    return [max(q[j * g:(j + 1) * g]) for j in range(n)]


def _row(layer: int, n: int, sc: dict[str, list[float]]) -> dict[str, Any]:
    q = held_q(sc.get("q") or [1.0] * n, n)
    return {"layer": layer, "k": list(sc.get("k") or [1.0] * n), "v": list(sc.get("v") or [1.0] * n), "q": q}


def scales_of(arm: Any) -> dict[str, Any] | None:
    """What the engine must hold for `arm` (protocol: a request arm's `scales`); None for the reference."""
    if arm.dtype is None:
        return None
    layers = sorted(set(arm.k) | set(arm.v) | set(arm.skip) | set(arm.serve_skip))   # quantised or skipped: all
    if arm.kind != "checkpoint":
        return {"layout": "tensor", "layers": [_row(i, 1, {}) for i in layers]}
    info = read_kv_info(arm.source)
    head = (info.kv_scheme or {}).get("strategy") == "attn_head"
    n = max([len(sc.get(kind) or ONE) for sc in info.scales.values() for kind in ("k", "v")] + [1]) if head else 1
    return {"layout": "head" if head else "tensor", "layers": [_row(i, n, info.scales.get(i, {})) for i in layers]}


def identity(model: str) -> tuple[str, ...]:
    """What a model folder is to the engine, less its KV scales: ("weights", fingerprint, config without
    quantization_config) for a safetensors folder, else ("path", the path): only the same folder matches."""
    path = Path(model)
    try:
        ck = integrity.scan(path)
        prints = fingerprint.tensor_prints(ck)
        config = integrity.read_json(path / "config.json", "config.json")
    except (OSError, ValueError):
        return ("path", str(path.resolve()) if path.exists() else str(model))
    if not prints:
        return ("path", str(path.resolve()))
    config.pop("quantization_config", None)
    return ("weights", fingerprint.weights_sha256(ck, prints), json.dumps(config, sort_keys=True))


def key(spec: dict[str, Any], ident: Callable[[str], tuple[str, ...]] = identity) -> tuple[Any, ...]:
    """The serve configuration of a request arm: arms with equal keys share one engine start (skip lists equal as
    sets are one configuration, whatever their order)."""
    layout = (spec.get("scales") or {}).get("layout")
    return (ident(spec["model"]), spec["kv_cache_dtype"], tuple(skip_order(spec["skip_layers"])), layout)


def group(specs: Sequence[dict[str, Any]], ident: Callable[[str], tuple[str, ...]] = identity) -> list[list[int]]:
    """Indices of `specs` per engine start, in order of first appearance (each start keeps its arms' order)."""
    cached = functools.cache(ident)       # a folder's identity reads its weights' bytes: once per folder
    groups: dict[tuple[Any, ...], list[int]] = {}
    for j, spec in enumerate(specs):
        groups.setdefault(key(spec, cached), []).append(j)
    return list(groups.values())
