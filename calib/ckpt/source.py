"""A source model folder read for export: its config, its weight map and the KV scales it already carries,
checked before anything is written (no torch: headers only).

Each engine's writer (calib.export) adds its own checks on the source's quantization config; what is
common to all of them — the output is not the source, the config is strict JSON, every shard header is
sound, the tensor sizes the new index will state — lives here. A folder's config.json and headers are read
once into `SourceFiles`; the model's checks (calib.model.load.preflight) and every target's `prepare` share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calib.ckpt import integrity
from calib.ckpt.names import CONFIG_FILE, INDEX_FILE
from calib.errors import KvcalibError
from calib.safety.readers import raising


class ExportError(KvcalibError, RuntimeError):
    """The checkpoint cannot be written; nothing was left at the output path."""


@dataclass(frozen=True)
class PreparedSource:
    path: Path
    config: dict[str, Any]
    weight_map: dict[str, str]
    total_size: int                      # bytes of the carried tensors, from the shard headers
    drop: frozenset[str] = frozenset()   # existing KV-scale tensors to leave out (--overwrite-kv-scales)
    shards: tuple[str, ...] = ()         # weight file names (relative to `path`), every header checked


@dataclass(frozen=True)
class SourceFiles:
    """A model folder's config.json and checked safetensors headers, read once."""
    path: Path
    config: dict[str, Any]
    weights: integrity.Checkpoint | None = None   # None: not scanned yet (or no safetensors weights)


def read_source(src: Path | SourceFiles) -> SourceFiles:
    """`src`'s config.json (strict JSON, an ExportError otherwise); a SourceFiles is returned as it is."""
    if isinstance(src, SourceFiles):
        return src
    with raising(ExportError, integrity.IntegrityError):
        return SourceFiles(Path(src), integrity.read_json(Path(src) / CONFIG_FILE, f"{Path(src)}/{CONFIG_FILE}"))


def check_out_is_not_source(source: Path, out: Path) -> None:
    if Path(out).resolve() == Path(source).resolve():
        raise ExportError(f"--out {out} is the source model directory; choose a new directory")


def scan_source(src: Path | SourceFiles) -> integrity.Checkpoint:
    """The source's weight files and tensors, every header checked (calib/ckpt/integrity.py), as an ExportError;
    headers a SourceFiles carries are not read again."""
    if isinstance(src, SourceFiles):
        if src.weights is not None:
            return src.weights
        src = src.path
    if not any(Path(src).glob("*.safetensors")) and not (Path(src) / INDEX_FILE).exists():
        raise ExportError(f"{src} has no .safetensors weights; engines' checkpoints are written beside "
                          "safetensors weights only: convert the model, or calibrate with --target '' for "
                          "statistics only")
    with raising(ExportError, integrity.IntegrityError):
        return integrity.scan(Path(src))


def read_json(path: Path) -> dict[str, Any]:
    """Another JSON file of the source (strict, an object), as an ExportError."""
    with raising(ExportError, integrity.IntegrityError):
        return integrity.read_json(path)


def scan_weights(source: Path | SourceFiles, config: dict[str, Any], carried: Callable[[str], bool], *,
                 overwrite_kv: bool = False, hint: str = "") -> PreparedSource:
    """The source's weights for export. Tensors `carried` calls KV scales are an error unless `overwrite_kv`,
    which leaves them out of the output (`drop`). `hint` finishes the error's advice."""
    ckpt = scan_source(source)
    source = source.path if isinstance(source, SourceFiles) else source
    wmap = ckpt.weight_map
    existing = sorted(k for k in wmap if carried(k))
    if existing and not overwrite_kv:
        raise ExportError(f"{source} already carries KV scale tensors ({existing[0]}, ...); {hint}"
                          "start from a checkpoint without them")
    total = sum(ckpt.tensor(k).nbytes for k in wmap if k not in existing)
    return PreparedSource(Path(source), config, dict(wmap), total, drop=frozenset(existing), shards=tuple(ckpt.shards))
