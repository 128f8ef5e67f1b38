"""vLLM: what it does with a checkpoint's KV scales, per version, attention backend and KV format.

Read from the vllm wheels 0.18.0, 0.19.0, 0.20.0, 0.21.0, 0.24.0, 0.25.0, 0.32.0, 0.33.0 and 0.34.0 (paths under
`vllm/`). The versions where behaviour changes: 0.19 (`--kv-cache-dtype-skip-layers`), 0.20 (fp8 and int8
per-token-head caches), 0.21 (the CPU backend runs quantized caches), 0.25 (int4 per-token-head), 0.33 (the CPU
backend refuses a cache it cannot run when it is selected) and 0.34 (a per-layer KV-dtype hook). Which formats
vLLM has, and their names, are calib.recipe.dtypes'.
"""

from __future__ import annotations

from calib.recipe.support.base import Effect as E, Engine, Measurement, TuneSpace, cell_maker, source_maker, v

_s = source_maker("vllm-project/vllm", "0.18.0-0.34.0")
_Q = "vllm/model_executor/layers/quantization/"
_A = "vllm/v1/attention/backends/"
V1 = _s(_Q + "kv_cache.py", "BaseKVCacheMethod.process_weights_after_loading (per-token-head caches: scales set "
        "to 1.0; a compressed-tensors checkpoint's own method replaces it and keeps the file's values, unused)",
        "0.20.0-0.34.0")
V2 = _s(_Q + "compressed_tensors/compressed_tensors.py", "CompressedTensorsKVCacheMethod.validate_kv_cache_scheme / "
        "create_weights (q/k/v_scale start at ones; attn_head q_scale reduced by amax over each KV-head group) / "
        "process_weights_after_loading (scalar copies: the max over heads)")
V3 = _s(_A + "flash_attn.py", "FlashAttentionBackend.supports_per_head_quant_scales (FlashAttention version >= 3)")
V3F = _s(_A + "fa_utils.py", "get_flash_attn_version (FA3 on Hopper, FA4 on Blackwell SM100)", "0.20.0-0.34.0")
V4 = _s("vllm/model_executor/layers/attention/attention.py", "_init_kv_cache_quant ('fp8_e5m2 kv-cache is not "
        "supported with fp8 checkpoints'; skip layers) / Attention.__init__ (query_quant: FP8 KV caches, not "
        "per-token-head)", "0.19.0-0.34.0")
V5 = _s("vllm/platforms/cuda.py", "CudaPlatform.get_valid_backends")
V6 = _s(_A + "triton_attn.py", "TritonAttentionBackend.supported_kv_cache_dtypes / TritonAttentionImpl "
        "(supports_quant_query_input on CUDA)")
V6P = _s(_A + "triton_attn.py", "TritonAttentionImpl.forward / do_kv_cache_update (per-token-head path: no q/k/v "
         "descale; the cache write computes each token and head's scale)", "0.32.0")
V6F = _s(_A + "flash_attn.py", "FlashAttentionBackend.supports_kv_cache_dtype")
V6I = _s(_A + "flashinfer.py", "FlashInferImpl.__init__ (supports_quant_query_input only with TensorRT-LLM-gen "
         "attention, SM100)", "0.24.0-0.34.0")
V7 = _s("vllm/platforms/cpu.py", "CpuPlatform.get_attn_backend_cls ('not supported by the CPU attention backend')",
        "0.21.0-0.32.0 (no check), 0.33.0-0.34.0 (check)")
V7A = _s(_A + "cpu_attn.py", "CPUAttentionBackendImpl.__init__ ('FP8 KV cache is unsupported in CPU_ATTN')",
         "0.18.0-0.20.0")
V7I = _s(_A + "cpu_attn.py", "_get_attn_isa ('FP8 KV cache on CPU requires x86 with AVX-512 or AMX', head size "
         "divisible by 32) / CPUAttentionBackend.supports_kv_cache_dtype (the same check at selection)",
         "0.21.0-0.32.0 (raise), 0.33.0-0.34.0 (refused at selection)")
V7K = _s(_A + "cpu_attn.py", "CPUAttentionBackendImpl (_k_scale_float)", "0.21.0-0.34.0")
V8 = _s("vllm/config/cache.py", "CacheDType / CacheConfig.kv_cache_dtype_skip_layers (from 0.19)")
V9 = _s(_Q + "base_config.py", "QuantizationConfig.get_kv_cache_dtype (per-layer KV dtype under --kv-cache-dtype "
        "auto; no quantization config overrides it yet; RFC issue 57445, ModelOpt layer-wise KV pull request "
        "56116 open)", "0.34.0")
