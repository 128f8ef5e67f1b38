"""The runner's answer (calib/engine/protocol.py's response) checked as untrusted input, in kvcalib's process.

Why apart from protocol.py: the runner imports protocol.py by file path in the engine's interpreter, where
calib is not installed; the check runs only here, so it is written on the shared typed readers
(calib/safety/readers.py, one error grammar) instead of carrying its own.

A runner runs in another interpreter, with an engine kvcalib does not control: whatever it writes is checked
here before a number of it reaches a metric. Every field has a type, a range and a size: log-probabilities
are finite and <= 0 (LOGPROB_SLACK for rounding), ids and counts are whole numbers, every list is as long as
the request makes it, texts are cut to one line. The file is not read past `response_cap(request)` bytes,
what the largest honest answer to that request can take.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from calib.engine.protocol import (ARM_RESPONSE_FIELDS, NOT_RUN, OK, OPTIONAL_ARM_RESPONSE_FIELDS,
                                   RESPONSE_FIELDS, SCALE_KINDS, ProtocolError, answer, check, not_run)
from calib.safety.readers import clean_text, fail, fields, items, number, raising, text, whole

LOGPROB_SLACK = 1e-4          # log_softmax rounding may give a hair above 0
MAX_ID = 2 ** 31 - 1
MAX_LAYERS, MAX_HEADS = 4096, 1024
MAX_COUNT = 1 << 40           # blocks, tokens, bytes a page: beyond any engine's pool
SAMPLE_FIELDS = ("target", "top_ids", "top_logprobs")
SCALE_FIELDS = ("layer", *SCALE_KINDS, *(f"{k}_float" for k in SCALE_KINDS))


def probe_formats(doc: Any) -> tuple[str, ...] | None:
    """The cache dtypes a probe answer lists (cleaned, at most 64); None when it lists none or is not a list."""
    names = doc.get("kv_cache_dtypes") if isinstance(doc, dict) else None
    if not isinstance(names, list):
        return None
    out = tuple(clean_text(n, 40) for n in names[:64] if isinstance(n, str) and n.strip())
    return out or None


def _logprob(value: Any, where: str) -> float:
    return min(number(value, where, hi=LOGPROB_SLACK), 0.0)


def _ids(value: Any, where: str, most: int) -> list[int]:
    return [whole(x, f"{where}[{i}]", 0, MAX_ID) for i, x in enumerate(items(value, where, hi=most))]


def _sample(row: Any, where: str, ids: list[int], k: int) -> dict[str, Any]:
    fields(row, where, SAMPLE_FIELDS)
    n = max(len(ids) - 1, 0)
    target = [_logprob(x, f"{where}.target[{j}]") for j, x in enumerate(items(row["target"], f"{where}.target", n))]
    top_ids, top_lps = items(row["top_ids"], f"{where}.top_ids", n), items(row["top_logprobs"], f"{where}.top_logprobs", n)
    out_ids = [_ids(top_ids[j], f"{where}.top_ids[{j}]", k) for j in range(n)]
    out_lps = [[_logprob(x, f"{where}.top_logprobs[{j}][{i}]") for i, x in
                enumerate(items(top_lps[j], f"{where}.top_logprobs[{j}]", len(out_ids[j])))] for j in range(n)]
    return {"target": target, "top_ids": out_ids, "top_logprobs": out_lps}


def _scales(doc: Any, where: str) -> dict[str, Any]:
    """A response arm's read-back scales, every value a finite number > 0."""
    rows = []
    for j, row in enumerate(items(fields(doc, where, ("layers",))["layers"], f"{where}.layers", hi=MAX_LAYERS)):
        at = f"{where}.layers[{j}]"
        out: dict[str, Any] = {"layer": whole(fields(row, at, SCALE_FIELDS)["layer"], f"{at}.layer", 0, MAX_LAYERS)}
        for kind in SCALE_KINDS:      # one scale per tensor or per KV head
            vals = items(row[kind], f"{at}.{kind}", lo=1, hi=MAX_HEADS)
            out[kind] = [number(x, f"{at}.{kind}[{i}]", 0, above=True) for i, x in enumerate(vals)]
            out[f"{kind}_float"] = number(row[f"{kind}_float"], f"{at}.{kind}_float", 0, above=True)
        rows.append(out)
    return {"layers": rows}


