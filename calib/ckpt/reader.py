"""Reading a checkpoint once: configs, index, safetensors headers, provenance, KV scale tensors and values.

One reader for everything that looks at a written checkpoint (verify's rules for both engines, `inspect`,
`eval --scales`), so they all see the same layout (calib.ckpt.names) the exporters write. Reads JSON and safetensors
headers/values only (`safetensors.safe_open(..., framework="numpy")`; bf16 values, which numpy cannot
represent, are decoded from the file's raw bytes); never unpickles, never imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from calib.ckpt import integrity, weightmap
from calib.ckpt.integrity import is_count
from calib.ckpt.names import (HF_QUANT_CONFIG, INDEX_FILE, PROVENANCE_FILE, TRTLLM_API_OPTIONS, is_scale_like,
                              parse_scale_name, scale_module, unparsed_reason)


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
class TensorEntry:
    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass(frozen=True)
class ScaleTensor:
    layer: int
    kind: str                # q | k | v
    form: str                # attn | proj | quark
    proj: str | None
    tensor: TensorEntry


@dataclass(frozen=True)
class Unmapped:
    """A scale-like tensor no engine maps onto an attention layer, and why; `known` False: a layout kvcalib
    does not know whose module exists (not checked)."""
    tensor: TensorEntry
    why: str
    known: bool = True


def read_json_soft(path: Path) -> tuple[Any, str | None]:
    """Strict JSON (calib.ckpt.integrity: no duplicate keys, no NaN, size-capped); (value, None) or (None, why)."""
    try:
        return integrity.read_json(path, path.name, kind=None), None
    except integrity.IntegrityError as e:
        return None, str(e)


def read_yaml_soft(path: Path, limit: int = 1 << 16) -> tuple[Any, str | None]:
    """A small YAML file (safe loader, size-capped); (value, None) or (None, why)."""
    try:
        if path.stat().st_size > limit:
            return None, f"{path.name}: larger than {limit} bytes"
        import yaml
        return yaml.safe_load(path.read_text(encoding="utf-8")), None
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path.name}: cannot be read ({e})"
    except Exception as e:      # yaml.YAMLError and its subclasses
        return None, f"{path.name}: not YAML ({str(e).splitlines()[0] if str(e) else type(e).__name__})"


def provenance_problem(doc: Any) -> str | None:
    """Why a kvcalib.json cannot be trusted by the readers (inspect, eval, verify's skipped layers), or None.
    Only the fields kvcalib reads back are checked; their recipe must be one kvcalib would accept."""
    if not isinstance(doc, dict):
        return "must hold a JSON object"
    for key in ("recipe", "data", "layers", "versions"):
        if key in doc and not isinstance(doc[key], dict):
            return f"field '{key}' must be an object"
    for key in ("skipped_layers", "skip_layers"):   # skipped_layers: resolved indices, as kvcalib writes them
        items = doc.get(key)
        if items is not None and not (isinstance(items, list) and all(
                is_count(i) or (i == "sliding_window" and key == "skip_layers") for i in items)):
            return f"field '{key}' must list layer indices"
    for key in ("producer", "target", "created", "model"):
        if doc.get(key) is not None and not isinstance(doc[key], str):
            return f"field '{key}' must be a string"
    for layer, entry in (doc.get("layers") or {}).items():
        if not (isinstance(layer, str) and layer.isdigit() and isinstance(entry, dict)):
            return f"field 'layers' must map layer indices to objects (found {layer!r})"
        for name, value in entry.items():
            if not (_number(value) or (isinstance(value, list) and all(_number(x) for x in value))):
                return f"field 'layers.{layer}.{name}' must be a number or a list of numbers"
    data = doc.get("data") or {}
    for key in ("samples", "tokens", "skipped_short"):
        if data.get(key) is not None and not is_count(data[key]):
            return f"field 'data.{key}' must be a count"
    if "recipe" in doc:
        from calib.recipe.recipe import RecipeError, from_dict

        try:
            from_dict(doc["recipe"], source="field 'recipe'")
        except RecipeError as e:
            return str(e)
    return None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class CheckpointFiles:
    """What the rules look at, read once: configs, index, safetensors headers, provenance. Files that cannot
    be read, or hold the wrong kind of value where a reader expects an object, become `read_problems` (and
    `read_kv_info` raises the first of them)."""

    def __init__(self, path: Path):
        self.path = path
        self.read_problems: list[Problem] = []

        def problem(where: str, message: str, code: str, severity: str = "error") -> None:
            self.read_problems.append(Problem("checkpoint", where, message, severity, code))

        self.config, err = read_json_soft(path / "config.json")
        if err or not isinstance(self.config, dict):
            problem("config.json", err or "must hold a JSON object", "checkpoint.config")
            self.config = {}
        text = self.config.get("text_config")
        if text is not None and not isinstance(text, dict):
            problem("config.json", "text_config must be an object", "checkpoint.config")
        self.text = text if isinstance(text, dict) else self.config
        n = self.text.get("num_hidden_layers", self.config.get("num_hidden_layers"))
        if n is not None and not (is_count(n) and n > 0):
            problem("config.json", f"num_hidden_layers = {n!r} must be a positive integer", "checkpoint.config")
        self.num_layers = n if is_count(n) and n > 0 else None
        self.num_heads = self.text.get("num_attention_heads")
        self.num_kv_heads = self.text.get("num_key_value_heads", self.num_heads)
        types = self.text.get("layer_types")
        self.layer_types = types if isinstance(types, list) else []
        qc = self.config.get("quantization_config")
        if qc is None and isinstance(text, dict):
            qc = text.get("quantization_config")
        if qc is not None and not isinstance(qc, dict):
            problem("config.json", f"quantization_config must be an object, not {type(qc).__name__}",
                    "checkpoint.config")
        self.inline_qc = qc
        self.compression_config = self.config.get("compression_config")

        self.index_present = (path / INDEX_FILE).is_file()
        self.index: dict[str, str] | None = None
        self.index_error: str | None = None
        if self.index_present:
            data, err = read_json_soft(path / INDEX_FILE)
            try:
                self.index = None if err else weightmap.parse(data)
            except weightmap.WeightMapError as e:
                err = f"{INDEX_FILE}: {e}"
            self.index_error = err

        self.hf_quant_present = (path / HF_QUANT_CONFIG).is_file()
        self.hf_quant, self.hf_quant_error = read_json_soft(path / HF_QUANT_CONFIG) if self.hf_quant_present else (None,
                                                                                                             None)
        if self.hf_quant_present and self.hf_quant_error is None and not isinstance(self.hf_quant, dict):
            self.hf_quant_error = f"{HF_QUANT_CONFIG} must hold a JSON object"
        # TensorRT-LLM's serve-time options kvcalib writes beside an unquantized model (calib/export/trtllm.py)
        self.api_options_present = (path / TRTLLM_API_OPTIONS).is_file()
        self.api_options, self.api_options_error = None, None
        if self.api_options_present:
            self.api_options, self.api_options_error = read_yaml_soft(path / TRTLLM_API_OPTIONS)
            if self.api_options_error is None and not isinstance(self.api_options, dict):
                self.api_options_error = f"{TRTLLM_API_OPTIONS} must hold a YAML mapping"
        self.provenance, self.provenance_error = None, None
        if (path / PROVENANCE_FILE).is_file():
            prov, err = read_json_soft(path / PROVENANCE_FILE)
            why = err or provenance_problem(prov)
            if why:
                self.provenance_error = why if why.startswith(PROVENANCE_FILE) else f"{PROVENANCE_FILE}: {why}"
                problem(PROVENANCE_FILE, f"{self.provenance_error} (ignored)", "checkpoint.provenance", "warning")
            else:
                self.provenance = prov

        self.files = sorted(p.name for p in path.glob("*.safetensors") if p.is_file())
        self.keys: dict[str, dict[str, TensorEntry]] = {}
        for name in self.files:
            try:
                integrity.contained(path, name, name)
                shard = integrity.read_header(path / name, name)
            except integrity.IntegrityError as e:  # a truncated, foreign or escaping file: report, check the rest
                problem(name, str(e), "checkpoint.shard")
                continue
            self.keys[name] = {k: TensorEntry(k, name, t.dtype, t.shape) for k, t in shard.tensors.items()}
        self._values: dict[tuple[str, str], np.ndarray | None] = {}

    def named_files(self) -> list[str]:
        """The shards a reader that follows the index loads: those the index names (every shard without one)."""
        if self.index is None:
            return list(self.files)
        named = set(self.index.values())
        return [f for f in self.files if f in named]

    def scales(self, files: Iterable[str]) -> list[ScaleTensor]:
        """The KV scales (calib.ckpt.names' layouts) the tensors of `files` hold."""
        parsed = ((t, parse_scale_name(t.name)) for name in files for t in self.keys.get(name, {}).values())
        return [ScaleTensor(n.layer, n.kind, n.form, n.proj, t) for t, n in parsed if n is not None]

    @cached_property
    def weight_modules(self) -> frozenset[str]:
        """Every module path the checkpoint's other tensors sit under (`model`, `model.layers`,
        `model.layers.0`, `model.layers.0.self_attn`, ...): the modules an engine builds for this model."""
        out: set[str] = set()
        for shard in self.keys.values():
            for name in shard:
                if not is_scale_like(name):
                    parts = name.split(".")
                    out.update(".".join(parts[:j]) for j in range(1, len(parts)))
        return frozenset(out)

    def unmapped(self, files: Iterable[str]) -> list[Unmapped]:
        """Scale-like tensors of `files` no engine maps onto an attention layer of this model: a name outside
        kvcalib's layouts (a layer index with a leading zero or in other digits, another prefix or attention
        module), or one whose attention module holds none of the checkpoint's weights. `known`: False when
        the name is outside the layouts but its module does hold weights (another architecture's layout,
        which kvcalib cannot check). Layers beyond num_hidden_layers are the range checks' and left out."""
        mods = self.weight_modules
        out = []
        for name in files:
            for t in self.keys.get(name, {}).values():
                if not is_scale_like(t.name):
                    continue
                parsed, module = parse_scale_name(t.name), scale_module(t.name)
                if parsed is None:
                    out.append(Unmapped(t, unparsed_reason(t.name), module not in mods or not mods))
                elif isinstance(self.num_layers, int) and parsed.layer >= self.num_layers:
                    continue
                elif mods and module not in mods:
                    out.append(Unmapped(t, f"the checkpoint's weights have no module {module!r}"
                                           f"{self._attention_hint(parsed.layer)}", True))
        return out

    def _attention_hint(self, layer: int) -> str:
        """Where the weights put layer `layer`'s attention (its K projection), when they say."""
        for m in sorted(self.weight_modules):
            if re.search(rf"(?:^|\.)layers\.{layer}\.[^.]+$", m) and (f"{m}.k_proj" in self.weight_modules
                                                                     or f"{m}.qkv_proj" in self.weight_modules):
                return f" (this model's layer {layer} attention is {m!r})"
        return ""

    def values(self, t: TensorEntry) -> np.ndarray | None:
        """float64 values of a (small) tensor; None for dtypes numpy cannot hold (e.g. FP8)."""
        key = (t.file, t.name)
        if key not in self._values:
            self._values[key] = tensor_values(self.path / t.file, t.name)
        return self._values[key]

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
        return [i for i in range(self.num_layers or 0) if i not in self.skipped_layers]


def widen_fp8(raw: bytes, dtype: str) -> np.ndarray:
    """float64 values of FP8 bytes: F8_E5M2 is the top byte of an IEEE half; F8_E4M3 is the `fn` format
    (bias 7, subnormals below 2^-6, no infinities, S.1111.111 is NaN), the one torch's float8_e4m3fn and the
    engines store."""
    b = np.frombuffer(raw, dtype=np.uint8)
    if dtype == "F8_E5M2":
        return (b.astype(np.uint16) << 8).view(np.float16).astype(np.float64)
    exp, man = (b >> 3) & 0xF, (b & 0x7).astype(np.float64)
    mag = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * np.exp2(exp.astype(np.float64) - 7))
    mag = np.where((exp == 15) & ((b & 0x7) == 7), np.nan, mag)
    return np.where(b & 0x80, -mag, mag)


RAW_DTYPES = ("BF16", "F8_E4M3", "F8_E5M2")     # numpy has no such dtype: widened from the file's bytes


def tensor_values(path: Path, name: str) -> np.ndarray | None:
    """float64 values of tensor `name` in a safetensors file; None for dtypes numpy cannot hold and kvcalib does
    not widen itself (bf16 and FP8, scales other tools store in FP8, are widened from their raw bytes)."""
    from safetensors import safe_open

    t = integrity.read_header(path).tensors[name]
    if t.dtype in RAW_DTYPES:
        with open(path, "rb") as fh:
            fh.seek(t.offset)
            raw = fh.read(t.nbytes)
        if t.dtype != "BF16":
            return widen_fp8(raw, t.dtype)
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    try:
        with safe_open(str(path), framework="numpy") as f:
            return np.asarray(f.get_tensor(name), dtype=np.float64).reshape(-1)
    except (TypeError, ValueError, AttributeError):    # a dtype numpy lacks (safetensors asks numpy for it by name)
        return None
