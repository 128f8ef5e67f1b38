"""What an FP8 KV cache buys in GPU vLLM: capacity, time to first token, time per output token, throughput.

A Llama-3.1-8B-shaped model with random weights (vLLM's `load_format="dummy"`: only config.json is written,
no weights travel) is started once per KV dtype. Random weights give the real model's speed: every kernel
does the same work whatever the values. The scale values do not change the kernels either, so a calibrated
FP8 arm would time the same as scale 1.0 here; its quality is what `kvcalib eval --engine vllm` measures.

    python bench/gpu/serving.py --out serving.json [--kv bfloat16,fp8] [--lengths 4096,32768,131072]

Per arm: the KV-cache capacity vLLM allocated (blocks x block size, in tokens), then per prompt length one
request of random token ids with prefix caching off: time to first token and time per output token from
vLLM's own request timestamps (first_token_ts - scheduled_ts; (last_token_ts - first_token_ts) / (n - 1)),
then the largest batch of `--tp-prompt` + `--tp-output` token requests the cache holds at once (capped at
`--max-seqs`), for output tokens per second. Runs inside the vLLM environment only (imports nothing from calib).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Llama-3.1-8B's config.json (architecture fields only; values as published by the model's authors).
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "vocab_size": 128256, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def write_model(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B, indent=1))
    return folder


def random_prompt(rng: random.Random, n: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(1000, 120000) for _ in range(n)]}


def request_times(output) -> dict:
    m = output.metrics
    n = len(output.outputs[0].token_ids)
    if m is None or not getattr(m, "first_token_ts", 0):
        return {"generated": n, "metrics": None}
    ttft = m.first_token_ts - m.scheduled_ts
    tpot = (m.last_token_ts - m.first_token_ts) / (n - 1) if n > 1 else float("nan")
    return {"generated": n, "ttft_s": ttft, "tpot_s": tpot, "first_token_latency_s": m.first_token_latency}


def run_arm(model: Path, kv: str, args) -> dict:
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              kv_cache_dtype=kv, max_model_len=LLAMA_31_8B["max_position_embeddings"],
              gpu_memory_utilization=args.gpu_util, enable_prefix_caching=False, disable_log_stats=False,
              max_num_seqs=args.max_seqs, seed=0)
    start_s = time.perf_counter() - started
    cfg = llm.llm_engine.vllm_config.cache_config
    capacity = int(cfg.num_gpu_blocks) * int(cfg.block_size)
    result = {"kv_cache_dtype": kv, "engine_start_s": round(start_s, 1), "capacity_tokens": capacity,
              "num_gpu_blocks": int(cfg.num_gpu_blocks), "block_size": int(cfg.block_size),
              "cache_dtype_engine": str(cfg.cache_dtype), "latency": {}}
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True, detokenize=False)
    llm.generate([random_prompt(rng, 512)], params, use_tqdm=False)  # warm-up
    for asked in args.lengths:
        # the longest prompt must leave room for its output inside the model's 128K positions
        length = min(asked, LLAMA_31_8B["max_position_embeddings"] - args.decode_tokens - 1)
        runs = []
        for _ in range(1 if length > 65536 else args.repeats):
            t0 = time.perf_counter()
            out = llm.generate([random_prompt(rng, length)], params, use_tqdm=False)[0]
            times = request_times(out)
            times["wall_s"] = time.perf_counter() - t0
            runs.append(times)
        row = {"prompt_tokens": length, "runs": runs}
        for key in ("ttft_s", "tpot_s"):
            vals = [r[key] for r in runs if key in r]
            if vals:
                row[key] = statistics.median(vals)
        result["latency"][str(asked)] = row
        print(kv, length, {k: row.get(k) for k in ("ttft_s", "tpot_s")}, flush=True)
    per_seq = args.tp_prompt + args.tp_output
    batch = max(1, min(args.max_seqs, capacity // per_seq))
    tp_params = SamplingParams(temperature=0.0, max_tokens=args.tp_output, ignore_eos=True, detokenize=False)
    prompts = [random_prompt(rng, args.tp_prompt) for _ in range(batch)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, tp_params, use_tqdm=False)
    wall = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    result["throughput"] = {"batch": batch, "prompt_tokens": args.tp_prompt, "output_tokens": args.tp_output,
                            "wall_s": wall, "output_tokens_per_s": generated / wall,
                            "total_tokens_per_s": (generated + batch * args.tp_prompt) / wall}
    print(kv, "throughput", result["throughput"], flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--kv", default="bfloat16,fp8", help="comma list of kv_cache_dtype values, one engine each")
    p.add_argument("--lengths", default="4096,32768,131072")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp-prompt", type=int, default=2048)
    p.add_argument("--tp-output", type=int, default=256)
    p.add_argument("--max-seqs", type=int, default=1024)
    p.add_argument("--gpu-util", type=float, default=0.9)
    p.add_argument("--arm", help=argparse.SUPPRESS)  # internal: run one arm in this process
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    # no flashinfer in the trimmed install (bench/gpu/vllm_setup.sh); the engine processes inherit this
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    model = write_model(Path(tempfile.gettempdir()) / "llama31-8b-shape")
    if args.arm:
        args.out.write_text(json.dumps(run_arm(model, args.arm, args), indent=1))
        return 0
    # One process per arm: a second LLM in the same process would find the first one's memory still taken.
    import subprocess

    import torch

    report = {"model": "Llama-3.1-8B shape, random bf16 weights (load_format=dummy)",
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "arms": {}}
    for kv in args.kv.split(","):
        out = args.out.with_suffix(f".{kv}.json")
        cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--arm", kv, "--out", str(out)]
        rc = subprocess.run(cmd, env=dict(os.environ)).returncode
        report["arms"][kv] = json.loads(out.read_text()) if rc == 0 and out.is_file() else {"error": f"rc={rc}"}
    import vllm

    report["vllm"] = vllm.__version__
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({kv: {k: a.get(k) for k in ("capacity_tokens", "throughput")} for kv, a in report["arms"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
