"""Perplexity in real vLLM on exact token ids (prompt logprobs), with a BF16 or FP8 KV cache, and optionally with
an emulated FP8 cache write injected into vLLM's own BF16 cache path.

Runs in the vLLM venv (not kvcalib's): `VLLM_VENV/bin/python bench/vllm_ppl.py --model M --ids ids.json --out r.json`.
`ids.json` holds a list of token-id lists; every position after the first is scored with the logprob vLLM
assigns to the actual next token (SamplingParams(prompt_logprobs=0)), so the number is comparable token for
token with `kvcalib eval` on the same ids.

Runs, in one engine start each (prefix caching off, so no run reuses another's cache):
- `--kv-cache-dtype auto` (the model dtype), then each `--inject MODE`: the same engine, but every K and V
  written to the cache first goes through MODE's FP8 cache write (`calib/evaluation/emulate.py`, `calib/scales/fp8.py`) and back
  to BF16. The rest — RoPE, attention kernel, chunked prefill — is vLLM's own, so the difference from the `auto`
  run isolates the cache rounding. Exact for scale 1.0 (every e4m3 value is a BF16 value); on vLLM's CPU build
  the FP8 path dequantises exactly and scales in float32, so this is its arithmetic up to float32 rounding order.
- `--kv-cache-dtype fp8` (or fp8_e5m2): the engine's own FP8 cache. vLLM's CPU build needs AVX-512 or AMX for it;
  elsewhere the run records the engine's refusal instead of a number.

Output JSON: {"vllm": version, "runs": [{"kv_cache_dtype", "inject", "ppl", "nll", "tokens", "seconds"} or
{"kv_cache_dtype", "error"}]}. Injection needs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, set here).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")     # engine core in this process: injection reaches it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def _injector(mode_name: str):
    """A replacement for vLLM's `cpu_attn_reshape_and_cache` that rounds K and V through `mode_name`'s cache write."""
    sys.path.insert(0, str(ROOT))
    import torch

    from calib.evaluation import emulate
    from calib.scales import fp8            # torch-only modules: the arithmetic under test, from its one home
    from vllm import _custom_ops as ops

    mode = emulate.by_name(mode_name)
    original = ops.cpu_attn_reshape_and_cache

    def write(key, value, key_cache, value_cache, slot_mapping, isa, k_scale=1.0, v_scale=1.0,
              kv_cache_dtype="auto"):
        if state["on"]:
            key = (fp8.cache_write(key, k_scale, mode.k.rounding, mode.k.scale_op) * k_scale).to(key.dtype)
            value = (fp8.cache_write(value, v_scale, mode.v.rounding, mode.v.scale_op) * v_scale).to(value.dtype)
        return original(key, value, key_cache, value_cache, slot_mapping, isa, k_scale=k_scale, v_scale=v_scale,
                        kv_cache_dtype=kv_cache_dtype)

    state = {"on": False}
    return state, write, torch


def score(llm, ids: list[list[int]]) -> tuple[float, int]:
    """(sum of -log p(actual next token), number of scored tokens) over every sample."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in ids], params, use_tqdm=False)
    nll, n = 0.0, 0
    for s, out in zip(ids, outs):
        for pos, entry in enumerate(out.prompt_logprobs):
            if pos == 0:
                continue
            nll -= entry[s[pos]].logprob
            n += 1
    return nll, n


def _engine(model: str, kv: str, max_len: int):
    from vllm import LLM

    return LLM(model=model, dtype="bfloat16", kv_cache_dtype=kv, max_model_len=max_len, enforce_eager=True,
               enable_prefix_caching=False, seed=0, max_num_seqs=8, skip_tokenizer_init=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True, help="JSON file: a list of token-id lists")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-cache-dtype", action="append", default=None,
                    help="auto, fp8, fp8_e5m2; repeatable (default: auto and fp8)")
    ap.add_argument("--inject", action="append", default=[],
                    help="emulation mode whose cache write is injected into the auto run; repeatable")
    a = ap.parse_args(argv)
    import vllm

    ids = json.loads(Path(a.ids).read_text())
    max_len = max(len(s) for s in ids) + 8
    runs = []
    for kv in a.kv_cache_dtype or ["auto", "fp8"]:
        try:
            t0 = time.perf_counter()
            injections = [(None, None)]
            if kv == "auto" and a.inject:
                from vllm import _custom_ops as ops
                for name in a.inject:
                    state, write, _ = _injector(name)
                    injections.append((name, state))
                    ops.cpu_attn_reshape_and_cache = write   # each wraps the previous; only one is on at a time
            llm = _engine(a.model, kv, max_len)
            for name, state in injections:
                for _, st in injections[1:]:
                    st["on"] = st is state
                t1 = time.perf_counter()
                nll, n = score(llm, ids)
                runs.append({"kv_cache_dtype": kv, "inject": name, "ppl": math.exp(nll / n), "nll": nll, "tokens": n,
                             "seconds": time.perf_counter() - t1})
                print(json.dumps(runs[-1]), flush=True)
            del llm
            runs[-1]["engine_seconds"] = time.perf_counter() - t0
        except Exception as e:          # the engine refused this cache dtype here: record why, go on
            msg = f"{type(e).__name__}: {e}".splitlines()[0]
            runs.append({"kv_cache_dtype": kv, "error": msg})
            print(json.dumps(runs[-1]), flush=True)
    Path(a.out).write_text(json.dumps({"vllm": vllm.__version__, "model": a.model, "samples": len(ids),
                                       "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
