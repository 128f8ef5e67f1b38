"""Write a checkpoint that an engine loads with our KV scales; the source weights are never rewritten.

Why not `save_pretrained`: re-serializing a 16 GB model costs minutes and risks changing bytes (dtype
casts, tied weights, shard layout). Weight files are hard-linked (or copied where links are impossible)
byte for byte; the scales go into one extra shard named in `model.safetensors.index.json`, and only the
small JSON files are rewritten.

vLLM target (compressed-tensors format): `config.json` gains a `quantization_config` with an empty
`config_groups` and a `kv_cache_scheme`; tensors `model.layers.{i}.self_attn.k_scale` / `.v_scale`.
Without the config vLLM refuses the scale tensors; with the config but without tensors it silently
uses 1.0 — so both are written together, always.

Atomicity: everything is written to a hidden temporary sibling directory and renamed into place only
when complete; on any error the temporary directory is removed and nothing appears at OUT (`outputs`
decides what may be written or replaced, and locks OUT).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .outputs import atomic_dir, check_room  # noqa: F401  (atomic_dir: re-exported for the exporters)
from . import integrity
from .integrity import INDEX_FILE
from .scales import Scales

SCALES_FILE = "kv_scales.safetensors"
PROVENANCE_FILE = "kvcalib.json"


class ExportError(RuntimeError):
    """The checkpoint cannot be written; nothing was left at the output path."""


def vllm_scale_name(layer: int, kind: str) -> str:
    """`kind` is k, v or q; vLLM remaps `self_attn.{kind}_scale` onto its attention layer."""
    return f"model.layers.{layer}.self_attn.{kind}_scale"


def vllm_quantization_config(strategy: str = "tensor") -> dict[str, Any]:
    """The compressed-tensors block for KV-only FP8, built with the library's own objects.
    `config_groups` stays (empty): vLLM injects head counts for `attn_head` only when the key exists."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    qc = QuantizationConfig(
        config_groups={},
        kv_cache_scheme=QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=False, symmetric=True),
        quantization_status="compressed",
        format="dense",
        ignore=[],
    )
    return _drop_none(qc.to_dict())


def _drop_none(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _drop_none(v) for k, v in d.items() if v is not None}
    return d


def _without(src: Path, dst: Path, drop: frozenset[str]) -> str:
    """Re-save a shard without the named tensors; every other tensor keeps its exact bytes and dtype."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        kept = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
    save_file(kept, str(dst), metadata=meta)
    return "rewritten without old KV scales"


def link_or_copy(src: Path, dst: Path) -> str:
    """Hard link when the filesystem allows (free, byte-identical), else copy the bytes."""
    try:
        os.link(src, dst)
        return "link"
    except OSError:
        shutil.copyfile(src, dst)
        return "copy"


def scan_source(src: Path) -> integrity.Checkpoint:
    """The source's weight files and tensors, every header checked (calib/integrity.py), as an ExportError."""
    if not any(Path(src).glob("*.safetensors")) and not (Path(src) / INDEX_FILE).exists():
        raise ExportError(f"{src} has no .safetensors weights; engines' checkpoints are written beside "
                          "safetensors weights only: convert the model, or calibrate with --target '' for "
                          "statistics only")
    try:
        return integrity.scan(Path(src))
    except integrity.IntegrityError as e:
        raise ExportError(str(e)) from None


def read_source_config(src: Path) -> dict[str, Any]:
    try:
        return integrity.read_json(Path(src) / "config.json", f"{src}/config.json")
    except integrity.IntegrityError as e:
        raise ExportError(str(e)) from None


def carry_files(src: PreparedSource, tmp: Path, skip: set[str]) -> set[str]:
    """Put the source's files into `tmp`: weight shards hard-linked (or copied; re-saved without old KV scales
    where asked), other files (tokenizer, generation config, ...) copied; names in `skip` are written by the
    caller. Only files inside the source folder are carried. Returns how the weights travelled."""
    how = set()
    rewrite = {src.weight_map[k] for k in src.drop}
    for name in sorted(src.shards):
        dst = tmp / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shard = src.path / name
        how.add(_without(shard, dst, src.drop) if name in rewrite else link_or_copy(shard, dst))
    for f in sorted(src.path.iterdir()):
        if f.name in skip or f.name in src.shards or f.suffix == ".safetensors" or not f.is_file():
            continue
        try:
            integrity.contained(src.path, f.name, str(src.path))
        except integrity.IntegrityError as e:
            raise ExportError(str(e)) from None
        shutil.copy2(f, tmp / f.name)
    return how


def _vllm_tensor(scale: torch.Tensor, strategy: str) -> torch.Tensor:
    """Per tensor: one element, shape []. `attn_head`: [heads, 1, 1], the layout vLLM's loader flattens."""
    t = scale.to(torch.float32).contiguous()
    return t.reshape(()) if strategy == "tensor" else t.reshape(-1, 1, 1)


