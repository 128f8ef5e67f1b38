"""Every file and tensor name of the checkpoints kvcalib writes and reads, in one place.

Why a module of its own: the names are the contract with the engines. vLLM finds a scale only as
`model.layers.{i}.self_attn.{k,v,q}_scale` (compressed-tensors) and TensorRT-LLM only as
`model.layers.{i}.self_attn.{k,v}_proj.{k,v}_scale` (ModelOpt); Quark writes `{k,v}_proj.output_scale`.
Exporters build these names, verify/inspect/eval parse them back, and the model loader skips them as
"not weights": spelling them once keeps the writers and the readers from drifting apart.

Imports nothing (no torch), so the readers stay instant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"   # tensor name -> shard file
SCALES_FILE = "kv_scales.safetensors"         # the one shard kvcalib adds to a checkpoint
PROVENANCE_FILE = "kvcalib.json"              # what kvcalib measured and how
HF_QUANT_CONFIG = "hf_quant_config.json"      # ModelOpt / TensorRT-LLM quantization config
STATS_FILE = "stats.safetensors"              # a statistics-only output's observer states


def vllm_scale_name(layer: int, kind: str) -> str:
    """`kind` is k, v or q; vLLM remaps `self_attn.{kind}_scale` onto its attention layer."""
    return f"model.layers.{layer}.self_attn.{kind}_scale"


def trtllm_scale_names(layer: int) -> tuple[str, str]:
    """The names TRT-LLM's fused-QKV loader finds a layer's K and V scale under."""
    return f"model.layers.{layer}.self_attn.k_proj.k_scale", f"model.layers.{layer}.self_attn.v_proj.v_scale"


# Text-model KV scale names. form "attn": `self_attn.k_scale` (compressed-tensors / vLLM), "proj":
# `self_attn.k_proj.k_scale` (ModelOpt / TRT-LLM), "quark": `self_attn.k_proj.output_scale` (AMD Quark).
SCALE_RE = re.compile(
    r"^(?:model\.|model\.language_model\.|language_model\.model\.|language_model\.)?layers\.(?P<layer>\d+)\."
    r"self_attn\.(?:(?P<akind>[qkv])_scale|(?P<proj>[qkv])_proj\.(?P<pkind>[qkv])_scale"
    r"|(?P<qproj>[qkv])_proj\.output_scale)$")


@dataclass(frozen=True)
class ScaleName:
    """A parsed KV scale tensor name: its layer, which scale (q|k|v), the layout form (attn|proj|quark) and,
    for the projection forms, the projection it hangs under."""
    layer: int
    kind: str
    form: str
    proj: str | None


def parse_scale_name(name: str) -> ScaleName | None:
    """The layer/kind/form of a KV scale tensor name of any producer's layout; None for any other tensor."""
    m = SCALE_RE.match(name)
    if not m:
        return None
    if m["akind"]:
        return ScaleName(int(m["layer"]), m["akind"], "attn", None)
    if m["pkind"]:
        return ScaleName(int(m["layer"]), m["pkind"], "proj", m["proj"])
    return ScaleName(int(m["layer"]), m["qproj"], "quark", m["qproj"])


# Leaf names of KV-cache quantization tensors under `.self_attn.` in any producer's layout
# (compressed-tensors, ModelOpt, Quark), zero points included: never model weights.
KV_SCALE_LEAVES = ("k_scale", "v_scale", "q_scale", "output_scale", "k_zero_point", "v_zero_point", "q_zero_point")
# Suffixes the TensorRT-LLM exporter refuses to find in a source (it cannot replace them): any scale it or
# another tool may have put there, TRT-LLM's own engine-side name included.
TRTLLM_CARRIED_SUFFIXES = (".k_scale", ".v_scale", ".q_scale", ".k_proj.output_scale", ".v_proj.output_scale",
                           ".kv_cache_scaling_factor")


def is_kv_scale(name: str) -> bool:
    """KV-cache scale tensors of any producer's layout (a checkpoint calibrated before): not model weights."""
    return ".self_attn." in name and name.rsplit(".", 1)[-1] in KV_SCALE_LEAVES
