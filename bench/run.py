"""Calibration cost against its floor, on one model and one set of tokens, in one process.

Why: the floor for calibration is a forward pass of the base model over the calibration tokens; every
second above it is overhead we chose. This script times, on identical batches:
  (a) the plain base-model forward (the floor),
  (b) kvcalib's capture + scale folding for each observer / granularity / q_scale arm,
  (c) llm-compressor's KV-only FP8 `oneshot`, when it is importable (it needs its own environment),
  (d) optionally, the vLLM export of a saved checkpoint against a plain copy of its files,
and prints seconds, tokens/s, peak accelerator memory and the ratio to the floor; `--json` saves it all.

    python bench/run.py --shape tiny                      # CPU smoke run (what CI runs)
    python bench/run.py --shape llama-3.1-8b --samples 256 --seq-len 2048 --batch-size 4   # one H200
Weights are random (bf16 on a GPU): activation ranges do not matter for timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calib import model as model_mod, pipeline, scales as scales_mod  # noqa: E402
from calib.recipe import Recipe  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=4096, max_position_embeddings=4096),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6),
}
ARMS = {
    "absmax tensor": dict(),
    "absmax head": dict(granularity="head"),
    "absmax tensor + q": dict(q_scale=True),
    "absmax head + q": dict(granularity="head", q_scale=True),
    "percentile": dict(observer="percentile"),
    "mse": dict(observer="mse"),
    "rope_bound": dict(observer="rope_bound"),
}


def build(shape: str, device: torch.device) -> model_mod.LoadedModel:
    from transformers import AutoConfig, AutoModel

    spec = dict(SHAPES[shape])
    config = AutoConfig.for_model(spec.pop("model_type", "llama"), **spec)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModel.from_config(config, dtype=dtype).eval()
    return model_mod.LoadedModel(model=model, tokenizer=None, source_dir=Path("."), config=config,
                                 attention_layers=model_mod.find_attention_layers(model), device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int) -> dict:
    best, peak = float("inf"), 0.0
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device) / 2**30)
    return {"seconds": best, "peak_gib": peak}


def run_llmcompressor(loaded: model_mod.LoadedModel, seqs: list[list[int]], batch_size: int) -> None:
    """llm-compressor's KV-only FP8 calibration on the same tokens (needs llmcompressor importable)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    causal = AutoModelForCausalLM.from_config(loaded.config, dtype=loaded.dtype).to(loaded.device)
    causal.model = loaded.model
    ds = Dataset.from_dict({"input_ids": seqs, "attention_mask": [[1] * len(s) for s in seqs]})
    recipe = QuantizationModifier(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor",
                                                   "dynamic": False, "symmetric": True})
    oneshot(model=causal, dataset=ds, recipe=recipe, num_calibration_samples=len(seqs),
            max_seq_length=max(map(len, seqs)), batch_size=batch_size)


