"""What a model folder's own files say, read once and checked before any weight is loaded.

Why a module of its own: a checkpoint is a folder of JSON files that name other files, and safetensors
shards whose JSON headers name byte ranges. Each of those names is input. An index whose `weight_map`
says `../../../../etc/passwd`, a shard symlinked out of the folder, a header whose offsets run past the
end of the file or whose byte counts do not match the shape: each must stop the run with one line naming
the file, before the forward pass (and before export copies a single name into OUT). Export and the
TensorRT-LLM variant take their file lists and the index's `total_size` from here, computed from the
headers, never from the source index's own claim. (The index's fields are parsed by calib.ckpt.weightmap;
this module checks what they name against the folder.)

This module imports neither torch nor transformers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from calib.ckpt import weightmap
from calib.ckpt.names import INDEX_FILE
from calib.errors import KvcalibError

MAX_JSON_BYTES = 64 << 20          # config/index/provenance files are kilobytes; 64 MiB is a broken file
MAX_HEADER_BYTES = 100_000_000     # the safetensors library's own limit
# safetensors dtype -> bits per element (sub-byte types pack several elements per byte)
DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8,
              "BOOL": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
              "U16": 16, "U32": 32, "U64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
# dtypes that hold integer-coded or packed weights: meaningless without a quantization_config
PACKED_DTYPES = frozenset({"I8", "U8", "I16", "U16", "I32", "U32", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2",
                           "F8_E5M2FNUZ", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"})


class IntegrityError(KvcalibError, ValueError):
    """A file of the model folder is unreadable, inconsistent or names something outside the folder."""


# ---------------------------------------------------------------- JSON files

def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise IntegrityError(f"key {k!r} appears twice")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise IntegrityError(f"{name} is not a JSON number")


def parse_json(raw: bytes, where: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity; errors are one line starting with `where`."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise IntegrityError(f"{where} is not UTF-8 text; repair or replace it") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except json.JSONDecodeError as e:
        raise IntegrityError(f"{where} is not valid JSON (line {e.lineno}: {e.msg}); repair or replace it") from None
    except IntegrityError as e:
        raise IntegrityError(f"{where} is not valid JSON ({e}); repair or replace it") from None
    except RecursionError:
        raise IntegrityError(f"{where} is nested too deeply to be a settings file; repair or replace it") from None


def read_json(path: Path, what: str | None = None, *, kind: type | None = dict) -> Any:
    """Read a small JSON file; `kind` (default dict) is the required top-level type."""
    return read_json_digest(path, what, kind=kind)[0]


def read_json_digest(path: Path, what: str | None = None, *, kind: type | None = dict) -> tuple[Any, str]:
    """`read_json`, and `sha256:<hex>` of the bytes it parsed (one read serves both)."""
    path = Path(path)
    where = what or str(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except FileNotFoundError:
        raise IntegrityError(f"{where} not found") from None
    except OSError as e:
        raise IntegrityError(f"{where} cannot be read ({e.strerror or type(e).__name__})") from None
    if len(raw) > MAX_JSON_BYTES:
        raise IntegrityError(f"{where} is larger than {MAX_JSON_BYTES >> 20} MiB; it is not a settings file")
    value = parse_json(raw, where)
    if kind is not None and not isinstance(value, kind):
        raise IntegrityError(f"{where} must hold a JSON {'object' if kind is dict else kind.__name__}, "
                             f"not {type(value).__name__}")
    return value, digest(raw)


def digest(raw: bytes) -> str:
    """How kvcalib names a file's content: `sha256:<hex>` (statistics files name their model's config.json so)."""
    return "sha256:" + hashlib.sha256(raw).hexdigest()


# ---------------------------------------------------------------- names inside the folder

def _home(root: Path) -> Path:
    """Where files of `root` may really live: the folder itself, or, for a Hugging Face hub cache snapshot
    (`models--org--name/snapshots/<rev>`, whose files are links into `../../blobs`), the repo's cache folder."""
    real = root.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--")):
        return real.parent.parent
    return real


