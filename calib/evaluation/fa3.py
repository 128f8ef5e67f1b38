"""FlashAttention-3's FP8 forward, block by block: a float32 torch reference and a fused Triton kernel.

Why: `fp8.fp8_attention` multiplies each query chunk with all keys in float32 and rounds P against one
global row max. That is quadratic traffic without tensor cores (the long-context evaluation of issue 30
ran at 5.5K tokens/s at 32K) and it is not FA3's arithmetic: FA3 rounds P per key block against the
*running* row max and rescales the accumulator afterwards, and rounding then rescaling by a factor that is
not a power of two is not rounding the rescaled value. This module computes what the Hopper kernel computes,
in O(length) memory, the same way on CPU (reference) and GPU (kernel).

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

Here the log2-domain logits x = S * scale_log2 are formed first (x - (m - 8) instead of FA3's fused
multiply-add): the same numbers up to float32 rounding. Masks: bool (True = attend) or additive (added as
mask * log2(e) to x), ANDed with `causal` (bottom-right aligned, as FA3) and `window_left` (FA3 local:
keys row - window_left .. row; transformers' sliding window W is window_left = W - 1). Unlike
`fp8.fp8_attention`, `causal` still applies when a mask is given: identical for transformers' causal-LM
masks, which are causal already.

Kernel: an e4m3 code is exact in bf16, so Q . K and P . V run on bf16 tensor cores with float32
accumulation; a kBlockN that is not a power of two (160, 224) is covered by up to three power-of-two
tiles sharing one block max. K/V values that are not codes times a per-head scale (per-channel or
per-token arms, `k_scale=None`) use float32 (IEEE) dots instead. Under Triton's interpreter (tests) the
dots run in float32 on the same codes (its bf16 dot is broken), and P is rounded arithmetically (its FP8
cast is not round-to-nearest).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

from calib.scales import fp8

try:
    import triton
    import triton.language as tl
except ImportError:                        # CPU-only installs: the reference does everything
    triton = None

Tensor = torch.Tensor
LOG2E = math.log2(math.e)
MAX_OFFSET = 8.0                           # FA3 FP8: P = exp2(x - (rowmax - 8)), at most 2^8
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNELS_ON_CPU = False                     # only for the interpreter: CPU tensors through the kernel
HW_P_CAST: bool | None = None              # round P with the GPU's cvt to e4m3 (True), arithmetic (False);
                                           # None: the cvt wherever `hw_cast_agrees` found it equal
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
        qs = qd[0].repeat_interleave(h // kvh)[None, :, None, None]
        qc = fp8.quantize(q, qs, fp8.E4M3, fp8.RNE, "reciprocal")
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


def _log2_scale(scaling: float, softcap: float | None, qk: Tensor) -> tuple[Tensor, Tensor | None]:
    """(scale_log2, softcap multiplier) per (b, kv head) in float32, as FA3 forms them: the host's
    softmax_scale * log2(e) (or softcap * log2(e)) times q_descale * k_descale (or that into the softcap)."""
    if softcap:
        cap = torch.tensor(scaling / softcap, dtype=torch.float32, device=qk.device) * qk
        return torch.full_like(qk, softcap * LOG2E), cap
    return torch.tensor(scaling * LOG2E, dtype=torch.float32, device=qk.device) * qk, None


# ------------------------------------------------------------------------------- float32 reference

def blockwise_reference(q: Tensor, k: Tensor, v: Tensor, *, scaling: float, q_scale: Tensor | float = 1.0,
                        k_scale: Tensor | float | None = None, v_scale: Tensor | float | None = None,
                        mask: Tensor | None = None, causal: bool = True, window_left: int | None = None,
                        quant_q: bool = True, quant_p: bool = True, softcap: float | None = None,
                        block_n: int | None = None, chunk: int = 256) -> Tensor:
    """FA3's FP8 forward in float32 torch ops (module docstring), `chunk` queries at a time (memory
    O(chunk x block_n) beyond the inputs). Arguments as `fa3_attention`. Returns [b, s, h, dv] float32."""
    x = prepare(q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, mask=mask, quant_q=quant_q)
    bn = block_n or fa3_block_n(q.shape[-1], local=window_left is not None, softcap=bool(softcap))
    return _reference(x, scaling, causal, window_left, quant_p, softcap, bn, chunk)


def _reference(x: Inputs, scaling: float, causal: bool, window_left: int | None, quant_p: bool,
               softcap: float | None, bn: int, chunk: int = 256) -> Tensor:
    b, h, s, _ = x.q.shape
    kvh, t, dv = x.k.shape[1], x.k.shape[2], x.v.shape[-1]
    rep = h // kvh
    dev = x.q.device
    c, cap = _log2_scale(scaling, softcap, x.q_descale * x.k_descale)
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
            kb = x.k[:, :, blk].repeat_interleave(rep, dim=1)
            sc = torch.matmul(x.q[:, :, a:z], kb.transpose(-1, -2))
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
        inv = torch.where(l > 0, 1.0 / torch.where(l > 0, l, 1.0), 0.0)
        out[:, :, a:z] = acc * (inv * vd)
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------- Triton kernel

def _tiles(block_n: int) -> tuple[int, int, int]:
    """block_n as up to three powers of two, largest first (160 = 128 + 32, 224 = 128 + 64 + 32)."""
    parts = [1 << i for i in reversed(range(block_n.bit_length())) if block_n >> i & 1]
    if len(parts) > 3:
        raise ValueError(f"fa3 attention: block_n {block_n} needs more than three power-of-two tiles")
    return tuple(parts + [0] * (3 - len(parts)))


def fused(q: Tensor) -> bool:
    """Whether `fa3_attention` takes the Triton kernel for q (CUDA or the interpreter, Triton working,
    KVCALIB_FUSED not 0)."""
    return (triton is not None and (q.is_cuda or KERNELS_ON_CPU)
            and os.environ.get("KVCALIB_FUSED", "1") != "0")


def fa3_attention_triton(q: Tensor, k: Tensor, v: Tensor, *, scaling: float, q_scale: Tensor | float = 1.0,
                         k_scale: Tensor | float | None = None, v_scale: Tensor | float | None = None,
                         mask: Tensor | None = None, causal: bool = True, window_left: int | None = None,
                         quant_q: bool = True, quant_p: bool = True, softcap: float | None = None,
                         block_n: int | None = None, block_m: int | None = None) -> Tensor:
    """The same computation as `blockwise_reference`, one Triton program per (block_m queries, head); block_m
    None: autotuned on CUDA, 64 under the interpreter.
    Raises whatever Triton raises (the dispatcher falls back). Returns [b, s, h, dv] float32."""
    x = prepare(q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, mask=mask, quant_q=quant_q)
    bn = block_n or fa3_block_n(q.shape[-1], local=window_left is not None, softcap=bool(softcap))
    return _kernel(x, scaling, causal, window_left, quant_p, softcap, bn, block_m)


SMEM_BUDGET = 200 * 1024       # bytes of shared memory a program may plan for (Hopper: 227 KB per block)


def pipeline(block_m: int, bn: int, bd: int, bdv: int, elem: int, stages: int) -> tuple[int, int]:
    """(block_m, stages) whose estimated shared memory fits SMEM_BUDGET: `stages` copies of a key block's K and V
    tiles plus the Q tile. On the H200 the kernel compiled and matched the reference at d 64 and d 128 with
    kBlockN 160 (estimate 80 / 176 KB) and failed at d 128 with kBlockN 224 and d 256 with kBlockN 128 (245 /
    288 KB at two stages): one stage, then fewer queries, bring those under the budget. The estimate ignores
    Triton's own scratch, hence the margin."""
    while stages > 1 and _need(block_m, bn, bd, bdv, elem, stages) > SMEM_BUDGET:
        stages -= 1
    while block_m > 16 and _need(block_m, bn, bd, bdv, elem, stages) > SMEM_BUDGET:
        block_m //= 2
    return block_m, stages


