"""One pass per tensor: the capture's per-batch reductions fused into single kernels on CUDA.

Why: the capture runs inside every attention call of every batch. As ordinary torch ops one layer's
statistics were about 25 small kernels, each reading or writing a tensor of the size of K: on one H200 3-5 %
over the forward pass for absmax, 22 % for the histogram observers. Here each tensor is read once by one
Triton kernel that folds its result straight into the observer's running state with (relaxed) atomics: no
temporaries, no host synchronisation, two or three launches per layer.

Everything has a torch reference beside it (CPU, no Triton, or KVCALIB_FUSED=0) with the same results bit for
bit: maxima select an element, counts are integers, and a bf16 value's histogram bin holds that value alone;
only the underflow bin's (values below amax·2^-15) float64 sum is added in another order. The tests run the
kernels under Triton's interpreter on CPU tensors, in a copy of this module whose KERNELS_ON_CPU is True.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

Tensor = torch.Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference does everything
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNELS_ON_CPU = False      # only for the interpreter: CPU tensors through the kernels
_BLOCK_TOKENS = 64
HIST_LANES = 16             # copies of the per-batch histogram, picked by token and channel group, so that
                            # the threads of one warp that hit the same bin mostly add to different copies


_failed: list[str] = []    # why Triton could not build a kernel here, once it failed (then torch does it all)


def fused(x: Tensor) -> bool:
    """Whether `x`'s reductions run as Triton kernels (a working Triton, a CUDA tensor, KVCALIB_FUSED not 0)."""
    return (triton is not None and not _failed and (x.is_cuda or KERNELS_ON_CPU)
            and os.environ.get("KVCALIB_FUSED", "1") != "0" and x.dim() == 4 and x.numel() < 2**31)


def _launch(kernel, grid, *args, **meta) -> bool:
    """Run a kernel; False if Triton cannot build it on this machine (no C compiler for its launcher, an
    unsupported GPU ...): the caller then takes the torch path, which gives the same results."""
    try:
        kernel[grid](*args, **meta)
        return True
    except Exception as e:  # compilation happens before launch: no state was touched
        _failed.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        print(f"kvcalib: Triton kernels unavailable here ({_failed[0][:200]}); using torch ops "
              "(same results, slower)", file=sys.stderr)
        return False


def _mask_args(x: Tensor, mask: Tensor | None) -> tuple[Tensor, int, int]:
    if mask is None:
        return x, 0, 0                   # unused pointer (HAS_MASK is False)
    m = mask.to(x.device, torch.bool)
    return m, m.stride(0), m.stride(1)


def _grid(x: Tensor) -> tuple[int, int]:
    b, h, s, _ = x.shape
    return b * h, triton.cdiv(s, _BLOCK_TOKENS)


# ---------------------------------------------------------------- max |x| per head, and counts above a limit

def absmax_(x: Tensor, mask: Tensor | None, amax: Tensor, over: Tensor | None = None,
            total: Tensor | None = None, limit: float = 448.0) -> None:
    """amax [h] float32 ← max(amax, max |x| over real tokens, per head); over [] int64 += #(|x| > limit);
    total [] int64 += #real values. x [b, h, s, d] with any strides; mask [b, s] (True = real token)."""
    if not fused(x):
        return _absmax_torch(x, mask, amax, over, total, limit)
    m, smb, sms = _mask_args(x, mask)
    b, h, s, d = x.shape
    count = over is not None
    if not _launch(_absmax_kernel, _grid(x),
                   x, m, amax, over if count else amax, total if count else amax, s, d, h,
                   *x.stride(), smb, sms, float(limit),
                   HAS_MASK=mask is not None, COUNT=count, BS=_BLOCK_TOKENS, BD=triton.next_power_of_2(d)):
        _absmax_torch(x, mask, amax, over, total, limit)


def _absmax_torch(x: Tensor, mask: Tensor | None, amax: Tensor, over: Tensor | None, total: Tensor | None,
                  limit: float) -> None:
    keep = None if mask is None else mask.to(x.device, torch.bool)
    a = x.detach().abs()
    per_token = a.amax(dim=-1)                              # a max selects an element: exact in x's dtype
    if keep is not None:
        per_token = per_token.masked_fill(~keep[:, None, :], 0)
    torch.maximum(amax, per_token.amax(dim=(0, 2)).to(torch.float32), out=amax)
    if over is not None:
        big = a > limit
        if keep is not None:
            big = big & keep[:, None, :, None]
            n = keep.sum() * x.shape[1] * x.shape[3]
        else:
            n = torch.tensor(x.numel(), device=x.device)
        over += big.sum()
        total += n