def contained(root: Path, name: Any, where: str) -> Path:
    """`root / name` when `name` is a plain relative file name that stays inside `root` (links included)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise IntegrityError(f"{where} names {name!r}, which is not a file name")
    if os.path.isabs(name) or name.startswith("~") or ".." in Path(name).parts or "\\" in name:
        raise IntegrityError(f"{where} names {name!r}, which leaves the model folder; names must be relative "
                             "paths inside it")
    path = root / name
    real = path.resolve()
    home = _home(root)
    if real != home and home not in real.parents:
        raise IntegrityError(f"{where}: {name!r} is a link to {real}, outside the model folder; copy the file in")
    return path


# ---------------------------------------------------------------- safetensors headers

@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0          # where its bytes start in the file (header included)


@dataclass(frozen=True)
class Shard:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def read_header(path: Path, where: str | None = None) -> Shard:
    """Open a safetensors file and check its header against the file: JSON object, known dtypes, shapes of
    non-negative integers, byte ranges that match the shapes, lie inside the file and cover the data
    section exactly (what the safetensors library itself requires when it maps the file)."""
    where = where or str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise IntegrityError(f"{where} is not a safetensors file ({size} bytes; truncated or empty)")
            n = struct.unpack("<Q", head)[0]
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise IntegrityError(f"{where} is not a safetensors file (header of {n} bytes in a file of "
                                     f"{size}); truncated or another format")
            raw = f.read(n)
    except OSError as e:
        raise IntegrityError(f"{where} cannot be read ({e.strerror or type(e).__name__})") from None
    header = parse_json(raw.rstrip(b" "), f"{where} header")
    if not isinstance(header, dict):
        raise IntegrityError(f"{where}: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise IntegrityError(f"{where}: safetensors __metadata__ must map strings to strings")
    data_len = size - 8 - n
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, e in header.items():
        tensors[name] = replace(_entry(name, e, where), offset=8 + n + e["data_offsets"][0])
        begin, end = e["data_offsets"]
        if end > data_len:
            raise IntegrityError(f"{where}: tensor {name!r} ends at byte {end} of a {data_len}-byte data section; "
                                 "the file is truncated")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            what = "overlaps another tensor" if begin < at else f"leaves a gap at byte {at}"
            raise IntegrityError(f"{where}: tensor {name!r} {what}; the file is corrupt")
        at = end
    if at != data_len:
        raise IntegrityError(f"{where}: {data_len - at} bytes after the last tensor; the file is corrupt or truncated")
    return Shard(Path(path), tensors, dict(meta))


def _entry(name: str, e: Any, where: str) -> TensorInfo:
    def bad(why: str) -> IntegrityError:
        return IntegrityError(f"{where}: tensor {name!r} {why}; the file is corrupt or not safetensors")

    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        raise bad("has no {dtype, shape, data_offsets} entry")
    dtype, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise bad(f"has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(is_count(d) for d in shape):
        raise bad(f"has shape {shape!r}, not a list of non-negative integers")
    if not (isinstance(offs, list) and len(offs) == 2 and all(is_count(o) for o in offs) and offs[0] <= offs[1]):
        raise bad(f"has data_offsets {offs!r}, not [begin, end]")
    nbytes = (math.prod(shape) * DTYPE_BITS[dtype] + 7) // 8     # sub-byte types pack several elements per byte
    if offs[1] - offs[0] != nbytes:
        raise bad(f"holds {offs[1] - offs[0]} bytes but {dtype} {shape} needs {nbytes}")
    return TensorInfo(name, dtype, tuple(shape), nbytes)


def is_count(v: Any) -> bool:
    """A whole number >= 0 (never a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# ---------------------------------------------------------------- the whole folder

@dataclass(frozen=True)
class Checkpoint:
    """The safetensors weights of a model folder: every shard's checked header and which shard holds what."""
    root: Path
    shards: dict[str, Shard]          # file name -> header (exactly the files the weights live in)
    weight_map: dict[str, str]        # tensor name -> file name
    indexed: bool                     # True when the folder has model.safetensors.index.json

    @property
    def total_size(self) -> int:
        """Bytes of every mapped tensor, from the headers (what an index's metadata.total_size states)."""
        return sum(self.shards[f].tensors[k].nbytes for k, f in self.weight_map.items())

    def tensor(self, name: str) -> TensorInfo:
        return self.shards[self.weight_map[name]].tensors[name]


def scan(root: Path, label: str = "MODEL") -> Checkpoint:
    """Read and check the index (when present) and every shard header of `root`."""
    root = Path(root)
    index_path = root / INDEX_FILE
    if index_path.exists() or index_path.is_symlink():
        return _scan_indexed(root, contained(root, INDEX_FILE, f"{label} {root}"))
    files = sorted(p.name for p in root.glob("*.safetensors") if p.is_file() or p.is_symlink())
    if not files:
        raise IntegrityError(f"{label} {root} has no .safetensors weights")
    shards = {f: read_header(contained(root, f, f"{label} {root}"), str(root / f)) for f in files}
    wmap: dict[str, str] = {}
    for f, shard in shards.items():
        for name in shard.tensors:
            if name in wmap:
                raise IntegrityError(f"{label} {root}: tensor {name!r} is in both {wmap[name]} and {f}; "
                                     "remove the stray file")
            wmap[name] = f
    return Checkpoint(root, shards, wmap, indexed=False)


def _scan_indexed(root: Path, index_path: Path) -> Checkpoint:
    where = str(index_path)
    try:
        data = read_json(index_path, "it")
    except IntegrityError as e:
        raise IntegrityError(f"{where} is not a valid safetensors index: {e}") from None
    try:
        wmap = weightmap.parse(data)
        weightmap.metadata(data)
    except weightmap.WeightMapError as e:
        raise IntegrityError(f"{where} is not a valid safetensors index ({e}); repair or remove it") from None
    files = sorted(set(wmap.values()))
    paths = {f: contained(root, f, where) for f in files}
    missing = [f for f, p in paths.items() if not p.is_file()]
    if missing:
        raise IntegrityError(f"{where} names shard(s) {missing} that are not in {root}; the checkpoint is incomplete")
    shards = {f: read_header(p, str(p)) for f, p in paths.items()}
    absent = [(k, f) for k, f in wmap.items() if k not in shards[f].tensors]
    if absent:
        k, f = absent[0]
        raise IntegrityError(f"{where} says tensor {k!r} is in {f}, but {f} does not hold it"
                             f"{f' ({len(absent)} such tensors)' if len(absent) > 1 else ''}; the index and the "
                             "shards are from different checkpoints")
    return Checkpoint(root, shards, dict(wmap), indexed=True)
