"""Calibration cost against its floor, on one model and one set of tokens, in one process.

Why: the floor for calibration is a forward pass of the base model over the calibration tokens; every
second above it is overhead we chose. This script times, on identical batches:
  (a) the plain base-model forward (the floor),
  (b) kvcalib's capture + scale folding for each observer / granularity / q_scale arm,
  (c) llm-compressor's KV-only FP8 `oneshot` (its default observer and static_minmax; `--llmc-arms`) on the
      same batches, when it is importable (its own environment: `make bench-llmc`, or on a GPU machine the
      wheels of bench/gpu/llmc_wheels.sh),
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

from calib import pipeline  # noqa: E402
from calib.capture.spec import capture_spec  # noqa: E402
from calib.model import load as model_mod  # noqa: E402
from calib.recipe.recipe import Recipe  # noqa: E402
from calib.scales import fold as scales_mod  # noqa: E402

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


# llm-compressor's KV-only FP8 arms: (observer, strategy). None is its own default (the moving-average
# "minmax" for activations in llmcompressor 0.14); "attn_head" is its per-KV-head strategy.
LLMC_ARMS = {
    "minmax (default) tensor": (None, "tensor"),
    "static_minmax tensor": ("static_minmax", "tensor"),
    "static_minmax head": ("static_minmax", "attn_head"),
    "minmax (default) head": (None, "attn_head"),
}
LLMC_DEFAULT_ARMS = "minmax (default) tensor,static_minmax tensor"
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")


def word_tokenizer(vocab_size: int):
    """A real fast tokenizer for a random-weight model: ids 0-3 are pad/bos/eos/unk, id i >= 4 is the word
    `t<i>`, split on whitespace, so text made of those words round-trips to exactly its ids. llm-compressor
    refuses a dataset without a processor, and a checkpoint saved with it loads by path in both tools."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {**{t: i for i, t in enumerate(SPECIALS)}, **{f"t{i}": i for i in range(len(SPECIALS), vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def llmc_scheme(observer: str | None, strategy: str) -> dict:
    """llm-compressor's kv_cache_scheme for static symmetric FP8 (e4m3) K and V."""
    scheme = {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}
    if observer is not None:
        scheme["observer"] = observer
    return scheme


def causal_lm(base: torch.nn.Module, config, config_dir: Path) -> torch.nn.Module:
    """`base` under a causal-LM head, as `oneshot` wants it; the config is saved to `config_dir` because
    oneshot re-reads the model's config from `config.name_or_path`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(config)
    p = next(base.parameters())
    causal.model = base
    causal.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=p.dtype, device=p.device)
    if getattr(config, "tie_word_embeddings", False):
        causal.lm_head.weight = base.embed_tokens.weight
    causal.eval()
    config.save_pretrained(config_dir)
    causal.config._name_or_path = str(config_dir)
    return causal


class RowCounter:
    """Rows (batch x positions) entering layer 0's k_proj: llm-compressor's sequential pipeline runs each
    layer twice per batch (a calibration pass with the observers, a propagation pass without), so a run on
    the same batches as kvcalib shows 2 x the padded tokens. Shapes only: no device synchronisation."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.rows = 0
        self.handle = module.register_forward_pre_hook(self._count)

    def _count(self, _module, args) -> None:
        self.rows += args[0].shape[:-1].numel()


