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
TRTLLM_API_OPTIONS = "llm_api_options.yaml"   # TensorRT-LLM serve-time options (trtllm-serve --extra_llm_api_options)
STATS_FILE = "stats.safetensors"              # a statistics-only output's observer states


def vllm_scale_name(layer: int, kind: str) -> str:
    """`kind` is k, v or q; vLLM remaps `self_attn.{kind}_scale` onto its attention layer."""
    return f"model.layers.{layer}.self_attn.{kind}_scale"


def trtllm_scale_names(layer: int) -> tuple[str, str]:
    """The names TRT-LLM's fused-QKV loader finds a layer's K and V scale under."""
    return f"model.layers.{layer}.self_attn.k_proj.k_scale", f"model.layers.{layer}.self_attn.v_proj.v_scale"


# TensorRT-LLM checkpoint (the layout and where it was read: calib/export/trtllm_engine.py): one `rank{r}.safetensors`
# per rank, one shared K/V scale per layer (index local to the rank's pipeline stage); the leaves below are what
# preprocess_weights folds into the first (and its reciprocal).
TRTLLM_CKPT_KV_RE = re.compile(r"^transformer\.layers\.(?P<layer>0|[1-9][0-9]*)\.attention\."
                               r"(?P<leaf>kv_cache_scaling_factor|kv_cache_rcp_scaling_factor|k_cache_scaling_factor"
                               r"|v_cache_scaling_factor)$")


def trtllm_rank_file(rank: int) -> str:
    """The weight file of one rank of a TensorRT-LLM checkpoint."""
    return f"rank{rank}.safetensors"


def trtllm_ckpt_scale_name(local_layer: int) -> str:
    """The shared K/V scale of a TensorRT-LLM checkpoint's layer (`local_layer`: index within the pipeline stage)."""
    return f"transformer.layers.{local_layer}.attention.kv_cache_scaling_factor"


# Text-model KV scale names. form "attn": `self_attn.k_scale` (compressed-tensors / vLLM), "proj":
# `self_attn.k_proj.k_scale` (ModelOpt / TRT-LLM), "quark": `self_attn.k_proj.output_scale` (AMD Quark).
# The layer index is the engines' module name, matched as a string: vLLM walks the weight name one dotted part
# at a time to the child module of that name (vllm/model_executor/models/utils.py: AutoWeightsLoader.
# _groupby_prefix, _load_module), TensorRT-LLM selects a module's tensors by the prefix `name.`
# (tensorrt_llm/_torch/models/modeling_utils.py: filter_weights). Layer i's module is named str(i): ASCII
# digits, no leading zero ("01", "١" name no module: `\d` would accept both).
PREFIXES = ("", "model.", "model.language_model.", "language_model.model.", "language_model.")
LAYER_RE = r"(?P<layer>0|[1-9][0-9]*)"
SCALE_RE = re.compile(
    r"^(?:model\.|model\.language_model\.|language_model\.model\.|language_model\.)?layers\." + LAYER_RE + r"\."
    r"self_attn\.(?:(?P<akind>[qkv])_scale|(?P<proj>[qkv])_proj\.(?P<pkind>[qkv])_scale"
    r"|(?P<qproj>[qkv])_proj\.output_scale)$")
# Any tensor an engine would take for a KV-cache scale, whatever precedes it: the suffixes vLLM remaps onto an
# attention layer (vllm/model_executor/model_loader/weight_utils.py: maybe_remap_kv_scale_name;
# layers/quantization/base_config.py: QuantizationConfig.get_cache_scale_mapper) and Quark's output scale.
SCALE_LEAF_RE = re.compile(r"(?:\.[qkv]_proj)?\.(?:[qkv]_scale|kv_scale|output_scale|[kv]_cache\.scale|q\.scale)$")
_LOOSE_RE = re.compile(r"^(?P<prefix>(?:[^.]*\.)*?)layers\.(?P<layer>[^.]*)\.(?P<module>[^.]*)\.")


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


def is_scale_like(name: str) -> bool:
    """Whether an engine would take `name` for a KV-cache scale (and try to map it onto an attention layer)."""
    m = SCALE_LEAF_RE.search(name)
    return bool(m) and (".output_scale" not in m.group(0) or "_proj." in m.group(0))


def scale_module(name: str) -> str:
    """The attention module a scale-like name hangs under (its scale leaf and projection cut off):
    `model.layers.0.self_attn.k_proj.k_scale` -> `model.layers.0.self_attn`."""
    m = SCALE_LEAF_RE.search(name)
    return name[:m.start()] if m else name


def unparsed_reason(name: str) -> str:
    """Why a scale-like name is none of kvcalib's layouts (`parse_scale_name` gives None), as the engines see
    it: a layer index that is no module's name, a prefix or attention module other than the layouts'."""
    m = _LOOSE_RE.match(name)
    if m is None:
        return "it is not under a `layers.{i}.` module"
    layer = m["layer"]
    if not (layer.isascii() and layer.isdigit()):
        kind = "is not written in ASCII digits" if layer.isdecimal() else "is not a number"
        return f"layer index {layer!r} {kind} (the engines name layer modules 0, 1, 2, ...)"
    if layer != str(int(layer)):
        return f"layer index {layer!r} has a leading zero (the engines' module for that layer is named {str(int(layer))!r})"
    if m["prefix"] not in PREFIXES:
        return f"prefix {m['prefix']!r} (the layouts' layers sit under {', '.join(repr(p) for p in PREFIXES[1:])})"
    if m["module"] != "self_attn":
        return f"attention module {m['module']!r} (the scale layouts hang under 'self_attn')"
    return "its leaf is none of self_attn.{k,v,q}_scale, self_attn.{k,v}_proj.{k,v}_scale, {k,v}_proj.output_scale"


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
