"""vLLM's side: which quantization config it reads, what that declares, which files and tensor names it
loads (the view), and one rule per loader check, collected in VLLM_RULES.

A module of its own so the vLLM rules can be read, and updated when vLLM changes, apart from TRT-LLM's.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from calib.ckpt import formats
from calib.ckpt.formats import producer_name
from calib.ckpt.names import HF_QUANT_CONFIG, INDEX_FILE
from calib.ckpt.reader import CheckpointFiles, Problem, ScaleTensor
from calib.verify.checker import Checker
from calib.verify.common import dtype_problems, unmapped_problems, value_problems, where_qc

# vllm/transformers_utils/model_arch_config_convertor.py: _normalize_quantization_config
_VLLM_MODELOPT_ALGOS = {"FP8": "modelopt", "FP8_PER_CHANNEL_PER_TOKEN": "modelopt", "FP8_PB_WO": "modelopt",
                        "NVFP4": "modelopt_fp4"}


@dataclass
class VllmView:
    source: str | None          # file the quantization config came from
    qc: dict[str, Any] | None
    method: str | None          # normalised quant_method; None: vLLM runs the model unquantized
    kv_declared: bool
    strategy: str | None        # compressed-tensors kv_cache_scheme strategy
    files: list[str]
    scales: list[ScaleTensor]

    def where(self, key: str = "") -> str:
        return where_qc(self.source, key)

    @property
    def accepted_forms(self) -> set[str]:
        if self.method == "quark":
            return {"attn", "proj", "quark"}
        return {"attn", "proj"} if self.method else set()


def vllm_config(ck: CheckpointFiles) -> tuple[str | None, dict[str, Any] | None]:
    """Where vLLM finds the quantization config.

    vllm/transformers_utils/config.py: get_config (config.json `quantization_config`, else
    `hf_quant_config.json`); vllm/model_executor/model_loader/weight_utils.py: get_quant_config (also the
    text_config's, then `compression_config`).
    """
    if isinstance(ck.inline_qc, dict):
        return "config.json", ck.inline_qc
    if isinstance(ck.compression_config, dict):
        return "config.json", ck.compression_config
    if ck.hf_quant_present and isinstance(ck.hf_quant, dict):
        return HF_QUANT_CONFIG, ck.hf_quant
    return None, None


def vllm_method(qc: dict[str, Any] | None) -> str | None:
    """vllm/transformers_utils/model_arch_config_convertor.py: _normalize_quantization_config.

    ModelOpt (producer.name "modelopt") becomes "modelopt"/"modelopt_fp4" only for a non-null FP8/NVFP4
    `quant_algo`; otherwise `quant_method` lower-cased, "" meaning unquantized.
    """
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method", "")).lower().replace("compressed_tensors", "compressed-tensors")
    inner = qc.get("quantization")
    if producer_name(qc) == "modelopt" and isinstance(inner, dict):
        algo = inner.get("quant_algo")
        if algo is not None:
            method = _VLLM_MODELOPT_ALGOS.get(str(algo).upper(), method)
    return method or None


def vllm_view(ck: CheckpointFiles) -> VllmView:
    source, qc = vllm_config(ck)
    method = vllm_method(qc)
    kv_declared, strategy = False, None
    if method == "compressed-tensors":
        scheme = formats.ct_declared_kv_scheme(qc)
        kv_declared = scheme is not None
        strategy = scheme.get("strategy") if isinstance(scheme, dict) else None
    elif method == "quark":
        kv_declared = bool(formats.quark_kv_group(qc))
    elif method and method.startswith("modelopt"):
        kv_declared = formats.modelopt_kv_cache_algo(qc) is not None
    # vllm/model_executor/model_loader/weight_utils.py: filter_duplicate_safetensors_files: with an index, vLLM
    # reads only the shards the index names (every tensor in them); without, all shards
    files = ck.named_files()
    return VllmView(source, qc, method, kv_declared, strategy, files, ck.scales(files))


def vllm_reads_a_quant_config(ck: CheckpointFiles, v: VllmView) -> Iterator[Problem]:
    """Scale tensors need a quantization config; without one nothing turns the KV cache to FP8.

    vllm/model_executor/models/utils.py: AutoWeightsLoader.load_weights adds the KV-scale name mapper only
    from a quant config, and AutoWeightsLoader._load_module raises "There is no module or parameter named"
    for a scale tensor otherwise (a `k_proj.k_scale` name instead reaches layers/linear.py:
    QKVParallelLinear.load_weights and fails there: seen with vLLM 0.32 on CPU loading a TRT-LLM variant);
    vllm/config/model.py: ModelConfig._verify_quantization.
    """
    if v.method is not None:
        if v.method not in ("compressed-tensors", "quark") and not v.method.startswith("modelopt"):
            yield Problem("vllm", v.where("quant_method"),
                          f"quant_method {v.method!r}: kvcalib does not know how vLLM handles KV scales for it; "
                          "only compressed-tensors, ModelOpt and Quark are checked", "warning", "vllm.unverified")
        return
    if v.scales:
        origin = " (hf_quant_config.json is not a ModelOpt FP8/NVFP4 config vLLM recognises)" \
            if ck.hf_quant_present else ""
        yield Problem("vllm", "config.json",
                      f"{len(v.scales)} KV scale tensor(s) (e.g. {v.scales[0].tensor.name}) but no quantization_config "
                      f"vLLM reads{origin}: vLLM refuses to load the checkpoint (no parameter takes them)",
                      code="vllm.scales-without-config")
    else:
        yield Problem("vllm", "config.json", "no quantization_config declares a KV-cache scheme: vLLM keeps the KV "
                      "cache in the model dtype (or uses scale 1.0 with --kv-cache-dtype fp8)",
                      code="vllm.no-kv-quant")


def vllm_ct_kv_cache_scheme(ck: CheckpointFiles, v: VllmView) -> Iterator[Problem]:
    """compressed-tensors `kv_cache_scheme`: num_bits 8, type float, strategy tensor|attn_head, symmetric.

    vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py:
    CompressedTensorsKVCacheMethod.validate_kv_cache_scheme (raises NotImplementedError otherwise).
    `dynamic` must be false: vLLM never computes KV scales at runtime on this path, it reads static
    tensors (CompressedTensorsKVCacheMethod.create_weights initialises them to 1.0).
    """
    if v.method != "compressed-tensors":
        return
    scheme = formats.ct_declared_kv_scheme(v.qc)
    where = v.where("kv_cache_scheme")
    if scheme is None:
        if v.scales:
            yield Problem("vllm", where, "absent: the scale tensors load, but vLLM turns on FP8 KV only with "
                          "--kv-cache-dtype fp8", "warning", "vllm.ct-no-kv-scheme")
        else:
            yield Problem("vllm", where, "absent and no scale tensors: the checkpoint declares no KV-cache "
                          "quantization", code="vllm.no-kv-quant")
        return
    if not isinstance(scheme, dict):
        yield Problem("vllm", where, f"must be an object, got {type(scheme).__name__}", code="vllm.kv-scheme")
        return
    expected = {"num_bits": (8,), "type": ("float",), "strategy": ("tensor", "attn_head"), "symmetric": (True,),
                "dynamic": (False,)}
    for key, allowed in expected.items():
        value = scheme.get(key)
        if value in allowed and type(value) is type(allowed[0]):
            continue
        why = ("vLLM reads static scale tensors only" if key == "dynamic"
               else "vLLM's compressed-tensors KV path raises NotImplementedError")
        yield Problem("vllm", f"{where}.{key}", f"is {value!r}; must be {' or '.join(map(repr, allowed))} ({why})",
                      code="vllm.kv-scheme")


def vllm_ct_config_groups(ck: CheckpointFiles, v: VllmView) -> Iterator[Problem]:
    """The compressed-tensors block needs a `config_groups` key ({} is fine for KV-only).

    vllm/model_executor/model_loader/weight_utils.py: get_quant_config passes total_num_heads /
    total_num_kv_heads (needed to load `attn_head` scales) only when `config_groups` is present;
    compressed_tensors.QuantizationConfig declares the field required.
    """
    if v.method == "compressed-tensors" and "config_groups" not in v.qc:
        yield Problem("vllm", v.where("config_groups"), "missing; write config_groups: {} for a KV-only "
                      "checkpoint", code="vllm.config-groups")


def vllm_quark_kv_config(ck: CheckpointFiles, v: VllmView) -> Iterator[Problem]:
    """Quark: `export.kv_cache_group` patterns must match `layer_quant_config` entries whose identical
    `output_tensors` say dtype fp8_e4m3, qscheme per_tensor.

    vllm/model_executor/layers/quantization/quark/quark.py: QuarkConfig.from_config and
    QuarkKVCacheMethod.validate_kv_cache_config.
    """
    def bad(key: str, message: str) -> Problem:
        return Problem("vllm", v.where(key), message, code="vllm.quark-kv")

    if v.method != "quark":
        return
    if formats.quark_export(v.qc) is None:
        yield bad("export", "missing; QuarkConfig.from_config requires it")
        return
    group = formats.quark_kv_group(v.qc) or []
    if not isinstance(group, list) or not all(isinstance(p, str) for p in group):
        yield bad("export.kv_cache_group", "must be a list of module name patterns")
        return
    if not group:
        if v.scales:
            yield Problem("vllm", v.where("export.kv_cache_group"), "empty: the scale tensors load, but vLLM "
                          "turns on FP8 KV only with --kv-cache-dtype fp8", "warning", "vllm.quark-no-kv")
        return
    layer_cfg = v.qc.get("layer_quant_config") or {}
    if not isinstance(layer_cfg, dict):
        yield bad("layer_quant_config", "must be an object of pattern: config")
        return
    matched = [cfg for name, cfg in layer_cfg.items() if any(fnmatch.fnmatchcase(name, p) for p in group)]
    if not matched:
        yield bad("layer_quant_config", f"no entry matches kv_cache_group {group}")
        return
    outs = [cfg.get("output_tensors") if isinstance(cfg, dict) else None for cfg in matched]
    if any(o != outs[0] for o in outs):
        yield bad("layer_quant_config", "the kv_cache_group entries have different output_tensors")
    first = outs[0] if isinstance(outs[0], dict) else {}
    for key, want in (("dtype", "fp8_e4m3"), ("qscheme", "per_tensor")):
        if first.get(key) != want:
            yield bad(f"layer_quant_config.output_tensors.{key}", f"is {first.get(key)!r}; vLLM supports {want!r} only")


def vllm_declared_without_scales(ck: CheckpointFiles, v: VllmView) -> Iterator[Problem]:
    """A declared KV scheme with no scale tensors runs FP8 KV with scale 1.0 and says nothing.

    vllm/model_executor/layers/quantization/compressed_tensors/compressed_tensors.py:
    CompressedTensorsKVCacheMethod.create_weights (placeholders = 1.0); kv_cache.py:
    BaseKVCacheMethod.process_weights_after_loading (no scale loaded -> 1.0).
    """
    if v.kv_declared and not [s for s in v.scales if s.form in v.accepted_forms]:
        yield Problem("vllm", v.where(), "declares a quantized KV cache but vLLM finds no k/v scale tensor in the "
                      "files it reads: vLLM would silently use 1.0 for every layer", code="vllm.silent-default")


def vllm_scale_names(ck: CheckpointFiles, v: VllmView) -> Iterator[Problem]:
    """Each scale must name an existing layer and a form the quant method maps onto the attention layer.

    vllm/model_executor/layers/quantization/base_config.py: QuantizationConfig.get_cache_scale_mapper
    (`self_attn.{q,k,v}_scale`, `self_attn.{k,v}_proj.{k,v}_scale`); quark/quark.py:
    QuarkConfig.get_cache_scale_mapper (`{q,k,v}_proj.output_scale`); models/utils.py:
    AutoWeightsLoader._load_module raises for a name with no parameter (e.g. a layer index out of range).
    A name that reaches no module (how vLLM walks it: calib.ckpt.names; the modules the checkpoint's weights have:
    calib.ckpt.reader, CheckpointFiles.unmapped) fails the load, or is dropped by models that remap with
    weight_utils.py: maybe_remap_kv_scale_name (the scale stays 1.0).
    """
    if v.method is None:
        return
    yield from unmapped_problems("vllm", ck, v.files, cannot_check="vLLM maps it",
                                 never_read="vLLM maps no attention layer to this name (it refuses to load the "
                                            "checkpoint, or drops the scale and keeps 1.0)")
    for s in v.scales:
        name = s.tensor.name
        if isinstance(ck.num_layers, int) and s.layer >= ck.num_layers:
            yield Problem("vllm", name, f"layer {s.layer} does not exist (num_hidden_layers = {ck.num_layers}); "
                          "vLLM refuses to load it", code="vllm.layer-range")
        elif s.form not in v.accepted_forms or (s.form == "proj" and s.kind == "q"):
            yield Problem("vllm", name, f"vLLM's {v.method} path maps no parameter to this name and refuses to load "
                          "it", code="vllm.unknown-name")


def vllm_one_scale_per_layer(ck: CheckpointFiles, v: VllmView) -> Iterator[Problem]:
    """One k and one v scale per attention layer (layers kvcalib.json lists as skipped excepted).

    compressed_tensors.py: CompressedTensorsKVCacheMethod.create_weights (a missing scale stays 1.0);
    kv_cache.py: BaseKVCacheMethod.process_weights_after_loading (ModelOpt/Quark: a missing one becomes
    1.0 or a copy of the other); two names for one parameter: the one read last wins.
    """
    usable = [s for s in v.scales if s.form in v.accepted_forms and s.kind in "kv"]
    if not v.kv_declared or not usable:
        return
    seen: dict[tuple[int, str], list[str]] = {}
    for s in usable:
        seen.setdefault((s.layer, s.kind), []).append(f"{s.tensor.name} in {s.tensor.file}")
    fallback = "1.0" if v.method == "compressed-tensors" else "1.0 (or the layer's other scale)"
    for layer in ck.expected_layers:
        for kind in "kv":
            names = seen.get((layer, kind), [])
            if not names:
                yield Problem("vllm", f"model.layers.{layer}.self_attn.{kind}_scale",
                              f"missing: vLLM would silently use {fallback} for layer {layer}",
                              code="vllm.missing-scale")
            elif len(names) > 1:
                yield Problem("vllm", f"model.layers.{layer}.self_attn.{kind}_scale",
                              f"stored {len(names)} times ({'; '.join(names)}): the one vLLM reads last wins",
                              code="vllm.duplicate-scale")


def vllm_scale_shapes(ck: CheckpointFiles, v: VllmView) -> Iterator[Problem]:
    """Per-tensor: one element; compressed-tensors `attn_head`: [kv_heads, 1, 1] or [kv_heads] (q: heads).

    vllm/model_executor/model_loader/weight_utils.py: default_weight_loader; kv_cache.py:
    KVCacheScaleParameter.weight_loader ("expects a scalar weight"); compressed_tensors.py:
    CompressedTensorsKVCacheMethod.create_weights (_tp_aware_loader flattens per-head scales).
    """
    for s in [s for s in v.scales if s.form in v.accepted_forms]:
        t = s.tensor
        if v.method == "compressed-tensors" and v.strategy == "attn_head":
            heads = ck.num_heads if s.kind == "q" else ck.num_kv_heads
            if not isinstance(heads, int):
                continue
            if t.shape not in ((heads,), (heads, 1, 1)):
                yield Problem("vllm", t.name, f"shape {list(t.shape)}; strategy attn_head needs [{heads}, 1, 1] or "
                              f"[{heads}]", code="vllm.shape")
        elif t.numel != 1:
            yield Problem("vllm", t.name, f"shape {list(t.shape)}; a per-tensor scale has one element",
                          code="vllm.shape")


def vllm_scale_dtypes_values(ck: CheckpointFiles, v: VllmView) -> Iterator[Problem]:
    """float32 (bf16/fp16 load, rounded), finite and > 0.

    kv_cache.py / compressed_tensors.py: the placeholders are float32 and `param.data.copy_` converts whatever is
    stored; compressed_tensors.py: CompressedTensorsKVCacheMethod.process_weights_after_loading uses the value as
    is (the cache write divides by it); kv_cache.py: BaseKVCacheMethod.process_weights_after_loading
    (ModelOpt/Quark) asserts k_scale > 0 for zero/NaN and treats a negative one as "not loaded" (1.0).
    """
    scales = [s for s in v.scales if s.form in v.accepted_forms]
    effect = ("the cache write divides by it" if v.method == "compressed-tensors"
              else "vLLM asserts at load (zero) or falls back to 1.0 (negative)")
    yield from dtype_problems("vllm", scales)
    yield from value_problems("vllm", ck, scales, "; the FP8 cache would be NaN/inf or the load fails",
                              f"; scales must be > 0 ({effect})")


def vllm_index_consistent(ck: CheckpointFiles, v: VllmView) -> Iterator[Problem]:
    """The index and the shards agree, and every scale sits in a shard the index names.

    vllm/model_executor/model_loader/weight_utils.py: filter_duplicate_safetensors_files (raises
    FileNotFoundError for a named shard that is missing; reads only named shards, so a scale in an
    unnamed shard is never loaded and silently stays 1.0).
    """
    if not ck.index_present:
        return
    if ck.index is None:
        yield Problem("vllm", INDEX_FILE, f"not a valid safetensors index ({ck.index_error}); vLLM fails to read it",
                      code="vllm.index")
        return
    for shard in sorted(set(ck.index.values()) - set(ck.files)):
        yield Problem("vllm", INDEX_FILE, f"names shard {shard}, which does not exist: vLLM raises FileNotFoundError",
                      code="vllm.index-missing-shard")
    for name, shard in sorted(ck.index.items()):
        if shard in ck.keys and name not in ck.keys[shard]:
            yield Problem("vllm", name, f"listed in {INDEX_FILE} under {shard}, which does not hold it",
                          code="vllm.index-entry")
    named = set(ck.index.values())
    for s in ck.scales(ck.files):
        t = s.tensor
        if t.file not in named:
            yield Problem("vllm", t.name, f"in {t.file}, a shard {INDEX_FILE} does not name: vLLM never reads it "
                          "and would silently use 1.0", code="vllm.unindexed-shard")
        elif t.name not in ck.index:
            yield Problem("vllm", t.name, f"in {t.file} but not listed in {INDEX_FILE}: vLLM reads it (it reads whole "
                          "shards), tools that look tensors up by index do not", "warning", "vllm.unindexed-tensor")


VLLM_RULES: tuple[Callable[[CheckpointFiles, VllmView], Iterable[Problem]], ...] = (
    vllm_reads_a_quant_config, vllm_ct_kv_cache_scheme, vllm_ct_config_groups, vllm_quark_kv_config,
    vllm_declared_without_scales, vllm_scale_names, vllm_one_scale_per_layer, vllm_scale_shapes,
    vllm_scale_dtypes_values, vllm_index_consistent,
)


def vllm_declared(ck: CheckpointFiles) -> bool:
    """The checkpoint is for vLLM when config.json holds a quantization config, or vLLM reads one from it — unless
    kvcalib.json says kvcalib wrote it for another engine that reads the same layout (SGLang)."""
    if (ck.provenance or {}).get("target") not in (None, "vllm", "trtllm"):
        return False
    source, qc = vllm_config(ck)
    return source == "config.json" or vllm_method(qc) is not None


CHECKER = Checker("vllm", vllm_view, VLLM_RULES, vllm_declared)
