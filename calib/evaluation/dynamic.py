"""What vLLM's dynamic per-token-head KV caches give back for K and V: the cache write, bit for bit, and its read.

Why exact: these caches need no calibration, so the question a user asks is whether they lose less than static
calibrated FP8 on their model and data (issue 25); an emulation that rounds differently from the kernel answers
a different question. Each function follows vLLM's Triton cache-write kernel step by step, in float32 as the
kernel computes, and returns the dequantised values attention reads (float32). Read in vLLM 0.32's source (the
same kernels serve 0.24's FP8/INT8 modes on CUDA):

- `vllm/v1/attention/ops/triton_reshape_and_cache_flash.py` `_reshape_cache_per_token_head` (FP8, INT8): per
  (token, KV head) a float32 scale stored beside the values; INT8 rounds half away from zero by adding +-0.5
  before the store truncates; FP8 clamps to +-448 (`float8_e4m3fn`; ROCm's e4m3fnuz, 224, is not emulated) and
  the store rounds to nearest even. Attention reads `code * scale`.
- `vllm/v1/attention/ops/int4_per_token_head.py` `reshape_and_cache_int4` / `_reshape_cache_int4_kernel`: K
  and V are first rotated by a randomized Hadamard transform (`single_rht`, block-diagonal over the largest
  power-of-two divisor b of head_dim) in float32, rounded to the model's dtype; then per (token, head) an
  asymmetric 4-bit code with a zero point hidden in the 4 low mantissa bits of the stored float32 scale
  (`_attn_packed` reads `bits(scale) & ~0xF`). Attention rotates Q the same way, divides the scores by b and
  un-rotates the output (`unified_attention_int4`); since D H H D = b I, that is attention on
  `D H ((q - zp) * scale') / b` in the original space, which `int4_per_token_head` returns.

Not reproduced bit for bit, each at most one unit in the last place of a float32 (or bf16) value, far below
the 4- and 8-bit steps: Triton's fused `x * inv + zp` (here in float64, rounded once: rare double-rounding
ties), its float32 division on CUDA, vLLM's hadacore INT4 rotation on CUDA (bf16; here the PyTorch butterfly
of its CPU tier), and INT4's rotation of Q and the output in the model's dtype.
"""

from __future__ import annotations

import torch

from calib.recipe.dtypes import FP8_PER_TOKEN_HEAD, INT4_PER_TOKEN_HEAD, INT8_PER_TOKEN_HEAD, KVDtype
from calib.scales import fp8

SCALE_FLOOR = 1e-6          # tl.maximum(..., 1e-6) in both kernels
RHT_SEED = 0x9E3779B9       # int4_per_token_head._get_rht_signs, round 0
INT4_LEVELS = 15.0


def _scaled(x: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * (1 / scale), scale) in float32 with the per-(token, head) scale max(max |x| / qmax, 1e-6)."""
    xf = x.to(torch.float32)
    scale = torch.clamp_min(xf.abs().amax(dim=-1, keepdim=True) / torch.tensor(qmax, dtype=torch.float32), SCALE_FLOOR)
    return xf * (1.0 / scale), scale


def _half_away(v: torch.Tensor) -> torch.Tensor:
    """Triton's `where(v >= 0, v + 0.5, v - 0.5)` then a float->int conversion (truncation toward zero)."""
    return torch.trunc(torch.where(v >= 0, v + 0.5, v - 0.5))


def fp8_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes as float32, per-token-head float32 scale [..., 1]) of `fp8_per_token_head` for x [..., d]."""
    v, scale = _scaled(x, FP8_PER_TOKEN_HEAD.qmax)
    return fp8.round_fp8(torch.clamp(v, -fp8.E4M3.max, fp8.E4M3.max), fp8.E4M3, fp8.RNE), scale


def int8_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes as float32, per-token-head float32 scale [..., 1]) of `int8_per_token_head` for x [..., d]."""
    v, scale = _scaled(x, INT8_PER_TOKEN_HEAD.qmax)
    return torch.clamp(_half_away(v), -128.0, 127.0), scale


# ------------------------------------------------------------------------------------------- INT4

def rht_signs(d: int) -> torch.Tensor:
    """vLLM's deterministic +-1 signs of length d (`_get_rht_signs(d, 0)`): a CPU generator seeded RHT_SEED."""
    gen = torch.Generator(device="cpu").manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=gen) - 1.0


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The unnormalised Walsh-Hadamard transform along the last (power-of-two) dimension, as vLLM's butterfly."""
    d, h = x.shape[-1], 1
    while h < d:
        xv = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        x = torch.stack([xv[..., 0, :] + xv[..., 1, :], xv[..., 0, :] - xv[..., 1, :]], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`single_rht`: H D x (inverse: D H x), block-diagonal over b = the largest power-of-two divisor of d."""
    d = x.shape[-1]
    b = d & -d                                   # the largest power-of-two divisor of d
    if b < d:
        lead = x.shape[:-1]
        return rht(x.reshape(*lead, d // b, b), inverse).reshape(*lead, d)
    signs = rht_signs(d).to(device=x.device, dtype=x.dtype)
    return hadamard(x) * signs if inverse else hadamard(x * signs)


def int4_codes(x: torch.Tensor, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15, zero points, the scale attention reads) of `int4_per_token_head` for x [..., d] (already rotated).
    `fused`: `x * inv + zp` rounded once, as an FMA (Triton fuses it on GPUs: `enable_fp_fusion`); False rounds the
    product first, as Triton's CPU interpreter computes it (tests/engine/test_vllm_formats.py)."""
    xf = x.to(torch.float32)
    lo, hi = xf.amin(dim=-1, keepdim=True), xf.amax(dim=-1, keepdim=True)
    scale = torch.clamp_min((hi - lo) / torch.tensor(INT4_LEVELS, dtype=torch.float32), SCALE_FLOOR)
    zp = torch.clamp(_half_away(-lo / scale), 0.0, INT4_LEVELS)
    inv = 1.0 / scale
    if fused:
        s = (xf.double() * inv.double() + zp.double()).to(torch.float32)       # one rounding, as an FMA
    else:
        s = xf * inv + zp
    q = torch.clamp(_half_away(s), 0.0, INT4_LEVELS)
    read = (scale.view(torch.int32) & -16).view(torch.float32)                  # zp lives in the low mantissa bits
    return q, zp, read


def int4_per_token_head(x: torch.Tensor) -> torch.Tensor:
    """What attention effectively reads for x [..., d] in the original (unrotated) space, float32."""
    d = x.shape[-1]
    rotated = rht(x.to(torch.float32)).to(x.dtype)               # single_rht(key.float()).to(key.dtype)
    q, zp, read = int4_codes(rotated)
    return rht((q - zp) * read, inverse=True) / (d & -d)


READ_BACK = {FP8_PER_TOKEN_HEAD.name: lambda x: torch.mul(*fp8_codes(x)),      # codes * scale
             INT8_PER_TOKEN_HEAD.name: lambda x: torch.mul(*int8_codes(x)),
             INT4_PER_TOKEN_HEAD.name: int4_per_token_head}


def read_back(x: torch.Tensor, dtype: KVDtype) -> torch.Tensor:
    """What the engine's attention reads for x [..., head_dim] cached as the dynamic format `dtype` (float32)."""
    try:
        return READ_BACK[dtype.name](x)
    except KeyError:
        raise ValueError(f"{dtype.name} is not a per-token-head cache; these are: {sorted(READ_BACK)}") from None
