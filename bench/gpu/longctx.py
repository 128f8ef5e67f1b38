"""On a CUDA machine: what an emulated FP8 arm costs against the plain bf16 forward at long context.

Why: issue 30's evaluation ran its emulated arms at a tenth of a forward's speed at 32K. This measures, per
model shape and length, one measuring pass exactly as `kvcalib eval` runs it (`calib.evaluation.measure`:
the reference forward + losses, then the arm's forward under the fake-quant hook + KL against the
reference), for three versions of the FP8 attention emulation:
  fused    - calib/evaluation/fa3_kernel.py's Triton kernel (what eval uses on CUDA);
  blockwise- the same algorithm as float32 torch blocks (KVCALIB_FUSED=0: the CPU path);
  global   - the emulation before fa3.py: calib.scales.fp8.fp8_attention (float32, one global row max).
and, per length, the largest peak memory of each pass, a torch.profiler breakdown of the fused pass by
kernel family, and the fused kernel against the float32 blockwise reference and the global-max one on one
layer's real Q/K/V (max and mean abs difference relative to max |out|).

Random weights give the real model's speed: every kernel does the same work whatever the values.

    python bench/gpu/longctx.py --json longctx.json [--cases smollm2-135m:8192x4,llama-3.1-8b:32768x1,...]
                                [--variants fused,blockwise,global] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from calib.evaluation import emulate, fa3, fa3_kernel, fakequant  # noqa: E402
from calib.evaluation.arms import Geometry, default_arm  # noqa: E402
from calib.evaluation.fakequant import fake_quant_kv  # noqa: E402
from calib.evaluation.head import Head  # noqa: E402
from calib.evaluation.measure import measure  # noqa: E402
from calib.evaluation.samples import Sample  # noqa: E402
from calib.evaluation.session import Session  # noqa: E402
from calib.model import load as model_mod  # noqa: E402
from calib.recipe.dtypes import FP8_E4M3  # noqa: E402
from calib.scales import fp8  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096),
    # the default model's architecture (SmolLM2-135M-Instruct)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5),
}


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def build(shape: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **SHAPES[shape])
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with DEV:
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def _global_fa3(module, query, k_hat, v_hat, attention_mask, arm, layer, emu, kwargs, plain):
    """The emulation before fa3.py: one global row max, float32 (calib.scales.fp8.fp8_attention)."""
    scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
    out = fp8.fp8_attention(query, k_hat.float(), v_hat.float(), scaling=float(scaling), q_scale=arm.q_scale(layer), mask=None,
                            causal=True)
    return out.to(query.dtype).contiguous()


@contextlib.contextmanager
def variant(name: str):
    old_env, old_fa3 = os.environ.get("KVCALIB_FUSED"), fakequant._fa3
    if name == "blockwise":
        os.environ["KVCALIB_FUSED"] = "0"
    if name == "global":
        fakequant._fa3 = _global_fa3
    try:
        yield
    finally:
        fakequant._fa3 = old_fa3
        if old_env is None:
            os.environ.pop("KVCALIB_FUSED", None)
        else:
            os.environ["KVCALIB_FUSED"] = old_env


def one_pass(s: Session, arm) -> dict:
    _sync()
    if DEV.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    ref, res = measure(s, [arm])
    _sync()
    wall = time.perf_counter() - t0
    r = res[arm.name]
    return {"wall_s": round(wall, 3), "reference_s": round(ref.seconds.metrics, 3),
            "arm_s": round(r.seconds.metrics, 3), "arm_over_reference": round(r.seconds.metrics / ref.seconds.metrics, 3),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2) if DEV.type == "cuda" else None,
            "ppl_change_pct": round(100 * r.summary.ppl_rel, 4),
            "kl": float(r.summary.kl)}


def profile_pass(s: Session, arm) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        measure(s, [arm])
        _sync()
    rows = []
    for e in prof.key_averages():
        cuda = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if cuda and e.device_type.name == "CUDA":
            rows.append({"kernel": e.key[:90], "cuda_ms": round(cuda / 1000, 2), "calls": e.count})
    rows.sort(key=lambda r: -r["cuda_ms"])
    return rows[:25]


def kernel_speed(lm: torch.nn.Module, length: int) -> dict:
    """One layer's attention at `length` (batch 1, causal): the fused kernel as eval calls it (codes split and
    checked, Q quantised, the launch) against torch's SDPA on the bf16 values (flash on CUDA); the first call
    also tunes the kernel for this length bucket, so it runs before the timed passes."""
    cfg = lm.config
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator(device=DEV).manual_seed(2)
    q = torch.randn(1, h, length, d, device=DEV, generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, kvh, length, d, device=DEV, generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, kvh, length, d, device=DEV, generator=g, dtype=torch.bfloat16)
    ks, vs = float(k.abs().amax()) / 448, float(v.abs().amax()) / 448
    kc = (fp8.quantize(k.float(), ks, fp8.E4M3, fp8.RNE, "divide") * ks)
    vc = (fp8.quantize(v.float(), vs, fp8.E4M3, fp8.RNE, "divide") * vs)
    t0 = time.perf_counter()
    fa3.fa3_attention(q, kc, vc, scaling=d ** -0.5, k_scale=ks, v_scale=vs)
    _sync()
    first = time.perf_counter() - t0

    def timed(fn, n=3):
        fn()
        _sync()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        _sync()
        return (time.perf_counter() - t) / n

    fused = timed(lambda: fa3.fa3_attention(q, kc, vc, scaling=d ** -0.5, k_scale=ks, v_scale=vs))
    kr, vr = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
    sdpa = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True))
    tuned = getattr(getattr(fa3_kernel, "_fa3_tuned", None), "cache", {}) or {}
    return {"length": length, "first_call_s": round(first, 3), "fused_s": round(fused, 4), "sdpa_s": round(sdpa, 4),
            "fused_over_sdpa": round(fused / sdpa, 2),
            "hw_cast": fa3_kernel.hw_cast_agrees(DEV) if DEV.type == "cuda" else None,
            "tuned": {str(k_): str(c) for k_, c in tuned.items()}}


def kernel_check(lm: torch.nn.Module, length: int) -> dict:
    """Layer 0's Q/K/V of a random sequence: fused kernel vs float32 blockwise reference vs global max."""
    cfg = lm.config
    h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    g = torch.Generator(device=DEV).manual_seed(1)
    n = min(length, 8192)
    q = (torch.randn(1, h, n, d, device=DEV, generator=g) * 2).to(torch.bfloat16)
    k = (torch.randn(1, kvh, n, d, device=DEV, generator=g) * 3)
    v = torch.randn(1, kvh, n, d, device=DEV, generator=g)
    ks, vs = k.abs().amax() / 448, v.abs().amax() / 448
    k = fp8.quantize(k, ks, fp8.E4M3, fp8.RNE, "divide") * ks
    v = fp8.quantize(v, vs, fp8.E4M3, fp8.RNE, "divide") * vs
    kw = dict(scaling=d ** -0.5, q_scale=1.0, k_scale=ks, v_scale=vs, causal=True)
    fused = fa3.fa3_attention_triton(q, k, v, **kw) if DEV.type == "cuda" else fa3.fa3_attention(q, k, v, **kw)
    ref = fa3.blockwise_reference(q, k, v, **kw)
    glob = fp8.fp8_attention(q, k, v, scaling=d ** -0.5, q_scale=1.0, causal=True).float()
    top = ref.abs().max()
    return {"tokens": n, "max_abs_out": float(top),
            "fused_vs_blockwise_max_rel": float((fused - ref).abs().max() / top),
            "fused_vs_blockwise_mean_rel": float((fused - ref).abs().mean() / top),
            "fused_vs_global_max_rel": float((fused - glob).abs().max() / top),
            "fused_vs_global_mean_rel": float((fused - glob).abs().mean() / top)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--cases", default="smollm2-135m:8192x4,llama-3.1-8b:32768x1,llama-3.1-8b:131072x1")
    ap.add_argument("--variants", default="fused,blockwise,global")
    ap.add_argument("--skip-variants-above", type=int, default=32768,
                    help="lengths above this run the fused variant only (the others are quadratic in memory/time)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "torch": torch.__version__, "cases": []}
    emu = emulate.by_name("vllm-fa3")
    models: dict[str, torch.nn.Module] = {}
    for case in args.cases.split(","):
        shape, spec = case.split(":")
        length, batch = (int(x) for x in spec.split("x"))
        if shape not in models:
            models.clear()
            if DEV.type == "cuda":
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            models[shape] = build(shape)
            print(f"{shape}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        lm = models[shape]
        g = torch.Generator().manual_seed(length)
        vocab = lm.config.vocab_size
        samples = tuple(Sample(i, tuple(torch.randint(100, vocab, (length,), generator=g).tolist()), length)
                        for i in range(batch))
        geo = Geometry.of(lm.config, model_mod.find_attention_layers(lm))
        arm = default_arm(geo, FP8_E4M3)
        row = {"shape": shape, "length": length, "batch": batch, "variants": {}}
        if DEV.type == "cuda":
            with torch.inference_mode():
                row["kernel_speed"] = kernel_speed(lm, length)
            print("kernel speed", row["kernel_speed"], flush=True)
        with fake_quant_kv(lm, emu) as hook, torch.inference_mode():
            s = Session(lm, hook, Head(lm), None, samples, (length,), batch_size=batch, failures=0)
            # warm-up: compiles, tunes, and lets SDPA pick its kernels for this length (one sample; a warm-up at
            # a shorter length left the first long call's one-time costs inside the timed pass)
            measure(replace_samples(s, samples[:1], min(length, 32768)), [arm])
            for name in args.variants.split(","):
                if name != "fused" and length > args.skip_variants_above:
                    row["variants"][name] = {"skipped": f"length > {args.skip_variants_above}"}
                    continue
                with variant(name):
                    try:
                        row["variants"][name] = one_pass(s, arm)
                    except torch.OutOfMemoryError as e:
                        row["variants"][name] = {"oom": str(e).splitlines()[0][:200]}
                        if DEV.type == "cuda":
                            torch.cuda.empty_cache()
                print(shape, length, name, row["variants"][name], flush=True)
            if args.profile:
                row["profile_fused"] = profile_pass(s, arm)
            row["kernel_check"] = kernel_check(lm, length)
            print("kernel", row["kernel_check"], flush=True)
        out["cases"].append(row)
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1)[:3000])


def replace_samples(s: Session, samples, length: int) -> Session:
    from dataclasses import replace

    cut = tuple(Sample(x.index, x.ids[:length], x.bucket) for x in samples)
    return replace(s, samples=cut, buckets=s.buckets)


if __name__ == "__main__":
    main()