if triton is not None:
    @triton.jit
    def _tile(m_ptr, S, H, smb, sms, HAS_MASK: tl.constexpr, BS: tl.constexpr):
        """This program's batch row and head, its BS token offsets and which of them hold a real token."""
        b = tl.program_id(0) // H
        offs_s = tl.program_id(1) * BS + tl.arange(0, BS)
        rows = offs_s < S
        if HAS_MASK:
            rows = rows & (tl.load(m_ptr + b * smb + offs_s * sms, mask=offs_s < S, other=0) != 0)
        return b, tl.program_id(0) % H, offs_s, rows

    @triton.jit
    def _abs_tile(x_ptr, m_ptr, S, D, H, sxb, sxh, sxs, sxd, smb, sms,
                  HAS_MASK: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr):
        """This program's tile: |x| in float32 for BS tokens of one (batch, head) — 0 outside the tensor and
        on padding — with the tile's validity, its head, token and channel offsets."""
        b, h, offs_s, rows = _tile(m_ptr, S, H, smb, sms, HAS_MASK, BS)
        offs_d = tl.arange(0, BD)
        valid = rows[:, None] & (offs_d[None, :] < D)
        ptrs = x_ptr + b * sxb + h * sxh + offs_s[:, None] * sxs + offs_d[None, :] * sxd
        a = tl.abs(tl.load(ptrs, mask=valid, other=0.0).to(tl.float32))
        return a, valid, h, offs_s, offs_d

    @triton.jit
    def _absmax_kernel(x_ptr, m_ptr, amax_ptr, over_ptr, total_ptr, S, D, H, sxb, sxh, sxs, sxd, smb, sms, limit,
                       HAS_MASK: tl.constexpr, COUNT: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr):
        a, valid, h, offs_s, offs_d = _abs_tile(x_ptr, m_ptr, S, D, H, sxb, sxh, sxs, sxd, smb, sms, HAS_MASK, BS, BD)
        tl.atomic_max(amax_ptr + h, tl.max(tl.max(tl.where(a == a, a, float("inf")), axis=1), axis=0),
                      sem="relaxed")
        if COUNT:
            over = tl.sum(tl.sum((a > limit).to(tl.int64), axis=1), axis=0)
            n = tl.sum(tl.sum(valid.to(tl.int64), axis=1), axis=0)
            tl.atomic_add(over_ptr, over, sem="relaxed")
            tl.atomic_add(total_ptr, n, sem="relaxed")


# ---------------------------------------------------------------- RoPE pair norms (rope_bound)

def pair_max_(x: Tensor, mask: Tensor | None, rotary_dim: int, interleaved: bool, pair_max: Tensor,
              pass_max: Tensor) -> None:
    """pair_max [h, rot/2] ← max over real tokens of hypot(first, second) of every rotary pair;
    pass_max [h, d - rot] ← max |x| of the unrotated channels. Layout as calib.capture.observers.RotaryLayout."""
    if not fused(x):
        return _pair_max_torch(x, mask, rotary_dim, interleaved, pair_max, pass_max)
    m, smb, sms = _mask_args(x, mask)
    b, h, s, d = x.shape
    half, rest = rotary_dim // 2, d - rotary_dim
    if not _launch(_pair_kernel, _grid(x),
                   x, m, pair_max, pass_max, s, h, half, rest, rotary_dim, *x.stride(), smb, sms,
                   HAS_MASK=mask is not None, INTERLEAVED=interleaved, BS=_BLOCK_TOKENS,
                   BP=triton.next_power_of_2(half), BR=triton.next_power_of_2(max(rest, 1)),
                   EXACT_HYPOT=not _INTERPRET):
        _pair_max_torch(x, mask, rotary_dim, interleaved, pair_max, pass_max)


