"""Exact FP8 arithmetic as the engines' kernels do it: the two formats, both roundings, and FA3-style attention.

Why a module of its own: an FP8 KV cache is not "round K and V to the nearest FP8 value". vLLM's CPU cache
write truncates toward zero, its CUDA cache write and Q quantisation round to nearest even, and FlashAttention-3
also casts Q and P to FP8 (docs/engine-emulation.md cites each kernel). `calib/evaluation/emulate.py` says which
engine does what; this module does the arithmetic on the exact grid, in float32 values that lie on it (the codes
the engines read back before multiplying by the scale), so an emulated cache holds bit for bit what theirs does.
- Saturating: inputs beyond the largest finite value become +-max (448 for e4m3fn, 57344 for e5m2), as the
  engines' `__NV_SATFINITE` / explicit clamps do; no NaN or Inf is produced from a finite input.
- Subnormals: kept (quantum 2^-9 for e4m3fn, 2^-16 for e5m2); RNE flushes |x| <= quantum / 2 to 0, RZ
  flushes |x| < quantum.
- `rne`: round to nearest, ties to even (CUDA `__nv_cvt_float_to_fp8`, torch's float8 casts).
  `rz`: round toward zero, i.e. truncate the mantissa (vLLM CPU `float_to_fp8e4m3_scalar`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

RNE = "rne"
RZ = "rz"
ROUNDINGS = (RNE, RZ)


@dataclass(frozen=True)
class Format:
    """An FP8 format: exponent/mantissa bits, bias and the largest finite magnitude."""
    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max: float

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    def grid(self) -> torch.Tensor:
        """Every finite non-negative value of the format, sorted (decoded from the bit patterns)."""
        vals = {(m / 2 ** self.man_bits) * 2.0 ** self.emin if e == 0 else
                (1 + m / 2 ** self.man_bits) * 2.0 ** (e - self.bias)
                for e in range(2 ** self.exp_bits) for m in range(2 ** self.man_bits)}
        return torch.tensor(sorted(v for v in vals if v <= self.max), dtype=torch.float32)


E4M3 = Format("e4m3", 4, 3, 7, 448.0)      # OCP e4m3fn: no Inf, S.1111.111 is NaN, max 1.75 * 2^8
E5M2 = Format("e5m2", 5, 2, 15, 57344.0)   # IEEE-like: max 1.75 * 2^15


def _pow2(exp: torch.Tensor) -> torch.Tensor:
    """2 ** exp for integer exponents in float32's normal range, built from the bits (exact)."""
    return ((exp.to(torch.int32) + 127) << 23).view(torch.float32)


def round_fp8(x: torch.Tensor, fmt: Format = E4M3, rounding: str = RNE) -> torch.Tensor:
    """float32 values of `x` rounded onto `fmt`'s grid (saturating, subnormals kept)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; accepted: {ROUNDINGS}")
    x = x.to(torch.float32).clamp(-fmt.max, fmt.max)
    a = x.abs()
    _, e = torch.frexp(a)                        # a = m * 2^e, m in [0.5, 1): the binade's exponent is e - 1
    q = _pow2((e - 1).clamp_min(fmt.emin) - fmt.man_bits)     # the grid spacing at a (exact power of two)
    n = a / q                                   # exact: q is a power of two and a is far from underflow
    n = torch.round(n) if rounding == RNE else torch.trunc(n)
    return torch.copysign(n * q, x)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: Format = E4M3, rounding: str = RNE,
             scale_op: str = "divide", work_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The codes (float32 grid values) an engine stores for `x` with dequantisation scale `scale`; `scale_op`:
    `divide` (x / scale, float32: vLLM's CUDA cache write), `reciprocal` (x * (1 / scale), float32: vLLM CPU and
    its static FP8 Q quantisation), `reciprocal-model` (x * (1 / scale) rounded in `work_dtype`, the model's
    dtype: TensorRT-LLM's cache write for bf16/fp16 models)."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if scale_op == "divide":
        v = x.to(torch.float32) / s
    elif scale_op == "reciprocal":
        v = x.to(torch.float32) * (1.0 / s)
    elif scale_op == "reciprocal-model":
        v = (x.to(work_dtype) * (1.0 / s).to(work_dtype)).to(torch.float32)
    else:
        raise ValueError(f"unknown scale_op {scale_op!r}")
    return round_fp8(v, fmt, rounding)


def vllm_cpu_e4m3(v: torch.Tensor) -> torch.Tensor:
    """vLLM CPU's e4m3 cache write on already-scaled float32 values (`float_to_fp8e4m3_scalar`): clamp to
    +-448, multiply by 2^-120 and keep the top 7 bits below the sign. For |v| < 2^-6 that product is a
    float32 subnormal, itself rounded to nearest at 2^-149 (2^-29 in v) before the truncation; this
    reproduces that double rounding, so the result is the kernel's bit for bit."""
    v = v.to(torch.float32).clamp(-E4M3.max, E4M3.max)
    sub = v.abs() < 2.0 ** E4M3.emin
    v = torch.where(sub, torch.round(v * 2.0 ** 29) * 2.0 ** -29, v)
    return round_fp8(v, E4M3, RZ)


