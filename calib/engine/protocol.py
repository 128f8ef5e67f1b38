"""The JSON exchanged between `kvcalib eval` and an engine runner script: one request, one response per arm.

Why a file protocol and a separate interpreter: a serving engine pins its own torch, transformers and
kernels (docs/design.md §8), so it lives in its own environment and kvcalib never imports it. kvcalib
writes a request file, runs `<engine python> <runner script> REQUEST RESPONSE`, reads progress lines from
the runner's stdout while it works, then reads the response file. The runner measures and returns raw
numbers only (log-probabilities, generated token ids, cache capacity); every metric is computed in kvcalib
(`calib/engine/metrics.py`), where it is tested.

This module is the one home of the format: the runner imports it by file path (it runs where `calib` is
not installed), so it uses the standard library only and no relative imports.

Request (one arm):
    {"protocol": 1, "arm": {"name", "model", "kv_cache_dtype": "auto" | "fp8" | "fp8_e5m2",
     "skip_layers": [int]},
     "samples": [[token ids]], "continuation_tokens": int,  # greedy tokens generated after each sample
     "passkey": [[token ids]], "passkey_tokens": int, "stop_token_ids": [int],
     "top_k": int, "kv_gib": int, "max_model_len": int, "dtype": "bfloat16", "seed": int,
     "chunk": int}                                           # samples per engine call (progress granularity)
Response:
    {"protocol": 1, "status": "ok" | "not_run", "reason": str | null, "engine": "vllm", "version": str,
     "kv_cache_dtype": str, "kv_capacity_tokens": int | null, "kv_gib": int, "seconds": {...},
     "samples": [{"target": [logprob of the actual next token, per position 1..n-1],
                  "top_ids": [[k ids] per position], "top_logprobs": [[k logprobs] per position]}],
     "continuations": [[generated ids]], "passkey": [[generated ids]]}
Progress lines on stdout: `{"progress": {"tokens": int, "samples": int, "passkey": int}}` (running totals).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PROTOCOL = 1
OK, NOT_RUN = "ok", "not_run"
PROGRESS = "progress"

REQUEST_FIELDS = ("protocol", "arm", "samples", "continuation_tokens", "passkey", "passkey_tokens",
                  "stop_token_ids", "top_k", "kv_gib", "max_model_len", "dtype", "seed", "chunk")
RESPONSE_FIELDS = ("protocol", "status", "reason", "engine", "version", "kv_cache_dtype", "kv_capacity_tokens",
                   "kv_gib", "seconds", "samples", "continuations", "passkey")


class ProtocolError(ValueError):
    """A request or response that does not follow this format; the message names the field."""


def check(doc: Any, fields: tuple[str, ...], what: str) -> dict[str, Any]:
    """`doc` as a dict holding every field of `fields`, at this protocol version."""
    if not isinstance(doc, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    missing = [f for f in fields if f not in doc]
    if missing:
        raise ProtocolError(f"{what}: missing field(s) {', '.join(missing)}")
    if doc["protocol"] != PROTOCOL:
        raise ProtocolError(f"{what}: protocol {doc['protocol']!r}, this kvcalib speaks {PROTOCOL}")
    return doc


def write(path: Path, doc: dict[str, Any]) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def read(path: Path, fields: tuple[str, ...], what: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ProtocolError(f"{what} {path}: {e}") from None
    return check(doc, fields, what)


def progress_line(tokens: int, samples: int, passkey: int) -> str:
    return json.dumps({PROGRESS: {"tokens": tokens, "samples": samples, "passkey": passkey}})


def parse_progress(line: str) -> dict[str, int] | None:
    """The counters of a progress line; None for any other output (engine logs)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        doc = json.loads(line)
    except json.JSONDecodeError:
        return None
    p = doc.get(PROGRESS) if isinstance(doc, dict) else None
    return p if isinstance(p, dict) else None


def not_run(reason: str, engine: str = "", version: str = "", kv_gib: int = 0) -> dict[str, Any]:
    """A response for an arm the engine did not (or could not) run."""
    return {"protocol": PROTOCOL, "status": NOT_RUN, "reason": reason, "engine": engine, "version": version,
            "kv_cache_dtype": None, "kv_capacity_tokens": None, "kv_gib": kv_gib, "seconds": {}, "samples": [],
            "continuations": [], "passkey": []}
