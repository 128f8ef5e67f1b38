"""On a CUDA machine: calib.capture.kernels's kernels against the torch reference, and where each arm's time goes.

Why a separate script: the tests check the kernels under Triton's interpreter on the CPU; only a GPU shows
whether the compiled kernels give the same bits (hypot, atomics, strided V) and what they cost. Three parts:
  1. equality on K/V-sized tensors (bf16, V's transposed strides, padding, a growing histogram range);
  2. per-call time of each reduction, fused vs torch (CUDA events, median of 50);
  3. a torch.profiler table per arm over a few batches of the model (kernel time per name), floor included.

    python bench/gpu/fused_check.py --json bench/h200-fused-check.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from calib.capture import hook as observe, observers, kernels  # noqa: E402
from calib.recipe.dtypes import FP8_E4M3  # noqa: E402


def _tensors(b=4, h=8, s=2048, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = (torch.randn(b, h, s, d, device="cuda", generator=g) * 40).to(torch.bfloat16)
    v = (torch.randn(b, s, h, d, device="cuda", generator=g) * 3).to(torch.bfloat16).transpose(1, 2)
    q = (torch.randn(b, s, 4 * h, d, device="cuda", generator=g) * 10).to(torch.bfloat16).transpose(1, 2)
    mask = torch.ones(b, s, dtype=torch.bool, device="cuda")
    mask[1, s // 2:] = False
    return q, k, v, mask


def _unfused():
    class Off:
        def __enter__(self):
            os.environ["KVCALIB_FUSED"] = "0"

        def __exit__(self, *a):
            os.environ.pop("KVCALIB_FUSED", None)
    return Off()


def equality() -> dict:
    out = {}
    q, k, v, mask = _tensors()
    for name, x in (("K", k), ("V (strided)", v), ("Q (strided)", q)):
        for m in (mask, None):
            res = []
            for off in (False, True):
                amax = torch.zeros(x.shape[1], device="cuda")
                over = torch.zeros((), dtype=torch.int64, device="cuda")
                total = torch.zeros((), dtype=torch.int64, device="cuda")
                if off:
                    with _unfused():
                        kernels.absmax_(x, m, amax, over, total, 100.0)
                else:
                    kernels.absmax_(x, m, amax, over, total, 100.0)
                res.append((amax, over, total))
            out[f"absmax {name} mask={m is not None}"] = all(torch.equal(a, b) for a, b in zip(*res))
    for inter in (False, True):
        for rot in (128, 64):
            res = []
            for off in (False, True):
                p, r = torch.zeros(8, rot // 2, device="cuda"), torch.zeros(8, 128 - rot, device="cuda")
                if off:
                    with _unfused():
                        kernels.pair_max_(k, mask, rot, inter, p, r)
                else:
                    kernels.pair_max_(k, mask, rot, inter, p, r)
                res.append((p, r))
            out[f"rope pairs rot={rot} interleaved={inter}"] = all(torch.equal(a, b) for a, b in zip(*res))
            (p1, r1), (p2, r2) = res
            out[f"rope pairs rot={rot} interleaved={inter} max rel diff"] = float(((p1 - p2).abs() / p2).max())
    seq = [(v, mask), (k, None), (v * 1e-4, mask), (k * 30, mask)]
    for cls in (lambda: observers.PercentileObserver(99.99), lambda: observers.MSEObserver(FP8_E4M3)):
        fused, ref = cls(), cls()
        for x, m in seq:
            fused.update(x, m)
            with _unfused():
                ref.update(x, m)
        a, b = fused.state_dict(), ref.state_dict()
        name = type(fused).__name__
        out[f"{name} state"] = {key: bool(torch.equal(a[key], b[key])) for key in a}
        out[f"{name} sums max rel diff"] = float(((a["sums"] - b["sums"]).abs() / b["sums"].abs().clamp_min(1e-300)).max())
        out[f"{name} amax equal"] = bool(torch.equal(fused.amax(), ref.amax()))
    return out


def _time(fn, n=50) -> float:
    times = []
    for _ in range(n + 5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times[5:])


def micro() -> dict:
    """Microseconds per call for one layer's tensors (K [4, 8, 2048, 128] bf16)."""
    q, k, v, mask = _tensors()
    out = {}
    cases = {
        "K absmax+overflow": lambda: observe._LayerObservers(observe.CaptureSpec()).update(q, k, v, mask),
        "Q absmax": lambda: observers.AbsMaxObserver().update(q, mask),
        "rope_bound K": lambda: observers.RopeBoundObserver(observers.RotaryLayout(128)).update(k, mask),
        "percentile K": lambda: observers.PercentileObserver(99.99).update(k, mask),
    }
    for name, fn in cases.items():
        out[name] = {"fused_us": _time(fn)}
        with _unfused():
            out[name]["torch_us"] = _time(fn)
    persistent = observers.PercentileObserver(99.99)
    persistent.update(k, mask)
    out["percentile K (running state)"] = {"fused_us": _time(lambda: persistent.update(k, mask))}
    return out


def profile(batches: int) -> dict:
    """Kernel time by name over `batches` batches of the 8B shape, per arm (torch.profiler)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import run as bench  # bench/run.py
    from calib import pipeline
    from calib.capture import spec as spec_mod
    from calib.recipe.recipe import Recipe
    from torch.profiler import ProfilerActivity, profile as prof

    loaded = bench.build("llama-3.1-8b", torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, loaded.config.vocab_size, (4 * batches, 2048), generator=g).tolist()
    out = {}

    def floor():
        with torch.inference_mode():
            for ids, m in pipeline.batches(seqs, 4):
                loaded.model(input_ids=ids.cuda(), attention_mask=m.cuda(), use_cache=False)

    arms = {"floor": None, "absmax head + q": Recipe(granularity="head", q_scale=True),
            "rope_bound": Recipe(observer="rope_bound"), "percentile": Recipe(observer="percentile"),
            "mse": Recipe(observer="mse")}
    for name, recipe in arms.items():
        fn = floor if recipe is None else (lambda r=recipe: pipeline.observe_kv(
            loaded, seqs, 4, None, spec_mod.capture_spec(r, loaded.config), pipeline.RunOptions()))
        fn()
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
            fn()
            torch.cuda.synchronize()
        rows = sorted(p.key_averages(), key=lambda e: -e.device_time_total)
        total = sum(e.self_device_time_total for e in rows)
        out[name] = {"cuda_ms_total": total / 1000,
                     "top": [(e.key[:90], round(e.self_device_time_total / 1000, 2), e.count) for e in rows[:14]]}
        print(f"--- {name}: {total / 1000:.1f} ms of kernels", flush=True)
        for key, ms, count in out[name]["top"]:
            print(f"   {ms:9.2f} ms  {count:6d}x  {key}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile-batches", type=int, default=4)
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    res["triton"] = triton.__version__
    res["equality"] = equality()
    print(json.dumps(res["equality"], indent=1), flush=True)
    res["micro_us"] = micro()
    print(json.dumps(res["micro_us"], indent=1), flush=True)
    if args.profile_batches:
        res["profile"] = profile(args.profile_batches)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