def _pair_max_torch(x: Tensor, mask: Tensor | None, rot: int, interleaved: bool, pair_max: Tensor,
                    pass_max: Tensor) -> None:
    xf = x.detach().to(torch.float32)        # every rotary pair (first, second channels), then the pass-through ones
    first, second = (slice(0, rot, 2), slice(1, rot, 2)) if interleaved else (slice(0, rot // 2), slice(rot // 2, rot))
    a, b, rest = xf[..., first], xf[..., second], xf[..., rot:]
    norm, rest = torch.hypot(a, b), rest.abs()
    if mask is not None:
        drop = ~mask.to(x.device, torch.bool)[:, None, :, None]
        norm, rest = norm.masked_fill(drop, 0), rest.masked_fill(drop, 0)
    torch.maximum(pair_max, norm.amax(dim=(0, 2)), out=pair_max)
    torch.maximum(pass_max, rest.amax(dim=(0, 2)), out=pass_max)


if triton is not None:
    from triton.language.extra import libdevice

    @triton.jit
    def _pair_kernel(x_ptr, m_ptr, pair_ptr, pass_ptr, S, H, HALF, REST, ROT, sxb, sxh, sxs, sxd, smb, sms,
                     HAS_MASK: tl.constexpr, INTERLEAVED: tl.constexpr, BS: tl.constexpr, BP: tl.constexpr,
                     BR: tl.constexpr, EXACT_HYPOT: tl.constexpr):
        b, h, offs_s, rows = _tile(m_ptr, S, H, smb, sms, HAS_MASK, BS)
        base = x_ptr + b * sxb + h * sxh + offs_s[:, None] * sxs
        p = tl.arange(0, BP)
        if INTERLEAVED:
            c1, c2 = 2 * p, 2 * p + 1
        else:
            c1, c2 = p, p + HALF
        vp = rows[:, None] & (p[None, :] < HALF)
        a = tl.load(base + c1[None, :] * sxd, mask=vp, other=0.0).to(tl.float32)
        c = tl.load(base + c2[None, :] * sxd, mask=vp, other=0.0).to(tl.float32)
        if EXACT_HYPOT:
            norm = libdevice.hypot(a, c)             # what torch.hypot calls on CUDA: same bits
        else:                                        # the interpreter has no libdevice: within 1 ulp
            norm = tl.sqrt(a * a + c * c)
        norm = tl.where(vp, tl.where(norm == norm, norm, float("inf")), 0.0)
        tl.atomic_max(pair_ptr + h * HALF + p, tl.max(norm, axis=0), mask=p < HALF, sem="relaxed")
        if REST > 0:
            r = tl.arange(0, BR)
            vr = rows[:, None] & (r[None, :] < REST)
            z = tl.abs(tl.load(base + (ROT + r[None, :]) * sxd, mask=vr, other=0.0).to(tl.float32))
            z = tl.where(z == z, z, float("inf"))
            tl.atomic_max(pass_ptr + h * REST + r, tl.max(z, axis=0), mask=r < REST, sem="relaxed")


# ---------------------------------------------------------------- float-binned histograms of bf16 |x|

def histogram_ok(x: Tensor, bins: int) -> bool:
    """The fused histogram takes bf16 tensors, where one bin (7 mantissa bits) is one representable value."""
    return fused(x) and x.dtype == torch.bfloat16 and bins <= 2**15


class HistScratch:
    """Scratch the fused histogram adds a batch into and the fold empties again (counts [HIST_LANES, h, bins]
    int32, the underflow bin's sum [h] float64): one per device and shape serves every observer."""

    def __init__(self, heads: int, bins: int, device: torch.device) -> None:
        self.counts = torch.zeros(HIST_LANES, heads, bins, dtype=torch.int32, device=device)
        self.sum0 = torch.zeros(heads, dtype=torch.float64, device=device)


@functools.cache
def scratch_for(device: torch.device, heads: int, bins: int) -> HistScratch:
    """The shared scratch for histograms of `heads` x `bins` on `device` (1 MiB for 8 heads of 2048 bins)."""
    return HistScratch(heads, bins, device)


def histogram_(x: Tensor, mask: Tensor | None, state: dict[str, Tensor], scratch: HistScratch,
               e_min: int, e_max: int, amax: Tensor | None = None) -> dict[str, Tensor] | None:
    """The histogram state (calib.capture.observers' _HistogramObserver layout) with bf16 x folded in, as fresh
    tensors: the batch's max first (`amax`, the capture's running max |x| including this batch, spares reading x
    again), its values binned on the grown range, the old counts moved onto that range and added. None (state
    untouched but for its exact max) when Triton cannot build the kernel here."""
    m, smb, sms = _mask_args(x, mask)
    b, h, s, d = x.shape
    bins = state["counts"].shape[-1]
    if amax is None:
        absmax_(x, mask, state["amax"])
    else:
        torch.maximum(state["amax"], amax, out=state["amax"])
    if not _launch(_hist_kernel, _grid(x),
                   x, m, state["amax"], scratch.counts, scratch.sum0, s, d, h, bins, *x.stride(), smb, sms,
                   e_min, e_max, HAS_MASK=mask is not None, LANES=HIST_LANES, BS=_BLOCK_TOKENS,
                   BD=triton.next_power_of_2(d)):
        return None
    new = {"exponent": torch.empty_like(state["exponent"]), "counts": torch.empty_like(state["counts"]),
           "sums": torch.empty_like(state["sums"]), "amax": state["amax"]}
    block = min(bins, 256)
    if not _launch(_fold_kernel, (h, bins // block),
                   state["exponent"], state["counts"], state["sums"], state["amax"], scratch.counts, scratch.sum0,
                   new["exponent"], new["counts"], new["sums"], h, e_min, e_max, BINS=bins, LANES=HIST_LANES,
                   BLOCK=block):
        raise RuntimeError(f"calib.capture.kernels: the histogram fold kernel failed after its batch kernel ran "
                           f"({_failed[0]}); run with KVCALIB_FUSED=0")
    return new


if triton is not None:
    @triton.jit
    def _range_exponent(amax, e_min, e_max):
        """frexp(amax).exponent clamped to [e_min, e_max] (e_min for 0), from the float32 bits."""
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 126
        return tl.minimum(tl.maximum(e, e_min), e_max)

    @triton.jit
    def _hist_kernel(x_ptr, m_ptr, amax_ptr, counts_ptr, sum0_ptr, S, D, H, BINS, sxb, sxh, sxs, sxd, smb, sms,
                     e_min, e_max, HAS_MASK: tl.constexpr, LANES: tl.constexpr, BS: tl.constexpr,
                     BD: tl.constexpr):
        a, valid, h, offs_s, offs_d = _abs_tile(x_ptr, m_ptr, S, D, H, sxb, sxh, sxs, sxd, smb, sms, HAS_MASK, BS, BD)
        e = _range_exponent(tl.load(amax_ptr + h), e_min, e_max)
        base = ((e + 127) << 7) - BINS
        idx = tl.minimum(tl.maximum((a.to(tl.int32, bitcast=True) >> 16) - base, 0), BINS - 1)
        lane = (offs_s[:, None] + offs_d[None, :] // 8) % LANES
        tl.atomic_add(counts_ptr + (lane * H + h) * BINS + idx, 1, mask=valid, sem="relaxed")
        low = valid & (idx == 0)
        tl.atomic_add(sum0_ptr + h + 0 * idx, a.to(tl.float64), mask=low, sem="relaxed")

    @triton.jit
    def _fold_kernel(e_ptr, counts_ptr, sums_ptr, amax_ptr, batch_ptr, sum0_ptr, e_out, counts_out, sums_out,
                     H, e_min, e_max, BINS: tl.constexpr, LANES: tl.constexpr, BLOCK: tl.constexpr):
        """One block of one head's bins: old bins moved down by the range's growth, plus the batch."""
        h = tl.program_id(0)
        e_old = tl.load(e_ptr + h).to(tl.int32)
        e_new = tl.maximum(_range_exponent(tl.load(amax_ptr + h), e_min, e_max), e_old)
        shift = (e_new - e_old) << 7                       # bins move down by 128 per octave of growth
        base = ((e_new + 127) << 7) - BINS
        row = h * BINS
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        src = j + shift
        moved = (src < BINS) & (j > 0)
        c = tl.load(counts_ptr + row + src, mask=moved, other=0)
        sm = tl.load(sums_ptr + row + src, mask=moved, other=0.0)
        if tl.program_id(1) == 0:                          # the underflow bin takes old bins 0..shift
            under_c = tl.full([], 0, tl.int64)
            under_s = tl.full([], 0.0, tl.float64)
            for k0 in range(0, BINS, BLOCK):
                k = k0 + tl.arange(0, BLOCK)
                sel = k <= shift
                under_c += tl.sum(tl.load(counts_ptr + row + k, mask=sel, other=0), axis=0)
                under_s += tl.sum(tl.load(sums_ptr + row + k, mask=sel, other=0.0), axis=0)
            c = tl.where(j == 0, under_c, c)
            sm = tl.where(j == 0, under_s + tl.load(sum0_ptr + h), sm)
            tl.store(sum0_ptr + h, 0.0)
            tl.store(e_out + h, e_new.to(tl.int64))
        add = tl.zeros((BLOCK,), dtype=tl.int64)
        for lane in tl.static_range(LANES):
            p = batch_ptr + (lane * H + h) * BINS + j
            add += tl.load(p).to(tl.int64)
            tl.store(p, tl.zeros((BLOCK,), dtype=tl.int32))
        start = (tl.maximum(base + j, 0) << 16).to(tl.float32, bitcast=True).to(tl.float64)
        sm += tl.where((j > 0) & (add > 0), add.to(tl.float64) * start, 0.0)
        tl.store(counts_out + row + j, c + add)
        tl.store(sums_out + row + j, sm)
