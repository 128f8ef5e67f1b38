"""Serving speed of one engine configuration, from the raw per-token timestamps its runner recorded.

Why here and not in the runner: the runner (calib/engine/vllm_runner.py) drives the engine loop itself and
returns only what it saw — when each request was added and when each of its tokens came out of an engine
step, how many requests the scheduler ran at once, the engine's preemption count, peak memory — and every
metric is computed here, where it is tested against brute force. The definitions are vLLM bench serve's:

- TTFT: first token time - the time the request was added (queueing and prefill included);
- TPOT: per request, (last token time - first token time) / (output tokens - 1): the first token excluded;
- ITL: every gap between two consecutive tokens of one request (tokens of one step share its time stamp);
- E2E: last token time - the time the request was added;
- throughput: completed requests and output tokens over the run's wall time (first add to last token),
  at a closed-loop concurrency of C (C requests in flight; a finished one is replaced at once).

Percentiles interpolate linearly between order statistics (numpy's default). Speed depends on the serve
configuration (KV dtype, skip layers, backend), not on the scale values (the kernels are the same), so it is
measured once per configuration (`config_key`) and arms that share one say so.

The runner's answer is untrusted input: `check` bounds every field before a number reaches a metric.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from calib.engine import support
from calib.errors import KvcalibError
from calib.model.layer_kinds import engine_requests_fit

PERCENTILES = (50, 90, 99)
MAX_TEXT = 400


class ServingError(KvcalibError, ValueError):
    """A serving answer that does not fit its request; the message names the field."""


@dataclass(frozen=True)
class ServingSpec:
    """The serving phase of an engine run: `concurrency` requests in flight (closed loop), each asking for
    exactly `output_tokens` tokens (end-of-sequence ignored), at least `requests` requests per bucket (the
    bucket's prompts repeated in order when it has fewer; prefix caching is off, so a repeat is no cheaper)."""
    concurrency: int = 4
    output_tokens: int = 32
    requests: int = 0              # 0: max(prompts in the bucket, 2 x concurrency)

    def problems(self) -> list[str]:
        out = []
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            out.append(f"--concurrency {self.concurrency}: give a whole number >= 1 (requests kept in flight)")
        if isinstance(self.output_tokens, bool) or not isinstance(self.output_tokens, int) or self.output_tokens < 2:
            out.append(f"--output-tokens {self.output_tokens}: give a whole number >= 2 (TPOT excludes the first "
                       "token, so one token measures no decoding)")
        if isinstance(self.requests, bool) or not isinstance(self.requests, int) or self.requests < 0:
            out.append(f"--requests {self.requests}: give a whole number >= 0 (0: twice the concurrency)")
        return out


def config_key(arm_spec: dict[str, Any]) -> str:
    """What speed depends on, from a runner arm spec: the KV dtype and the layers kept in the model dtype (numbers
    and kind names, `support.skip_order`: one key per set)."""
    skip = ",".join(map(str, support.skip_order(arm_spec.get("skip_layers") or [])))
    return f"kv={arm_spec['kv_cache_dtype']} skip=[{skip}]"


def request_field(spec: ServingSpec, buckets: Sequence[int], sample_buckets: Sequence[int]) -> dict[str, Any]:
    """The request's "serving" field: per bucket the indices of its samples (the prompts, already in the request)."""
    groups = [{"bucket": int(b), "samples": [i for i, sb in enumerate(sample_buckets) if sb == b]} for b in buckets]
    groups = [g for g in groups if g["samples"]]
    for g in groups:
        want = spec.requests or max(len(g["samples"]), 2 * spec.concurrency)
        g["requests"] = max(want, len(g["samples"]))
    return {"concurrency": spec.concurrency, "output_tokens": spec.output_tokens, "groups": groups}


# --------------------------------------------------------------------------------------- checking the answer

def _num(v: Any, where: str, lo: float = 0.0) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
        raise ServingError(f"serving.{where} = {str(v)[:40]}: expected a finite number >= {lo:g}")
    return float(v)


def _int(v: Any, where: str, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (hi is not None and v > hi):
        raise ServingError(f"serving.{where} = {str(v)[:40]}: expected a whole number in [0, {hi}]"
                           if hi is not None else f"serving.{where} = {str(v)[:40]}: expected a whole number >= 0")
    return v


def _opt(v: Any, conv, where: str):
    return None if v is None else conv(v, where)


def _text(v: Any, where: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str):
        raise ServingError(f"serving.{where}: expected a string")
    return " ".join("".join(c if c.isprintable() else " " for c in v[:MAX_TEXT]).split())


def check(raw: Any, field: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """The runner's serving answer to the request's `field`, every field bounded (ServingError otherwise)."""
    if not isinstance(raw, dict):
        raise ServingError("serving: expected an object")
    out = {"error": _text(raw.get("error"), "error"), "oom": bool(raw.get("oom", False)),
           "device": _text(raw.get("device"), "device") or "unknown",
           "on_cpu": bool(raw.get("on_cpu", False)),
           "peak_memory_bytes": _opt(raw.get("peak_memory_bytes"), _int, "peak_memory_bytes"),
           "memory_kind": _text(raw.get("memory_kind"), "memory_kind"),
           "preemptions": _opt(raw.get("preemptions"), _int, "preemptions"),
           "preemptions_source": _text(raw.get("preemptions_source"), "preemptions_source"),
           "max_num_seqs": _opt(raw.get("max_num_seqs"), _int, "max_num_seqs"),
           "groups": []}
    groups = raw.get("groups", [])
    if not isinstance(groups, list) or len(groups) > len(field["groups"]):
        raise ServingError(f"serving.groups: expected at most {len(field['groups'])} groups")
    n_out = int(field["output_tokens"])
    for gi, (g, asked) in enumerate(zip(groups, field["groups"])):
        where = f"groups[{gi}]"
        if not isinstance(g, dict) or not isinstance(g.get("requests"), list):
            raise ServingError(f"serving.{where}: expected an object with a requests list")
        if len(g["requests"]) > asked["requests"]:
            raise ServingError(f"serving.{where}.requests holds {len(g['requests'])}; asked {asked['requests']}")
        reqs = []
        for ri, r in enumerate(g["requests"]):
            w = f"{where}.requests[{ri}]"
            if not isinstance(r, dict) or not isinstance(r.get("token_times"), list) or len(r["token_times"]) > n_out:
                raise ServingError(f"serving.{w}: expected an object with at most {n_out} token_times")
            added = _num(r.get("added"), f"{w}.added")
            times = [_num(t, f"{w}.token_times[{k}]") for k, t in enumerate(r["token_times"])]
            if any(b < a for a, b in zip([added] + times, times)):
                raise ServingError(f"serving.{w}.token_times: not in order after the request was added")
            reqs.append({"added": added, "token_times": times,
                         "prompt_tokens": _int(r.get("prompt_tokens"), f"{w}.prompt_tokens", max_model_len),
                         "preemptions": _opt(r.get("preemptions"), _int, f"{w}.preemptions")})
        out["groups"].append({"bucket": int(asked["bucket"]), "requests": reqs,
                              "max_running": _opt(g.get("max_running"), _int, f"{where}.max_running")})
    return out


# --------------------------------------------------------------------------------------------- the metrics

def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear interpolation between order statistics; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean and p50 / p90 / p99 of `values` (seconds), None where there is nothing to measure."""
    out: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    out.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return out


def request_times(added: float, times: Sequence[float]) -> dict[str, Any]:
    """One request's TTFT, TPOT (None with fewer than two tokens), ITLs and end-to-end latency."""
    if not times:
        return {"ttft": None, "tpot": None, "itl": [], "e2e": None}
    return {"ttft": times[0] - added, "tpot": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
            "itl": [b - a for a, b in zip(times, times[1:])], "e2e": times[-1] - added}


def group_summary(group: dict[str, Any], concurrency: int, output_tokens: int,
                  capacity: int | None, kv_groups: dict[str, Any] | None = None) -> dict[str, Any]:
    """One bucket's serving numbers from its checked raw requests. The largest batch is the engine's own count
    where it reported its KV cache groups (`layer_kinds.engine_requests_fit`: on a hybrid model the pool in tokens
    counts one group's blocks, so the pool over the request's tokens overstates it several times), else the pool
    over the request's tokens."""
    reqs = group["requests"]
    per = [request_times(r["added"], r["token_times"]) for r in reqs]
    done = [r for r in reqs if len(r["token_times"]) == output_tokens]
    generated = sum(len(r["token_times"]) for r in reqs)
    ends = [r["token_times"][-1] for r in reqs if r["token_times"]]
    wall = (max(ends) - min(r["added"] for r in reqs)) if ends else None
    per_request_tokens = max((r["prompt_tokens"] for r in reqs), default=0) + output_tokens
    pre = [r["preemptions"] for r in reqs]
    return {
        "bucket": group["bucket"], "requests": len(reqs), "completed": len(done), "concurrency": concurrency,
        "prompt_tokens": max((r["prompt_tokens"] for r in reqs), default=0),
        "output_tokens_asked": output_tokens * len(reqs), "output_tokens": generated,
        "ttft_s": distribution([p["ttft"] for p in per if p["ttft"] is not None]),
        "tpot_s": distribution([p["tpot"] for p in per if p["tpot"] is not None]),
        "itl_s": distribution([x for p in per for x in p["itl"]]),
        "e2e_s": distribution([p["e2e"] for p in per if p["e2e"] is not None]),
        "wall_s": wall,
        "request_throughput": len(done) / wall if wall else None,
        "output_throughput": generated / wall if wall else None,
        "largest_batch_fits": _fits(capacity, kv_groups, per_request_tokens),
        "per_request_tokens": per_request_tokens,
        "max_running": group["max_running"],
        "request_preemptions": None if any(p is None for p in pre) or not pre else sum(pre),
    }


def _fits(capacity: int | None, kv_groups: dict[str, Any] | None, tokens: int) -> int | None:
    if not tokens:
        return None
    if kv_groups:
        return engine_requests_fit(kv_groups, tokens)
    return capacity // tokens if capacity else None


def summarize(checked: dict[str, Any], field: dict[str, Any], capacity: int | None,
              kv_groups: dict[str, Any] | None = None) -> dict[str, Any]:
    """The serving entry of one engine run: per bucket (`group_summary`) plus the run's memory, preemptions,
    errors and whether it ran on a CPU (its numbers are then CPU numbers and say so). `kv_capacity_tokens` is the
    pool (blocks x block size); `kv_context_tokens` the engine's own capacity in context tokens at
    `kv_context_max_model_len` where it reported its cache groups (on a hybrid model far below the pool)."""
    c, n = int(field["concurrency"]), int(field["output_tokens"])
    buckets = {str(g["bucket"]): group_summary(g, c, n, capacity, kv_groups) for g in checked["groups"]}
    pre = checked["preemptions"]
    if pre is None:                         # the engine's counter absent: the per-request counts, if every bucket has them
        per = [b["request_preemptions"] for b in buckets.values()]
        pre = sum(per) if per and None not in per else None
    missing = [b for b, g in buckets.items() if g["completed"] < g["requests"]]
    return {"status": "ok" if checked["error"] is None and len(buckets) == len(field["groups"]) else "failed",
            "error": checked["error"], "oom": checked["oom"], "device": checked["device"],
            "on_cpu": checked["on_cpu"], "label": "CPU" if checked["on_cpu"] else "GPU",
            "concurrency": c, "output_tokens": n, "kv_capacity_tokens": capacity,
            "kv_context_tokens": (kv_groups or {}).get("size_tokens"),
            "kv_context_max_model_len": (kv_groups or {}).get("max_model_len"),
            "peak_memory_bytes": checked["peak_memory_bytes"], "memory_kind": checked["memory_kind"],
            "preemptions": pre, "preemptions_source": checked["preemptions_source"] if pre is not None
            else "not reported by this vLLM", "max_num_seqs": checked["max_num_seqs"],
            "incomplete_buckets": missing, "buckets": buckets}


def speed_ok(entry: dict[str, Any] | None) -> tuple[bool | None, str]:
    """The speed half of go / no-go: (True, why) when the run served every request with every token asked and
    no OOM or preemption at its concurrency; (False, why) otherwise; (None, why) when nothing was measured."""
    if not entry or entry.get("status") is None:
        return None, "no serving measurement"
    if entry.get("oom"):
        return False, f"out of memory at concurrency {entry['concurrency']}: {entry.get('error')}"
    if entry["status"] != "ok":
        return False, f"serving failed: {entry.get('error') or 'not every bucket ran'}"
    if entry["incomplete_buckets"]:
        return False, f"requests ended short of {entry['output_tokens']} tokens in buckets {entry['incomplete_buckets']}"
    if entry["preemptions"] is None:
        return True, "no OOM; preemptions not reported by this vLLM"
    if entry["preemptions"] > 0:
        return False, f"{entry['preemptions']} preemption(s) at concurrency {entry['concurrency']}"
    return True, f"no preemption or OOM at concurrency {entry['concurrency']}"
