"""What each serving engine does to Q, K, V, the softmax probabilities P and the accumulation when its KV
cache is FP8: one registry, so `kvcalib eval --emulate MODE` computes what that engine computes.

Why: rounding K and V to the nearest FP8 value and attending in high precision (`kv-only`, what kvcalib did
first) is no engine's arithmetic: on a real 135M model it predicted +0.99 % perplexity where vLLM's CPU build,
which truncates, measured +2.72 % (docs/design.md §6). Each mode is read from the engine's source (`sources`;
docs/engine-emulation.md has the reasoning and the measured agreement). The registry is data only (no torch):
`calib/evaluation/fakequant.py` applies it with `calib/scales/fp8.py`'s exact conversions.

Vocabulary of a step (`Cast`):
- rounding: `rne` (nearest, ties to even), `rz` (toward zero), `rz-cpu` (toward zero exactly as vLLM's
  CPU kernel, whose subnormal path rounds to nearest at 2^-29 first);
- scale_op: `divide` (x / scale in float32), `reciprocal` (x * (1 / scale) in float32), `reciprocal-model`
  (x * (1 / scale) in the model's dtype);
- always saturating to the format's largest finite value.
INT8 arms are unaffected by the mode: every engine that serves INT8 KV rounds to nearest (`torch.round`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Cast:
    """How one tensor is converted to FP8 e4m3 before the engine uses it."""
    rounding: str
    scale_op: str
    scale: str          # which scale: k_scale | v_scale | q_scale | fixed 2^8 offset (P)

    def text(self) -> str:
        rnd = {"rne": "round to nearest even", "rz": "truncate toward zero",
               "rz-cpu": "truncate toward zero"}[self.rounding]
        op = {"divide": "x / {s}", "reciprocal": "x * (1/{s})", "reciprocal-model": "x * (1/{s}) in the model dtype",
              "offset": "x * {s}"}[self.scale_op].format(s=self.scale)
        return f"{op}, saturate, {rnd}"


@dataclass(frozen=True)
class Emulation:
    name: str
    engine: str
    k: Cast
    v: Cast
    q: Cast | None = None          # None: Q stays in the model dtype
    p: Cast | None = None          # None: softmax probabilities stay in float32
    accumulate: str = "float32"
    attention: str = "model"       # model: the model's own attention function on dequantised K/V; fa3: calib.scales.fp8
    # Whether per-head K/V scales (strategy attn_head) apply per head. vLLM's CPU backend reads one float per
    # layer (`_k_scale_float`, the max over heads) and TensorRT-LLM one scalar, so their arms use the fold.
    per_head_kv: bool = True
    summary: str = ""
    sources: tuple[str, ...] = ()

    def describe(self) -> dict[str, Any]:
        """The report's `emulation` entry."""
        d = asdict(self)
        d["mode"] = d.pop("name")
        d["description"] = d.pop("summary")
        for part in ("q", "k", "v", "p"):
            cast = getattr(self, part)
            d[part] = cast.text() if cast else "unchanged (model dtype)" if part == "q" else "unchanged (float32)"
        d["sources"] = list(self.sources)
        d["line"] = self.line()
        return d

    def line(self) -> str:
        """One line for report.md."""
        parts = [f"K/V {self.k.text()}"] + [f"{n} {c.text()}" for n, c in (("Q", self.q), ("P", self.p)) if c]
        return f"`{self.name}` ({self.engine}): " + "; ".join(parts) + f"; {self.accumulate} accumulation"


_VLLM_CPU_SOURCES = (
    "vllm csrc/cpu/cpu_attn.cpp cpu_attn_reshape_and_cache: k_inv = 1.0f / k_scale, v_inv = 1.0f / v_scale",
    "vllm csrc/cpu/cpu_attn_fp8.hpp float_to_fp8e4m3_scalar: v *= inv_scale, clamp to +-448, multiply by "
    "2^-120 and keep bits [26:20] of the float32 (mantissa truncated); float_to_fp8e5m2_scalar truncates too",
    "vllm csrc/cpu/cpu_attn_vec.hpp AttentionImpl<ISA::VEC>: q_buffer_t/logits/probs float; FP8 dequantised "
    "exactly, k_scale folded into the softmax scale, v_scale into the output (float32)",
    "vllm csrc/cpu/cpu_attn_amx.hpp TileGemm224<BFloat16, fp8>::deq_tile: FP8 widened to BF16 exactly; P is "
    "BF16 for the PV product with any KV dtype (the BF16-KV reference too)",
)