def _arm(doc: Any, request: dict[str, Any], where: str) -> dict[str, Any]:
    """One arm's answer, every field checked; a not_run answer keeps only its reason and names."""
    fields(doc, where, ARM_RESPONSE_FIELDS, OPTIONAL_ARM_RESPONSE_FIELDS)
    if doc["status"] not in (OK, NOT_RUN):
        fail(f"{where}.status", doc["status"], f"{OK!r} or {NOT_RUN!r}")
    engine, version = text(doc["engine"], f"{where}.engine"), text(doc["version"], f"{where}.version")
    kv_gib = whole(doc["kv_gib"], f"{where}.kv_gib")
    if doc["status"] == NOT_RUN:
        reason = text(doc["reason"], f"{where}.reason", null=True)
        return not_run(reason or "the runner gave no reason", engine, version, kv_gib)
    samples, k = request["samples"], int(request["top_k"])
    seconds = doc["seconds"]
    if not isinstance(seconds, dict) or len(seconds) > 32:
        fail(f"{where}.seconds", seconds, "an object of at most 32 timings")
    cont, pk = int(request["continuation_tokens"]), max(1, int(request["passkey_tokens"]))
    rows = items(doc["samples"], f"{where}.samples", len(samples))
    groups = {"kv_groups": kv_groups(doc["kv_groups"])} if doc.get("kv_groups") is not None else {}
    return {**groups,
        "status": OK, "reason": None, "engine": engine, "version": version,
        "kv_cache_dtype": text(doc["kv_cache_dtype"], f"{where}.kv_cache_dtype"),
        "kv_capacity_tokens": whole(doc["kv_capacity_tokens"], f"{where}.kv_capacity_tokens", 0, MAX_COUNT, null=True),
        "kv_gib": kv_gib,
        "seconds": {n: number(v, f"{where}.seconds.{n}", 0)
                    for n, v in ((clean_text(str(name), 40), v) for name, v in seconds.items())},
        "samples": [_sample(row, f"{where}.samples[{i}]", samples[i], k) for i, row in enumerate(rows)],
        "continuations": [_ids(c, f"{where}.continuations[{i}]", cont) for i, c in
                          enumerate(items(doc["continuations"], f"{where}.continuations", len(samples)))],
        "passkey": [_ids(a, f"{where}.passkey[{i}]", pk) for i, a in
                    enumerate(items(doc["passkey"], f"{where}.passkey", len(request["passkey"])))],
        "scales": None if doc["scales"] is None else _scales(doc["scales"], f"{where}.scales"),
    }


def kv_groups(doc: Any) -> dict[str, Any]:
    """The optional `kv_groups` of a response (protocol.py), every number checked (ProtocolError names the field).
    Sizes are divisors downstream (calib.model.layer_kinds.engine_requests_fit): zero is refused here, and every
    count is bounded by what any real engine holds (2^40 blocks or tokens), so a hostile answer is one line.
    size_tokens, in_flight_tokens and max_concurrency may be null: an engine version that does not keep one."""
    with raising(ProtocolError):
        if not isinstance(doc, dict):
            fail("kv_groups", doc, "an object")
        out: dict[str, Any] = {
            "max_model_len": whole(doc.get("max_model_len"), "kv_groups.max_model_len", 1, MAX_COUNT),
            "num_blocks": whole(doc.get("num_blocks"), "kv_groups.num_blocks", 0, MAX_COUNT),
            **{k: whole(doc.get(k), f"kv_groups.{k}", 0, MAX_COUNT, null=True) for k in ("size_tokens", "in_flight_tokens")},
            "max_concurrency": number(doc.get("max_concurrency"), "kv_groups.max_concurrency", 0, null=True)}
        out["groups"] = [_group(g, f"kv_groups.groups[{j}]")
                         for j, g in enumerate(items(doc.get("groups"), "kv_groups.groups", lo=1, hi=4096))]
        return out


def _group(g: Any, where: str) -> dict[str, Any]:
    if not isinstance(g, dict):
        fail(where, g, "an object")
    return {"layers": [whole(x, f"{where}.layers", 0, 100_000)
                       for x in items(g.get("layers"), f"{where}.layers", lo=1, hi=100_000)],
            "spec": text(g.get("spec"), f"{where}.spec"), "dtype": text(g.get("dtype"), f"{where}.dtype"),
            "block_size": whole(g.get("block_size"), f"{where}.block_size", 1, MAX_COUNT),
            "page_bytes": whole(g.get("page_bytes"), f"{where}.page_bytes", 1, MAX_COUNT),
            "window": whole(g.get("window"), f"{where}.window", 1, MAX_COUNT, null=True)}


def check_response(doc: Any, request: dict[str, Any]) -> dict[str, Any]:
    """The runner's response to `request`, every field checked (ProtocolError names the first bad one, as
    `arms[i].field`): one answer per request arm."""
    with raising(ProtocolError):
        doc = check(fields(doc, "response", RESPONSE_FIELDS), RESPONSE_FIELDS, "response")
        arms = items(doc["arms"], "arms", len(request["arms"]))
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
