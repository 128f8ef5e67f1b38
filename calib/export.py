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
when complete; on any error the temporary directory is removed and nothing appears at OUT.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .scales import Scales

SCALES_FILE = "kv_scales.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PROVENANCE_FILE = "kvcalib.json"
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


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


@contextmanager
def atomic_dir(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temp sibling of `out`; on success it replaces `out`, on error it is removed."""
    out = Path(out)
    if out.exists() and not force:
        raise ExportError(f"output {out} already exists; pass --force to replace it or choose another --out")
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} is a file, not a directory; choose another --out")
    blocking = next((p for p in (out.parent, *out.parent.parents) if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ExportError(f"output folder {blocking} is a file, not a directory; choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(out.parent, os.W_OK):
        raise ExportError(f"output folder {out.parent} is not writable; choose another --out")
    tmp = out.parent / f".{out.name}.kvcalib-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            trash = out.parent / f".{out.name}.kvcalib-old-{os.getpid()}"
            os.rename(out, trash)
            os.rename(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_space(files: list[Path], out: Path, extra_bytes: int = 1 << 20) -> None:
    """Refuse before writing when the output filesystem cannot hold the export. Weights on the same
    filesystem are hard-linked and cost no space; otherwise their bytes are copied."""
    parent = next(p for p in (out.parent, *out.parent.parents) if p.exists())
    same_fs = all(f.stat().st_dev == parent.stat().st_dev for f in files)
    need = extra_bytes + (0 if same_fs else sum(f.stat().st_size for f in files))
    free = shutil.disk_usage(parent).free
    if free < need:
        raise ExportError(f"output folder {parent} has {free / 2**30:.2f} GiB free but the export needs "
                          f"{need / 2**30:.2f} GiB; free space or choose another --out")


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


def _weight_map(src: Path) -> tuple[dict[str, str], int]:
    """tensor name -> shard file, and total tensor bytes, from the index or from the shards' headers."""
    from safetensors import safe_open

    index = src / INDEX_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text())
            wmap = dict(data["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ExportError(f"{index} is not a valid safetensors index ({e}); repair or remove it") from None
        missing = sorted({f for f in wmap.values() if not (src / f).is_file()})
        if missing:
            raise ExportError(f"{index} names shard(s) {missing} that are not in {src}; the checkpoint is incomplete")
        total = data.get("metadata", {}).get("total_size")
        if isinstance(total, int):
            return wmap, total
        shards = sorted(set(wmap.values()))
    else:
        shards = sorted(p.name for p in src.glob("*.safetensors"))
        wmap = {}
        if not shards:
            raise ExportError(f"{src} has no .safetensors weights; engines' checkpoints are written beside "
                              "safetensors weights only: convert the model, or calibrate with --target '' for "
                              "statistics only")
    total = 0
    for shard in shards:
        try:
            with safe_open(src / shard, framework="pt") as f:
                for key in f.keys():
                    wmap.setdefault(key, shard)
                    sl = f.get_slice(key)
                    total += _DTYPE_BYTES.get(sl.get_dtype(), 0) * int(torch.Size(sl.get_shape()).numel())
        except Exception as e:
            raise ExportError(f"{src / shard}: not a readable safetensors file ({str(e)[:200]})") from None
    return wmap, total


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
    total_size: int
    drop: frozenset[str] = frozenset()   # existing KV-scale tensors to leave out (--overwrite-kv-scales)


def prepare_source(source: Path, out: Path, *, quantized_ok: bool = False, overwrite_kv: bool = False) -> PreparedSource:
    """Validate a source checkpoint for export (before anything is written). A weight-quantized source is
    accepted when `quantized_ok` and its config is compressed-tensors (the only weight format whose config
    we merge into for vLLM); other formats get an error that says so."""
    source, out = Path(source), Path(out)
    if out.resolve() == source.resolve():
        raise ExportError(f"--out {out} is the source model directory; choose a new directory")
    config = json.loads((source / "config.json").read_text())
    qc = config.get("quantization_config")
    if qc is not None and not quantized_ok:
        raise ExportError(f"{source}/config.json already has a quantization_config; to add KV scales to a "
                          "weight-quantized checkpoint, pass it as --into")
    if qc is not None and qc.get("quant_method") != "compressed-tensors":
        raise ExportError(f"{source}: weight quantization {qc.get('quant_method')!r} — the vllm target merges KV "
                          "scales only into compressed-tensors configs; use the trtllm target for ModelOpt checkpoints")
    if qc is not None and qc.get("kv_cache_scheme") and not overwrite_kv:
        raise ExportError(f"{source} already declares a kv_cache_scheme; pass --overwrite-kv-scales to replace its "
                          "KV scales, or start from the checkpoint without them")
    wmap, total = _weight_map(source)
    existing = sorted(k for k in wmap if _is_kv_scale(k))
    if existing and not overwrite_kv:
        raise ExportError(f"{source} already carries KV scale tensors ({existing[0]}, ...); pass "
                          "--overwrite-kv-scales to replace them, or start from the checkpoint without them")
    return PreparedSource(source, config, wmap, total, drop=frozenset(existing))


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
    weight_files = set(src.weight_map.values())
    rewrite = {src.weight_map[k] for k in src.drop}   # shards holding old KV scales: re-saved without them
    check_space([source / f for f in sorted(weight_files)], Path(out))
    with atomic_dir(out, force) as tmp:
        how = set()
        for f in sorted(source.iterdir()):
            if not f.is_file() or f.name in ("config.json", INDEX_FILE, PROVENANCE_FILE, SCALES_FILE,
                                             *(extra_files or {})):
                continue
            if f.name in rewrite:
                how.add(_without(f, tmp / f.name, src.drop))
            elif f.name in weight_files:
                how.add(link_or_copy(f, tmp / f.name))
            elif f.suffix != ".safetensors":
                shutil.copy2(f, tmp / f.name)
        save_file(tensors, str(tmp / SCALES_FILE), metadata={"format": "pt", "producer": "kvcalib"})
        new_map = {**wmap, **{name: SCALES_FILE for name in tensors}}
        index = {"metadata": {"total_size": total + sum(4 * t.numel() for t in tensors.values())},
                 "weight_map": dict(sorted(new_map.items()))}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        (tmp / SCALES_FILE).chmod(0o644)
        prov = {**provenance, "weights": sorted(how)}
        (tmp / PROVENANCE_FILE).write_text(json.dumps(prov, indent=2) + "\n")
    return out
