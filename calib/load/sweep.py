"""A load sweep of one serve configuration: per length bucket, one server start and the levels of `LoadSpec`.

Why one server per bucket: the engine logs its own capacity — requests of max_model_len its pool holds at once,
counting every KV cache group, page padding and sliding-window reservation — so starting it at the bucket's
longest request makes that number the bucket's capacity, with nothing re-derived here. Levels run back to back on
the one start; a warm-up request first (the first request compiles and fills caches). The best level (highest
goodput) is measured a second time where the spec asks: the spread of the two is this arm's run-to-run noise.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from calib.load import records, server
from calib.load.spec import LoadSpec

Log = Callable[[str], Any]
MARGIN = 16           # tokens of room over the longest prompt: re-tokenizing decoded text may add a few


@dataclass(frozen=True)
class Bucket:
    """The prompts of one length bucket as text (the load generator sends text) and their token counts."""
    bucket: int
    prompts: tuple[str, ...]
    tokens: tuple[int, ...]


def _level(venv: Path, srv: server.Server, b: Bucket, spec: LoadSpec, level: int, folder: Path, tokenizer: str,
           tag: str, timeout: float, n: int | None = None) -> dict[str, Any]:
    n = n or spec.requests(level)
    data = folder / f"{tag}-data.jsonl"
    with open(data, "w", encoding="utf-8") as f:      # the load generator's custom dataset: a line per request
        f.writelines(json.dumps({"prompt": b.prompts[k % len(b.prompts)], "output_tokens": spec.output_tokens}) + "\n"
                     for k in range(n))
    result = folder / f"{tag}-result.json"
    cmd = server.bench_argv(venv, srv, data, n, level, result, tokenizer, spec.slo_ttft_ms, spec.slo_tpot_ms)
    t0 = time.monotonic()
    with srv.watching() as watch:
        try:
            code, text = server.run_bench(cmd, folder, timeout)
        except subprocess.TimeoutExpired:
            code, text = -1, f"the load generator passed its {timeout:.0f} s deadline"
    out: dict[str, Any] = {"level": level, "requests_sent": n, "seconds": time.monotonic() - t0,
                           "server": asdict(watch)}
    if srv.proc is not None and srv.proc.poll() is not None:
        return {**out, "status": "failed", "error": f"the server died: {srv.why()}"}
    if code != 0 or not result.is_file():
        last = [ln for ln in text.splitlines() if ln.strip()][-1:] or ["no output"]
        return {**out, "status": "failed", "error": f"vllm bench serve exited {code}: {last[0][:300]}"}
    try:
        doc = json.loads(result.read_text(encoding="utf-8", errors="replace")[:256 << 20])
        reqs, duration, own = records.parse(doc, n, spec.output_tokens, srv.launch.max_model_len)
    except (ValueError, RecursionError) as e:
        return {**out, "status": "failed", "error": f"its result file: {e}"}
    slo = records.SLO(spec.slo_ttft_ms / 1000, spec.slo_tpot_ms / 1000)
    return {**out, "status": "ok", **records.summarize(reqs, duration, spec.output_tokens, slo), "generator": own}


def sweep_bucket(venv: Path, cfg: server.ServeConfig, launch: server.Launch, b: Bucket, spec: LoadSpec,
                 folder: Path, tokenizer: str, log: Log) -> dict[str, Any]:
    """One bucket's sweep on its own server start: the engine's capacity, every level, the best level and its
    repeat. A server that does not start, or a level that fails, ends the sweep with the reason; what ran is kept."""
    out: dict[str, Any] = {"bucket": b.bucket, "max_model_len": launch.max_model_len, "levels": [], "status": "ok",
                           "error": None}
    t0 = time.monotonic()
    try:
        with server.serving(venv, cfg, launch, folder) as srv:
            out.update(start_s=srv.started_s, capacity=srv.capacity, cache=srv.cache)
            fits = srv.capacity.get("requests_fit")
            log(f"validate: `{cfg.command()}` up in {srv.started_s:.0f} s; at {launch.max_model_len:,} tokens the "
                f"engine holds {fits if fits is not None else 'an unreported number of'} request(s)")
            limit = launch.timeout
            warm = _level(venv, srv, Bucket(b.bucket, b.prompts[:1], b.tokens[:1]),
                          LoadSpec(output_tokens=min(spec.output_tokens, 8)), 1, folder, tokenizer,
                          f"b{b.bucket}-warmup", limit, n=1)
            if warm["status"] != "ok":
                return {**out, "status": "failed", "error": f"warm-up: {warm['error']}"}
            spent = 0.0
            done: list[tuple[int, float]] = []
            while (level := spec.next_level(done, fits, spent)) is not None:
                row = _level(venv, srv, b, spec, level, folder, tokenizer, f"b{b.bucket}-c{level}", limit)
                spent += row["seconds"]
                out["levels"].append(row)
                if row["status"] != "ok":
                    out.update(status="failed", error=f"concurrency {level}: {row['error']}")
                    break
                log(f"validate: {cfg.command()} <= {b.bucket}: concurrency {level}: {row['request_throughput']:.3g} "
                    f"req/s, goodput {row['goodput']:.3g} req/s, TTFT p50 {1000 * row['ttft_s']['p50']:.0f} ms")
                done.append((level, row["request_throughput"]))
            ok = [r for r in out["levels"] if r["status"] == "ok"]
            if ok and spec.repeat and out["status"] == "ok":
                best = max(ok, key=lambda r: r["goodput"])
                again = _level(venv, srv, b, spec, best["level"], folder, tokenizer, f"b{b.bucket}-repeat", limit)
                out["repeat"] = again
    except server.ServerError as e:
        return {**out, "status": "failed", "error": str(e), "seconds": time.monotonic() - t0}
    out["seconds"] = time.monotonic() - t0
    out.update(best_of(out))
    return out


def best_of(entry: dict[str, Any]) -> dict[str, Any]:
    """The best goodput over a bucket's levels (the mean of the best level and its repeat), where it is reached,
    and the run-to-run noise (the two measurements' relative spread; None without a repeat)."""
    ok = [r for r in entry["levels"] if r["status"] == "ok"]
    if not ok:
        return {"best": None, "noise": None}
    best = max(ok, key=lambda r: (r["goodput"], -r["level"]))
    keys = ("goodput", "request_throughput", "output_throughput")
    rep = entry.get("repeat")
    if not (rep and rep.get("status") == "ok" and rep["level"] == best["level"]):
        return {"best": {"level": best["level"], **{k: best[k] for k in keys}}, "noise": None}
    a, b = best["goodput"], rep["goodput"]
    ta, tb = best["request_throughput"], rep["request_throughput"]
    spread = abs(a - b) / max(a, b) if max(a, b) > 0 else abs(ta - tb) / max(ta, tb, 1e-12)
    return {"best": {"level": best["level"], **{k: (best[k] + rep[k]) / 2 for k in keys}}, "noise": spread}


def sweep_config(venv: Path, cfg: server.ServeConfig, buckets: Sequence[Bucket], spec: LoadSpec,
                 base: server.Launch, context: int | None, folder: Path, tokenizer: str, log: Log) -> dict[str, Any]:
    """Every bucket's sweep for one serve configuration: {"config", "command", "buckets": {bucket: entry}}."""
    out: dict[str, Any] = {"config": cfg.command(), "flags": cfg.flags(), "buckets": {}}
    for b in buckets:
        need = max(b.tokens) + spec.output_tokens + MARGIN
        length = min(need, context) if context else need
        launch = server.Launch(length, base.kv_gib, base.dtype, base.max_num_seqs, spec.prefix_caching, base.on_cpu,
                               base.timeout)
        out["buckets"][str(b.bucket)] = sweep_bucket(venv, cfg, launch, b, spec, folder, tokenizer, log)
    return out
