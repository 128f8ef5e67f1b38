"""The quantization configs kvcalib reads and writes: compressed-tensors (vLLM, llm-compressor), ModelOpt
(TensorRT-LLM's `hf_quant_config.json`) and, read only, AMD Quark (vLLM loads its KV scales).

Readers take parsed JSON and never raise on odd shapes (they answer None or False, and the caller decides
whether that is an error); writers build the exact blocks the exporters put into a checkpoint. Imports
nothing from torch: verify and inspect read these without loading a tensor library.
"""

from __future__ import annotations

from typing import Any

from calib.safety.readers import whole

# ---------------------------------------------------------------- compressed-tensors (vLLM)

def is_compressed_tensors(qc: Any) -> bool:
    """`quant_method` compressed-tensors (either spelling)."""
    return isinstance(qc, dict) and \
        str(qc.get("quant_method", "")).lower().replace("_", "-") == "compressed-tensors"


def ct_declared_kv_scheme(qc: Any) -> Any:
    """The `kv_cache_scheme` a compressed-tensors block declares, as written (any JSON value: the caller checks
    its shape); None when `qc` is not compressed-tensors or declares none."""
    return qc.get("kv_cache_scheme") if is_compressed_tensors(qc) else None


def ct_kv_cache_scheme(strategy: str = "tensor") -> dict[str, Any]:
    """compressed-tensors' `kv_cache_scheme` for static, symmetric FP8 scales; `strategy` is `tensor` (one
    scale per layer) or `attn_head` (one per KV head)."""
    return {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}


