"""SGLang: what it does with a checkpoint's KV scales, per version, backend (CUDA or CPU), KV format and model.

Read from the sglang wheels 0.5.18 to 0.5.23 (paths under `python/sglang/srt/`). The versions where behaviour
changes: 0.5.19 (a compressed-tensors kv_cache_scheme loads its scales) and 0.5.20 (the x86 CPU backend applies
them; fp8_e5m2 refused on CPU). Whether the scales load also depends on the model: each architecture's weight
loader must remap `self_attn.k_scale` onto its attention layer, and the loaders of Qwen2/Qwen2.5, Qwen3-MoE and
Mixtral do not (sglang issue 39942): those models run every layer at 1.0 — the matrix's model axis.
"""

from __future__ import annotations

from calib.recipe.support.base import Effect as E, Engine, Source, cell_maker, source_maker, v

_P = "python/sglang/srt/"
_s = source_maker("sgl-project/sglang", "0.5.19-0.5.23", _P)

S1 = _s("layers/quantization/compressed_tensors/compressed_tensors.py", "CompressedTensorsConfig.get_quant_method / "
        "CompressedTensorsKVCacheMethod.is_supported_scheme (float, 8 bits, strategy tensor, static, symmetric)")
S1_OLD = _s("layers/quantization/compressed_tensors/compressed_tensors.py", "CompressedTensorsConfig.get_quant_method "
            "(no KV method for attention)", "0.5.17, 0.5.18")
S2 = _s("mem_cache/kv_cache_dtype.py", "configure_kv_cache_dtype ('--kv-cache-dtype fp8_e5m2 is not supported on "
        "CPU' from 0.5.20)", "0.5.18-0.5.23")
S3 = _s("layers/quantization/kv_cache.py", "BaseKVCacheMethod.process_weights_after_loading (no scale loaded: 1.0)")
S4 = _s("model_loader/weight_utils.py", "maybe_remap_kv_scale_name (self_attn.k_scale -> self_attn.attn.k_scale; "
        "called by the llama, mistral (a LlamaForCausalLM), qwen3 and gemma3 loaders)", "0.5.18-0.5.23")
S5 = _s("models/qwen2.py, models/qwen3_moe.py, models/mixtral.py", "Qwen2ForCausalLM / Qwen2Attention.load_weights, "
        "Qwen3MoeForCausalLM.load_weights, MixtralForCausalLM.load_weights (no maybe_remap_kv_scale_name: the scale "
        "is not in params_dict and is dropped)", "0.5.18-0.5.23")
S6 = _s("mem_cache/memory_pool.py", "MHATokenToKVPool.set_kv_buffer (divides by k_scale / v_scale before the cast "
        "to the cache's FP8 dtype, e4m3 or e5m2)")
S7 = _s("models/llama.py", "LlamaForCausalLM._legacy_load_weights (q_scale not in params_dict)")
S8 = _s("arg_groups/fields/model.py", "kv_cache_dtype choices (no int8, no per-token-head, no per-layer KV dtype)",
        "0.5.23")
S9 = _s("layers/attention/intel_amx_backend.py, layers/attention/torch_native_backend.py", "IntelAMXAttnBackend "
        "(k_scale_float passed to set_kv_buffer and the kernels from 0.5.20), TorchNativeAttnBackend (set_kv_buffer "
        "without scales)", "0.5.19, 0.5.20, 0.5.23")
S_39942 = Source("sgl-project/sglang", "issue 39942 (open)", "FP8 KV cache scales silently dropped for Qwen3-MoE, "
                 "Qwen2 and Mixtral; every layer falls back to scale 1.0", "filed 2026-09-17")

ENGINE = Engine(
    "sglang", "SGLang", 2, {"cuda": "CUDA", "cpu": "CPU"}, v("0.5.23"),
    "sglang 0.5.17, 0.5.18, 0.5.19, 0.5.20, 0.5.21, 0.5.22, 0.5.23 wheels",
    ("python", "-m", "sglang.launch_server", "--model-path", "{model}"), "--context-length",
    "--kv-cache-dtype choice", "not a --kv-cache-dtype choice", (S8,), kv_flag="--kv-cache-dtype")

c = cell_maker(ENGINE)
FP8 = ("fp8_e4m3", "fp8_e5m2")
# Architectures whose loader drops the checkpoint's k_scale / v_scale (S5); Qwen2.5 is a Qwen2ForCausalLM.
DROPS_SCALES = ("Qwen2ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
_DROPPED = ("this model's weight loader never remaps self_attn.k_scale / v_scale: the scales are dropped and every "
            "layer runs at 1.0 (sglang issue 39942)")


def _per_backend(aspect: str, effect: E, note: str, *evidence: Source) -> tuple:
    """One aspect on every FP8 cache, except fp8_e5m2 on CPU, which 0.5.20 refuses outright."""
    return (c("cuda", FP8, aspect, effect, note, *evidence), c("cpu", "fp8_e4m3", aspect, effect, note, *evidence),
            c("cpu", "fp8_e5m2", aspect, effect, note, *evidence, until="0.5.20"))


CELLS = (
    c("*", FP8, "tensor", E.IGNORED, "no KV method for compressed-tensors before 0.5.19: the scales are 'not loaded'",
      S1_OLD, S4, until="0.5.19"),
    c("cuda", FP8, "tensor", E.APPLIED, "static per-tensor scales of a compressed-tensors kv_cache_scheme load and the "
      "pool divides by them for either FP8 cache, where the model's loader remaps the scale names (read: Llama, "
      "Mistral, Qwen3, Gemma3; not Qwen2/2.5, Qwen3-MoE, Mixtral)", S1, S3, S4, S6, since="0.5.19"),
    c("cuda", FP8, "tensor", E.IGNORED, _DROPPED, S5, S3, S_39942, since="0.5.19", models=DROPS_SCALES),
    c("cpu", FP8, "tensor", E.IGNORED, "the CPU backends write the cache without the scales", S9, since="0.5.19",
      until="0.5.20"),
    c("cpu", "fp8_e4m3", "tensor", E.APPLIED, "applied by the x86 CPU backend (intel_amx, the default there); arm64's "
      "torch_native backend writes the cache without them", S1, S9, since="0.5.20"),
    c("cpu", "fp8_e4m3", "tensor", E.IGNORED, _DROPPED, S5, S3, S_39942, since="0.5.20", models=DROPS_SCALES),
    c("cpu", "fp8_e5m2", "*", E.REFUSED, "fp8_e5m2 is refused on CPU", S2, since="0.5.20"),
    *_per_backend("head", E.IGNORED, "'only static symmetric per-tensor FP8 scales are supported': per-head schemes "
                  "are dropped with a warning", S1),
    *_per_backend("q_scale", E.IGNORED, "q_scale is not a parameter ('not found in params_dict')", S4, S7),
    *_per_backend("q_absent", E.UNREAD, "whether Q is quantized with an FP8 cache was not read", S2),
    *_per_backend("skip_layers", E.IGNORED, "no per-layer KV dtype option: every layer is quantized", S8),
)
