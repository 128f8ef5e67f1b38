"""SGLang's side: which quantization config it reads, whether its compressed-tensors KV method takes the
declared scheme, which files and tensor names it loads (the view), and one rule per loader check.

Read from sgl-project/sglang 0.5.23 (compressed-tensors KV scales load since 0.5.19; earlier versions drop them,
and so do the weight loaders of some architectures: see calib.recipe.support). Paths below are under
`python/sglang/srt/`. A rule the engine would fail on is an "error"; one where SGLang loads the checkpoint but runs
the cache at scale 1.0 (it only warns in its log) is a "warning" that says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from calib.ckpt import formats
from calib.ckpt.names import HF_QUANT_CONFIG, INDEX_FILE
from calib.ckpt.reader import CheckpointFiles, Problem, ScaleTensor
from calib.recipe import support
from calib.verify.checker import Checker
from calib.verify.common import scalar_problems, where_qc


@dataclass
class SglangView:
    source: str | None          # file the quantization config came from
    qc: dict[str, Any] | None
    method: str | None          # compressed-tensors | modelopt | another quant_method | None
    scheme: Any                 # the compressed-tensors kv_cache_scheme as written
    kv_supported: bool          # a KV scheme SGLang's KV method takes (its scales reach the cache)
    files: list[str]
    scales: list[ScaleTensor]

    def where(self, key: str = "") -> str:
        return where_qc(self.source, key)


def sglang_config(ck: CheckpointFiles) -> tuple[str | None, dict[str, Any] | None]:
    """Where SGLang finds the quantization config.

    configs/model_config.py: ModelConfig._parse_quant_hf_config (config.json `quantization_config`, else
    `hf_quant_config.json` through ModelConfig._parse_modelopt_quant_config, which answers None for a
    ModelOpt config without a weight `quant_algo`: a KV-only file is not read).
    """
    if isinstance(ck.inline_qc, dict):
        return "config.json", ck.inline_qc
    if ck.hf_quant_present and isinstance(ck.hf_quant, dict):
        inner = formats.modelopt_quantization(ck.hf_quant)
        if inner is not None and inner.get("quant_algo") is not None:
            return HF_QUANT_CONFIG, ck.hf_quant
    return None, None


def supported_scheme(scheme: Any) -> bool:
    """layers/quantization/compressed_tensors/compressed_tensors.py: CompressedTensorsKVCacheMethod
    .is_supported_scheme — type float, 8 bits, strategy tensor, symmetric true or absent, dynamic false or absent."""
    return (isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8
            and scheme.get("strategy") == "tensor" and scheme.get("symmetric", True) is True
            and scheme.get("dynamic", False) is False)


def sglang_view(ck: CheckpointFiles) -> SglangView:
    source, qc = sglang_config(ck)
    method, scheme, supported = None, None, False
    if formats.is_compressed_tensors(qc):
        method, scheme = "compressed-tensors", formats.ct_declared_kv_scheme(qc)
        supported = supported_scheme(scheme)
    elif source == HF_QUANT_CONFIG or formats.is_modelopt(qc):
        method = "modelopt"
        supported = formats.modelopt_kv_cache_algo(qc) == "FP8"
    elif isinstance(qc, dict):
        method = str(qc.get("quant_method", "")).lower() or None
    files = ck.named_files()
    return SglangView(source, qc, method, scheme, supported, files, ck.scales(files))


def sglang_reads_a_kv_config(ck: CheckpointFiles, v: SglangView) -> Iterator[Problem]:
    """Scales reach the cache only through a quantization config SGLang reads.

    model_loader/weight_utils.py: maybe_remap_kv_scale_name (without a KV method the scale names find no
    parameter: "... is not loaded" warning, `--kv-cache-dtype fp8_e4m3` runs at 1.0); configs/model_config.py:
    ModelConfig._parse_modelopt_quant_config (quant_algo null -> None: a KV-only hf_quant_config.json is
    not read, kvcalib's TensorRT-LLM variant included).
    """
    if v.method is not None:
        if v.method not in ("compressed-tensors", "modelopt"):
            yield Problem("sglang", v.where("quant_method"), f"quant_method {v.method!r}: kvcalib does not know how "
                          "SGLang handles KV scales for it", "warning", "sglang.unverified")
        return
    why = (f" ({HF_QUANT_CONFIG} without a weight quant_algo is not read by SGLang)" if ck.hf_quant_present else "")
    if v.scales:
        yield Problem("sglang", "config.json", f"{len(v.scales)} KV scale tensor(s) (e.g. {v.scales[0].tensor.name}) "
                      f"but no quantization config SGLang reads{why}: it logs 'not loaded' and an FP8 cache runs at "
                      "scale 1.0; export with --target sglang", "warning", "sglang.scales-without-config")
    else:
        yield Problem("sglang", "config.json", f"no quantization config declares a KV-cache scheme{why}: SGLang keeps "
                      "the KV cache in the model dtype (or uses scale 1.0 with --kv-cache-dtype fp8_e4m3)",
                      code="sglang.no-kv-quant")


def sglang_ct_kv_cache_scheme(ck: CheckpointFiles, v: SglangView) -> Iterator[Problem]:
    """compressed-tensors `kv_cache_scheme`: only static symmetric per-tensor FP8 scales load.

    layers/quantization/compressed_tensors/compressed_tensors.py: CompressedTensorsConfig.get_quant_method
    (RadixAttention branch: an unsupported scheme gets "Ignoring compressed-tensors kv_cache_scheme ...: only
    static symmetric per-tensor FP8 scales are supported", no KV method, scale 1.0) and
    CompressedTensorsKVCacheMethod.is_supported_scheme; mem_cache/kv_cache_dtype.py: configure_kv_cache_dtype
    (`--kv-cache-dtype auto` becomes fp8_e4m3 only for a supported scheme).
    """
    if v.method != "compressed-tensors":
        return
    where = v.where("kv_cache_scheme")
    if v.scheme is None:
        if v.scales:
            yield Problem("sglang", where, "absent: SGLang has no KV method for the scale tensors ('not loaded'); "
                          "an FP8 cache runs at scale 1.0", "warning", "sglang.ct-no-kv-scheme")
        return
    if v.kv_supported:
        return
    strategy = v.scheme.get("strategy") if isinstance(v.scheme, dict) else None
    if strategy == "attn_head":
        msg = ("strategy attn_head: SGLang runs per-head KV scales at 1.0 (it takes only per-tensor FP8 scales and "
               "drops this scheme with a warning); export with --target sglang for per-tensor scales")
    else:
        msg = (f"{v.scheme!r}: SGLang takes only type float, num_bits 8, strategy tensor, symmetric, static; it drops "
               "this scheme with a warning and runs the cache at scale 1.0")
    yield Problem("sglang", where, msg, "warning", "sglang.kv-scheme-ignored")


def sglang_declared_without_scales(ck: CheckpointFiles, v: SglangView) -> Iterator[Problem]:
    """A supported scheme with no k/v scale tensor in the files SGLang reads runs at 1.0.

    layers/quantization/kv_cache.py: BaseKVCacheMethod.create_weights (placeholders -1.0) and
    .process_weights_after_loading (both not loaded -> 1.0).
    """
    if v.kv_supported and not _usable(v):
        yield Problem("sglang", v.where(), "declares an FP8 KV cache but SGLang finds no k/v scale tensor in the "
                      "files it reads: every layer would run at scale 1.0", code="sglang.silent-default")


def _usable(v: SglangView) -> list[ScaleTensor]:
    return [s for s in v.scales if s.kind in "kv" and (s.form == "attn" or (s.form == "proj" and s.proj == s.kind))]


def sglang_scale_names(ck: CheckpointFiles, v: SglangView) -> Iterator[Problem]:
    """`model.layers.{i}.self_attn.{k,v}_scale` (and ModelOpt's `{k,v}_proj.{k,v}_scale`) map onto the attention
    layer; q_scale has no parameter.

    model_loader/weight_utils.py: maybe_remap_kv_scale_name; models/llama.py:
    LlamaForCausalLM._legacy_load_weights ("Parameter ... not found in params_dict" for q_scale).
    """
    if not v.kv_supported:
        return
    for s in v.scales:
        name = s.tensor.name
        if isinstance(ck.num_layers, int) and s.layer >= ck.num_layers:
            yield Problem("sglang", name, f"layer {s.layer} does not exist (num_hidden_layers = {ck.num_layers}): "
                          "SGLang never loads it", code="sglang.layer-range")
        elif s.kind == "q":
            yield Problem("sglang", name, "SGLang has no q_scale parameter: ignored (FP8 attention with Q is "
                          "vLLM's)", "warning", "sglang.q-scale-ignored")
        elif s.form == "quark" or (s.form == "proj" and s.proj != s.kind):
            yield Problem("sglang", name, "SGLang maps no parameter to this name: not loaded, the layer runs at "
                          "scale 1.0", code="sglang.unknown-name")


def sglang_model_loads_scales(ck: CheckpointFiles, v: SglangView) -> Iterator[Problem]:
    """The model's own weight loader must remap `self_attn.{k,v}_scale` onto its attention layer; some do not
    (the support matrix's SGLang cells for this architecture, calib.recipe.support).

    model_loader/weight_utils.py: maybe_remap_kv_scale_name (called by the llama, mistral, qwen3 and gemma3
    loaders); models/qwen2.py, models/qwen3_moe.py, models/mixtral.py: load_weights (never call it: the scale is
    not in params_dict and is dropped; sglang issue 39942).
    """
    arch = (ck.config.get("architectures") or [None])[0] if isinstance(ck.config.get("architectures"), list) else None
    if not v.kv_supported or not _usable(v) or not isinstance(arch, str):
        return
    c = support.cell("sglang", None, "cuda", "fp8_e4m3", "tensor", arch)
    if c.models and c.effect is not support.Effect.APPLIED:
        yield Problem("sglang", "config.json:architectures", f"{arch}: {c.note}; serve it with vLLM, or with a "
                      "SGLang whose loader for this model remaps the scales", "warning", "sglang.model-drops-scales")


def sglang_one_scale_per_layer(ck: CheckpointFiles, v: SglangView) -> Iterator[Problem]:
    """Both k and v for every layer: one alone is duplicated as max(k, v); none stays 1.0.

    layers/quantization/kv_cache.py: BaseKVCacheMethod.process_weights_after_loading.
    """
    if not v.kv_supported or not _usable(v):
        return
    seen: dict[tuple[int, str], list[str]] = {}
    for s in _usable(v):
        seen.setdefault((s.layer, s.kind), []).append(s.tensor.name)
    for layer in ck.expected_layers:
        have = {k for k in "kv" if seen.get((layer, k))}
        if not have:
            yield Problem("sglang", f"model.layers.{layer}.self_attn", "no k_scale or v_scale: SGLang runs this "
                          "layer at scale 1.0", code="sglang.missing-scale")
        elif len(have) == 1:
            other = "v" if "k" in have else "k"
            yield Problem("sglang", f"model.layers.{layer}.self_attn.{other}_scale", f"missing: SGLang uses the "
                          f"{next(iter(have))}_scale for both", "warning", "sglang.missing-scale")
        for k in "kv":
            if len(seen.get((layer, k), [])) > 1:
                yield Problem("sglang", f"model.layers.{layer}.self_attn.{k}_scale", f"stored {len(seen[(layer, k)])} "
                              "times: the one SGLang reads last wins", code="sglang.duplicate-scale")


def sglang_scale_shapes_dtypes_values(ck: CheckpointFiles, v: SglangView) -> Iterator[Problem]:
    """One element each (`[]` or `[1]`), a float dtype, finite and > 0.

    model_loader/weight_utils.py: default_weight_loader (copies when both have one element, asserts on any
    other shape); layers/quantization/kv_cache.py: BaseKVCacheMethod.process_weights_after_loading (a scale
    <= 0 counts as not loaded: 1.0).
    """
    if not v.kv_supported:
        return
    yield from scalar_problems("sglang", ck, _usable(v),
                               shape_why=": SGLang's loader asserts on a scale with more than one element "
                                         "(per-tensor only)",
                               nonfinite_why="; the FP8 cache would be NaN/inf",
                               nonpositive_why=": SGLang treats a scale <= 0 as not loaded and uses 1.0")


def sglang_index_consistent(ck: CheckpointFiles, v: SglangView) -> Iterator[Problem]:
    """Every scale in a shard the index names.

    model_loader/weight_utils.py: filter_duplicate_safetensors_files (with an index, only the shards it names
    are read: a scale elsewhere is never loaded and the layer runs at 1.0).
    """
    if not ck.index_present or ck.index is None:
        if ck.index_present:
            yield Problem("sglang", INDEX_FILE, f"not a valid safetensors index ({ck.index_error})",
                          code="sglang.index")
        return
    named = set(ck.index.values())
    for s in ck.scales(ck.files):
        if s.tensor.file not in named:
            yield Problem("sglang", s.tensor.name, f"in {s.tensor.file}, a shard {INDEX_FILE} does not name: SGLang "
                          "never reads it and the layer runs at 1.0", code="sglang.unindexed-shard")


SGLANG_RULES: tuple[Callable[[CheckpointFiles, SglangView], Iterable[Problem]], ...] = (
    sglang_reads_a_kv_config, sglang_ct_kv_cache_scheme, sglang_declared_without_scales, sglang_scale_names,
    sglang_model_loads_scales, sglang_one_scale_per_layer, sglang_scale_shapes_dtypes_values, sglang_index_consistent,
)


def sglang_declared(ck: CheckpointFiles) -> bool:
    """A checkpoint names SGLang only through kvcalib.json (its configs are vLLM's compressed-tensors ones)."""
    return (ck.provenance or {}).get("target") == "sglang"


CHECKER = Checker("sglang", sglang_view, SGLANG_RULES, sglang_declared)
