"""Read what a checkpoint says about its KV cache, without torch (so `kvcalib inspect` is instant).

Recognises the vLLM compressed-tensors layout (`quantization_config.kv_cache_scheme` and
`*.self_attn.k_scale` / `v_scale` tensors) and the TensorRT-LLM layout (`hf_quant_config.json` and
`*.k_proj.k_scale` / `*.v_proj.v_scale`); tensors are read through the safetensors index or the shards.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(k|v|q)_proj\.)?(k|v|q)_scale$")


@dataclass
class KVInfo:
    path: Path
    targets: list[str]
    kv_scheme: dict[str, Any] | None
    scales: dict[int, dict[str, list[float]]] = field(default_factory=dict)   # layer -> {"k": [...], "v": [...]}
    provenance: dict[str, Any] | None = None
    num_layers: int | None = None


def _shards(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(path.glob("*.safetensors"))


def read_kv_info(path: str | Path) -> KVInfo:
    from safetensors import safe_open

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json; point at a checkpoint directory")
    config = json.loads(cfg_file.read_text())
    qc = config.get("quantization_config") or {}
    targets = []
    scheme = qc.get("kv_cache_scheme") if qc.get("quant_method") == "compressed-tensors" else None
    if scheme:
        targets.append("vllm")
    if (path / "hf_quant_config.json").is_file():
        hq = json.loads((path / "hf_quant_config.json").read_text()).get("quantization", {})
        if hq.get("kv_cache_quant_algo"):
            targets.append("trtllm")
    from .verify._checkpoint import tensor_values

    scales: dict[int, dict[str, list[float]]] = {}
    for shard in _shards(path):
        with safe_open(shard, framework="numpy") as f:
            keys = list(f.keys())
        for key in keys:
            m = _SCALE.search(key)
            values = tensor_values(shard, key) if m else None
            if values is not None:
                scales.setdefault(int(m.group(1)), {})[m.group(3)] = [float(x) for x in values]
    prov_file = path / "kvcalib.json"
    prov = json.loads(prov_file.read_text()) if prov_file.is_file() else None
    text_cfg = config.get("text_config", config)
    return KVInfo(path=path, targets=targets, kv_scheme=scheme, scales=dict(sorted(scales.items())),
                  provenance=prov, num_layers=text_cfg.get("num_hidden_layers"))
