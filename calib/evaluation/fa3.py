"""FlashAttention-3's FP8 forward, block by block: a float32 torch reference and a fused Triton kernel.

Why: `fp8.fp8_attention` multiplies each query chunk with all keys in float32 and rounds P against one global row max:
quadratic traffic without tensor cores (issue 30: 5.5K tokens/s at 32K), and not FA3's arithmetic, which rounds P per
key block against the *running* row max and rescales the accumulator afterwards (rounding then rescaling by a
non-power-of-two is not rounding the rescaled value). This module computes what the Hopper kernel computes, in O(length)
memory, the same way on CPU (reference) and GPU (the kernel in `calib/evaluation/fa3_kernel.py`).

The algorithm, as read from flash-attention's hopper/ sources:
- Q, K, V enter as e4m3 codes with one descale factor each per (batch, KV head): `flash_fwd_kernel_sm90.h`
  (FlashAttnFwdSm90::operator(): `softmax_scale_log2 *= q_descale * k_descale`, unless softcapped) and
  `mainloop_fwd_sm90_tma_gmma_ws.hpp` (CollectiveMainloopFwdSm90::mma: with softcap
  `softcap_val *= q_descale * k_descale`, tanh before the mask; `softmax.finalize(v_descale)`).
  vLLM quantises Q itself (x * (1 / q_scale), nearest; `calib/evaluation/emulate.py` cites it).
- Key blocks of kBlockN keys from key 0, visited from the last one the query tile can see down to the
  first (`mma`: `n_block = n_block_max - 1`, `--n_block`); S = Q . K^T with float32 accumulation.
- Online softmax with `Max_offset = 8` for FP8 (`hopper/softmax.h`, Softmax::max_get_scale, online_softmax,
  scale_apply_exp2): the row max m is running; on a new max the row sum and the accumulator are multiplied
  by exp2((m_old - m_new) * scale_log2) (rescale_o); P = exp2(S * scale_log2 - (m * scale_log2 - 8)), so
  the row's largest P is 2^8; a row whose max is -inf uses 0 there (all its P are 0). The row sum adds the
  float32 P before any rounding. P is then converted to e4m3 (`convert_type_out`, round to nearest even,
  saturating) for the P . V GEMM, float32 accumulators. Finalize: O * (1 / rowsum) * v_descale, 0 for an
  empty row (P carries 2^8 and so does the sum: it cancels).
- kBlockN for FP8: `hopper/tile_size.h` tile_size_fwd_sm90 (element_size 1), with vLLM's 16-token pages
  taking the non-TMA paged path (`flash_api.cpp` get_pagedkv_tma: page_size % kBlockN != 0): see
  `fa3_block_n`.

Here the log2-domain logits x = S * scale_log2 are formed first (x - (m - 8) instead of FA3's fused multiply-add): the
same numbers up to float32 rounding. Masks: bool (True = attend) or additive (added as mask * log2(e) to x), ANDed with
`causal` (bottom-right aligned, as FA3) and `window_left` (FA3 local: keys row - window_left .. row; transformers'
sliding window W is window_left = W - 1). Unlike `fp8.fp8_attention`, `causal` still applies when a mask is given:
identical for transformers' causal-LM masks, which are causal already.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from calib.evaluation import fa3_kernel
from calib.scales import fp8

Tensor = torch.Tensor
LOG2E = math.log2(math.e)
MAX_OFFSET = 8.0                           # FA3 FP8: P = exp2(x - (rowmax - 8)), at most 2^8
_failed: dict[tuple, str] = {}             # kernel configurations Triton could not build or fit here


def fa3_block_n(head_dim: int, *, local: bool = False, softcap: bool = False, paged_non_tma: bool = True) -> int:
    """FA3's kBlockN for FP8 on Hopper (`hopper/tile_size.h` tile_size_fwd_sm90, element_size 1, two MMA
    warpgroups). `paged_non_tma`: vLLM's paged cache with pages that are no multiple of kBlockN."""
    if head_dim <= 64:
        return 160
    if head_dim <= 96:
        return 128
    if head_dim <= 128:
        return 160 if paged_non_tma else (192 if softcap and local else 224)
    if head_dim <= 192:
        return 128 if (paged_non_tma or softcap) and local else 160
    return 64 if local else 128


@dataclass(frozen=True)
class Inputs:
    """What FA3 is given: codes (float32 tensors holding grid values, or plain values), descales [b, kv_h],
    the mask expanded to [b, h, s, t] (stride 0 where broadcast) and whether every code is exact in bf16."""
    q: Tensor
    k: Tensor
    v: Tensor
    q_descale: Tensor
    k_descale: Tensor
    v_descale: Tensor
    mask: Tensor | None
    bf16_exact: bool


def _descale(scale: Tensor | float | None, b: int, kvh: int, device: torch.device, what: str) -> Tensor:
    """A per-tensor or per-KV-head scale as FA3's [batch, kv_heads] descale array."""
    s = torch.ones(()) if scale is None else torch.as_tensor(scale, dtype=torch.float32)
    s = s.to(device=device, dtype=torch.float32).reshape(-1)
    if s.numel() not in (1, kvh):
        raise ValueError(f"fa3 attention: {what} has {s.numel()} values; FA3 takes one per tensor or one per "
                         f"KV head ({kvh})")
    return s.expand(kvh).reshape(1, kvh).expand(b, kvh).contiguous()