def cache_write(x: torch.Tensor, scale: torch.Tensor | float, rounding: str, scale_op: str) -> torch.Tensor:
    """The e4m3 codes an engine's cache write stores for `x`, in `calib/evaluation/emulate.py`'s Cast vocabulary
    (`reciprocal-model`: in x's dtype)."""
    if rounding == "rz-cpu":
        s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        return vllm_cpu_e4m3(x.to(torch.float32) * (1.0 / s))
    return quantize(x, scale, E4M3, rounding, scale_op, work_dtype=x.dtype)


# ------------------------------------------------------------------------------- FA3-style attention

P_OFFSET = 256.0     # FA3 FP8: exp2 runs against (row max - 8), so P lies in [0, 2^8] before the e4m3 cast


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float,
                  q_scale: torch.Tensor | float = 1.0, mask: torch.Tensor | None = None, causal: bool = True,
                  quant_q: bool = True, quant_p: bool = True, softcap: float | None = None,
                  fmt: Format = E4M3, chunk: int = 512) -> torch.Tensor:
    """FlashAttention-3's FP8 forward with one global row max, in float32: the emulation before
    calib/evaluation/fa3.py, kept as the simpler reference its tests and bench/gpu/longctx.py bound it against.

    `q` [b, h, s, d] in the model's dtype, quantised with `q_scale` (x * (1 / q_scale), RNE) and multiplied
    back; `k`, `v` [b, kv_h, t, d]: what the cache gives back (float32). P = exp(S - rowmax) * 256 cast to e4m3,
    the row sum over the unquantised P (as FA3); O = (Pq @ V) / rowsum. `mask`: bool (True = attend) or
    additive, broadcastable to [b, h, s, t]; None with `causal`: bottom-right causal. Not FA3's numbers (FA3
    rounds P against a running block max: 7.2e-2 apart at max |o| 3.16 on tests/evaluation/test_fa3.py's
    inputs, blocks of 16). Returns [b, s, h, d] float32 (transformers' attention-function layout).
    """
    b, h, s, d = q.shape
    kvh, t = k.shape[1], k.shape[2]
    rep = h // kvh
    qs = torch.as_tensor(q_scale, dtype=torch.float32, device=q.device)
    qf = quantize(q, qs, fmt, RNE, "reciprocal") * qs if quant_q else q.to(torch.float32)
    kf = k.to(torch.float32).repeat_interleave(rep, dim=1)
    vf = v.to(torch.float32).repeat_interleave(rep, dim=1)
    out = torch.empty(b, h, s, vf.shape[-1], dtype=torch.float32, device=q.device)
    cols = torch.arange(t, device=q.device)[None, :]
    for a in range(0, s, chunk):
        z = slice(a, min(s, a + chunk))
        scores = torch.matmul(qf[:, :, z], kf.transpose(-1, -2)) * scaling
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            m = mask[..., z, :t] if mask.shape[-2] == s else mask[..., :t]
            scores = scores.masked_fill(~m, -math.inf) if m.dtype == torch.bool else scores + m.float()
        elif causal:
            rows = torch.arange(a, z.stop, device=q.device)[:, None] + (t - s)
            scores = scores.masked_fill(cols > rows, -math.inf)
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        p = torch.exp(scores - top) * P_OFFSET
        total = p.sum(dim=-1, keepdim=True)
        pq = round_fp8(p, fmt, RNE) if quant_p else p
        out[:, :, z] = torch.matmul(pq, vf) / torch.where(total > 0, total, torch.ones_like(total))
    return out.transpose(1, 2)