def run_llmcompressor(causal: torch.nn.Module, batches: list[dict], tokenizer, scheme: dict) -> None:
    """llm-compressor's KV-only FP8 `oneshot` on exactly these batches (a DataLoader is used as given:
    no re-tokenizing, truncation or shuffling)."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from torch.utils.data import DataLoader

    oneshot(model=causal, processor=tokenizer, dataset=DataLoader(batches, batch_size=None, shuffle=False),
            recipe=QuantizationModifier(kv_cache_scheme=scheme), num_calibration_samples=len(batches))


def llmc_arms(loaded: model_mod.LoadedModel, seqs: list[list[int]], batch_size: int, names: list[str],
              tokenizer, results: dict, save) -> None:
    """Each llm-compressor arm on a fresh copy of the base model (oneshot rewrites the attention modules it
    calibrates), timed like the kvcalib arms; the copy is made outside the timed region."""
    import copy
    import gc

    batches = [{"input_ids": ids, "attention_mask": mask} for ids, mask in pipeline.batches(seqs, batch_size)]
    padded = sum(b["input_ids"].numel() for b in batches)
    device = loaded.device
    base_cpu = loaded.model.to("cpu")          # the kvcalib arms are done: keep the pristine weights off the device
    with tempfile.TemporaryDirectory() as config_dir:
        # untimed, as the kvcalib arms' first batch: one-time imports and set-up inside oneshot, on one batch
        warm = causal_lm(copy.deepcopy(base_cpu).to(device), loaded.config, Path(config_dir))
        run_llmcompressor(warm, batches[:1], tokenizer, llmc_scheme(*LLMC_ARMS[names[0]]))
        del warm
        for name in names:
            observer, strategy = LLMC_ARMS[name]
            causal = causal_lm(copy.deepcopy(base_cpu).to(device), loaded.config, Path(config_dir))
            counter = RowCounter(causal.model.layers[0].self_attn.k_proj)
            key = f"llm-compressor {name}"
            results[key] = timed(lambda: run_llmcompressor(causal, batches, tokenizer, llmc_scheme(observer, strategy)),
                                 device, 1)
            counter.handle.remove()
            results[key].update(observer=observer or "default", strategy=strategy, layer0_k_rows=counter.rows,
                                padded_tokens=padded)
            print(f"{key}: {results[key]}", flush=True)
            save()
            del causal
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


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
    ap.add_argument("--arms", default=",".join(ARMS), help="comma list of kvcalib arms ('' for none)")
    ap.add_argument("--llmc-arms", default=LLMC_DEFAULT_ARMS,
                    help=f"comma list of llm-compressor arms, run when llmcompressor is importable ('' for none); "
                         f"known: {', '.join(LLMC_ARMS)}")
    ap.add_argument("--also-unfused", default="", help="comma list of arms to time again with KVCALIB_FUSED=0 "
                    "(calib.capture.kernels's torch reference instead of its kernels), in the same process")
    ap.add_argument("--device")
    ap.add_argument("--export", action="store_true", help="also time the export against a file copy")
    ap.add_argument("--workdir", type=Path, help="where --export writes (default: a temp dir)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    unknown = [n for n in (args.arms + "," + args.also_unfused).split(",") if n and n not in ARMS] + \
        [n for n in args.llmc_arms.split(",") if n and n not in LLMC_ARMS]
    if unknown:
        ap.error(f"unknown arm(s) {unknown}; kvcalib: {list(ARMS)}; llm-compressor: {list(LLMC_ARMS)}")

    device = model_mod.pick_device(args.device)
    loaded = model_mod.load(args.model, device=args.device) if args.model else build(args.shape, device)
    device = loaded.device
    g = torch.Generator().manual_seed(0)
    if args.model and args.data:
        from calib.data import sources as data_mod
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
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "dtype": str(loaded.dtype), "shape": args.model or args.shape,
           "samples": len(seqs),
           "seq_len": args.seq_len, "batch_size": args.batch_size, "tokens": tokens}
    out: dict = {"results": results, "env": env}
    stats_for_export = None

    def save() -> None:  # after every arm, so a run cut short still leaves its numbers
        for r in results.values():
            if "seconds" in r:
                r["tokens_per_s"] = tokens / r["seconds"]
                r["ratio_to_floor"] = r["seconds"] / results["plain forward (floor)"]["seconds"]
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))

    arms = [(n, False) for n in args.arms.split(",") if n] + [(n, True) for n in args.also_unfused.split(",") if n]
    for name, unfused in arms:
        recipe = Recipe(**ARMS[name])

        def arm(part: list[list[int]] = seqs) -> None:
            nonlocal stats_for_export
            stats = pipeline.observe_kv(loaded, part, args.batch_size, None,
                                        capture_spec(recipe, loaded.config), opts).stats
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
    llmc = [n for n in args.llmc_arms.split(",") if n]
    if llmc:
        try:
            import llmcompressor
        except ImportError as e:
            results["llm-compressor"] = {"skipped": f"llmcompressor not importable in this environment ({e})"}
        else:
            env["llmcompressor"] = llmcompressor.__version__
            tokenizer = loaded.tokenizer or word_tokenizer(loaded.config.vocab_size)
            llmc_arms(loaded, seqs, args.batch_size, llmc, tokenizer, results, save)

    floor_s = results["plain forward (floor)"]["seconds"]
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    print(f"{'arm':<40} {'seconds':>9} {'tokens/s':>11} {'peak GiB':>9} {'x floor':>8}")
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<40} skipped: {r['skipped']}")
            continue
        r["tokens_per_s"] = tokens / r["seconds"]
        r["ratio_to_floor"] = r["seconds"] / floor_s
        print(f"{name:<40} {r['seconds']:>9.3f} {r['tokens_per_s']:>11,.0f} {r['peak_gib']:>9.2f} {r['ratio_to_floor']:>8.3f}")
    if "export" in out:
        e = out["export"]
        print(f"export of {e['checkpoint_gib']:.2f} GiB: {e['export_seconds']:.2f} s vs copy {e['copy_seconds']:.2f} s "
              f"({e['ratio_to_copy']:.3f}x)")
    save()


if __name__ == "__main__":
    main()
