"""A stand-in engine runner for fast tests: speaks calib/engine/protocol.py, computes with transformers.

It is not vLLM: the model-dtype arm runs the model's own forward (a second code path next to the emulation's
chunked head), FP8 arms either are refused with vLLM's message on AVX2 CPUs (FAKE_ENGINE=refuse, the
default), run through kvcalib's default emulation (FAKE_ENGINE=fp8), or both: only the `default` arm is
refused (FAKE_ENGINE=refuse-default). FAKE_ENGINE=crash / hang make FP8
arms exit without an answer / never finish, to test the driver. A per-token-head cache runs kvcalib's exact
emulation of it; FAKE_DYNAMIC=garbage makes it answer nonsense instead, as CPU vLLM 0.32 does (docs/design.md
§11). The probe lists FAKE_KV_DTYPES (comma-separated) as the cache dtypes it accepts, or none. KV capacity is the pool divided by the
cache's bytes per token (layers x 2 x kv heads x head dim x element size, a skipped layer at the model dtype), as a
paged cache would hold.
A request of several arms (one engine start) is answered arm by arm; each arm's scales are read back as sent,
except with FAKE_SCALES=drop, where every arm after the first holds what the first held (scales that did not
take). Each request appends one line to FAKE_STARTS (a file), when set: the engine starts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from calib.engine import protocol  # noqa: E402

REFUSAL = "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."


def measure(req: dict) -> dict:
    if os.environ.get("FAKE_STARTS"):
        with open(os.environ["FAKE_STARTS"], "a") as f:
            f.write(" + ".join(a["name"] for a in req["arms"]) + "\n")
    answers = []
    for j, arm in enumerate(req["arms"]):
        one = measure_arm(req, arm, j)
        if one["status"] == protocol.OK and arm["scales"] is not None:
            first = req["arms"][0]["scales"]
            held = first if os.environ.get("FAKE_SCALES") == "drop" and j and first else arm["scales"]
            one["scales"] = {"layers": [{**{k: row[k] for k in ("layer", "k", "v", "q")},
                                         **{f"{k}_float": max(row[k]) for k in ("k", "v", "q")}}
                                        for row in held["layers"]]}
        answers.append(one)
    return protocol.answer(answers)


def measure_arm(req: dict, arm: dict, j: int = 0) -> dict:
    mode = os.environ.get("FAKE_ENGINE", "refuse")
    fp8 = arm["kv_cache_dtype"] != "auto"
    if fp8 and (mode == "refuse" or mode == "refuse-default" and arm["name"] == "default"):
        return protocol.not_run(REFUSAL, "vllm", "0.0-fake", req["kv_gib"])
    if fp8 and mode == "crash":
        print("RuntimeError: fake engine crashed", file=sys.stderr)
        sys.exit(3)
    if fp8 and mode == "hang":
        time.sleep(3600)
    longest = max((len(ids) for ids in req["samples"] + req["passkey"]), default=0)
    if longest >= req["max_model_len"]:         # vLLM's input check: a prompt must leave room for one token
        return protocol.not_run(f"VLLMValidationError: The decoder prompt (length {longest}) plus the number of "
                                f"requested output tokens (at least 1) is longer than the maximum model length of "
                                f"{req['max_model_len']}.", "vllm", "0.0-fake", req["kv_gib"])
    import torch

    from calib.evaluation import emulate, passkey
    from calib.evaluation.arms import Geometry, checkpoint_arms, default_arm, format_arms
    from calib.evaluation.fakequant import fake_quant_kv
    from calib.evaluation.run import load_causal_lm
    from calib.recipe.dtypes import kv_dtype

    t0 = time.perf_counter()
    loaded = load_causal_lm(arm["model"], "cpu")
    lm, config = loaded.model, loaded.config
    geo = Geometry.of(config, loaded.attention_layers)
    q, skipped = None, set()
    dynamic = arm["kv_cache_dtype"].endswith("_per_token_head")
    if dynamic or arm["kv_cache_dtype"] == "fp8_e5m2":       # the whole-format arms: their names are vLLM's
        q = format_arms(geo, [arm["kv_cache_dtype"]])[0]
    elif fp8:
        dtype = kv_dtype("fp8_e4m3")
        kv_info = Path(arm["model"], "kvcalib.json")
        q = checkpoint_arms(arm["model"], geo)[0] if kv_info.is_file() else default_arm(geo, dtype)
        if arm["skip_layers"]:       # indices, or vLLM's "sliding_window" (every layer with a sliding window)
            from calib.model.layer_kinds import layer_kinds

            sliding = layer_kinds(config).sliding if "sliding_window" in arm["skip_layers"] else ()
            skipped = {*sliding, *(i for i in arm["skip_layers"] if not isinstance(i, str))}
            q = q.skipping(sorted(skipped))
    k, cont = req["top_k"], req["continuation_tokens"]
    samples, continuations, answers, tokens = [], [], [], 0
    with fake_quant_kv(lm, emulate.by_name(emulate.DEFAULT)) as hook, torch.inference_mode(), hook.applying(q):
        for ids in req["samples"]:
            logits = lm(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
            if dynamic and os.environ.get("FAKE_DYNAMIC") == "garbage":
                logits = torch.zeros_like(logits)
                logits[:, 0] = 60.0                        # always token 0, sure of it: e^60 perplexity
            lp = torch.log_softmax(logits, -1)[:-1]
            top = lp.topk(k, dim=-1)
            samples.append({"target": lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(),
                            "top_ids": top.indices.tolist(), "top_logprobs": top.values.tolist()})
            room = min(cont, req["max_model_len"] - len(ids))      # vLLM stops at max_model_len
            continuations.append(passkey.greedy(lm, ids, max_new_tokens=room) if cont else [])
            tokens += len(ids) + cont
            print(protocol.progress_line(tokens, len(samples), 0, j), flush=True)
        stop = req["stop_token_ids"][0] if req["stop_token_ids"] else None
        for ids in req["passkey"]:
            answers.append(passkey.greedy(lm, ids, max_new_tokens=req["passkey_tokens"], eos_id=stop))
            tokens += len(ids) + req["passkey_tokens"]
            print(protocol.progress_line(tokens, len(samples), len(answers), j), flush=True)
    from calib.recipe.dtypes import kv_format

    wide = 2 * geo.kv_heads * geo.head_dim * (torch.finfo(loaded.dtype).bits // 8)
    narrow = kv_format(arm["kv_cache_dtype"], "vllm").bytes_per_token(geo.kv_heads, geo.head_dim) if fp8 else wide
    per_token = int(sum(wide if i in skipped else narrow for i in geo.layers))    # skipped layers: model dtype
    capacity = req["kv_gib"] * 2 ** 30 // per_token // 16 * 16
    return {"status": protocol.OK, "reason": None, "engine": "vllm", "scales": None,
            "version": "0.0-fake", "kv_cache_dtype": arm["kv_cache_dtype"], "kv_capacity_tokens": capacity,
            "kv_gib": req["kv_gib"], "seconds": {"all": time.perf_counter() - t0}, "samples": samples,
            "continuations": continuations, "passkey": answers}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"]:
        if os.environ.get("FAKE_ENGINE") == "missing":
            print("ModuleNotFoundError: No module named 'vllm'", file=sys.stderr)
            return 1
        listed = [n for n in os.environ.get("FAKE_KV_DTYPES", "").split(",") if n] or None
        print(json.dumps({"engine": "vllm", "version": "0.0-fake", "kv_cache_dtypes": listed}))
        return 0
    req = protocol.read(Path(argv[0]), protocol.REQUEST_FIELDS, "request")
    protocol.write(Path(argv[1]), measure(req))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