def export_vllm(source: Path, out: Path, scales: Scales, provenance: dict[str, Any], *, strategy: str = "tensor",
                force: bool = False, overwrite_kv: bool = False) -> Path:
    """Write the vLLM (compressed-tensors) variant of `source` with `scales` to `out`; returns `out`.
    `strategy` is `tensor` (scales of shape []) or `attn_head` (scales of shape [kv_heads]).

    A `source` that already carries a compressed-tensors weight config (W8A8, FP8, W4A16 ... made by
    llm-compressor) keeps it — `config_groups`, `ignore`, `format` and the rest — and gains only a
    `kv_cache_scheme`; its weight files are carried over byte for byte like any other source's."""
    prepared = prepare_source(source, out, quantized_ok=True, overwrite_kv=overwrite_kv)
    tensors: dict[str, torch.Tensor] = {}
    for layer, s in scales.items():
        for kind, value in (("k", s.k_scale), ("v", s.v_scale), ("q", s.q_scale)):
            if value is not None:
                if strategy == "tensor" and value.numel() != 1:
                    raise ExportError(f"layer {layer}: {kind}_scale has {value.numel()} values but strategy is tensor")
                tensors[vllm_scale_name(layer, kind)] = _vllm_tensor(value, strategy)
    qc = prepared.config.get("quantization_config")
    if qc is None:
        qc = vllm_quantization_config(strategy)
    else:
        qc = {**qc, "kv_cache_scheme": vllm_quantization_config(strategy)["kv_cache_scheme"]}
        qc.setdefault("config_groups", {})
    config = dict(prepared.config, quantization_config=qc)
    return write_variant(prepared, out, tensors, config, {**provenance, "target": "vllm"}, force=force)


@dataclass(frozen=True)
class PreparedSource:
    path: Path
    config: dict[str, Any]
    weight_map: dict[str, str]
    total_size: int                      # bytes of the carried tensors, from the shard headers
    drop: frozenset[str] = frozenset()   # existing KV-scale tensors to leave out (--overwrite-kv-scales)
    shards: tuple[str, ...] = ()         # weight file names (relative to `path`), every header checked


def prepare_source(source: Path, out: Path, *, quantized_ok: bool = False, overwrite_kv: bool = False) -> PreparedSource:
    """Validate a source checkpoint for export (before anything is written). A weight-quantized source is
    accepted when `quantized_ok` and its config is compressed-tensors (the only weight format whose config
    we merge into for vLLM); other formats get an error that says so."""
    source, out = Path(source), Path(out)
    if out.resolve() == source.resolve():
        raise ExportError(f"--out {out} is the source model directory; choose a new directory")
    config = read_source_config(source)
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ExportError(f"{source}/config.json: quantization_config must be an object, not {type(qc).__name__}")
    if qc is not None and not quantized_ok:
        raise ExportError(f"{source}/config.json already has a quantization_config; to add KV scales to a "
                          "weight-quantized checkpoint, pass it as --into")
    if qc is not None and qc.get("quant_method") != "compressed-tensors":
        raise ExportError(f"{source}: weight quantization {qc.get('quant_method')!r} — the vllm target merges KV "
                          "scales only into compressed-tensors configs; use the trtllm target for ModelOpt checkpoints")
    if qc is not None and qc.get("kv_cache_scheme") and not overwrite_kv:
        raise ExportError(f"{source} already declares a kv_cache_scheme; pass --overwrite-kv-scales to replace its "
                          "KV scales, or start from the checkpoint without them")
    ckpt = scan_source(source)
    wmap = ckpt.weight_map
    existing = sorted(k for k in wmap if _is_kv_scale(k))
    if existing and not overwrite_kv:
        raise ExportError(f"{source} already carries KV scale tensors ({existing[0]}, ...); pass "
                          "--overwrite-kv-scales to replace them, or start from the checkpoint without them")
    total = sum(ckpt.tensor(k).nbytes for k in wmap if k not in existing)
    return PreparedSource(source, config, dict(wmap), total, drop=frozenset(existing), shards=tuple(ckpt.shards))


def _is_kv_scale(name: str) -> bool:
    """KV-cache scale tensors of any producer's layout (compressed-tensors, ModelOpt, Quark)."""
    return ".self_attn." in name and name.rsplit(".", 1)[-1] in ("k_scale", "v_scale", "q_scale", "output_scale",
                                                                  "k_zero_point", "v_zero_point", "q_zero_point")


def write_variant(src: PreparedSource, out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                  provenance: dict[str, Any], *, force: bool = False, extra_files: dict[str, str] | None = None) -> Path:
    """Link the weights, add the scale shard to the index, write config/provenance (+ extra JSON files)."""
    from safetensors.torch import save_file

    source, total = src.path, src.total_size
    wmap = {k: v for k, v in src.weight_map.items() if k not in src.drop}
    check_room(Path(out), [source / f for f in src.shards])
    with atomic_dir(out, force, inputs=[("the model folder", source)]) as tmp:
        how = carry_files(src, tmp, {"config.json", INDEX_FILE, PROVENANCE_FILE, SCALES_FILE, *(extra_files or {})})
        save_file(tensors, str(tmp / SCALES_FILE), metadata={"format": "pt", "producer": "kvcalib"})
        new_map = {**wmap, **{name: SCALES_FILE for name in tensors}}
        index = {"metadata": {"total_size": total + sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": dict(sorted(new_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        (tmp / SCALES_FILE).chmod(0o644)
        prov = {**provenance, "weights": sorted(how)}
        (tmp / PROVENANCE_FILE).write_text(json.dumps(prov, indent=2) + "\n")
    return out
