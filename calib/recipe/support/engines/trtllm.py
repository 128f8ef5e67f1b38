"""TensorRT-LLM, PyTorch backend: what it does with a checkpoint's KV scales (hf_quant_config.json
kv_cache_quant_algo), and what the open pull request 18953 (calibrated INT8 KV) changes for a build carrying it.

Read from NVIDIA/TensorRT-LLM main, late 2026: 1.4.0rc (PyPI's newest pre-release is 1.4.0rc1). Main moved the
attention backends to `tensorrt_llm/_torch/attention/`; the FP8 cache still runs at scale 1.0 there.
"""

from __future__ import annotations

from calib.recipe.support.base import Effect as E, Engine, TuneSpace, cell_maker, source_maker, v

_MAIN = "main, 1.4.0rc, read 2026-12"
_OLD = "the 1.2-1.3.0rc form; the file is still on main"
_s = source_maker("NVIDIA/TensorRT-LLM", _MAIN)

T1 = _s("tensorrt_llm/_torch/attention/backends/trtllm.py", "TrtllmAttention.__init__ (layer-level FP8 KV scales stay "
        "1.0 for the PyTorch backend)")
T2 = _s("tensorrt_llm/_torch/attention/attention.py", "Attention._attn_impl (forward_args.kv_scale_* only for an FP4 "
        "KV cache)")
T3 = _s("tensorrt_llm/_torch/modules/linear.py", "FP8QDQLinearMethod.load_kv_scales (reshape to [])", _OLD)
T4 = _s("tensorrt_llm/_torch/models/modeling_utils.py", "DecoderModelForCausalLM.apply_quant_config_exclude_modules",
        _OLD)
T5 = _s("tensorrt_llm/quantization/modelopt_config.py", "read_modelopt_quant_config / _kv_cache_scheme_to_algo", _OLD)
T6 = _s("tensorrt_llm/llmapi/llm_utils.py", "ModelLoader._update_from_hf_quant_config (quant_algo null: "
        "'Pre-quantized checkpoint must have quant_algo.')", "commit 0066b2a5 and the 1.0-1.2 form; run on kvcalib's "
        "outputs 2026-12")
T7 = _s("tensorrt_llm/_torch/pyexecutor/model_loader.py", "validate_and_set_kv_cache_quant (kv_cache_config.dtype "
        "fp8 | nvfp4 | auto)", _OLD)
T_PR = _s("pull request 18953 (open)", "calibrated INT8 KV cache for the PyTorch backend: paired positive finite "
          "scalar k_scale / v_scale, their max the one shared K/V scale per layer",
          "unmerged; its description read 2026-12")

ENGINE = Engine(
    "trtllm", "TensorRT-LLM", 1, {"pytorch": "PyTorch backend"}, v("1.4"),
    "NVIDIA/TensorRT-LLM main, late 2026 (1.4.0rc; no calibrated INT8 KV merged)", ("trtllm-serve", "{model}"),
    "--max_seq_len", "kv_cache_quant_algo", "no such kv_cache_quant_algo (FP8 e4m3, INT8, NVFP4 only)", (T5,),
    tune=TuneSpace())

c = cell_maker(ENGINE)
_BOTH = ("fp8_e4m3", "int8")

CELLS = (
    c("*", "fp8_e4m3", ("tensor", "head"), E.IGNORED, "the FP8 cache runs at scale 1.0; scales reach the kernel only "
      "for NVFP4 KV (per-head scales are folded to one scalar); an unquantized model gets FP8 KV only from the "
      "serve-time kv_cache_config.dtype (the LLM API refuses hf_quant_config.json with quant_algo null)",
      T1, T2, T3, T6, T7),
    c("*", "int8", ("tensor", "head"), E.IGNORED, "the INT8 cache runs at scale 1.0 in merged code, and only under "
      "quantized weights (no int8 kv_cache_config.dtype; quant_algo null refused); calibrated INT8 is only in open "
      "pull request 18953", T1, T2, T6, T7, T_PR),
    c("*", "int8", "tensor", E.SHARED_KV, "max(k_scale, v_scale) per layer; the pull request requires paired "
      "positive finite scalar scales", T_PR, build="pr18953"),
    c("*", "int8", "head", E.REFUSED, "the pull request takes scalar k_scale / v_scale only: a per-head scale is "
      "refused (kvcalib's trtllm variant writes the max over heads instead)", T_PR, build="pr18953"),
    c("*", _BOTH, "q_scale", E.IGNORED, "no q_scale is read", T3),
    c("*", _BOTH, "q_absent", E.UNREAD, "whether Q is quantized with an FP8 or INT8 cache was not read", T1),
    c("*", _BOTH, "skip_layers", E.IGNORED, "not expressible: kv_cache_quant_algo takes precedence over "
      "exclude_modules, every layer is quantized", T4),
)
