"""Fingerprints that bind an input to the model it was made from: its weights, read cheaply.

Why: statistics, a resume file or a weight-quantized `--into` checkpoint used with another model give scales
of the wrong model without a word: config.json alone cannot tell two models of one architecture apart (a
fine-tune, another seed, another size of the same family with the geometry kvcalib compares). Reading every
weight to hash it would cost as much as loading the model, so each tensor is read in part: its name, dtype,
shape and SAMPLES chunks of CHUNK bytes at offsets keyed by its name (a whole tensor when it is smaller),
which is a few MiB for a 70B model. Two models that differ in any sampled byte, any name, dtype or shape have
different fingerprints; an edit between the sampled bytes is not seen (this is a binding, not a signature).

KV scale tensors are left out (a checkpoint kvcalib wrote carries the weights of its model plus scales). Reads
safetensors headers through calib.ckpt.integrity; no torch.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from calib.ckpt import integrity
from calib.ckpt.names import is_kv_scale, is_scale_like

SAMPLES, CHUNK = 8, 1024
KEY = b"kvcalib-weights-1"


@dataclass(frozen=True)
class TensorPrint:
    dtype: str
    shape: tuple[int, ...]
    digest: str


def _offsets(name: str, nbytes: int) -> list[int]:
    """Where a tensor of `nbytes` bytes is sampled: its first and last chunk and SAMPLES - 2 keyed by its name."""
    span = nbytes - CHUNK
    keyed = [int.from_bytes(hashlib.sha256(KEY + name.encode() + bytes([j])).digest()[:8], "little") % (span + 1)
             for j in range(SAMPLES - 2)]
    return sorted({0, span, *keyed})


def tensor_prints(root: Path | integrity.Checkpoint) -> dict[str, TensorPrint]:
    """{tensor name: dtype, shape and the digest of its sampled bytes} of every weight of a model folder (or of
    its headers, already read and checked)."""
    ck = root if isinstance(root, integrity.Checkpoint) else integrity.scan(Path(root))
    out: dict[str, TensorPrint] = {}
    for file, shard in sorted(ck.shards.items()):
        names = sorted(n for n, f in ck.weight_map.items() if f == file and not (is_kv_scale(n) or is_scale_like(n)))
        if not names:
            continue
        with open(shard.path, "rb") as fh:
            for name in names:
                t = shard.tensors[name]
                h = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
                spans = [(0, t.nbytes)] if t.nbytes <= SAMPLES * CHUNK else [(o, CHUNK) for o in _offsets(name, t.nbytes)]
                for at, size in spans:
                    fh.seek(t.offset + at)
                    h.update(fh.read(size))
                out[name] = TensorPrint(t.dtype, t.shape, h.hexdigest())
    return out


def weights_sha256(root: Path | integrity.Checkpoint, prints: Mapping[str, TensorPrint] | None = None) -> str:
    """One digest over every weight's name and print: equal for the same weights, wherever they lie."""
    prints = tensor_prints(root) if prints is None else prints
    h = hashlib.sha256(KEY)
    for name in sorted(prints):
        h.update(f"{name}:{prints[name].digest};".encode())
    return "sha256:" + h.hexdigest()


def of_model(weights: integrity.Checkpoint | None) -> str | None:
    """The weights digest of a model whose headers the checks read (None: pickle weights, nothing to read)."""
    return None if weights is None else weights_sha256(weights)


def mismatch(saved: str | None, mine: str | None, what: str, here: str) -> str | None:
    """Why `what` (recorded on weights `saved`) does not belong to `here` (weights `mine`): a one-line error
    naming both sides, or None when they agree. An input written before fingerprints existed (`saved` None)
    is let through with one line on stderr saying it could not be checked."""
    if saved is None:
        note(f"{what} carries no weights fingerprint (written by an older kvcalib): not checked against {here}")
    if saved is None or mine is None or saved == mine:
        return None
    return (f"{what} was recorded on other weights than {here} (weights {short(saved)} there, {short(mine)} "
            "here): it belongs to another model")


def short(digest: str | None) -> str:
    return "none" if not digest else digest.removeprefix("sha256:")[:12]


def note(message: str) -> None:
    """One line on stderr: an input that could not be checked (written before fingerprints existed)."""
    print(message, file=sys.stderr)


def same_weights(a: Mapping[str, TensorPrint], b: Mapping[str, TensorPrint]) -> tuple[list[str], list[str]]:
    """(tensors held by both with the same dtype and shape whose sampled bytes differ, names held by both whose
    dtype or shape differ). A weight-quantized checkpoint of a model keeps some tensors as they were
    (embeddings, norms, often the head): those must be the model's own."""
    common = sorted(set(a) & set(b))
    shape = [n for n in common if a[n].shape != b[n].shape]
    differ = [n for n in common if a[n].shape == b[n].shape and a[n].dtype == b[n].dtype and a[n].digest != b[n].digest]
    return differ, shape


def comparable(a: Mapping[str, TensorPrint], b: Mapping[str, TensorPrint]) -> int:
    """How many tensors both hold with the same dtype and shape (what `same_weights` can compare)."""
    return sum(1 for n in set(a) & set(b) if a[n].shape == b[n].shape and a[n].dtype == b[n].dtype)
