"""The JSON exchanged between `kvcalib eval` and an engine runner script: one request, one response per engine start.

Why a file protocol and a separate interpreter: a serving engine pins its own torch, transformers and
kernels (docs/design.md §8), so it lives in its own environment and kvcalib never imports it. kvcalib
writes a request file, runs `<engine python> <runner script> REQUEST RESPONSE`, reads progress lines from
the runner's stdout while it works, then reads the response file. The runner measures and returns raw
numbers only (log-probabilities, generated token ids, cache capacity, the KV scales the engine holds); every
metric is computed in kvcalib (`calib/engine/metrics.py`), where it is tested.

One request is one engine start: `arms` share one serve configuration (model weights, KV cache dtype, skip
layers, scale layout), so they differ only in their KV scales. The runner starts the engine from the first
arm; before each following arm it sets that arm's scales on every attention layer in place and clears the
prefix cache. For every arm with `scales` it reads back what the engine holds (`scales_mismatch` compares):
an engine start costs a minute on a GPU, scales set in place cost nothing.

This module is the one home of the format: the runner imports it by file path (it runs where `calib` is
not installed), so it uses the standard library only and no relative imports. kvcalib checks the runner's
answer against it as untrusted input in calib/engine/answer.py (which runs only in kvcalib's process).

Request (one engine start):
    {"protocol": 2, "arms": [{"name", "model", "kv_cache_dtype": "auto" | "fp8" | "fp8_e5m2" | "<x>_per_token_head",
      "skip_layers": [int], "attention_backend": str (optional: the backend the format needs, e.g. TRITON_ATTN),
      "cuda_attention_backend": str (optional: the backend it needs on CUDA only, e.g. FLASHINFER for fp8_e5m2),
      "scales": null | {"layout": "tensor" | "head",            # what the engine must hold for this arm
                        "layers": [{"layer": int, "k": [float], "v": [float], "q": [float]}]}}],
     "samples": [[token ids]], "continuation_tokens": int,  # greedy tokens generated after each sample
     "passkey": [[token ids]], "passkey_tokens": int, "stop_token_ids": [int],
     "top_k": int, "kv_gib": int, "max_model_len": int, "dtype": "bfloat16", "seed": int,
     "chunk": int}                                           # prompts per engine call (they go in together)
    Every arm of a request has the same model weights, kv_cache_dtype, skip_layers and scale layout; the
    engine loads arms[0]["model"]. Scales per layer: one value per tensor, or one per KV head ("head"); q is
    the engine's query scale (per KV-head group when "head"), 1.0 where the checkpoint has none.
Response:
    {"protocol": 2, "arms": [one per request arm, in order:
      {"status": "ok" | "not_run", "reason": str | null, "engine": "vllm", "version": str,
       "kv_cache_dtype": str, "kv_capacity_tokens": int | null, "kv_gib": int, "seconds": {...},
       "samples": [{"target": [logprob of the actual next token, per position 1..n-1],
                    "top_ids": [[k ids] per position], "top_logprobs": [[k logprobs] per position]}],
       "continuations": [[generated ids]], "passkey": [[generated ids]],
       "scales": null | {"layers": [{"layer": int, "k": [float], "v": [float], "q": [float],
                                     "k_float": float, "v_float": float, "q_float": float}]}}]}
    `scales`: what the engine's attention layers held while the arm ran (their tensors and the Python
    floats some kernels read instead); null for an arm whose request carries none.
Probe (`runner --probe`, one line on stdout): {"engine": str, "version": str, "kv_cache_dtypes": [str] | null}
(the cache dtypes the engine's own config type accepts; `answer.probe_formats` reads them).
Progress lines on stdout: `{"progress": {"arm": int, "tokens": int, "samples": int, "passkey": int}}` (running
totals of the arm with that index in the request).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

PROTOCOL = 2
OK, NOT_RUN = "ok", "not_run"
PROGRESS = "progress"

REQUEST_FIELDS = ("protocol", "arms", "samples", "continuation_tokens", "passkey", "passkey_tokens",
                  "stop_token_ids", "top_k", "kv_gib", "max_model_len", "dtype", "seed", "chunk")
RESPONSE_FIELDS = ("protocol", "arms")
ARM_RESPONSE_FIELDS = ("status", "reason", "engine", "version", "kv_cache_dtype", "kv_capacity_tokens", "kv_gib",
                       "seconds", "samples", "continuations", "passkey", "scales")
SCALE_KINDS = ("k", "v", "q")
SCALE_REL = 1e-6              # float32 scales through JSON come back exact; this allows one float32 rounding
# Optional per arm: "kv_groups": {"size_tokens", "max_concurrency", "max_model_len", "num_blocks", "in_flight_tokens",
#   "groups": [{"layers": [int], "spec", "block_size", "page_bytes", "dtype", "window"}]} — the engine's capacity
#   as its hybrid cache manager counts it (vllm_capacity.kv_groups). size_tokens, max_concurrency and in_flight_tokens
#   may be null: an engine version that does not keep one still reports the groups.
OPTIONAL_ARM_RESPONSE_FIELDS = ("kv_groups",)


class ProtocolError(ValueError):
    """A request or response that does not follow this format; the message names the field."""


def check(doc: Any, fields: tuple[str, ...], what: str) -> dict[str, Any]:
    """`doc` as a dict holding every field of `fields`, at this protocol version."""
    if not isinstance(doc, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    missing = [f for f in fields if f not in doc]
    if missing:
        raise ProtocolError(f"{what}: missing field(s) {', '.join(missing)}")
    if isinstance(doc["protocol"], bool) or doc["protocol"] != PROTOCOL:
        raise ProtocolError(f"{what}: protocol {str(doc['protocol'])[:40]}, this kvcalib speaks {PROTOCOL}")
    return doc


def write(path: Path, doc: dict[str, Any]) -> None:
    """`doc` into `path` through a new sibling file (created with O_EXCL | O_NOFOLLOW: never through a link)."""
    tmp = Path(path).with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc))
    os.replace(tmp, path)


def read(path: Path, fields: tuple[str, ...], what: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ProtocolError(f"{what} {path}: {e}") from None
    return check(doc, fields, what)


def progress_line(tokens: int, samples: int, passkey: int, arm: int = 0) -> str:
    return json.dumps({PROGRESS: {"arm": arm, "tokens": tokens, "samples": samples, "passkey": passkey}})


def parse_progress(line: str) -> dict[str, int] | None:
    """The counters of a progress line; None for any other output (engine logs)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        return None
    p = doc.get(PROGRESS) if isinstance(doc, dict) else None
    if not isinstance(p, dict):
        return None
    counts = {k: p.get(k) for k in ("tokens", "samples", "passkey")}
    counts["arm"] = p.get("arm", 0)
    ok = all(type(v) is int and v >= 0 for v in counts.values())
    return counts if ok else None


