"""What a checkpoint says about its KV cache (`kvcalib inspect`, `eval --scales`), without torch.

Recognises the vLLM compressed-tensors layout (`quantization_config.kv_cache_scheme` and
`*.self_attn.k_scale` / `v_scale` tensors), the TensorRT-LLM/ModelOpt layout (`hf_quant_config.json` and
`*.k_proj.k_scale` / `*.v_proj.v_scale`) and Quark's (`export.kv_cache_group`, `*.k_proj.output_scale`).
The configs are read by calib.ckpt.formats and the files by calib.ckpt.reader, as verify reads them; tensors
come from the shards the index names (or every shard when there is no index).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calib.ckpt import formats
from calib.ckpt.reader import CheckpointFiles


@dataclass
class KVInfo:
    path: Path
    targets: list[str]
    kv_scheme: dict[str, Any] | None
    scales: dict[int, dict[str, list[float]]] = field(default_factory=dict)   # layer -> {"k": [...], "v": [...]}
    provenance: dict[str, Any] | None = None
    num_layers: int | None = None
    kv_cache_quant_algo: str | None = None       # hf_quant_config.json's (TensorRT-LLM), when it declares one
    unmapped: dict[str, str] = field(default_factory=dict)   # scale-like tensor -> why no engine loads it as a scale


def read_kv_info(path: str | Path) -> KVInfo:
    """What `inspect` shows, read through calib.ckpt.reader, as `verify` reads it (any producer's layout:
    compressed-tensors, ModelOpt, Quark; bf16 scales included)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json; point at a checkpoint directory")
    ck = CheckpointFiles(path)
    first = next((p for p in ck.read_problems if p.severity == "error"), None)
    for why in (first and f"{first.where}: {first.message}", ck.index_error, ck.hf_quant_error,
                ck.api_options_error, ck.provenance_error):
        if why:
            raise ValueError(why if str(path) in why else f"{path}/{why}")
    qc = ck.inline_qc if isinstance(ck.inline_qc, dict) else {}
    scheme = formats.ct_declared_kv_scheme(qc)
    if scheme is not None and not isinstance(scheme, dict):
        raise ValueError(f"{path}/config.json: quantization_config.kv_cache_scheme must be an object, "
                         f"not {type(scheme).__name__}")
    targets = ["vllm"] if scheme or formats.quark_kv_group(qc) else []
    if targets and (ck.provenance or {}).get("target") == "sglang":
        targets = ["sglang"]      # the same compressed-tensors layout, written (per tensor, no q) for SGLang
    kv_algo = formats.modelopt_kv_cache_algo(ck.hf_quant)
    served = formats.trtllm_serve_kv_algo(ck.api_options) if ck.api_options_error is None else None
    if served in formats.TRTLLM_KV_DTYPES.values():
        kv_algo = served      # TensorRT-LLM's serve-time KV dtype (llm_api_options.yaml) overrides the checkpoint's
    if kv_algo:
        targets.append("trtllm")
    files = ck.named_files()
    unmapped = {u.tensor.name: u.why for u in ck.unmapped(files) if u.known}
    scales: dict[int, dict[str, list[float]]] = {}
    for sc in ck.scales(files):
        if isinstance(ck.num_layers, int) and sc.layer >= ck.num_layers:
            unmapped[sc.tensor.name] = f"layer {sc.layer} does not exist (num_hidden_layers = {ck.num_layers})"
            continue
        if sc.tensor.name in unmapped:
            continue
        values = ck.values(sc.tensor)
        if values is not None:
            scales.setdefault(sc.layer, {})[sc.kind] = [float(x) for x in values]
    return KVInfo(path=path, targets=targets, kv_scheme=scheme, scales=dict(sorted(scales.items())),
                  provenance=ck.provenance, num_layers=ck.num_layers,
                  kv_cache_quant_algo=kv_algo if isinstance(kv_algo, str) else None, unmapped=unmapped)