# (queries per program, warps, pipeline stages) the autotuner tries on CUDA; configurations over the shared
# memory budget are dropped before it times them (`_prune`)
LONG = 16384               # lengths from here on share one tuned configuration (all bound by the same MMAs)
CONFIGS = ((64, 4, 2), (64, 4, 3), (128, 8, 2), (128, 8, 1), (64, 4, 1), (32, 4, 1), (16, 4, 1))
_hw_ok: dict[int, bool] = {}


def hw_cast_agrees(device: torch.device) -> bool:
    """Whether this GPU's float32 -> e4m3 conversion gives `_round_e4m3`'s result on every case that can differ:
    each e4m3 value, the midpoint between each pair of neighbours (ties to even), the float32 values either
    side of each midpoint, and random values from the subnormals to 2^9. Checked once per device. The cast is
    one instruction where the arithmetic rounding is about fifteen per score: the kernel uses it only where
    this holds."""
    idx = torch.device(device).index or 0
    if idx not in _hw_ok:
        g = fp8.E4M3.grid().to(device)
        mid = (g[:-1] + g[1:]) / 2
        rnd = torch.rand(1 << 16, device=device, generator=torch.Generator(device).manual_seed(0))
        x = torch.cat([g, mid, torch.nextafter(mid, torch.zeros_like(mid)),
                       torch.nextafter(mid, torch.full_like(mid, 512.0)),
                       rnd * 2.0 ** torch.arange(-14, 9, device=device).repeat(len(rnd) // 23 + 1)[:len(rnd)]])
        x = x[x <= 448]
        _hw_ok[idx] = bool(torch.equal(round_e4m3_triton(x), round_e4m3_triton(x, hardware=True)))
    return _hw_ok[idx]


def _need(bm: int, bn: int, bd: int, bdv: int, elem: int, stages: int) -> int:
    """Estimated shared memory of one program: `stages` copies of a key block's K and V tiles, plus Q."""
    return stages * bn * (bd + bdv) * elem + bm * bd * elem


def _prune(configs, named_args, **kwargs):
    a = {**named_args, **kwargs}
    elem = 2 if a["BF16"] else 4
    fit = [c for c in configs if _need(c.kwargs["BM"], a["BN"], a["BD"], a["BDV"], elem, c.num_stages) <= SMEM_BUDGET
           and (a["BF16"] or c.kwargs["BM"] <= 32)]
    return fit or [min(configs, key=lambda c: (c.kwargs["BM"], c.num_stages))]


def _kernel(x: Inputs, scaling: float, causal: bool, window_left: int | None, quant_p: bool,
            softcap: float | None, bn: int, block_m: int | None = None) -> Tensor:
    """Launch `_fa3_fwd`. `block_m` None on CUDA: the autotuned configuration for this shape and length bucket;
    given (or under the interpreter): that many queries per program, `pipeline`'s stages."""
    b, h, s, d = x.q.shape
    kvh, t, dv = x.k.shape[1], x.k.shape[2], x.v.shape[-1]
    t1, t2, t3 = _tiles(bn)
    c, cap = _log2_scale(scaling, softcap, x.q_descale * x.k_descale)
    bf16 = x.bf16_exact and not _INTERPRET
    qc, kc, vc = (x.q, x.k, x.v) if not bf16 else (x.q.to(torch.bfloat16), x.k.to(torch.bfloat16),
                                                   x.v.to(torch.bfloat16))
    hw = (HW_P_CAST if HW_P_CAST is not None else x.q.is_cuda and hw_cast_agrees(x.q.device)) and quant_p
    out = torch.empty(b, s, h, dv, dtype=torch.float32, device=x.q.device)
    o4 = out.transpose(1, 2)
    mode, mt = 0, qc                                                  # unused pointer without a mask
    if x.mask is not None:
        mode = 1 if x.mask.dtype == torch.bool else 2
        mt = x.mask.view(torch.uint8) if mode == 1 else x.mask
    ms = mt.stride() if x.mask is not None else (0, 0, 0, 0)
    bd, bdv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    args = (qc, kc, vc, o4, c.contiguous(), (cap if cap is not None else c).contiguous(), x.v_descale, mt,
            *qc.stride(), *kc.stride(), *vc.stride(), *o4.stride(), *ms, h, kvh, h // kvh, s, t, d, dv,
            window_left or 0, min(LONG, max(1024, triton.next_power_of_2(max(s, t)))))
    meta = dict(BD=bd, BDV=bdv, BN=bn, T1=t1, T2=t2, T3=t3, CAUSAL=causal, WINDOW=window_left is not None,
                MASK=mode, SOFTCAP=bool(softcap), QUANT_P=quant_p, BF16=bf16, HW_CAST=bool(hw) and not _INTERPRET,
                EVEN_D=bd == d and bdv == dv, LOOP_N=triton.cdiv(t, bn) if _INTERPRET else 0)
    if block_m is None and not _INTERPRET:
        _fa3_tuned[lambda m: (triton.cdiv(s, m["BM"]), b * h)](*args, **meta)
        return out
    block_m = block_m or 64
    if not bf16:                 # float32 tiles: half the queries, no pipelining (shared memory at d = 256)
        block_m = min(block_m, 32)
    block_m, stages = pipeline(block_m, bn, bd, bdv, 2 if bf16 else 4, 2 if bf16 else 1)
    _fa3_fwd[(triton.cdiv(s, block_m), b * h)](*args, BM=block_m, num_warps=4 if block_m <= 64 else 8,
                                               num_stages=stages, **meta)
    return out


def fa3_attention(q: Tensor, k: Tensor, v: Tensor, *, scaling: float, q_scale: Tensor | float = 1.0,
                  k_scale: Tensor | float | None = None, v_scale: Tensor | float | None = None,
                  mask: Tensor | None = None, causal: bool = True, window_left: int | None = None,
                  quant_q: bool = True, quant_p: bool = True, softcap: float | None = None,
                  block_n: int | None = None) -> Tensor:
    """FlashAttention-3's FP8 attention: the Triton kernel on CUDA, the float32 reference elsewhere (or when
    Triton cannot build the kernel here; same numbers up to float32 rounding).

    `q` [b, h, s, d] in the model's dtype; `k`, `v` [b, kv_h, t, d]: what the cache gives back, codes times
    `k_scale` / `v_scale` (one per tensor or per KV head; None: k, v are taken as they are, descale 1);
    `q_scale`: vLLM's Q scale (`quant_q`); `mask`: bool (True = attend) or additive, broadcastable to
    [b, h, s, t], ANDed with `causal`; `window_left`: FA3's local window; `block_n`: FA3's kBlockN (None:
    `fa3_block_n`). Returns [b, s, h, dv] float32 (transformers' attention-function layout)."""
    x = prepare(q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, mask=mask, quant_q=quant_q)
    bn = block_n or fa3_block_n(q.shape[-1], local=window_left is not None, softcap=bool(softcap))
    args = (x, scaling, causal, window_left, quant_p, softcap, bn)
    config = (x.bf16_exact, x.q.shape[-1], x.v.shape[-1], bn, softcap is not None)
    if fused(q) and config not in _failed:
        try:
            return _kernel(*args)
        except Exception as e:           # compilation and resource checks fail before launch: nothing written
            _failed[config] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"kvcalib: the fused FA3 kernel is unavailable for {config} here ({_failed[config][:200]}); "
                  "using the float32 reference (same numbers, slower)", file=sys.stderr)
    return _reference(*args)


if triton is not None:
    @triton.jit
    def _round_e4m3(p):
        """Non-negative float32 p (at most 448) to the nearest e4m3 value, ties to even, from the bits."""
        e = tl.maximum(((p.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)   # binade, subnormals at -6
        quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        n = p * ((127 - e + 3) << 23).to(tl.float32, bitcast=True)                # p / quantum, exact
        f = tl.floor(n)
        rem = n - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        r = f + tl.where(rem > 0.5, 1.0, 0.0) + tl.where((rem == 0.5) & odd, 1.0, 0.0)
        return r * quantum

    @triton.jit
    def _round_kernel(x_ptr, o_ptr, N, BLOCK: tl.constexpr, HW: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < N, other=0.0)
        if HW:
            r = x.to(tl.float8e4nv).to(tl.float32)
        else:
            r = _round_e4m3(x)
        tl.store(o_ptr + i, r, mask=i < N)

    @triton.jit
    def _scores(q, k_ptr, m_ptr, start, offs_m, offs_d, rows, c, cap, skt, skd, smm, smt, S, T, D, window,
                TN: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr,
                SOFTCAP: tl.constexpr, BF16: tl.constexpr, FULL: tl.constexpr, EVEN_D: tl.constexpr):
        """One tile of TN keys: log2-domain logits x [BM, TN] (-inf where masked) and the key offsets.
        FULL: every key of the tile exists and every query sees it (no mask to build or apply)."""
        offs_n = start + tl.arange(0, TN)
        kp = k_ptr + offs_n[None, :] * skt + offs_d[:, None] * skd
        if FULL and EVEN_D:
            kt = tl.load(kp)
        elif FULL:
            kt = tl.load(kp, mask=offs_d[:, None] < D, other=0.0)
        else:
            kt = tl.load(kp, mask=(offs_n[None, :] < T) & (offs_d[:, None] < D), other=0.0)
        if BF16:
            sc = tl.dot(q, kt)
        else:
            sc = tl.dot(q, kt, input_precision="ieee")
        if SOFTCAP:
            y = sc * cap
            ey = tl.exp(-2.0 * tl.abs(y))
            sc = tl.where(y < 0, -1.0, 1.0) * (1.0 - ey) / (1.0 + ey)
        x = sc * c
        if FULL:
            return x, offs_n
        keep = offs_n[None, :] < T
        if CAUSAL:
            keep = keep & (offs_n[None, :] <= rows[:, None])
        if WINDOW:
            keep = keep & (offs_n[None, :] >= rows[:, None] - window)
        if MASK != 0:
            mptr = m_ptr + offs_m[:, None].to(tl.int64) * smm + offs_n[None, :] * smt
            inb = (offs_m[:, None] < S) & (offs_n[None, :] < T)
            if MASK == 1:
                keep = keep & (tl.load(mptr, mask=inb, other=0) != 0)
            else:
                x = x + tl.load(mptr, mask=inb, other=0.0).to(tl.float32) * 1.4426950408889634
        return tl.where(keep, x, float("-inf")), offs_n

    @triton.jit
    def _pv(acc, x, off, v_ptr, offs_n, offs_dv, svt, svd, T, DV,
            QUANT_P: tl.constexpr, BF16: tl.constexpr, HW_CAST: tl.constexpr, FULL: tl.constexpr,
            EVEN_D: tl.constexpr):
        """P of one tile against the block's offset: (acc + round(P) . V, the tile's float32 row sum)."""
        p = tl.exp2(x - off[:, None])
        if QUANT_P:
            if HW_CAST:
                pq = p.to(tl.float8e4nv).to(tl.float32)
            else:
                pq = _round_e4m3(p)
        else:
            pq = p
        vp = v_ptr + offs_n[:, None] * svt + offs_dv[None, :] * svd
        if FULL and EVEN_D:
            vt = tl.load(vp)
        elif FULL:
            vt = tl.load(vp, mask=offs_dv[None, :] < DV, other=0.0)
        else:
            vt = tl.load(vp, mask=(offs_n[:, None] < T) & (offs_dv[None, :] < DV), other=0.0)
        if BF16:
            acc = tl.dot(pq.to(tl.bfloat16), vt, acc)
        else:
            acc = tl.dot(pq, vt, acc, input_precision="ieee")
        return acc, tl.sum(p, axis=1)

    @triton.jit
    def _block(acc, l_i, m_i, start, q, k_base, v_base, m_base, offs_m, offs_d, offs_dv, rows, c, cap, skt, skd,
               svt, svd, smm, smt, S, T, D, DV, window, T1: tl.constexpr, T2: tl.constexpr, T3: tl.constexpr,
               CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr, SOFTCAP: tl.constexpr,
               QUANT_P: tl.constexpr, BF16: tl.constexpr, HW_CAST: tl.constexpr, FULL: tl.constexpr,
               EVEN_D: tl.constexpr):
        """One FA3 key block (T1 + T2 + T3 keys from `start`): block max, rescale, P, row sum, P . V."""
        x1, n1 = _scores(q, k_base, m_base, start, offs_m, offs_d, rows, c, cap, skt, skd, smm, smt, S, T, D,
                         window, T1, CAUSAL, WINDOW, MASK, SOFTCAP, BF16, FULL, EVEN_D)
        m_blk = tl.max(x1, axis=1)
        if T2 > 0:
            x2, n2 = _scores(q, k_base, m_base, start + T1, offs_m, offs_d, rows, c, cap, skt, skd, smm, smt,
                             S, T, D, window, T2, CAUSAL, WINDOW, MASK, SOFTCAP, BF16, FULL, EVEN_D)
            m_blk = tl.maximum(m_blk, tl.max(x2, axis=1))
        if T3 > 0:
            x3, n3 = _scores(q, k_base, m_base, start + T1 + T2, offs_m, offs_d, rows, c, cap, skt, skd, smm,
                             smt, S, T, D, window, T3, CAUSAL, WINDOW, MASK, SOFTCAP, BF16, FULL, EVEN_D)
            m_blk = tl.maximum(m_blk, tl.max(x3, axis=1))
        m_new = tl.maximum(m_i, m_blk)
        empty = m_new == float("-inf")
        alpha = tl.exp2(m_i - tl.where(empty, 0.0, m_new))           # 0 while the row has seen nothing
        off = tl.where(empty, 0.0, m_new - 8.0)                       # FA3's Max_offset: max P is 2^8
        acc = acc * alpha[:, None]
        acc, l_blk = _pv(acc, x1, off, v_base, n1, offs_dv, svt, svd, T, DV, QUANT_P, BF16, HW_CAST, FULL, EVEN_D)
        if T2 > 0:
            acc, l2 = _pv(acc, x2, off, v_base, n2, offs_dv, svt, svd, T, DV, QUANT_P, BF16, HW_CAST, FULL, EVEN_D)
            l_blk = l_blk + l2
        if T3 > 0:
            acc, l3 = _pv(acc, x3, off, v_base, n3, offs_dv, svt, svd, T, DV, QUANT_P, BF16, HW_CAST, FULL, EVEN_D)
            l_blk = l_blk + l3
        return acc, l_i * alpha + l_blk, m_new

    @triton.jit
    def _fa3_fwd(q_ptr, k_ptr, v_ptr, o_ptr, c_ptr, cap_ptr, vd_ptr, m_ptr,
                 sqb, sqh, sqs, sqd, skb, skh, skt, skd, svb, svh, svt, svd, sob, soh, sos, sod,
                 smb, smh, smm, smt, H, KVH, REP, S, T, D, DV, window, LEN_BUCKET,
                 BM: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr, T1: tl.constexpr,
                 T2: tl.constexpr,
                 T3: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr,
                 SOFTCAP: tl.constexpr, QUANT_P: tl.constexpr, BF16: tl.constexpr, HW_CAST: tl.constexpr,
                 EVEN_D: tl.constexpr, LOOP_N: tl.constexpr):
        pid_m = tl.program_id(0)
        b = (tl.program_id(1) // H).to(tl.int64)                    # 64-bit offsets: a 128K x 128K mask
        h = (tl.program_id(1) % H).to(tl.int64)
        kh = h // REP
        c = tl.load(c_ptr + b * KVH + kh)
        cap = tl.load(cap_ptr + b * KVH + kh)
        vd = tl.load(vd_ptr + b * KVH + kh)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, BD)
        offs_dv = tl.arange(0, BDV)
        q = tl.load(q_ptr + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :] * sqd,
                    mask=(offs_m[:, None] < S) & (offs_d[None, :] < D), other=0.0)
        rows = offs_m + (T - S)                                      # key index of each query (bottom-right)
        k_base = k_ptr + b * skb + kh * skh
        v_base = v_ptr + b * svb + kh * svh
        m_base = m_ptr + b * smb + h * smh
        hi = T
        if CAUSAL:
            hi = tl.minimum(T, tl.minimum(S, pid_m * BM + BM) + T - S)
        j_hi = tl.cdiv(tl.maximum(hi, 0), BN)
        j_lo = 0
        if WINDOW:
            j_lo = tl.maximum(pid_m * BM + T - S - window, 0) // BN
        # [f_lo, f_hi): blocks every query of this tile sees whole (all keys exist, none past the tile's first
        # row, none before its last row's window) and no mask tensor: no mask to build there. FA3 splits its
        # loop the same way; the visiting order, and so every number, stays the same.
        f_hi = j_lo
        f_lo = j_lo
        if MASK == 0:
            f_hi = T // BN
            if CAUSAL:
                f_hi = tl.minimum(f_hi, tl.maximum(pid_m * BM + T - S + 1, 0) // BN)
            f_hi = tl.minimum(tl.maximum(f_hi, j_lo), j_hi)
            if WINDOW:
                f_lo = tl.minimum(tl.cdiv(tl.maximum(pid_m * BM + BM - 1 + T - S - window, 0), BN), f_hi)
                f_lo = tl.maximum(f_lo, j_lo)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, BDV], tl.float32)
        if LOOP_N > 0:     # the interpreter cannot loop to a bound computed from program_id: it visits every
            for jj in range(0, LOOP_N):   # block; those outside [j_lo, j_hi) are fully masked: no-ops
                j = LOOP_N - 1 - jj
                if (j >= f_lo) & (j < f_hi):
                    acc, l_i, m_i = _block(acc, l_i, m_i, j * BN, q, k_base, v_base, m_base, offs_m, offs_d,
                                           offs_dv, rows, c, cap, skt, skd, svt, svd, smm, smt, S, T, D, DV,
                                           window, T1, T2, T3, CAUSAL, WINDOW, MASK, SOFTCAP, QUANT_P, BF16,
                                           HW_CAST, True, EVEN_D)
                else:
                    acc, l_i, m_i = _block(acc, l_i, m_i, j * BN, q, k_base, v_base, m_base, offs_m, offs_d,
                                           offs_dv, rows, c, cap, skt, skd, svt, svd, smm, smt, S, T, D, DV,
                                           window, T1, T2, T3, CAUSAL, WINDOW, MASK, SOFTCAP, QUANT_P, BF16,
                                           HW_CAST, False, EVEN_D)
        else:              # key blocks from the last one down: masked ones, whole ones, masked ones
            for jj in range(0, j_hi - f_hi):
                acc, l_i, m_i = _block(acc, l_i, m_i, (j_hi - 1 - jj) * BN, q, k_base, v_base, m_base, offs_m,
                                       offs_d, offs_dv, rows, c, cap, skt, skd, svt, svd, smm, smt, S, T, D, DV,
                                       window, T1, T2, T3, CAUSAL, WINDOW, MASK, SOFTCAP, QUANT_P, BF16, HW_CAST,
                                       False, EVEN_D)
            for jj in range(0, f_hi - f_lo):
                acc, l_i, m_i = _block(acc, l_i, m_i, (f_hi - 1 - jj) * BN, q, k_base, v_base, m_base, offs_m,
                                       offs_d, offs_dv, rows, c, cap, skt, skd, svt, svd, smm, smt, S, T, D, DV,
                                       window, T1, T2, T3, CAUSAL, WINDOW, MASK, SOFTCAP, QUANT_P, BF16, HW_CAST,
                                       True, EVEN_D)
            for jj in range(0, f_lo - j_lo):
                acc, l_i, m_i = _block(acc, l_i, m_i, (f_lo - 1 - jj) * BN, q, k_base, v_base, m_base, offs_m,
                                       offs_d, offs_dv, rows, c, cap, skt, skd, svt, svd, smm, smt, S, T, D, DV,
                                       window, T1, T2, T3, CAUSAL, WINDOW, MASK, SOFTCAP, QUANT_P, BF16, HW_CAST,
                                       False, EVEN_D)
        inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
        o = acc * (inv * vd)[:, None]
        tl.store(o_ptr + b * sob + h * soh + offs_m[:, None] * sos + offs_dv[None, :] * sod, o,
                 mask=(offs_m[:, None] < S) & (offs_dv[None, :] < DV))


    # one configuration per head size, kBlockN, mask kind and power-of-two length bucket (not per length: eval's
    # lengths vary sample by sample); the kernel only writes its output, so timing it again is harmless
    _fa3_tuned = triton.autotune(
        configs=[triton.Config({"BM": bm}, num_warps=w, num_stages=st) for bm, w, st in CONFIGS],
        key=["LEN_BUCKET", "BD", "BDV", "BN", "CAUSAL", "WINDOW", "MASK", "SOFTCAP", "QUANT_P", "BF16", "HW_CAST"],
        prune_configs_by={"early_config_prune": _prune})(_fa3_fwd)


def round_e4m3_triton(x: Tensor, hardware: bool = False) -> Tensor:
    """The kernel's rounding of P on its own (non-negative float32 up to 448), arithmetic or (`hardware`, CUDA)
    the GPU's conversion: for tests and `hw_cast_agrees`."""
    x = x.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024, HW=hardware)
    return out
