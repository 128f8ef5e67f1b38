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
not installed), so it uses the standard library only and no relative imports.

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
(the cache dtypes the engine's own config type accepts; `probe_formats` reads them).
Progress lines on stdout: `{"progress": {"arm": int, "tokens": int, "samples": int, "passkey": int}}` (running
totals of the arm with that index in the request).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
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
MAX_LAYERS, MAX_HEADS = 4096, 1024
# Optional per arm: "kv_groups": {"size_tokens", "max_concurrency", "max_model_len", "num_blocks", "in_flight_tokens",
#   "groups": [{"layers": [int], "spec", "block_size", "page_bytes", "dtype", "window"}]} — the engine's capacity
#   as its hybrid cache manager counts it (vllm_capacity.kv_groups). size_tokens, max_concurrency and in_flight_tokens
#   may be null: an engine version that does not keep one still reports the groups.
OPTIONAL_ARM_RESPONSE_FIELDS = ("kv_groups",)
MAX_COUNT = 1 << 40          # blocks, tokens, bytes a page: beyond any engine's pool


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
        raise ProtocolError(f"{what}: protocol {_show(doc['protocol'])}, this kvcalib speaks {PROTOCOL}")
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


def probe_formats(doc: Any) -> tuple[str, ...] | None:
    """The cache dtypes a probe answer lists (cleaned, at most 64); None when it lists none or is not a list."""
    names = doc.get("kv_cache_dtypes") if isinstance(doc, dict) else None
    if not isinstance(names, list):
        return None
    out = tuple(clean_text(n, 40) for n in names[:64] if isinstance(n, str) and n.strip())
    return out or None


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


# ------------------------------------------------------------------ the runner's answer is untrusted input
#
# A runner runs in another interpreter, with an engine kvcalib does not control: whatever it writes is
# checked here before a number of it reaches a metric. Every field has a type, a range and a size: log-
# probabilities are finite and <= 0 (LOGPROB_SLACK for rounding), ids and counts are whole numbers, every
# list is as long as the request makes it, texts are cut to one line. The file is not read past
# `response_cap(request)` bytes, what the largest honest answer to that request can take.

LOGPROB_SLACK = 1e-4          # log_softmax rounding may give a hair above 0
MAX_TEXT = 400                # characters kept of a runner's text (reason, versions, dtype names)
MAX_ID = 2 ** 31 - 1


def clean_text(value: str, limit: int = MAX_TEXT) -> str:
    """One printable line: control characters become spaces, lone surrogates U+FFFD, cut to `limit`."""
    out = "".join(" " if ord(c) < 32 or ord(c) == 127 else "\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c
                  for c in value[:limit * 2])
    return " ".join(out.split())[:limit]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(value: Any, where: str, lo: int = 0, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}"
        raise ProtocolError(f"{where} = {_show(value)}: expected a whole number{bound}")
    return value


def _real(value: Any, where: str, ok: Callable[[float], bool], expected: str) -> float:
    """A finite number (never a bool) for which `ok` holds; else ProtocolError "<where> = <value>: <expected>"."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ProtocolError(f"{where} = {_show(value)}: {expected}")
    return float(value)


def _logprob(value: Any, where: str) -> float:
    return min(_real(value, where, lambda x: x <= LOGPROB_SLACK, "not a log-probability (a finite number <= 0)"), 0.0)


def _text(value: Any, where: str, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ProtocolError(f"{where} = {_show(value)}: expected a string")
    return clean_text(value)


def _list(value: Any, where: str, n: int | None = None, most: int | None = None) -> list:
    if not isinstance(value, list):
        raise ProtocolError(f"{where} = {_show(value)}: expected a list")
    if n is not None and len(value) != n:
        raise ProtocolError(f"{where} holds {len(value)} entries; the request asked for {n}")
    if most is not None and len(value) > most:
        raise ProtocolError(f"{where} holds {len(value)} entries; the request allows at most {most}")
    return value


def _ids(value: Any, where: str, most: int) -> list[int]:
    return [_whole(x, f"{where}[{i}]", 0, MAX_ID) for i, x in enumerate(_list(value, where, most=most))]


def _sample(row: Any, where: str, ids: list[int], k: int) -> dict[str, Any]:
    if not isinstance(row, dict) or set(row) != {"target", "top_ids", "top_logprobs"}:
        raise ProtocolError(f"{where}: expected an object with target, top_ids and top_logprobs, got {_show(row)}")
    n = max(len(ids) - 1, 0)
    target = [_logprob(x, f"{where}.target[{j}]") for j, x in enumerate(_list(row["target"], f"{where}.target", n))]
    top_ids, top_lps = _list(row["top_ids"], f"{where}.top_ids", n), _list(row["top_logprobs"], f"{where}.top_logprobs", n)
    out_ids, out_lps = [], []
    for j in range(n):
        ti = _ids(top_ids[j], f"{where}.top_ids[{j}]", k)
        tl = _list(top_lps[j], f"{where}.top_logprobs[{j}]", len(ti))
        out_ids.append(ti)
        out_lps.append([_logprob(x, f"{where}.top_logprobs[{j}][{i}]") for i, x in enumerate(tl)])
    return {"target": target, "top_ids": out_ids, "top_logprobs": out_lps}


def _scale(value: Any, where: str) -> float:
    return _real(value, where, lambda x: x > 0, "expected a finite scale > 0")


def _scales(doc: Any, where: str) -> dict[str, Any]:
    """A response arm's read-back scales, every value a finite number > 0."""
    if not isinstance(doc, dict) or set(doc) != {"layers"}:
        raise ProtocolError(f"{where}: expected an object with layers, got {_show(doc)}")
    rows = []
    for j, row in enumerate(_list(doc["layers"], f"{where}.layers", most=MAX_LAYERS)):
        at = f"{where}.layers[{j}]"
        want = {"layer", *SCALE_KINDS, *(f"{k}_float" for k in SCALE_KINDS)}
        if not isinstance(row, dict) or set(row) != want:
            raise ProtocolError(f"{at}: expected an object with {', '.join(sorted(want))}, got {_show(row)}")
        out: dict[str, Any] = {"layer": _whole(row["layer"], f"{at}.layer", 0, MAX_LAYERS)}
        for kind in SCALE_KINDS:
            vals = _list(row[kind], f"{at}.{kind}", most=MAX_HEADS)
            if not vals:
                raise ProtocolError(f"{at}.{kind} is empty: expected one scale per tensor or per KV head")
            out[kind] = [_scale(x, f"{at}.{kind}[{i}]") for i, x in enumerate(vals)]
            out[f"{kind}_float"] = _scale(row[f"{kind}_float"], f"{at}.{kind}_float")
        rows.append(out)
    return {"layers": rows}


def _arm(doc: Any, request: dict[str, Any], where: str) -> dict[str, Any]:
    """One arm's answer, every field checked; a not_run answer keeps only its reason and names."""
    if not isinstance(doc, dict):
        raise ProtocolError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    missing = [f for f in ARM_RESPONSE_FIELDS if f not in doc]
    if missing:
        raise ProtocolError(f"{where}: missing field(s) {', '.join(missing)}")
    extra = sorted(str(f) for f in doc if f not in ARM_RESPONSE_FIELDS + OPTIONAL_ARM_RESPONSE_FIELDS)
    if extra:
        raise ProtocolError(f"{where}: unknown field(s) {clean_text(', '.join(extra), 80)}")
    if doc["status"] not in (OK, NOT_RUN):
        raise ProtocolError(f"{where}.status = {_show(doc['status'])}: expected {OK!r} or {NOT_RUN!r}")
    engine, version = _text(doc["engine"], f"{where}.engine"), _text(doc["version"], f"{where}.version")
    kv_gib = _whole(doc["kv_gib"], f"{where}.kv_gib")
    if doc["status"] == NOT_RUN:
        reason = _text(doc["reason"], f"{where}.reason", optional=True)
        return not_run(reason or "the runner gave no reason", engine, version, kv_gib)
    samples, k = request["samples"], int(request["top_k"])
    seconds = doc["seconds"]
    if not isinstance(seconds, dict) or len(seconds) > 32:
        raise ProtocolError(f"{where}.seconds = {_show(seconds)}: expected an object of at most 32 timings")
    cont, pk = int(request["continuation_tokens"]), max(1, int(request["passkey_tokens"]))
    rows = _list(doc["samples"], f"{where}.samples", len(samples))
    groups = {"kv_groups": kv_groups(doc["kv_groups"])} if doc.get("kv_groups") is not None else {}
    return {**groups,
        "status": OK, "reason": None, "engine": engine, "version": version,
        "kv_cache_dtype": _text(doc["kv_cache_dtype"], f"{where}.kv_cache_dtype"),
        "kv_capacity_tokens": None if doc["kv_capacity_tokens"] is None
        else _whole(doc["kv_capacity_tokens"], f"{where}.kv_capacity_tokens", 0, MAX_COUNT),
        "kv_gib": kv_gib,
        "seconds": {n: _real(v, f"{where}.seconds.{n}", lambda x: x >= 0, "expected a finite number of seconds >= 0")
                    for n, v in ((clean_text(str(name), 40), v) for name, v in seconds.items())},
        "samples": [_sample(row, f"{where}.samples[{i}]", samples[i], k) for i, row in enumerate(rows)],
        "continuations": [_ids(c, f"{where}.continuations[{i}]", cont) for i, c in
                          enumerate(_list(doc["continuations"], f"{where}.continuations", len(samples)))],
        "passkey": [_ids(a, f"{where}.passkey[{i}]", pk) for i, a in
                    enumerate(_list(doc["passkey"], f"{where}.passkey", len(request["passkey"])))],
        "scales": None if doc["scales"] is None else _scales(doc["scales"], f"{where}.scales"),
    }


def kv_groups(doc: Any) -> dict[str, Any]:
    """The optional `kv_groups` of a response, every number checked (ProtocolError names the field)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("groups"), list) or not 1 <= len(doc["groups"]) <= 4096:
        raise ProtocolError("kv_groups: expected an object with a list 'groups' of 1 to 4096 groups")
    # sizes are divisors downstream (calib.model.layer_kinds.engine_requests_fit): zero is refused here, and every
    # count is bounded by what any real engine holds (2^40 blocks or tokens), so a hostile answer is one line
    out: dict[str, Any] = {"max_model_len": _whole(doc.get("max_model_len"), "kv_groups.max_model_len", 1, MAX_COUNT),
                           "num_blocks": _whole(doc.get("num_blocks"), "kv_groups.num_blocks", 0, MAX_COUNT)}
    for k in ("size_tokens", "in_flight_tokens"):      # null: this engine version does not keep it
        out[k] = None if doc.get(k) is None else _whole(doc[k], f"kv_groups.{k}", 0, MAX_COUNT)
    conc = doc.get("max_concurrency")
    out["max_concurrency"] = None if conc is None else _real(conc, "kv_groups.max_concurrency", lambda x: x >= 0,
                                                             "expected a finite number >= 0 or null")
    groups = []
    for j, g in enumerate(doc["groups"]):
        where = f"kv_groups.groups[{j}]"
        if not isinstance(g, dict) or not isinstance(g.get("layers"), list):
            raise ProtocolError(f"{where}: expected an object with a list 'layers'")
        window = g.get("window")
        if not 1 <= len(g["layers"]) <= 100_000:
            raise ProtocolError(f"{where}.layers: expected 1 to 100000 layer numbers")
        groups.append({"layers": [_whole(x, f"{where}.layers", 0, 100_000) for x in g["layers"]],
                       "spec": _text(g.get("spec"), f"{where}.spec"), "dtype": _text(g.get("dtype"), f"{where}.dtype"),
                       "block_size": _whole(g.get("block_size"), f"{where}.block_size", 1, MAX_COUNT),
                       "page_bytes": _whole(g.get("page_bytes"), f"{where}.page_bytes", 1, MAX_COUNT),
                       "window": None if window is None else _whole(window, f"{where}.window", 1, MAX_COUNT)})
    out["groups"] = groups
    return out


def check_response(doc: Any, request: dict[str, Any]) -> dict[str, Any]:
    """The runner's response to `request`, every field checked (ProtocolError names the first bad one, as
    `arms[i].field`): one answer per request arm."""
    doc = check(doc, RESPONSE_FIELDS, "response")
    extra = sorted(str(f) for f in doc if f not in RESPONSE_FIELDS)
    if extra:
        raise ProtocolError(f"response: unknown field(s) {clean_text(', '.join(extra), 80)}")
    arms = _list(doc["arms"], "arms", len(request["arms"]))
    return answer([_arm(a, request, f"arms[{i}]") for i, a in enumerate(arms)])


def response_cap(request: dict[str, Any]) -> int:
    """The most bytes an honest response to `request` takes (twice the densest JSON, plus 1 MiB): per arm and
    scored position one target and top_k (id, log-probability) pairs, the generated ids and the read-back scales."""
    k = int(request["top_k"])
    positions = sum(max(len(s) - 1, 0) for s in request["samples"])
    generated = (len(request["samples"]) * int(request["continuation_tokens"])
                 + len(request["passkey"]) * max(1, int(request["passkey_tokens"])))
    scales = sum(sum(len(row[kind]) for kind in SCALE_KINDS) + 8 for arm in request["arms"]
                 for row in ((arm.get("scales") or {}).get("layers") or []))
    per_arm = positions * (48 + 48 * k) + 24 * generated + (1 << 12)
    return (1 << 20) + 2 * (len(request["arms"]) * per_arm + 64 * scales)


def read_response(path: Path, request: dict[str, Any]) -> dict[str, Any]:
    """The checked response file (ProtocolError: too large, not JSON, or not the answer to `request`)."""
    cap = response_cap(request)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > cap:
                raise ProtocolError(f"response is {size:,} bytes, more than the {cap:,} an answer to this "
                                    "request can take")
            raw = f.read(cap + 1)
    except OSError as e:
        raise ProtocolError(f"response unreadable: {e.strerror or e}") from None
    if len(raw) > cap:
        raise ProtocolError(f"response grew past the {cap:,} bytes an answer to this request can take")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ProtocolError(f"response is not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ProtocolError(f"response is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:     # an integer of thousands of digits, nesting past the stack
        raise ProtocolError(f"response is not usable JSON ({clean_text(str(e) or type(e).__name__, 120)})") from None
    return check_response(doc, request)