_VLLM_FA3_SOURCES = (
    "vllm csrc/cache_kernels.cu CopyWithScaleOp -> csrc/quantization/fp8/nvidia/quant_utils.cuh "
    "scaled_vec_conversion<uint8_t, bf16>: __nv_cvt_float_to_fp8(x / scale, __NV_SATFINITE, __NV_E4M3) (RNE)",
    "vllm vllm/v1/attention/backends/flash_attn.py FlashAttentionImpl.forward: for an fp8 cache, query = "
    "ops.scaled_fp8_quant(query, layer._q_scale); q/k/v_descale passed to flash_attn_varlen_func",
    "vllm csrc/quantization/fp8/common.cu(h) static scaled_fp8_quant kernel: inverted_scale = 1 / scale; "
    "scaled_fp8_conversion: x * inverted_scale, clamp to +-448, cast to Float8_e4m3fn (RNE)",
    "flash-attention hopper/flash_fwd_kernel_sm90.h: Softmax<..., Max_offset = Is_FP8 ? 8 : 0>, "
    "softmax_scale_log2 *= q_descale * k_descale",
    "flash-attention hopper/softmax.h scale_apply_exp2: exp2(x * scale - (max * scale - 8)) so P lies in [0, 256]; "
    "row_sum from the float32 P; finalize divides the sum by 2^8. P is then converted to e4m3 for the PV GEMM "
    "(float32 accumulators)",
)

_TRTLLM_SOURCES = (
    "TensorRT-LLM cpp/tensorrt_llm/kernels/unfusedAttentionKernels/unfusedAttentionKernels_2_template.h "
    "applyBiasRopeUpdateKVCache: K/V written with mmha::store_8bits_vec(..., scaleOrigQuant), scaleOrigQuant = "
    "kv_scale_orig_quant (1 / scale) converted to kv_cache_scale_type_t<T, TCache>",
    "TensorRT-LLM cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttentionUtils.h kv_cache_scale_type_t: float by "
    "default, __nv_bfloat16 for <__nv_bfloat16, __nv_fp8_e4m3>, uint16_t (half) for <half, __nv_fp8_e4m3>",
    "assumed, not read: store_8bits_vec multiplies in that type and converts with __nv_fp8_e4m3 (RNE, "
    "satfinite); the FP8 context FMHA (FP8_OUTPUT branch of the same kernel) also quantises Q with the KV "
    "scale, and fmha_v2 quantises P: neither is emulated",
)

EMULATIONS: dict[str, Emulation] = {e.name: e for e in (
    Emulation(
        "vllm-cpu", "vLLM CPU (x86, VEC/AMX attention)",
        k=Cast("rz-cpu", "reciprocal", "k_scale"), v=Cast("rz-cpu", "reciprocal", "v_scale"),
        summary="vLLM's CPU cache write multiplies by the reciprocal scale and truncates the mantissa (round "
                "toward zero); attention then runs on the exactly dequantised cache in float32 (Q unquantised).",
        per_head_kv=False, sources=_VLLM_CPU_SOURCES),
    Emulation(
        "vllm-fa3", "vLLM CUDA, FlashAttention-3 FP8 (Hopper)",
        k=Cast("rne", "divide", "k_scale"), v=Cast("rne", "divide", "v_scale"),
        q=Cast("rne", "reciprocal", "q_scale"), p=Cast("rne", "offset", "2^8"),
        attention="fa3",
        summary="vLLM's CUDA cache write divides by the scale and rounds to nearest even; FlashAttention-3 "
                "also quantises Q (q_scale, round to nearest) and the softmax probabilities (P * 256 to e4m3), "
                "accumulating in float32.",
        sources=_VLLM_FA3_SOURCES),
    Emulation(
        "trtllm", "TensorRT-LLM (CUDA)",
        k=Cast("rne", "reciprocal-model", "k_scale"), v=Cast("rne", "reciprocal-model", "v_scale"),
        summary="TensorRT-LLM's cache write multiplies by the reciprocal scale in the model's dtype and rounds to "
                "nearest even (what could be verified; its FP8 context attention is not emulated). Its FP8 KV "
                "path runs with scale 1.0 whatever the checkpoint holds (docs/design.md §5).",
        per_head_kv=False, sources=_TRTLLM_SOURCES),
    Emulation(
        "kv-only", "none (K/V rounding only)",
        k=Cast("rne", "divide", "k_scale"), v=Cast("rne", "divide", "v_scale"),
        summary="K and V rounded to the nearest FP8 value, attention in the model's own precision: no engine's "
                "arithmetic; kept to compare with earlier reports.",
        sources=()),
)}

DEFAULT = "vllm-cpu"      # the engine this project's users run (vLLM's CPU build); --emulate picks another
HOPPER = (9, 0)           # CUDA compute capability of H100 / H200, where vLLM serves FP8 KV with FlashAttention-3


def for_this_machine() -> str:
    """The command line's default: vLLM's FlashAttention-3 arithmetic where the first GPU is a Hopper (what vLLM
    runs there), DEFAULT otherwise. Imports torch, so only when a command runs (never on `--help`)."""
    import torch

    if torch.cuda.is_available() and tuple(torch.cuda.get_device_capability()) == HOPPER:
        return "vllm-fa3"
    return DEFAULT


def names() -> tuple[str, ...]:
    return tuple(EMULATIONS)


def by_name(name: str) -> Emulation:
    """The emulation called `name`; ValueError naming the accepted ones otherwise."""
    try:
        return EMULATIONS[name]
    except KeyError:
        raise ValueError(f"unknown emulation {name!r}; accepted: {', '.join(EMULATIONS)}") from None