def not_run(reason: str, engine: str = "", version: str = "", kv_gib: int = 0) -> dict[str, Any]:
    """One arm's answer when the engine did not (or could not) run it."""
    return {"status": NOT_RUN, "reason": reason, "engine": engine, "version": version, "kv_cache_dtype": None,
            "kv_capacity_tokens": None, "kv_gib": kv_gib, "seconds": {}, "samples": [], "continuations": [],
            "passkey": [], "scales": None}


def answer(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """The response of one engine start: one answer per request arm."""
    return {"protocol": PROTOCOL, "arms": list(arms)}


def not_run_all(reason: str, request: dict[str, Any], engine: str = "", version: str = "",
                kv_gib: int = 0) -> dict[str, Any]:
    """The response when the engine start itself failed (or the runner died): every arm not run, same reason."""
    return answer([not_run(reason, engine, version, kv_gib) for _ in request["arms"]])


def scales_mismatch(sent: dict[str, Any] | None, held: dict[str, Any] | None) -> str | None:
    """Why the engine's scales (`held`, a response arm's `scales`) are not the ones the request `sent`, in one
    line naming the first layer that differs; None when every layer holds what was sent (to SCALE_REL) and its
    Python floats are the max of its tensors (what vLLM's loader stores for kernels that read floats)."""
    if sent is None:
        return None
    if held is None:
        return "the runner read no scales back"
    have = {row["layer"]: row for row in held["layers"]}
    for row in sent["layers"]:
        i = row["layer"]
        got = have.get(i)
        if got is None:
            return f"layer {i}: the engine has no attention layer with that index"
        for kind in SCALE_KINDS:
            want, eng = row[kind], got[kind]
            if len(want) != len(eng) or any(abs(a - b) > SCALE_REL * max(abs(a), abs(b)) for a, b in zip(want, eng)):
                return f"layer {i}: sent {kind} {_values(want)}, engine holds {_values(eng)}"
            top = max(eng)
            if abs(got[f"{kind}_float"] - top) > SCALE_REL * abs(top):
                return f"layer {i}: engine's {kind} tensor holds {_values(eng)} but its {kind}_float {got[kind + '_float']!r}"
    return None


def _values(xs: list[float]) -> str:
    shown = ", ".join(f"{x:.6g}" for x in xs[:4]) + (", ..." if len(xs) > 4 else "")
    return shown if len(xs) == 1 else f"[{shown}]"
