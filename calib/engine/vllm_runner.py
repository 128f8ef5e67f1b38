"""Measure one evaluation arm in real vLLM: prompt log-probabilities, greedy continuations, passkey answers
and the KV-cache capacity, on exactly the token ids kvcalib sends.

Runs with the vLLM environment's python, never kvcalib's (docs/design.md §8): it imports nothing from
`calib` and reads the format from `protocol.py` beside it, by file path.

    <vllm venv>/bin/python vllm_runner.py REQUEST.json RESPONSE.json
    <vllm venv>/bin/python vllm_runner.py --probe            # prints {"engine": "vllm", "version": ...,
                                                             #         "kv_cache_dtypes": [...]}

Why these settings: the engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so an engine
that refuses a configuration (vLLM's CPU build refuses an FP8 cache on CPUs without AVX-512/AMX) raises
its own message here, and the arm comes back "not run: <that message>" instead of a crash or a made-up
number. The KV-cache pool is fixed (`kv_gib`: VLLM_CPU_KVCACHE_SPACE on CPU, `kv_cache_memory_bytes`
on GPUs) so capacity in tokens is comparable between KV dtypes. Prompts go in as token ids (no tokenizer
in the engine) and every sampling is greedy, so runs repeat exactly.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402  (a sibling file: this script runs outside the calib package)


def _reason(exc: BaseException) -> str:
    """The engine's own one-line message: the innermost cause that says something."""
    seen, chain = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for e in reversed(chain):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        if lines:
            return f"{type(e).__name__}: {lines[-1]}"[:400]
    return type(chain[0]).__name__


def _version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _kv_cache_dtypes() -> list[str] | None:
    """The --kv-cache-dtype values this vLLM accepts, from its own config type (`vllm/config/cache.py`
    `CacheDType`, a Literal); None when this version has no such type."""
    import typing

    try:
        from vllm.config.cache import CacheDType
    except ImportError:
        return None
    names = [str(x) for x in typing.get_args(CacheDType)]
    return names or None


def _backend_kwargs(backend: str) -> dict:
    """How this vLLM takes an attention backend: the engine argument `attention_backend` (0.32),
    `attention_config={"backend": ...}`, or else the VLLM_ATTENTION_BACKEND variable of older versions."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    if "attention_backend" in fields:
        return {"attention_backend": backend}
    if "attention_config" in fields:
        return {"attention_config": {"backend": backend}}
    os.environ["VLLM_ATTENTION_BACKEND"] = backend
    return {}


def _backends_used(llm) -> set[str]:
    """The attention backends the engine's attention layers run (empty when this version does not say)."""
    try:
        ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        return {m.attn_backend.get_name() for m in ctx.values() if hasattr(m, "attn_backend")}
    except Exception:
        return set()


def _engine(req: dict, on_cpu: bool):
    from vllm import LLM

    arm = req["arm"]
    kwargs = dict(model=arm["model"], dtype=req["dtype"], kv_cache_dtype=arm["kv_cache_dtype"],
                  max_model_len=req["max_model_len"], enforce_eager=True, seed=req["seed"], skip_tokenizer_init=True,
                  max_logprobs=max(20, req["top_k"]), max_num_seqs=max(1, req["chunk"]))
    if arm["skip_layers"]:
        kwargs["kv_cache_dtype_skip_layers"] = [str(i) for i in arm["skip_layers"]]
    if arm.get("attention_backend"):
        kwargs.update(_backend_kwargs(arm["attention_backend"]))
    if not on_cpu:
        import torch

        # a fixed pool, and a utilization the start-up check accepts while kvcalib's own copy of the model
        # still occupies part of the device
        free, total = torch.cuda.mem_get_info()
        kwargs["kv_cache_memory_bytes"] = int(req["kv_gib"]) * 2 ** 30
        kwargs["gpu_memory_utilization"] = max(0.05, min(0.9, free / total - 0.02))
    return LLM(**kwargs)


def _capacity(llm) -> tuple[int | None, str]:
    cfg = llm.llm_engine.vllm_config.cache_config
    blocks = getattr(cfg, "num_gpu_blocks", None)
    tokens = int(blocks) * int(cfg.block_size) if blocks else None
    dtype = str(cfg.cache_dtype)
    if dtype == "auto":                        # the model's dtype
        dtype = f"auto ({str(llm.llm_engine.model_config.dtype).removeprefix('torch.')})"
    return tokens, dtype