def bench_export(loaded: model_mod.LoadedModel, workdir: Path, stats) -> dict:
    """Export of a saved checkpoint vs. copying its files (weights are hard-linked on one filesystem)."""
    from calib import export

    src = workdir / "src"
    loaded.model.save_pretrained(src)
    scales = scales_mod.per_tensor_fp8(stats)
    out = {}
    t0 = time.perf_counter()
    shutil.copytree(src, workdir / "copy")
    out["copy_seconds"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    export.export_vllm(src, workdir / "export", scales, {"producer": "kvcalib-bench"})
    out["export_seconds"] = time.perf_counter() - t0
    out["checkpoint_gib"] = sum(f.stat().st_size for f in src.iterdir()) / 2**30
    out["ratio_to_copy"] = out["export_seconds"] / out["copy_seconds"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="kvcalib calibration vs. its forward-pass floor")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--model", help="time a real checkpoint instead of a random --shape")
    ap.add_argument("--data", help="with --model: calibration text (default: random token ids)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1, help="timed repetitions per arm (best is kept)")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma list of kvcalib arms")
    ap.add_argument("--also-unfused", default="", help="comma list of arms to time again with KVCALIB_FUSED=0 "
                    "(calib.reduce's torch reference instead of its kernels), in the same process")
    ap.add_argument("--device")
    ap.add_argument("--export", action="store_true", help="also time the export against a file copy")
    ap.add_argument("--workdir", type=Path, help="where --export writes (default: a temp dir)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    device = model_mod.pick_device(args.device)
    loaded = model_mod.load(args.model, device=args.device) if args.model else build(args.shape, device)
    device = loaded.device
    g = torch.Generator().manual_seed(0)
    if args.model and args.data:
        from calib import data as data_mod
        seqs = list(data_mod.samples(args.data, loaded.tokenizer, seq_len=args.seq_len, max_samples=args.samples,
                                     min_tokens=16, pack=False, seed=0, vocab_size=loaded.config.vocab_size,
                                     report=data_mod.DataReport()))
    else:
        seqs = torch.randint(0, loaded.config.vocab_size, (args.samples, args.seq_len), generator=g).tolist()
    tokens = sum(map(len, seqs))
    opts = pipeline.RunOptions()

    def floor() -> None:
        with torch.inference_mode():
            for ids, mask in pipeline.batches(seqs, args.batch_size):
                loaded.model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)

    floor()  # warm-up: kernels, allocator
    results = {"plain forward (floor)": timed(floor, device, args.repeat)}
    out: dict = {"results": results}
    stats_for_export = None

    def save() -> None:  # after every arm, so a run cut short still leaves its numbers
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))

    arms = [(n, False) for n in args.arms.split(",")] + [(n, True) for n in args.also_unfused.split(",") if n]
    for name, unfused in arms:
        recipe = Recipe(**ARMS[name])

        def arm(part: list[list[int]] = seqs) -> None:
            nonlocal stats_for_export
            stats = pipeline.observe_kv(loaded, part, args.batch_size, None,
                                        pipeline.capture_spec(recipe, loaded.config), opts).stats
            scales_mod.compute(stats, dtype=recipe.dtype, granularity=recipe.granularity)
            stats_for_export = stats
        label = f"kvcalib {name}" + (" (unfused)" if unfused else "")
        if unfused:
            os.environ["KVCALIB_FUSED"] = "0"
        try:
            arm(seqs[:args.batch_size])   # untimed: compiles the arm's kernels (Triton JIT) first
            results[label] = timed(arm, device, args.repeat)
        finally:
            os.environ.pop("KVCALIB_FUSED", None)
        print(f"{label}: {results[label]}", flush=True)
        save()
        if args.export and "export" not in out:
            with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
                out["export"] = bench_export(loaded, Path(tmp), stats_for_export)
            print(f"export: {out['export']}", flush=True)
            save()
    try:
        import llmcompressor  # noqa: F401
    except ImportError:
        results["llm-compressor oneshot"] = {"skipped": "llmcompressor not importable in this environment"}
    else:
        results["llm-compressor oneshot"] = timed(lambda: run_llmcompressor(loaded, seqs, args.batch_size), device, 1)

    floor_s = results["plain forward (floor)"]["seconds"]
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "dtype": str(loaded.dtype), "shape": args.model or args.shape,
           "samples": len(seqs),
           "seq_len": args.seq_len, "batch_size": args.batch_size, "tokens": tokens}
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(f"{'arm':<28} {'seconds':>9} {'tokens/s':>11} {'peak GiB':>9} {'x floor':>8}")
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<28} skipped: {r['skipped']}")
            continue
        r["tokens_per_s"] = tokens / r["seconds"]
        r["ratio_to_floor"] = r["seconds"] / floor_s
        print(f"{name:<28} {r['seconds']:>9.3f} {r['tokens_per_s']:>11,.0f} {r['peak_gib']:>9.2f} {r['ratio_to_floor']:>8.3f}")
    out["env"] = env
    if "export" in out:
        e = out["export"]
        print(f"export of {e['checkpoint_gib']:.2f} GiB: {e['export_seconds']:.2f} s vs copy {e['copy_seconds']:.2f} s "
              f"({e['ratio_to_copy']:.3f}x)")
    save()


if __name__ == "__main__":
    main()
