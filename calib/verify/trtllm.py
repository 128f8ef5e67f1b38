"""TensorRT-LLM's side (PyTorch backend): what it makes of hf_quant_config.json, llm_api_options.yaml (the
serve-time KV dtype) and config.json, which
files and tensor names it loads (the view), and one rule per loader check, collected in TRT_RULES.

A module of its own so the TRT-LLM rules can be read, and updated when TRT-LLM changes, apart from
vLLM's (the exporter for this engine is calib.export.trtllm; this module only checks).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from calib.ckpt.formats import (TRTLLM_KV_DTYPES, ct_declared_kv_scheme, is_compressed_tensors, is_modelopt,
                                modelopt_quantization, trtllm_serve_kv_algo)
from calib.ckpt.names import HF_QUANT_CONFIG, PROVENANCE_FILE, TRTLLM_API_OPTIONS
from calib.ckpt.reader import CheckpointFiles, Problem, ScaleTensor
from calib.verify.checker import Checker
from calib.verify.common import scalar_problems, unmapped_problems

# tensorrt_llm/quantization/mode.py: KV_CACHE_QUANT_ALGO_LIST
TRT_KV_ALGOS = ("FP8", "INT8", "NVFP4")
# tensorrt_llm/quantization/mode.py: QuantAlgo members (as read); unknown names are a warning, not an error
_TRT_QUANT_ALGOS = frozenset(
    "W8A16 W4A16 W4A16_AWQ W4A8_AWQ W8A16_GPTQ W4A16_GPTQ W8A8_SQ_PER_CHANNEL W8A8_SQ_PER_TENSOR_PLUGIN "
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN W8A8_SQ_PER_CHANNEL_PER_TENSOR_PLUGIN W8A8_SQ_PER_TENSOR_PER_TOKEN_PLUGIN "
    "W4A8_QSERVE_PER_GROUP W4A8_QSERVE_PER_CHANNEL FP8 FP8_PER_CHANNEL_PER_TOKEN FP8_BLOCK_SCALES INT8 "
    "MIXED_PRECISION NVFP4 W4A8_NVFP4_FP8 W4A8_MXFP4_FP8 W4A8_MXFP4_MXFP8 W4A16_MXFP4 NO_QUANT MXFP8".split())


@dataclass
class TrtView:
    inner: dict[str, Any] | None    # hf_quant_config.json's normalised `quantization` dict
    kv_algo: str | None             # what TRT-LLM ends up with
    serve_kv: Any                   # the KV algo llm_api_options.yaml's kv_cache_config.dtype asks for (None: none)
    files: list[str]
    skipped_files: list[str]
    scales: list[ScaleTensor]


def _trt_files(ck: CheckpointFiles) -> tuple[list[str], list[str]]:
    """tensorrt_llm/_torch/models/checkpoints/hf/weight_loader.py: HfWeightLoader.load_weights.

    Every `*.safetensors` file, index ignored; files named "*consolidated*" are skipped when others exist.
    """
    plain = [f for f in ck.files if "consolidated" not in f]
    return (plain, [f for f in ck.files if f not in plain]) if plain else (list(ck.files), [])


def trt_view(ck: CheckpointFiles) -> TrtView:
    inner = modelopt_quantization(ck.hf_quant) if isinstance(ck.hf_quant, dict) else None
    kv = inner.get("kv_cache_quant_algo") if inner else None
    qc = ck.inline_qc
    if (inner is None or inner.get("quant_algo") is None) and is_compressed_tensors(qc):
        scheme = ct_declared_kv_scheme(qc)
        if isinstance(scheme, dict) and scheme.get("num_bits") == 8 and scheme.get("type") == "float" \
                and qc.get("config_groups"):
            kv = "FP8"   # update_quant_config_from_compressed_tensors
    serve_kv = trtllm_serve_kv_algo(ck.api_options) if ck.api_options_error is None else None
    if isinstance(serve_kv, str) and serve_kv in TRT_KV_ALGOS:
        kv = serve_kv   # an explicit kv_cache_config.dtype overrides the checkpoint's (validate_and_set_kv_cache_quant)
    files, skipped = _trt_files(ck)
    return TrtView(inner, str(kv) if kv is not None else None, serve_kv, files, skipped, ck.scales(files))


def trt_hf_quant_config(ck: CheckpointFiles, t: TrtView) -> Iterator[Problem]:
    """`hf_quant_config.json` = {"producer": ..., "quantization": {"quant_algo", "kv_cache_quant_algo",
    "exclude_modules"}} (or ModelOpt's flat shape); kv_cache_quant_algo one of FP8, INT8, NVFP4.

    tensorrt_llm/_torch/model_config.py: ModelConfig.from_pretrained and _build_modelopt_quant_config
    (`QuantAlgo(...)` raises ValueError for an unknown name); tensorrt_llm/quantization/modelopt_config.py:
    read_modelopt_quant_config; tensorrt_llm/quantization/mode.py: KV_CACHE_QUANT_ALGO_LIST. quant_algo null (and
    no `quantized_layers`): the LLM API refuses to start (where read, and run: calib/export/trtllm.py's docstring).
    """
    where = HF_QUANT_CONFIG
    if not ck.hf_quant_present:
        if t.kv_algo is None and not ck.api_options_present:
            yield Problem("trtllm", where, "missing: TensorRT-LLM sees no KV-cache quantization in this checkpoint",
                          code="trtllm.no-hf-quant-config")
        return
    if ck.hf_quant_error is not None or not isinstance(ck.hf_quant, dict):
        yield Problem("trtllm", where, f"not a JSON object ({ck.hf_quant_error}); TensorRT-LLM fails to load",
                      code="trtllm.hf-quant-config")
        return
    if t.inner is None:
        yield Problem("trtllm", where, "has neither a 'quantization' object nor a ModelOpt marker; "
                      "read_modelopt_quant_config raises ValueError", code="trtllm.hf-quant-config")
        return
    kv = t.inner.get("kv_cache_quant_algo")
    if kv is None and t.serve_kv is None:
        yield Problem("trtllm", f"{where}:quantization.kv_cache_quant_algo", "null: TensorRT-LLM keeps the KV cache in "
                      "the model dtype", code="trtllm.no-kv-quant")
    elif not isinstance(kv, str) or kv not in TRT_KV_ALGOS:
        yield Problem("trtllm", f"{where}:quantization.kv_cache_quant_algo", f"is {kv!r}; TensorRT-LLM accepts "
                      f"{' | '.join(TRT_KV_ALGOS)} (exact spelling) and fails to load otherwise", code="trtllm.kv-algo")
    algo = t.inner.get("quant_algo")
    if algo is None and not t.inner.get("quantized_layers"):
        yield Problem("trtllm", f"{where}:quantization.quant_algo", "null: TensorRT-LLM's LLM API refuses to start "
                      "(\"Pre-quantized checkpoint must have quant_algo.\"); for an unquantized model leave "
                      f"{HF_QUANT_CONFIG} out and set kv_cache_config.dtype at serve time ({TRTLLM_API_OPTIONS})",
                      code="trtllm.no-quant-algo")
    if algo is not None and (not isinstance(algo, str) or algo not in _TRT_QUANT_ALGOS):
        yield Problem("trtllm", f"{where}:quantization.quant_algo", f"is {algo!r}, not a QuantAlgo name kvcalib knows; "
                      "TensorRT-LLM raises ValueError for an unknown one", "warning", "trtllm.quant-algo")
    excl = t.inner.get("exclude_modules")
    if excl is not None and not (isinstance(excl, list) and all(isinstance(x, str) for x in excl)):
        yield Problem("trtllm", f"{where}:quantization.exclude_modules", "must be a list of module name patterns",
                      code="trtllm.hf-quant-config")


def trt_api_options(ck: CheckpointFiles, t: TrtView) -> Iterator[Problem]:
    """`llm_api_options.yaml` (what kvcalib's serve command passes as `--extra_llm_api_options`):
    `kv_cache_config.dtype` one of fp8 | nvfp4 | auto, or int8 with pull request 18953.

    tensorrt_llm/_torch/pyexecutor/model_loader.py: validate_and_set_kv_cache_quant (_VALID_KV_CACHE_DTYPES
    ("fp8", "nvfp4", "auto"): any other raises ValueError; an explicit dtype overrides the checkpoint's
    kv_cache_quant_algo); tensorrt_llm/llmapi/llm_utils.py: ModelLoader._update_from_hf_quant_config
    (explicit_kv_cache_quant_algo); NVIDIA/TensorRT-LLM pull request 18953 (`KvCacheConfig(dtype="int8")`).
    """
    where = TRTLLM_API_OPTIONS
    if not ck.api_options_present:
        return
    if ck.api_options_error is not None:
        yield Problem("trtllm", where, f"{ck.api_options_error}; trtllm-serve fails to read it",
                      code="trtllm.api-options")
        return
    kv = ck.api_options.get("kv_cache_config")
    if kv is not None and not isinstance(kv, dict):
        yield Problem("trtllm", f"{where}:kv_cache_config", "must be a mapping", code="trtllm.api-options")
        return
    dtype = (kv or {}).get("dtype")
    if dtype is None or dtype == "auto":
        if not ck.hf_quant_present:
            yield Problem("trtllm", f"{where}:kv_cache_config.dtype", "not set: without hf_quant_config.json "
                          "TensorRT-LLM keeps the KV cache in the model dtype", code="trtllm.no-kv-quant")
    elif dtype not in TRTLLM_KV_DTYPES:
        yield Problem("trtllm", f"{where}:kv_cache_config.dtype", f"is {dtype!r}; TensorRT-LLM accepts fp8, nvfp4 "
                      "or auto (validate_and_set_kv_cache_quant raises ValueError otherwise)", code="trtllm.kv-algo")
    elif dtype == "int8":
        yield Problem("trtllm", f"{where}:kv_cache_config.dtype", "int8: merged TensorRT-LLM refuses it "
                      "(validate_and_set_kv_cache_quant); only a build with pull request 18953 serves it",
                      "warning", "trtllm.int8-build")
    elif t.inner is not None and t.inner.get("kv_cache_quant_algo") not in (None, t.serve_kv):
        yield Problem("trtllm", f"{where}:kv_cache_config.dtype", f"{dtype} overrides {HF_QUANT_CONFIG}'s "
                      f"kv_cache_quant_algo {t.inner.get('kv_cache_quant_algo')!r}", "warning",
                      "trtllm.config-overrides")


def trt_int8_needs_unquantized_weights(ck: CheckpointFiles, t: TrtView) -> Iterator[Problem]:
    """INT8 KV only with unquantized FP16/BF16 projections (weight quant_algo null).

    NVIDIA/TensorRT-LLM pull request 18953 (calibrated INT8 KV cache, PyTorch backend): create_attention
    rejects a quantized-projection config ("unquantized FP16/BF16 projections").
    """
    if t.kv_algo == "INT8" and t.inner and t.inner.get("quant_algo") is not None:
        yield Problem("trtllm", f"{HF_QUANT_CONFIG}:quantization.quant_algo", f"is {t.inner['quant_algo']!r}; "
                      "INT8 KV cache needs unquantized FP16/BF16 projections", code="trtllm.int8-weights")


def trt_config_json_quantization(ck: CheckpointFiles, t: TrtView) -> Iterator[Problem]:
    """config.json's quantization_config must not take over from hf_quant_config.json.

    tensorrt_llm/_torch/model_config.py: ModelConfig.from_pretrained (with no weight quant_algo in
    hf_quant_config.json it calls load_hf_quant_config on config.json's block and, if that sets a weight
    algo, uses it instead: hf_quant_config.json's kv_cache_quant_algo is dropped);
    tensorrt_llm/models/quant_config_utils.py: update_quant_config_from_compressed_tensors raises
    ValueError for missing or empty config_groups.
    """
    qc = ck.inline_qc
    if not isinstance(qc, dict) or is_modelopt(qc):
        return
    if t.inner is not None and t.inner.get("quant_algo") is not None:
        return  # hf_quant_config.json decides; config.json's block is not consulted
    where = "config.json:quantization_config"
    if is_compressed_tensors(qc):
        if not qc.get("config_groups"):
            yield Problem("trtllm", where, "a compressed-tensors block without weight config_groups: TensorRT-LLM "
                          "raises ValueError (config_groups is empty) and does not load; keep it out of the "
                          "TensorRT-LLM variant", code="trtllm.ct-config")
        elif ck.hf_quant_present and t.inner and t.inner.get("kv_cache_quant_algo") not in (None, t.kv_algo):
            yield Problem("trtllm", where, f"compressed-tensors weights replace hf_quant_config.json's quantization: "
                          f"its kv_cache_quant_algo {t.inner.get('kv_cache_quant_algo')!r} is dropped",
                          code="trtllm.config-overrides")
    elif t.inner is not None and t.inner.get("kv_cache_quant_algo") is not None:
        yield Problem("trtllm", where, f"quant_method {qc.get('quant_method')!r} replaces hf_quant_config.json's "
                      "quantization (no weight quant_algo there): its kv_cache_quant_algo is dropped",
                      code="trtllm.config-overrides")


def trt_no_skipped_layers(ck: CheckpointFiles, t: TrtView) -> Iterator[Problem]:
    """TRT-LLM cannot keep layers out of a quantized KV cache.

    tensorrt_llm/_torch/models/modeling_utils.py: DecoderModelForCausalLM.apply_quant_config_exclude_modules
    ("kv_cache_quant_algo takes precedence over exclude_modules").
    """
    if t.kv_algo is not None and ck.skipped_layers:
        yield Problem("trtllm", PROVENANCE_FILE, f"lists skipped layers {sorted(ck.skipped_layers)}, but TensorRT-LLM "
                      "quantizes every layer's KV cache: those layers would run quantized",
                      code="trtllm.skip-layers")


def trt_scale_names(ck: CheckpointFiles, t: TrtView) -> Iterator[Problem]:
    """TRT-LLM reads `...self_attn.k_proj.k_scale` and `...self_attn.v_proj.v_scale` of existing layers only.

    tensorrt_llm/_torch/models/modeling_utils.py: _load_weights_impl (fused `qkv_proj` gets one dict per
    `{q,k,v}_proj` via filter_weights; the scale is key `k_scale` of the k dict, `v_scale` of the v dict);
    tensorrt_llm/_torch/models/checkpoints/hf/weight_loader.py: HfWeightLoader.load_weights (skips
    "*consolidated*" files when other shards exist). A name that reaches no module of the model (filter_weights
    selects by the exact module name: calib.ckpt.names, calib.ckpt.reader CheckpointFiles.unmapped) is never read.
    """
    yield from unmapped_problems("trtllm", ck, t.files, cannot_check="TensorRT-LLM reads it",
                                 never_read="TensorRT-LLM selects a module's tensors by its exact name and never "
                                            "reads this one")
    for s in t.scales:
        name = s.tensor.name
        if isinstance(ck.num_layers, int) and s.layer >= ck.num_layers:
            yield Problem("trtllm", name, f"layer {s.layer} does not exist (num_hidden_layers = {ck.num_layers}): "
                          "TensorRT-LLM never reads it", code="trtllm.layer-range")
        elif s.form == "proj" and s.kind in "kv" and s.proj != s.kind:
            yield Problem("trtllm", name, f"a {s.kind} scale under {s.proj}_proj: TensorRT-LLM reads it as part of the "
                          f"{s.proj} projection; name it {s.kind}_proj.{s.kind}_scale", code="trtllm.name")
        elif s.form != "proj" and s.kind in "kv" and t.kv_algo is not None:
            yield Problem("trtllm", name, f"TensorRT-LLM does not read this name; it reads "
                          f"model.layers.{s.layer}.self_attn.{s.kind}_proj.{s.kind}_scale", "warning",
                          "trtllm.ignored-name")
    for f in t.skipped_files:
        for s in ck.scales([f]):
            yield Problem("trtllm", s.tensor.name, f"in {f}: TensorRT-LLM skips '*consolidated*' files when other "
                          "shards exist, so it never reads it", code="trtllm.skipped-file")


def _trt_usable(t: TrtView) -> list[ScaleTensor]:
    return [s for s in t.scales if s.form == "proj" and s.kind in "kv" and s.proj == s.kind]


def trt_scales_present(ck: CheckpointFiles, t: TrtView) -> Iterator[Problem]:
    """Where KV quantization is declared: both scales for every layer.

    INT8: NVIDIA/TensorRT-LLM pull request 18953 (fused QKV loader raises "both scales must be loaded
    together" unless each layer has k_scale and v_scale); FP8: tensorrt_llm/_torch/attention_backend/
    trtllm.py: TrtllmAttention.__init__ (FP8 KV runs with 1.0 today, so missing scales cost nothing yet);
    NVFP4: tensorrt_llm/_torch/modules/linear.py (scales optional, identity otherwise).
    """
    if t.kv_algo is None:
        return
    severity = "error" if t.kv_algo == "INT8" else "warning"
    why = {"INT8": "TensorRT-LLM's INT8 KV cache refuses to load without both scales of every layer",
           "FP8": "TensorRT-LLM's FP8 KV cache uses 1.0 today, but the checkpoint carries no calibration for when "
                  "it reads them",
           "NVFP4": "TensorRT-LLM uses identity scales for it"}.get(t.kv_algo, "")
    usable = _trt_usable(t)
    if not usable:
        yield Problem("trtllm", HF_QUANT_CONFIG, f"declares {t.kv_algo} KV but no *.k_proj.k_scale / *.v_proj.v_scale "
                      f"tensor is present ({why})", severity, "trtllm.no-scales")
        return
    seen: dict[tuple[int, str], list[str]] = {}
    for s in usable:
        seen.setdefault((s.layer, s.kind), []).append(f"{s.tensor.name} in {s.tensor.file}")
    for layer in range(ck.num_layers) if isinstance(ck.num_layers, int) else []:
        for kind in "kv":
            names = seen.get((layer, kind), [])
            where = f"model.layers.{layer}.self_attn.{kind}_proj.{kind}_scale"
            if not names:
                yield Problem("trtllm", where, f"missing ({why})", severity, "trtllm.missing-scale")
            elif len({n.split(' in ')[0] for n in names}) < len(names):
                yield Problem("trtllm", where, f"stored in {len(names)} files: TensorRT-LLM keeps whichever file it "
                              "loads last", code="trtllm.duplicate-scale")


def trt_scale_shapes_dtypes_values(ck: CheckpointFiles, t: TrtView) -> Iterator[Problem]:
    """Scalar (one element), float32, finite and > 0.

    NVIDIA/TensorRT-LLM pull request 18953: the INT8 loader rejects non-scalar, zero, negative, NaN and
    inf scales ("INT8 KV cache"); tensorrt_llm/_torch/modules/linear.py: the NVFP4 path builds
    `[1.0, max(k_scale), max(v_scale)]` from scalars; ModelOpt writes scalars.
    """
    yield from scalar_problems("trtllm", ck, _trt_usable(t),
                               shape_why="; TensorRT-LLM reads one scalar per layer (fold per-head scales by max)",
                               nonfinite_why="; scales must be finite and > 0",
                               nonpositive_why="; scales must be finite and > 0")


TRT_RULES: tuple[Callable[[CheckpointFiles, TrtView], Iterable[Problem]], ...] = (
    trt_hf_quant_config, trt_api_options, trt_int8_needs_unquantized_weights, trt_config_json_quantization,
    trt_no_skipped_layers, trt_scale_names, trt_scales_present, trt_scale_shapes_dtypes_values,
)


def trt_declared(ck: CheckpointFiles) -> bool:
    """The checkpoint is for TensorRT-LLM when it has an hf_quant_config.json or TensorRT-LLM's serve options."""
    return ck.hf_quant_present or ck.api_options_present


CHECKER = Checker("trtllm", trt_view, TRT_RULES, trt_declared)