def ct_quantization_config(strategy: str = "tensor") -> dict[str, Any]:
    """The compressed-tensors block for KV-only FP8: what `compressed_tensors.QuantizationConfig` serialises
    (its None fields dropped; tests check the two agree). `config_groups` stays (empty): vLLM injects head
    counts for `attn_head` only when the key exists."""
    return {"config_groups": {}, "format": "dense", "ignore": [], "kv_cache_scheme": ct_kv_cache_scheme(strategy),
            "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def ct_with_kv_scheme(qc: dict[str, Any], strategy: str = "tensor") -> dict[str, Any]:
    """A weight-quantized compressed-tensors block (W8A8, FP8, W4A16, ...) with our `kv_cache_scheme` added;
    every other field kept."""
    out = {**qc, "kv_cache_scheme": ct_kv_cache_scheme(strategy)}
    out.setdefault("config_groups", {})
    return out


# ---------------------------------------------------------------- ModelOpt (TensorRT-LLM)

# ModelOpt's flat shape names its KV scheme as (type, num_bits); the legacy shape spells the algorithm.
_KV_SCHEME_ALGOS = {("float", 8): "FP8", ("float", 4): "NVFP4", ("int", 8): "INT8"}


def producer_name(qc: dict[str, Any]) -> Any:
    """`producer.name` of a config, None when `producer` is not an object."""
    producer = qc.get("producer")
    return producer.get("name") if isinstance(producer, dict) else None


def is_modelopt(qc: Any) -> bool:
    """tensorrt_llm/quantization/modelopt_config.py: is_modelopt_quant_config."""
    return isinstance(qc, dict) and (str(qc.get("quant_method", "")).lower().startswith("modelopt")
                                     or producer_name(qc) == "modelopt")


def modelopt_kv_algo(scheme: Any) -> str | None:
    """The KV algorithm a flat ModelOpt `kv_cache_scheme` names (a string, or a {type, num_bits} object)."""
    if isinstance(scheme, str):
        return scheme.upper()
    if isinstance(scheme, dict):
        try:
            return _KV_SCHEME_ALGOS.get((scheme.get("type"), scheme.get("num_bits")))
        except TypeError:   # a list or object where a name or a number belongs
            return None
    return None


def modelopt_quantization(qc: dict[str, Any]) -> dict[str, Any] | None:
    """The legacy `quantization` dict (a copy) from either ModelOpt shape; None when neither shape fits.

    tensorrt_llm/quantization/modelopt_config.py: read_modelopt_quant_config (legacy wrapper
    `quantization`, or the flat shape with `ignore` and a `kv_cache_scheme`).
    """
    if "quantization" in qc:
        return dict(qc["quantization"]) if isinstance(qc["quantization"], dict) else None
    if not is_modelopt(qc):
        return None
    # the flat shape: `ignore` becomes `exclude_modules`, the marker keys go
    inner = {k: v for k, v in qc.items() if k not in ("producer", "quant_method", "ignore", "kv_cache_scheme",
                                                     "config_groups")}
    if "ignore" in qc:
        inner["exclude_modules"] = qc["ignore"]
    if isinstance(qc.get("kv_cache_scheme"), (str, dict)):
        inner["kv_cache_quant_algo"] = modelopt_kv_algo(qc["kv_cache_scheme"])
    return inner


def modelopt_kv_cache_algo(qc: Any) -> Any:
    """The `kv_cache_quant_algo` a ModelOpt config declares, in either shape, as written (None: none, or not a
    config TensorRT-LLM reads)."""
    inner = modelopt_quantization(qc) if isinstance(qc, dict) else None
    return inner.get("kv_cache_quant_algo") if inner else None


def hf_quant_config(quantization: dict[str, Any], version: str) -> dict[str, Any]:
    """`hf_quant_config.json` in ModelOpt's legacy shape, produced by kvcalib `version`."""
    return {"producer": {"name": "kvcalib", "version": version}, "quantization": quantization}


# TensorRT-LLM's serve-time KV dtype (LLM API `kv_cache_config.dtype`) -> its kv_cache_quant_algo. "fp8" and "nvfp4"
# from tensorrt_llm/llmapi/llm_utils.py ModelLoader._update_from_hf_quant_config (explicit_kv_cache_quant_algo) and
# tensorrt_llm/_torch/pyexecutor/model_loader.py validate_and_set_kv_cache_quant (_KV_CACHE_MAP, main 2026); "int8"
# only with NVIDIA/TensorRT-LLM pull request 18953 (open: `KvCacheConfig(dtype="int8")`).
TRTLLM_KV_DTYPES = {"fp8": "FP8", "nvfp4": "NVFP4", "int8": "INT8"}


def trtllm_api_options(kv_algo: str) -> str:
    """The YAML kvcalib writes for `trtllm-serve --extra_llm_api_options`: the KV cache dtype, nothing else."""
    dtype = {v: k for k, v in TRTLLM_KV_DTYPES.items()}[kv_algo]
    return f"# TensorRT-LLM LLM API options: trtllm-serve MODEL --extra_llm_api_options THIS_FILE\n" \
           f"kv_cache_config:\n  dtype: {dtype}\n"


def trtllm_serve_kv_algo(options: Any) -> Any:
    """The kv_cache_quant_algo TensorRT-LLM's `kv_cache_config.dtype` in `options` (parsed YAML) asks for: "FP8",
    "INT8", "NVFP4"; None when it names none ("auto" or absent); the value as written when it is no known dtype."""
    kv = options.get("kv_cache_config") if isinstance(options, dict) else None
    dtype = kv.get("dtype") if isinstance(kv, dict) else None
    if dtype is None or dtype == "auto":
        return None
    return TRTLLM_KV_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype


# ---------------------------------------------------------------- Quark (AMD; read only: vLLM loads it)

def quark_export(qc: dict[str, Any]) -> dict[str, Any] | None:
    """A Quark config's `export` object; None when it is missing or not an object."""
    export = qc.get("export")
    return export if isinstance(export, dict) else None


def quark_kv_group(qc: Any) -> Any:
    """The module patterns a Quark config's `export.kv_cache_group` names for the KV cache, as written (None:
    not Quark, or no `export` object). vLLM turns on FP8 KV from Quark only when this is a non-empty list."""
    is_quark = isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "quark"   # vLLM's spelling
    export = quark_export(qc) if is_quark else None
    return export.get("kv_cache_group") if export is not None else None


# ---------------------------------------------------------------- TensorRT-LLM checkpoint (TensorRT-engine backend)
# The 1.2 / 1.3.0rc layout (where it was read: calib/export/trtllm_engine.py); tensorrt_llm/mapping.py Mapping:
# world_size = tp_size * pp_size * cp_size, cp ranks share a file (rank files are tp_rank + pp_rank * tp_size).

TRTLLM_CKPT_KV_ALGOS = ("FP8", "INT8")


def is_trtllm_checkpoint(config: Any) -> bool:
    """A TensorRT-LLM checkpoint's config.json (PretrainedConfig): `architecture` and a `mapping` object."""
    return isinstance(config, dict) and isinstance(config.get("architecture"), str) \
        and isinstance(config.get("mapping"), dict)


# PretrainedConfig's names for the sizes a Hugging Face config.json states (modeling_utils.py PretrainedConfig.to_dict;
# `head_size` is its head_dim); the architecture is its single `architecture` (HF: `architectures[0]`)
TRTLLM_HF_SIZES = {"num_hidden_layers": "num_hidden_layers", "num_attention_heads": "num_attention_heads",
                   "num_key_value_heads": "num_key_value_heads", "hidden_size": "hidden_size",
                   "intermediate_size": "intermediate_size", "vocab_size": "vocab_size", "head_dim": "head_size"}


def trtllm_ckpt_sizes(config: dict[str, Any]) -> dict[str, Any]:
    """A TensorRT-LLM checkpoint's sizes under the Hugging Face names, and `architecture` as `architectures`."""
    out = {hf: config.get(trt) for hf, trt in TRTLLM_HF_SIZES.items()}
    out["architectures"] = [config.get("architecture")]
    return out


def trtllm_ckpt_grid(config: dict[str, Any]) -> tuple[int, int, int]:
    """(num_hidden_layers, tp_size, pp_size) of a TensorRT-LLM checkpoint (the sizes from `mapping`, 1 where absent,
    as Mapping's defaults); ValueError naming the field for anything but positive integers, or a world_size that
    disagrees."""
    m = config.get("mapping")
    if not isinstance(m, dict):
        raise ValueError("config.json has no 'mapping' object")
    tp, pp, cp = (whole(m.get(key, 1), f"config.json mapping.{key}", lo=1) for key in ("tp_size", "pp_size", "cp_size"))
    world = m.get("world_size", tp * pp * cp)
    if world != tp * pp * cp:
        raise ValueError(f"config.json mapping.world_size = {world!r} is not tp_size * pp_size * cp_size "
                         f"({tp} * {pp} * {cp}); TensorRT-LLM's Mapping refuses it")
    n = whole(config.get("num_hidden_layers"), "config.json num_hidden_layers", lo=1)
    return n, tp, pp


def pp_layers(num_layers: int, pp_size: int, stage: int) -> list[int]:
    """The global layers of pipeline stage `stage` (TensorRT-LLM's Mapping.pp_layers: torch.tensor_split, the
    first num_layers % pp_size stages one layer more)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pp_size {pp_size} must be between 1 and num_hidden_layers {num_layers}")
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def trtllm_rank_layers(num_layers: int, tp_size: int, pp_size: int) -> dict[int, list[int]]:
    """{rank file index: the global layers it holds, in local order} (rank = tp_rank + pp_rank * tp_size)."""
    return {r: pp_layers(num_layers, pp_size, r // tp_size) for r in range(tp_size * pp_size)}
