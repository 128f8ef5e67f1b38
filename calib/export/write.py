"""The one writer every engine target uses: carry the source's files, add one scale shard, index it.

Why not `save_pretrained`: re-serializing a 16 GB model costs minutes and risks changing bytes (dtype
casts, tied weights, shard layout). Weight files are hard-linked (or copied where links are impossible)
byte for byte; the scales go into one extra shard named in `model.safetensors.index.json`, and only the
small JSON files are rewritten.

Atomicity: everything is written to a hidden temporary sibling directory and renamed into place only
when complete; on any error the temporary directory is removed and nothing appears at OUT (`outputs`
decides what may be written or replaced, and locks OUT).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calib.ckpt import integrity, weightmap
from calib.ckpt.names import CONFIG_FILE, INDEX_FILE, PROVENANCE_FILE, SCALES_FILE
from calib.ckpt.source import ExportError, PreparedSource
from calib.provenance import Provenance, as_provenance
from calib.safety import files
from calib.safety.outputs import atomic_dir, check_room
from calib.safety.readers import raising

if TYPE_CHECKING:
    import torch


def _without(src: Path, dst: Path, drop: frozenset[str]) -> str:
    """Re-save a shard without the named tensors; every other tensor keeps its exact bytes and dtype."""
    from safetensors import safe_open

    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        kept = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
    files.save_tensors(dst, kept, meta)
    return "rewritten without old KV scales"


def link_or_copy(src: Path, dst: Path) -> str:
    """Hard link when the filesystem allows (free, byte-identical), else copy the bytes (into a new file: a link
    at `dst` is refused either way)."""
    try:
        os.link(src, dst)
        return "link"
    except FileExistsError:
        raise
    except OSError:
        files.copy(src, dst)
        return "copy"


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
        with raising(ExportError, integrity.IntegrityError):
            integrity.contained(src.path, f.name, str(src.path))
        files.copy(f, tmp / f.name)
    return how


def write_variant(src: PreparedSource, out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None,
                  provenance: Provenance | dict[str, Any], *, force: bool = False,
                  extra_files: dict[str, str] | None = None) -> Path:
    """Link the weights, add the scale shard to the index, write config/provenance (+ extra JSON files).
    `config` None keeps the source's config.json byte for byte."""
    source, total = src.path, src.total_size
    wmap = {k: v for k, v in src.weight_map.items() if k not in src.drop}
    check_room(Path(out), [source / f for f in src.shards])
    with atomic_dir(out, force, inputs=[("the model folder", source)]) as tmp:
        how = carry_files(src, tmp, {CONFIG_FILE, INDEX_FILE, PROVENANCE_FILE, SCALES_FILE, *(extra_files or {})})
        files.save_tensors(tmp / SCALES_FILE, tensors, {"format": "pt", "producer": "kvcalib"})
        new_map = {**wmap, **{name: SCALES_FILE for name in tensors}}
        index = weightmap.document(new_map, total + sum(t.numel() * t.element_size() for t in tensors.values()))
        files.write_text(tmp / INDEX_FILE, json.dumps(index, indent=2) + "\n")
        if config is None:
            files.copy(source / CONFIG_FILE, tmp / CONFIG_FILE)
        else:
            files.write_text(tmp / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, text in (extra_files or {}).items():
            files.write_text(tmp / name, text)
        (tmp / SCALES_FILE).chmod(0o644)
        prov = as_provenance(provenance).with_weights(sorted(how))
        files.write_text(tmp / PROVENANCE_FILE, json.dumps(prov.to_dict(), indent=2) + "\n")
    return out