def _codes(x: Tensor, descale: Tensor) -> tuple[Tensor, bool]:
    """x = codes * descale (what a fake-quantised cache gives back) split into its codes, and whether they are
    exact: rounded to bf16 and multiplied back they give x bit for bit (else x / descale, not bf16-exact)."""
    d = descale[:, :, None, None]
    c = (x.to(torch.float32) / d).to(torch.bfloat16).to(torch.float32)
    if torch.equal(c * d, x.to(torch.float32)):
        return c, True
    return x.to(torch.float32) / d, False


def prepare(q: Tensor, k: Tensor, v: Tensor, *, q_scale: Tensor | float = 1.0, k_scale: Tensor | float | None = None,
            v_scale: Tensor | float | None = None, mask: Tensor | None = None, quant_q: bool = True) -> Inputs:
    """Q quantised as vLLM does (x * (1 / q_scale), nearest even, saturating); K, V split into codes and
    descales; the mask sliced to the keys and broadcast to [b, h, s, t] without a copy."""
    b, h, s, _ = q.shape
    kvh, t = k.shape[1], k.shape[2]
    if h % kvh or v.shape[:3] != k.shape[:3] or k.shape[0] != b or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"fa3 attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
                         "[b, h, s, d] / [b, kv_h, t, d] with h a multiple of kv_h")
    dev = q.device
    if quant_q:
        qd = _descale(q_scale, b, kvh, dev, "q_scale")
        qc = fp8.quantize(q, qd[0].repeat_interleave(h // kvh)[None, :, None, None], fp8.E4M3, fp8.RNE, "reciprocal")
        q_exact = True
    else:
        qd, qc = _descale(None, b, kvh, dev, "q_scale"), q.to(torch.float32)
        q_exact = torch.equal(qc.to(torch.bfloat16).to(torch.float32), qc)
    kd, vd = _descale(k_scale, b, kvh, dev, "k_scale"), _descale(v_scale, b, kvh, dev, "v_scale")
    kc, k_exact = _codes(k, kd)
    vc, v_exact = _codes(v, vd)
    if mask is not None:
        mask = mask.to(dev)[..., :t]
        if mask.dim() != 4 or mask.shape[-2] not in (1, s):
            raise ValueError(f"fa3 attention: mask {tuple(mask.shape)} is not broadcastable to [b, h, {s}, {t}]")
        mask = mask.expand(b, h, s, t)
    return Inputs(qc, kc, vc, qd, kd, vd, mask, q_exact and k_exact and v_exact)


def log2_scale(scaling: float, softcap: float | None, qk: Tensor) -> tuple[Tensor, Tensor | None]:
    """(scale_log2, softcap multiplier) per (b, kv head) in float32, as FA3 forms them: the host's
    softmax_scale * log2(e) (or softcap * log2(e)) times q_descale * k_descale (or that into the softcap)."""
    if softcap:
        cap = torch.tensor(scaling / softcap, dtype=torch.float32, device=qk.device) * qk
        return torch.full_like(qk, softcap * LOG2E), cap
    return torch.tensor(scaling * LOG2E, dtype=torch.float32, device=qk.device) * qk, None


def _args(q: Tensor, k: Tensor, v: Tensor, *, scaling: float, q_scale: Tensor | float = 1.0,
          k_scale: Tensor | float | None = None, v_scale: Tensor | float | None = None, mask: Tensor | None = None,
          causal: bool = True, window_left: int | None = None, quant_q: bool = True, quant_p: bool = True,
          softcap: float | None = None, block_n: int | None = None) -> tuple:
    """The arguments of `fa3_attention` (its docstring) as `_reference` and `_kernel` take them."""
    x = prepare(q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, mask=mask, quant_q=quant_q)
    bn = block_n or fa3_block_n(q.shape[-1], local=window_left is not None, softcap=bool(softcap))
    return x, scaling, causal, window_left, quant_p, softcap, bn


# ------------------------------------------------------------------------------- float32 reference

def blockwise_reference(q: Tensor, k: Tensor, v: Tensor, *, chunk: int = 256, **kw: Any) -> Tensor:
    """FA3's FP8 forward in float32 torch ops, `chunk` queries at a time (memory O(chunk x block_n) beyond the
    inputs). Arguments and result as `fa3_attention`."""
    return _reference(*_args(q, k, v, **kw), chunk)


def _reference(x: Inputs, scaling: float, causal: bool, window_left: int | None, quant_p: bool,
               softcap: float | None, bn: int, chunk: int = 256) -> Tensor:
    b, h, s, _ = x.q.shape
    kvh, t, dv = x.k.shape[1], x.k.shape[2], x.v.shape[-1]
    rep = h // kvh
    dev = x.q.device
    c, cap = log2_scale(scaling, softcap, x.q_descale * x.k_descale)
    per_head = lambda a: a.repeat_interleave(rep, dim=1)[:, :, None, None]          # noqa: E731
    c, cap, vd = per_head(c), None if cap is None else per_head(cap), per_head(x.v_descale)
    out = torch.empty(b, h, s, dv, dtype=torch.float32, device=dev)
    for a in range(0, s, chunk):
        z = min(s, a + chunk)
        rows = torch.arange(a, z, device=dev)[:, None] + (t - s)               # bottom-right aligned
        hi = min(t, z + t - s) if causal else t
        lo = max(0, a + t - s - window_left) if window_left is not None else 0
        m = torch.full((b, h, z - a, 1), -math.inf, device=dev)
        l = torch.zeros_like(m)
        acc = torch.zeros(b, h, z - a, dv, device=dev)
        for j in reversed(range(lo // bn, -(-hi // bn) if hi > 0 else 0)):
            blk = slice(j * bn, min(t, (j + 1) * bn))
            cols = torch.arange(blk.start, blk.stop, device=dev)[None, :]
            sc = torch.matmul(x.q[:, :, a:z], x.k[:, :, blk].repeat_interleave(rep, dim=1).transpose(-1, -2))
            xs = torch.tanh(sc * cap) * c if cap is not None else sc * c
            keep = torch.ones_like(xs, dtype=torch.bool)
            if causal:
                keep = keep & (cols <= rows)
            if window_left is not None:
                keep = keep & (cols >= rows - window_left)
            if x.mask is not None:
                mb = x.mask[:, :, a:z, blk]
                if mb.dtype == torch.bool:
                    keep = keep & mb
                else:
                    xs = xs + mb.to(torch.float32) * LOG2E
            xs = xs.masked_fill(~keep, -math.inf)
            m_new = torch.maximum(m, xs.amax(dim=-1, keepdim=True))
            empty = m_new == -math.inf
            alpha = torch.exp2(m - torch.where(empty, 0.0, m_new))
            p = torch.exp2(xs - torch.where(empty, 0.0, m_new - MAX_OFFSET))
            l = l * alpha + p.sum(dim=-1, keepdim=True)
            pq = fp8.round_fp8(p, fp8.E4M3, fp8.RNE) if quant_p else p
            acc = acc * alpha + torch.matmul(pq, x.v[:, :, blk].repeat_interleave(rep, dim=1))
            m = m_new
        out[:, :, a:z] = acc * (torch.where(l > 0, 1.0 / torch.where(l > 0, l, 1.0), 0.0) * vd)
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------- Triton kernel

def fa3_attention_triton(q: Tensor, k: Tensor, v: Tensor, *, block_m: int | None = None, **kw: Any) -> Tensor:
    """`blockwise_reference`'s computation in `fa3_kernel`'s Triton kernel, one program per (block_m queries,
    head; None: autotuned on CUDA, 64 under the interpreter). Raises whatever Triton raises."""
    return _kernel(*_args(q, k, v, **kw), block_m)


def _kernel(x: Inputs, scaling: float, causal: bool, window_left: int | None, quant_p: bool,
            softcap: float | None, bn: int, block_m: int | None = None) -> Tensor:
    c, cap = log2_scale(scaling, softcap, x.q_descale * x.k_descale)
    return fa3_kernel.launch(x, c, cap, causal, window_left, quant_p, softcap, bn, block_m)


def fused(q: Tensor) -> bool:
    """Whether `fa3_attention` takes the Triton kernel for q (CUDA or the interpreter, KVCALIB_FUSED not 0)."""
    return (fa3_kernel.triton is not None and (q.is_cuda or fa3_kernel.KERNELS_ON_CPU)
            and os.environ.get("KVCALIB_FUSED", "1") != "0")


def fa3_attention(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
    """FlashAttention-3's FP8 attention: the Triton kernel on CUDA, the float32 reference elsewhere (or when
    Triton cannot build the kernel here; same numbers up to float32 rounding).

    `q` [b, h, s, d] in the model's dtype; `k`, `v` [b, kv_h, t, d]: what the cache gives back, codes times
    `k_scale` / `v_scale` (one per tensor or per KV head; None: k, v are taken as they are, descale 1);
    `scaling`: the softmax scale; `q_scale`: vLLM's Q scale (`quant_q`); `quant_p`: P rounded to e4m3;
    `mask`: bool (True = attend) or additive, broadcastable to [b, h, s, t], ANDed with `causal`;
    `window_left`: FA3's local window; `softcap`: the logit softcap; `block_n`: FA3's kBlockN (None:
    `fa3_block_n`). Returns [b, s, h, dv] float32 (transformers' attention-function layout)."""
    args = _args(q, k, v, **kw)
    x, *_, softcap, bn = args
    config = (x.bf16_exact, x.q.shape[-1], x.v.shape[-1], bn, softcap is not None)
    if fused(q) and config not in _failed:
        try:
            return _kernel(*args)
        except Exception as e:           # compilation and resource checks fail before launch: nothing written
            _failed[config] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"kvcalib: the fused FA3 kernel is unavailable for {config} here ({_failed[config][:200]}); "
                  "using the float32 reference (same numbers, slower)", file=sys.stderr)
    return _reference(*args)