M_GPU = Measurement("GPU vLLM 0.24 on one H100, kvcalib's default model, one engine start per case with the "
                    "backend forced (bench/results/matrix/vllm-0.24-h100.json, tests/recipe/test_support_measured.py)",
                    "2026-12-07")
M_CPU = Measurement("CPU vLLM 0.32, SmolLM2-135M, 2 x 512 held-out tokens, prompt log-prob perplexity: BF16 22.4, "
                    "fp8_per_token_head 224,275, int8_per_token_head 270,845; no warning", "2026-12-05")

ENGINE = Engine(
    "vllm", "vLLM", 0, {"fa3": "FlashAttention 3/4", "triton": "Triton", "flashinfer": "FlashInfer", "cpu": "CPU"},
    v("0.34.0"), "vllm 0.18.0, 0.19.0, 0.20.0, 0.21.0, 0.24.0, 0.25.0, 0.32.0, 0.33.0, 0.34.0 wheels",
    ("vllm", "serve", "{model}"), "--max-model-len", "--kv-cache-dtype choice",
    "not a --kv-cache-dtype choice; a compressed-tensors int KV scheme raises NotImplementedError", (V8, V2),
    kv_flag="--kv-cache-dtype", backend_flag="--attention-backend", skip_flag="--kv-cache-dtype-skip-layers",
    skip_kinds=("sliding_window",), tune=TuneSpace(("tensor", "head"), (False, True)))

c = cell_maker(ENGINE)
_GPU = ("fa3", "triton", "flashinfer")
_DYN2 = ("fp8_per_token_head", "int8_per_token_head")
_KV = ("tensor", "head", "q_scale")
_SKIP_OLD = "--kv-cache-dtype-skip-layers does not exist before 0.19: vLLM refuses the option"
_SKIP = "--kv-cache-dtype-skip-layers keeps the named layers (indices, or sliding_window) in the model dtype"
_CPU_OLD = "the CPU backend refuses a quantized KV cache before 0.21"
_E5M2 = "e5m2 runs at 1.0 by design; a checkpoint declaring KV scales is refused at start"
_ISA = ("; needs x86 AVX-512 or AMX and a head size divisible by 32 (otherwise NotImplementedError at start, "
        "from 0.33 refused when the backend is selected)")


def _dynamic(formats: tuple[str, ...], since: str) -> tuple:
    """The per-token-head caches from the version that has them: Triton only; CPU broken until 0.33."""
    cpu_from = max(since, "0.21", key=v)
    return (
        c("triton", formats, _KV, E.IGNORED, "checkpoint scales unused: the cache write computes a scale per token "
          "and head", V1, V6P, M_GPU, since=since),
        c("triton", formats, "q_absent", E.UNQUANTIZED, "Q stays in the model dtype (no query quantization with a "
          "per-token-head cache)", V4, since=since),
        c("triton", formats, "skip_layers", E.APPLIED, "skipped layers stay in the model dtype", V4, V8, since=since),
        c(("fa3", "flashinfer"), formats, "*", E.REFUSED, "only the Triton backend implements per-token-head caches",
          V6, V6F, M_GPU, since=since),
        *((c("cpu", formats, "*", E.REFUSED, _CPU_OLD, V7A, since=since, until="0.21"),) if v(since) < v("0.21")
          else ()),
        c("cpu", formats, (*_KV, "q_absent"), E.BROKEN, "accepted without a check; the CPU kernel treats it as a "
          "quantized cache at 1.0 and returns garbage", V7, *((M_CPU,) if formats == _DYN2 else ()), since=cpu_from,
          until="0.33"),
        c("cpu", formats, "skip_layers", E.APPLIED, "skipped layers stay in the model dtype (the others are broken)",
          V4, V8, since=cpu_from, until="0.33"),
        c("cpu", formats, "*", E.REFUSED, "'not supported by the CPU attention backend'", V7, since="0.33"),
    )


