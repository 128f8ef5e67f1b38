"""Reading a checkpoint once for every rule: configs, index, safetensors headers, provenance, scale values.

Kept apart from the engine rules so both engines' views share one read. Reads JSON and safetensors
headers/values only (`safetensors.safe_open(..., framework="numpy")`; bf16 values, which numpy cannot
represent, are decoded from the file's raw bytes); never unpickles, never imports torch.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

INDEX_FILE = "model.safetensors.index.json"      # same names as calib.export (not imported: it needs torch)
PROVENANCE_FILE = "kvcalib.json"
HF_QUANT_CONFIG = "hf_quant_config.json"

# Text-model KV scale names. form "attn": `self_attn.k_scale` (compressed-tensors / vLLM), "proj":
# `self_attn.k_proj.k_scale` (ModelOpt / TRT-LLM), "quark": `self_attn.k_proj.output_scale` (AMD Quark).
_SCALE_RE = re.compile(
    r"^(?:model\.|model\.language_model\.|language_model\.model\.|language_model\.)?layers\.(?P<layer>\d+)\."
    r"self_attn\.(?:(?P<akind>[qkv])_scale|(?P<proj>[qkv])_proj\.(?P<pkind>[qkv])_scale"
    r"|(?P<qproj>[qkv])_proj\.output_scale)$")


@dataclass(frozen=True)
class Problem:
    """One finding: which engine, where (file, config key or tensor name), what; `severity` error|warning."""
    engine: str
    where: str
    message: str
    severity: str = "error"
    code: str = ""

    def __str__(self) -> str:
        return f"{self.severity.upper()} [{self.engine}] {self.where}: {self.message}".replace("\n", " ")


@dataclass(frozen=True)
class _Tensor:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass(frozen=True)
class _Scale:
    layer: int
    kind: str                # q | k | v
    form: str                # attn | proj | quark
    proj: str | None
    tensor: _Tensor


def _parse_scale(t: _Tensor) -> _Scale | None:
    m = _SCALE_RE.match(t.name)
    if not m:
        return None
    if m["akind"]:
        return _Scale(int(m["layer"]), m["akind"], "attn", None, t)
    if m["pkind"]:
        return _Scale(int(m["layer"]), m["pkind"], "proj", m["proj"], t)
    return _Scale(int(m["layer"]), m["qproj"], "quark", m["qproj"], t)


def _read_json(path: Path) -> tuple[Any, str | None]:
    try:
        return json.loads(path.read_text()), None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, str(e).splitlines()[0][:200]


class _Checkpoint:
    """What the rules look at, read once: configs, index, safetensors headers, provenance."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        self.read_problems: list[Problem] = []
        self.config, err = _read_json(path / "config.json")
        if err or not isinstance(self.config, dict):
            self.read_problems.append(Problem("checkpoint", "config.json", f"not a readable JSON object ({err})",
                                              code="checkpoint.config"))
            self.config = {}
        text = self.config.get("text_config")
        self.text = text if isinstance(text, dict) else self.config
        self.num_layers = self.text.get("num_hidden_layers", self.config.get("num_hidden_layers"))
        self.num_heads = self.text.get("num_attention_heads")
        self.num_kv_heads = self.text.get("num_key_value_heads", self.num_heads)
        self.layer_types = self.text.get("layer_types") or []
        qc = self.config.get("quantization_config")
        if qc is None and isinstance(text, dict):
            qc = text.get("quantization_config")
        self.inline_qc = qc
        self.compression_config = self.config.get("compression_config")

        self.index_present = (path / INDEX_FILE).is_file()
        self.index: dict[str, str] | None = None
        self.index_error: str | None = None
        if self.index_present:
            data, err = _read_json(path / INDEX_FILE)
            wmap = data.get("weight_map") if isinstance(data, dict) else None
            if err or not isinstance(wmap, dict):
                self.index_error = err or "no weight_map object"
            else:
                self.index = {str(k): str(v) for k, v in wmap.items()}

        self.hf_quant_present = (path / HF_QUANT_CONFIG).is_file()
        self.hf_quant, self.hf_quant_error = _read_json(path / HF_QUANT_CONFIG) if self.hf_quant_present else (None,
                                                                                                             None)
        prov, _ = _read_json(path / PROVENANCE_FILE) if (path / PROVENANCE_FILE).is_file() else (None, None)
        self.provenance = prov if isinstance(prov, dict) else None

        self.files = sorted(p.name for p in path.glob("*.safetensors") if p.is_file())
        self.keys: dict[str, dict[str, _Tensor]] = {}
        for name in self.files:
            try:
                with safe_open(str(path / name), framework="numpy") as f:
                    entries = {}
                    for key in f.keys():
                        sl = f.get_slice(key)
                        entries[key] = _Tensor(key, name, str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()))
                self.keys[name] = entries
            except Exception as e:  # a truncated or foreign file: report, keep checking the rest
                self.read_problems.append(Problem("checkpoint", name, f"not a readable safetensors file "
                                                  f"({str(e).splitlines()[0][:200]})", code="checkpoint.shard"))
        self._values: dict[tuple[str, str], np.ndarray | None] = {}

    def scales(self, files: Iterable[str]) -> list[_Scale]:
        out = []
        for name in files:
            for t in self.keys.get(name, {}).values():
                s = _parse_scale(t)
                if s is not None:
                    out.append(s)
        return out

    def values(self, t: _Tensor) -> np.ndarray | None:
        """float64 values of a (small) tensor; None for dtypes numpy cannot hold (e.g. FP8)."""
        key = (t.file, t.name)
        if key not in self._values:
            self._values[key] = self._read_values(t)
        return self._values[key]

    def _read_values(self, t: _Tensor) -> np.ndarray | None:
        return tensor_values(self.path / t.file, t.name)

    @cached_property
    def skipped_layers(self) -> set[int]:
        """Layers kvcalib.json says stay out of the quantized cache (indices, or `sliding_window`)."""
        prov = self.provenance or {}
        items = prov.get("skipped_layers") or prov.get("skip_layers") or (prov.get("recipe") or {}).get(
            "skip_layers") or []
        out: set[int] = set()
        for item in items if isinstance(items, list) else []:
            if isinstance(item, int) and not isinstance(item, bool):
                out.add(item)
            elif isinstance(item, str) and item.isdigit():
                out.add(int(item))
            elif item == "sliding_window":
                out |= {i for i, kind in enumerate(self.layer_types) if kind == "sliding_attention"}
        return out

    @cached_property
    def expected_layers(self) -> list[int]:
        if not isinstance(self.num_layers, int):
            return []
        return [i for i in range(self.num_layers) if i not in self.skipped_layers]


def tensor_values(path: Path, name: str) -> np.ndarray | None:
    """float64 values of tensor `name` in a safetensors file, read without torch or pickle; None for dtypes
    numpy cannot hold (e.g. FP8). bf16 is widened from its raw 16-bit patterns."""
    from safetensors import safe_open

    with open(path, "rb") as fh:
        n = struct.unpack("<Q", fh.read(8))[0]
        entry = json.loads(fh.read(n))[name]
        if entry["dtype"] == "BF16":
            start, end = entry["data_offsets"]
            fh.seek(8 + n + start)
            raw = fh.read(end - start)
            return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    try:
        with safe_open(str(path), framework="numpy") as f:
            return np.asarray(f.get_tensor(name), dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        return None
