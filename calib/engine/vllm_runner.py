"""Measure evaluation arms in real vLLM, one engine start per request: prompt log-probabilities, greedy
continuations, passkey answers, the KV-cache capacity and the KV scales the engine holds, on exactly the token
ids kvcalib sends.

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

Arms that differ only in their KV scales share one start (calib/engine/protocol.py): the engine loads the
first arm's model; before each following arm the scales are written into every attention layer in place
(`set_scales`, through `LLM.apply_model`, the same call in vLLM 0.2x and 0.3x): the tensors the CUDA
kernels read (`_k_scale`, `_v_scale`, `_q_scale`) and the Python floats the CPU kernel and some backends read
(`_k_scale_float`, ...). Then the prefix cache is cleared: passkey prompts share their filler, and a block
written under the old scales must not be read under the new ones (prefix caching stays on, as in a separate
start, so both measure the same way). What every arm ran with is read back (`read_scales`) and compared
with what kvcalib sent (`protocol.scales_mismatch`); an arm whose scales did not take is not measured.
The engine runs with enforce_eager: no CUDA graph or compiled graph has a scale baked in.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import protocol  # noqa: E402  (a sibling file: this script runs outside the calib package)
from vllm_capacity import kv_groups, pool  # noqa: E402  (likewise)


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
    return (type(chain[-1]).__name__ + _where(chain[-1]))[:400]


def _where(exc: BaseException) -> str:
    """Where a message-less exception (a bare `assert`) was raised: the innermost frame's file from the package
    root on, its line and source, so "not run" names the check that refused."""
    import traceback

    f = (traceback.extract_tb(exc.__traceback__) or [None])[-1]
    if f is None:
        return ""
    parts = Path(f.filename).parts
    root = next((i for i, p in enumerate(parts) if p in ("vllm", "flashinfer", "torch", "transformers")), -2)
    return f" at {'/'.join(parts[root:])}:{f.lineno}" + (f" ({f.line.strip()})" if f.line else "")


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


def wanted_backend(arm: dict, on_cpu: bool) -> str | None:
    """The attention backend the arm asks for on this device (protocol: `attention_backend`, or on CUDA only
    `cuda_attention_backend`); None: the engine's own choice."""
    return arm.get("attention_backend") or (None if on_cpu else arm.get("cuda_attention_backend"))


def _backends_used(llm) -> set[str]:
    """The attention backends the engine's attention layers run (empty when this version does not say)."""
    try:
        ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        return {m.attn_backend.get_name() for m in ctx.values() if hasattr(m, "attn_backend")}
    except Exception:
        return set()


def _engine(req: dict, on_cpu: bool):
    from vllm import LLM

    arm = req["arms"][0]
    kwargs = dict(model=arm["model"], dtype=req["dtype"], kv_cache_dtype=arm["kv_cache_dtype"],
                  max_model_len=req["max_model_len"], enforce_eager=True, seed=req["seed"], skip_tokenizer_init=True,
                  max_logprobs=max(20, req["top_k"]), max_num_seqs=max(1, req["chunk"]))
    if arm["skip_layers"]:
        kwargs["kv_cache_dtype_skip_layers"] = [str(i) for i in arm["skip_layers"]]
    backend = wanted_backend(arm, on_cpu)
    if backend:
        kwargs.update(_backend_kwargs(backend))
    if on_cpu:
        return LLM(**kwargs)
    import time

    import torch

    # a fixed pool, and a utilization the start-up check accepts while kvcalib's own copy of the model still
    # occupies part of the device. On a device other processes share, free memory can drop between the reading
    # and vLLM's check ("less than desired GPU memory utilization"): read it again and retry, a few times.
    kwargs["kv_cache_memory_bytes"] = int(req["kv_gib"]) * 2 ** 30
    for attempt in range(4):
        free, total = torch.cuda.mem_get_info()
        kwargs["gpu_memory_utilization"] = max(0.05, min(0.9, free / total - 0.02))
        try:
            return LLM(**kwargs)
        except ValueError as e:
            if "memory utilization" not in str(e) or attempt == 3:
                raise
            time.sleep(10 * (attempt + 1))


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


# ------------------------------------------------------------------------ scales set in place (one start)

def _attention_layers(model) -> dict:
    """{layer index: attention module} of the engine's model: modules holding KV scales, indexed by the
    number after `layers.` in their name (`model.layers.3.self_attn.attn`), as checkpoints name them."""
    import re

    out = {}
    for name, mod in model.named_modules():
        if not (hasattr(mod, "_k_scale") and hasattr(mod, "_v_scale") and hasattr(mod, "kv_cache_dtype")):
            continue
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", str(getattr(mod, "layer_name", "") or name) + ".")
        if m is not None:
            out.setdefault(int(m.group(1)), mod)
    return out


def read_scales(llm) -> dict:
    """What every attention layer holds: its k/v/q scale tensors and the floats kernels read instead."""
    def read(model):
        rows = []
        for i, mod in sorted(_attention_layers(model).items()):
            row = {"layer": i}
            for kind in protocol.SCALE_KINDS:
                row[kind] = [float(x) for x in getattr(mod, f"_{kind}_scale").detach().float().cpu().reshape(-1)]
                row[f"{kind}_float"] = float(getattr(mod, f"_{kind}_scale_float", max(row[kind])))
            rows.append(row)
        return {"layers": rows}
    return llm.apply_model(read)[0]