CELLS = (
    # ---- static FP8 e4m3 (a compressed-tensors kv_cache_scheme)
    c(_GPU, "fp8_e4m3", "tensor", E.APPLIED, "per-tensor k/v scales reach the kernel", V2, V6, M_GPU),
    c("fa3", "fp8_e4m3", "head", E.APPLIED, "per-head k/v scales applied per head by FlashAttention >= 3 (FA3 on "
      "Hopper, FA4 on Blackwell)", V2, V3, V3F, M_GPU),
    c(("triton", "flashinfer"), "fp8_e4m3", "head", E.REFUSED, "backends without per-head scales are dropped: 'No "
      "valid attention backend found' without FlashAttention >= 3", V3, V5, M_GPU),
    c(("fa3", "triton"), "fp8_e4m3", "q_scale", E.APPLIED, "Q quantized to FP8 with q_scale; per-head q scales are "
      "reduced to one per KV head (the max over each group)", V2, V4, V6, M_GPU),
    c("flashinfer", "fp8_e4m3", "q_scale", E.IGNORED, "FlashInfer quantizes Q only with its TensorRT-LLM-gen kernels "
      "(Blackwell, SM100): elsewhere Q stays in the model dtype and q_scale is unused", V4, V6I),
    c(("fa3", "triton"), "fp8_e4m3", "q_absent", E.IGNORED, "a compressed-tensors checkpoint without q_scale "
      "quantizes Q to FP8 at scale 1.0 (its q_scale starts at ones)", V2, V4, M_GPU),
    c("flashinfer", "fp8_e4m3", "q_absent", E.UNQUANTIZED, "Q stays in the model dtype (quantized at 1.0 only with "
      "the TensorRT-LLM-gen kernels on Blackwell)", V4, V6I),
    c(_GPU, "fp8_e4m3", "skip_layers", E.REFUSED, _SKIP_OLD, V8, until="0.19"),
    c(_GPU, "fp8_e4m3", "skip_layers", E.APPLIED, _SKIP, V4, V8, M_GPU, since="0.19"),
    c("cpu", ("fp8_e4m3", "fp8_e5m2"), "*", E.REFUSED, _CPU_OLD, V7A, until="0.21"),
    c("cpu", "fp8_e4m3", "tensor", E.APPLIED, "per-tensor k/v scales reach the CPU kernel" + _ISA, V7K, V7I,
      since="0.21"),
    c("cpu", "fp8_e4m3", "head", E.MAX_OVER_HEADS, "the CPU kernel reads one scale per layer, the max over heads",
      V2, V7K, since="0.21"),
    c("cpu", "fp8_e4m3", "q_scale", E.IGNORED, "no query quantization on CPU", V4, V7K, since="0.21"),
    c("cpu", ("fp8_e4m3", "fp8_e5m2"), "q_absent", E.UNQUANTIZED, "no query quantization on CPU", V4, V7K,
      since="0.21"),
    c("cpu", ("fp8_e4m3", "fp8_e5m2"), "skip_layers", E.APPLIED, _SKIP, V4, V8, since="0.21"),
    # ---- fp8_e5m2: no checkpoint scales
    c("fa3", "fp8_e5m2", "*", E.REFUSED, "FlashAttention supports FP8 e4m3 only", V6F, M_GPU),
    c(("triton", "flashinfer"), "fp8_e5m2", _KV, E.REFUSED, _E5M2, V4, M_GPU),
    c("cpu", "fp8_e5m2", _KV, E.REFUSED, _E5M2, V4, since="0.21"),
    c("triton", "fp8_e5m2", "q_absent", E.IGNORED, "Q quantized to FP8 at scale 1.0 (Triton on CUDA)", V4, V6),
    c("flashinfer", "fp8_e5m2", "q_absent", E.UNQUANTIZED, "Q stays in the model dtype (quantized at 1.0 only with "
      "the TensorRT-LLM-gen kernels on Blackwell)", V4, V6I),
    c(("triton", "flashinfer"), "fp8_e5m2", "skip_layers", E.REFUSED, _SKIP_OLD, V8, until="0.19"),
    c(("triton", "flashinfer"), "fp8_e5m2", "skip_layers", E.APPLIED, _SKIP, V4, V8, since="0.19"),
    # ---- the dynamic per-token-head caches (fp8/int8 from 0.20, int4 from 0.25)
    *_dynamic(_DYN2, "0.20"),
    *_dynamic(("int4_per_token_head",), "0.25"),
)

# Read but not a cell: 0.34 adds a per-layer KV-dtype hook that no quantization config implements yet (V9).
NOTES = (("0.34: `QuantizationConfig.get_kv_cache_dtype(prefix)` lets a checkpoint choose each layer's KV dtype "
          "under --kv-cache-dtype auto; no quantization config implements it in 0.34, so every layer keeps one "
          "dtype", V9),)
