"""TensorRT-LLM's TensorRT-engine backend: a TensorRT-LLM checkpoint (config.json + rank{r}.safetensors) carries one
kv_cache_scaling_factor per layer, shared by K and V, which the engine applies.

Read from NVIDIA/TensorRT-LLM in the 1.2 / 1.3.0rc form, the last that has the TensorRT backend (deprecated in
pull request 11723, removed from main in 15918, 16369 and 16612; 1.3.0rc20 the last with it). Its cells cover
1.2 to before 1.3.1; outside that span every format is refused.
"""

from __future__ import annotations

from calib.recipe.support.base import EVERY_FORMAT, Effect as E, Engine, cell_maker, source_maker, v

_TE = "1.2 / 1.3.0rc form"
_s = source_maker("NVIDIA/TensorRT-LLM", _TE)

TE1 = _s("tensorrt_llm/quantization/quantize.py", "kv_cache_quantize (kv_cache_scaling_factor Parameter shape (1,) "
         "float32 on every Attention)")
TE2 = _s("tensorrt_llm/models/modeling_utils.py", "preprocess_weights / process_kv_scaling_factor (max(k, v); "
         "kv_cache_rcp_scaling_factor = 1 / scale)")
TE3 = _s("tensorrt_llm/models/llama/convert.py", "load_weights_from_hf_model (transformer.layers.{l - the stage's "
         "first layer}.attention.kv_cache_scaling_factor, reshape([1]); INT8: max over q/k/v outputs / 127)")
TE4 = _s("tensorrt_llm/models/modeling_utils.py", "PretrainedModel.load ('Required but not provided tensors')")
TE5 = _s("(release notes)", "TensorRT backend deprecated in pull request 11723; removed from main in 15918, 16369, "
         "16612", "1.3.0rc20 the last with it")
NAME = "trtllm-engine"

ENGINE = Engine(
    NAME, "TensorRT-LLM (TensorRT engine)", 3, {"tensorrt": "TensorRT-engine backend"}, v("1.2.1"),
    "NVIDIA/TensorRT-LLM, the 1.2 / 1.3.0rc form that still has the TensorRT backend (removed from main 2026)",
    ("trtllm-serve", "{model}", "--backend", "tensorrt"), "--max_seq_len", "kv_cache_quant_algo",
    "no such kv_cache_quant_algo", (TE1,), span=("1.2", "1.3.1"))

c = cell_maker(ENGINE)
_BOTH = ("fp8_e4m3", "int8")
_SPAN = {"since": "1.2", "until": "1.3.1"}

CELLS = (
    c("*", _BOTH, "tensor", E.APPLIED, "one kv_cache_scaling_factor per layer, shared by K and V (max(k, v)): FP8 "
      "amax/448, INT8 amax/127; 1.3.0rc1-rc20 too (rc tags are not told apart: 1.3.0 final and later have no "
      "TensorRT backend)", TE1, TE2, TE3, **_SPAN),
    c("*", _BOTH, "head", E.REFUSED, "one scale per layer: per-head scales cannot be expressed", TE1, TE3, **_SPAN),
    c("*", _BOTH, "q_scale", E.REFUSED, "no q_scale tensor in the checkpoint", TE1, **_SPAN),
    c("*", _BOTH, "q_absent", E.UNREAD, "whether Q is quantized with an FP8 or INT8 cache was not read", TE1, **_SPAN),
    c("*", _BOTH, "skip_layers", E.REFUSED, "every attention layer gets a kv_cache_scaling_factor and needs one",
      TE1, TE4, **_SPAN),
    c("*", EVERY_FORMAT, "*", E.REFUSED, "not read before 1.2: kvcalib's rules are 1.2.x-1.3.0rc20's", TE1,
      until="1.2"),
    c("*", EVERY_FORMAT, "*", E.REFUSED, "the TensorRT backend is removed (last in 1.3.0rc20)", TE5, since="1.3.1"),
)