def set_scales(llm, scales: dict) -> None:
    """Write `scales` (a request arm's) into the engine's attention layers in place: each tensor keeps its
    shape (ValueError when the value count differs: another layout needs its own start), each float becomes
    the max over the tensor (what vLLM's loaders store), host copies are refilled where the engine has them."""
    def put(model):
        import torch

        layers = _attention_layers(model)
        for row in scales["layers"]:
            mod = layers.get(row["layer"])
            if mod is None:
                raise ValueError(f"layer {row['layer']}: the engine has no attention layer with that index")
            for kind in protocol.SCALE_KINDS:
                t, vals = getattr(mod, f"_{kind}_scale"), row[kind]
                if t.numel() != len(vals):
                    raise ValueError(f"layer {row['layer']}: the engine holds {t.numel()} {kind} scale(s), the "
                                     f"arm has {len(vals)} (another scale layout needs its own engine start)")
                with torch.no_grad():
                    t.copy_(torch.tensor(vals, dtype=t.dtype).reshape(t.shape).to(t.device))
                setattr(mod, f"_{kind}_scale_float", float(max(vals)))
                host = getattr(mod, f"_{kind}_scale_cpu", None)
                if isinstance(host, torch.Tensor):
                    host.fill_(float(max(vals)))
        return len(scales["layers"])
    llm.apply_model(put)


def switch_scales(llm, arm: dict) -> str | None:
    """Set a following arm's scales and clear the prefix cache; why not, in one line, when that fails."""
    try:
        if arm["scales"] is not None:
            set_scales(llm, arm["scales"])
        if llm.reset_prefix_cache() is False:
            return "the engine could not clear its prefix cache after setting the scales"
    except Exception as e:
        return f"setting the scales in place failed: {_reason(e)}"
    return None


# ------------------------------------------------------------------------------------------- measuring

def measure(req: dict) -> dict:
    """One engine start for every arm of `req` (protocol 2); the response."""
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()
    version = _version()
    t0 = time.perf_counter()
    try:
        llm = _engine(req, on_cpu)
    except Exception as e:                     # the engine refused this configuration: say why, do not crash
        return protocol.not_run_all(_reason(e), req, "vllm", version, req["kv_gib"])
    startup = time.perf_counter() - t0
    wanted, used = wanted_backend(req["arms"][0], on_cpu), _backends_used(llm)
    if wanted and used and used != {wanted}:
        # vLLM's CPU platform logs "Cannot use <backend> backend on CPU" and runs its own, which computes
        # garbage for a per-token-head cache (docs/design.md §11): not this arm's format as designed
        return protocol.not_run_all(f"{req['arms'][0]['kv_cache_dtype']} needs the {wanted} attention backend; "
                                    f"this engine ran {', '.join(sorted(used))} instead", req, "vllm", version,
                                    req["kv_gib"])
    capacity, cache_dtype = pool(llm)
    groups = kv_groups(llm)
    answers = []
    for j, arm in enumerate(req["arms"]):
        t0 = time.perf_counter()
        why = switch_scales(llm, arm) if j else None
        seconds = {"startup": startup} if j == 0 else {"set_scales": time.perf_counter() - t0}
        held = None
        if why is None and arm["scales"] is not None:
            try:
                held = read_scales(llm)
            except Exception as e:
                why = f"reading the scales back failed: {_reason(e)}"
            else:
                bad = protocol.scales_mismatch(arm["scales"], held)
                why = f"scales did not take ({bad})" if bad else None
        if why is not None:
            answers.append({**protocol.not_run(why, "vllm", version, req["kv_gib"]), "scales": held})
            continue
        one = measure_arm(llm, req, j, version)
        if one["status"] == protocol.OK:
            one.update(kv_cache_dtype=cache_dtype, kv_capacity_tokens=capacity, scales=held,
                       seconds={**seconds, **one["seconds"]})
            if groups:
                one["kv_groups"] = groups
        answers.append(one)
    return protocol.answer(answers)


def measure_arm(llm, req: dict, arm: int, version: str) -> dict:
    """One arm's numbers from the running engine: prompt log-probs and continuations of every sample, then
    the passkey answers; prompts go in `chunk` at a time, together."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    k, chunk = int(req["top_k"]), max(1, int(req["chunk"]))
    cont, room = int(req["continuation_tokens"]), int(req["max_model_len"])
    seconds = {}

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
            print(protocol.progress_line(tokens, len(samples), 0, arm), flush=True)
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
            print(protocol.progress_line(tokens, len(samples), len(answers), arm), flush=True)
        seconds["passkey"] = time.perf_counter() - t0
    except Exception as e:
        return protocol.not_run(f"failed while measuring: {_reason(e)}", "vllm", version, req["kv_gib"])
    return {"status": protocol.OK, "reason": None, "engine": "vllm", "version": version, "kv_cache_dtype": None,
            "kv_capacity_tokens": None, "kv_gib": req["kv_gib"], "seconds": seconds, "samples": samples,
            "continuations": continuations, "passkey": answers, "scales": None}


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
