"""The fused Triton kernel for `calib/evaluation/fa3.py`'s FP8 attention (CUDA; the interpreter in tests).

Why a kernel: the float32 reference runs without tensor cores; at 32K-128K the emulated arms have to cost
about what the model's own forward does. An e4m3 code is exact in bf16, so Q . K and P . V run on bf16 tensor
cores with float32 accumulation (IEEE float32 dots for K/V that are not codes times a per-head scale); a
kBlockN that is not a power of two (160, 224) is up to three power-of-two tiles sharing one block max. Under
Triton's interpreter (tests) the dots run in float32 (its bf16 dot is broken) and P is rounded arithmetically.

Speed, as FA3 gets it: key blocks that every query of a tile sees whole (behind the diagonal, inside the
window, no mask tensor) skip the mask; P is rounded by the GPU's float32 -> e4m3 conversion where
`hw_cast_agrees` finds it equal to the arithmetic rounding on every tie; queries per program, warps and
pipeline stages are autotuned once per head size, kBlockN, mask kind and power-of-two length bucket.
"""

from __future__ import annotations

import os

import torch

from calib.scales import fp8

try:
    import triton
    import triton.language as tl
except ImportError:                        # CPU-only installs: the reference does everything
    triton = None

Tensor = torch.Tensor
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNELS_ON_CPU = False                     # only for the interpreter: CPU tensors through the kernel
HW_P_CAST: bool | None = None              # round P with the GPU's cvt to e4m3 (True), arithmetic (False);
                                           # None: the cvt wherever `hw_cast_agrees` found it equal


def _tiles(block_n: int) -> tuple[int, int, int]:
    """block_n as up to three powers of two, largest first (160 = 128 + 32, 224 = 128 + 64 + 32)."""
    parts = [1 << i for i in reversed(range(block_n.bit_length())) if block_n >> i & 1]
    if len(parts) > 3:
        raise ValueError(f"fa3 attention: block_n {block_n} needs more than three power-of-two tiles")
    return tuple(parts + [0] * (3 - len(parts)))


SMEM_BUDGET = 200 * 1024       # bytes of shared memory a program may plan for (Hopper: 227 KB per block)


def pipeline(block_m: int, bn: int, bd: int, bdv: int, elem: int, stages: int) -> tuple[int, int]:
    """(block_m, stages) whose estimated shared memory (`_need`) fits SMEM_BUDGET. On the H200 the kernel
    compiled at d 64 and d 128 with kBlockN 160 (estimate 80 / 176 KB) and failed at d 128 with kBlockN 224 and
    d 256 with kBlockN 128 (245 / 288 KB at two stages): one stage, then fewer queries, bring those under the
    budget. The estimate ignores Triton's own scratch, hence the margin."""
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
    side of each midpoint, and random values from the subnormals to 2^9; once per device. The cast is one
    instruction where the arithmetic rounding is about fifteen per score."""
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


def launch(x, c: Tensor, cap: Tensor | None, causal: bool, window_left: int | None, quant_p: bool,
           softcap: float | None, bn: int, block_m: int | None = None) -> Tensor:
    """Launch `_fa3_fwd` on `fa3.Inputs` x with the log2-domain scale `c` (and softcap multiplier `cap`) per
    (batch, KV head); `block_m` None on CUDA: autotuned, else that many queries per program (`pipeline`)."""
    b, h, s, d = x.q.shape
    kvh, t, dv = x.k.shape[1], x.k.shape[2], x.v.shape[-1]
    t1, t2, t3 = _tiles(bn)
    bf16 = x.bf16_exact and not _INTERPRET
    qc, kc, vc = (t.to(torch.bfloat16) if bf16 else t for t in (x.q, x.k, x.v))
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
        return (f + tl.where(rem > 0.5, 1.0, 0.0) + tl.where((rem == 0.5) & odd, 1.0, 0.0)) * quantum

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
                 T2: tl.constexpr, T3: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr,
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
                    acc, l_i, m_i = _block(acc, l_i, m_i, j * BN, q, k_base, v_base, m_base, offs_m, offs_d, offs_dv,
                                           rows, c, cap, skt, skd, svt, svd, smm, smt, S, T, D, DV, window, T1, T2, T3,
                                           CAUSAL, WINDOW, MASK, SOFTCAP, QUANT_P, BF16, HW_CAST, True, EVEN_D)
                else:
                    acc, l_i, m_i = _block(acc, l_i, m_i, j * BN, q, k_base, v_base, m_base, offs_m, offs_d, offs_dv,
                                           rows, c, cap, skt, skd, svt, svd, smm, smt, S, T, D, DV, window, T1, T2, T3,
                                           CAUSAL, WINDOW, MASK, SOFTCAP, QUANT_P, BF16, HW_CAST, False, EVEN_D)
        else:              # key blocks from the last one down: masked ones, whole ones, masked ones
            for jj in range(0, j_hi - f_hi):
                acc, l_i, m_i = _block(acc, l_i, m_i, (j_hi - 1 - jj) * BN, q, k_base, v_base, m_base, offs_m, offs_d,
                                       offs_dv, rows, c, cap, skt, skd, svt, svd, smm, smt, S, T, D, DV, window, T1, T2,
                                       T3, CAUSAL, WINDOW, MASK, SOFTCAP, QUANT_P, BF16, HW_CAST, False, EVEN_D)
            for jj in range(0, f_hi - f_lo):
                acc, l_i, m_i = _block(acc, l_i, m_i, (f_hi - 1 - jj) * BN, q, k_base, v_base, m_base, offs_m, offs_d,
                                       offs_dv, rows, c, cap, skt, skd, svt, svd, smm, smt, S, T, D, DV, window, T1, T2,
                                       T3, CAUSAL, WINDOW, MASK, SOFTCAP, QUANT_P, BF16, HW_CAST, True, EVEN_D)
            for jj in range(0, f_lo - j_lo):
                acc, l_i, m_i = _block(acc, l_i, m_i, (f_lo - 1 - jj) * BN, q, k_base, v_base, m_base, offs_m, offs_d,
                                       offs_dv, rows, c, cap, skt, skd, svt, svd, smm, smt, S, T, D, DV, window, T1, T2,
                                       T3, CAUSAL, WINDOW, MASK, SOFTCAP, QUANT_P, BF16, HW_CAST, False, EVEN_D)
        o = acc * (tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0) * vd)[:, None]
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