def _prompt_row(ids: list[int], plp: list, k: int) -> dict:
    """Per position 1..n-1: the logprob of the actual token and the engine's top-k (ids, logprobs)."""
    target, top_ids, top_lps = [], [], []
    for j in range(1, len(ids)):
        d = plp[j]
        target.append(float(d[ids[j]].logprob))
        top = sorted(((lp.rank, tid, float(lp.logprob)) for tid, lp in d.items() if lp.rank is not None
                      and lp.rank <= k))
        top_ids.append([t[1] for t in top])
        top_lps.append([t[2] for t in top])
    return {"target": target, "top_ids": top_ids, "top_logprobs": top_lps}


def _room(want: int, max_model_len: int, ids: list[int]) -> int:
    """Tokens to generate after `ids`: `want` (at least 1), no more than max_model_len leaves."""
    return max(1, min(max(1, want), max_model_len - len(ids)))


def measure(req: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    version = _version()
    t0 = time.perf_counter()
    try:
        llm = _engine(req, on_cpu)
    except Exception as e:                     # the engine refused this configuration: say why, do not crash
        return protocol.not_run(_reason(e), "vllm", version, req["kv_gib"])
    seconds = {"startup": time.perf_counter() - t0}
    wanted, used = req["arm"].get("attention_backend"), _backends_used(llm)
    if wanted and used and used != {wanted}:
        # vLLM's CPU platform logs "Cannot use <backend> backend on CPU" and runs its own, which computes
        # garbage for a per-token-head cache (docs/design.md §11): not this arm's format as designed
        return protocol.not_run(f"{req['arm']['kv_cache_dtype']} needs the {wanted} attention backend; this engine "
                                f"ran {', '.join(sorted(used))} instead", "vllm", version, req["kv_gib"])
    capacity, cache_dtype = _capacity(llm)
    k, chunk = int(req["top_k"]), max(1, int(req["chunk"]))
    cont, room = int(req["continuation_tokens"]), int(req["max_model_len"])

    def scoring(ids: list[int]) -> SamplingParams:
        # a sample at the model's context leaves room for fewer continuation tokens than asked (at least one)
        return SamplingParams(temperature=0.0, max_tokens=_room(cont, room, ids), prompt_logprobs=k,
                              ignore_eos=True, detokenize=False, seed=req["seed"])
    samples, continuations, tokens = [], [], 0
    t0 = time.perf_counter()
    try:
        for a in range(0, len(req["samples"]), chunk):
            group = req["samples"][a:a + chunk]
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in group],
                                [scoring(ids) for ids in group], use_tqdm=False)
            for ids, out in zip(group, outs):
                samples.append(_prompt_row(list(ids), out.prompt_logprobs, k))
                continuations.append([int(t) for t in out.outputs[0].token_ids][:cont])
                tokens += len(ids) + cont
            print(protocol.progress_line(tokens, len(samples), 0), flush=True)
        seconds["samples"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        answers = []
        def gen(ids: list[int]) -> SamplingParams:
            return SamplingParams(temperature=0.0, max_tokens=_room(int(req["passkey_tokens"]), room, ids),
                                  detokenize=False, stop_token_ids=list(req["stop_token_ids"]), seed=req["seed"])
        for a in range(0, len(req["passkey"]), chunk):
            group = req["passkey"][a:a + chunk]
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(ids)) for ids in group],
                                [gen(ids) for ids in group], use_tqdm=False)
            answers += [[int(t) for t in o.outputs[0].token_ids] for o in outs]
            tokens += sum(len(ids) + int(req["passkey_tokens"]) for ids in group)
            print(protocol.progress_line(tokens, len(samples), len(answers)), flush=True)
        seconds["passkey"] = time.perf_counter() - t0
    except Exception as e:
        return protocol.not_run(f"failed while measuring: {_reason(e)}", "vllm", version, req["kv_gib"])
    return {"protocol": protocol.PROTOCOL, "status": protocol.OK, "reason": None, "engine": "vllm",
            "version": version, "kv_cache_dtype": cache_dtype, "kv_capacity_tokens": capacity,
            "kv_gib": req["kv_gib"], "seconds": seconds, "samples": samples, "continuations": continuations,
            "passkey": answers}


def main(argv: list[str]) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"     # engine errors surface here, with their message
    if argv[:1] == ["--probe"]:
        print(json.dumps({"engine": "vllm", "version": _version(), "kv_cache_dtypes": _kv_cache_dtypes()}))
        return 0
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    req = protocol.read(Path(argv[0]), protocol.REQUEST_FIELDS, "request")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(req["kv_gib"]))   # GiB (an integer) on CPU
    protocol.write(Path(argv[1]), measure(req))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
