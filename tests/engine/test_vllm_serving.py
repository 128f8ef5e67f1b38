"""`kvcalib validate`'s serving half in real (CPU) vLLM: the default model served with `vllm serve` per arm (BF16 KV,
FP8 scale 1.0), a short sweep (1 and 2 requests in flight) by `vllm bench serve`, read by kvcalib (calib/load).
Runs inside the vLLM venv (`make engine-test`). Checked against the engine's second path where one exists: the
capacity kvcalib parsed from the start-up log against the server's own metrics page (cache_config_info), goodput
counted from the request records against the load generator's own, every request served with every token asked,
the concurrency reached within the level, every number typed and bounded. No timed assertions."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

OUTPUT_TOKENS, LEVELS = 8, (1, 2)


@pytest.fixture(scope="module")
def validated(request, tmp_path_factory):
    kvcalib = request.config.getoption("--kvcalib")
    if not kvcalib:
        pytest.skip("needs --kvcalib <kvcalib executable of the project's venv>")
    model = request.config.getoption("--eval-model")
    out = tmp_path_factory.mktemp("validate") / "v"
    args = [kvcalib, "validate", "--vllm-venv", sys.prefix, "--samples", "2", "--buckets", "128",
            "--concurrency", ",".join(map(str, LEVELS)), "--output-tokens", str(OUTPUT_TOKENS), "--max-skip", "0",
            "--passkey-trials", "0", "--no-progress", "--out", str(out)]
    args += ["--model", model] if model else []
    r = subprocess.run(args, capture_output=True, text=True, timeout=3000)
    assert r.returncode in (0, 3), r.stdout[-3000:] + r.stderr[-3000:]      # a decision either way: go 0, no-go 3
    return r, out, json.loads((out / "validate.json").read_text())


def _served(doc):
    return [c for c in doc["configs"] if all(e.get("status") == "ok" for e in c["buckets"].values())]


def test_every_arm_is_served_or_says_why(validated):
    r, out, doc = validated
    assert doc["schema"] == "kvcalib.validate/2" and doc["device"] == ("CPU" if _cpu_build() else "GPU")
    assert (out / "validate.md").is_file() and (out / "eval" / "report.json").is_file()
    ref = doc["reference"]
    assert doc["arms"][ref]["config"] is not None and _served(doc), doc["configs"]
    for name, arm in doc["arms"].items():
        if arm["decision"] == "not measured":      # an FP8 cache this CPU refuses: said, never filled in
            assert arm["why"] and arm["buckets"]["128"]["goodput"] is None
        else:
            assert arm["buckets"]["128"]["goodput"] > 0 and arm["serve_command"].startswith("vllm serve ")
    overall = doc["decision"]["overall"]
    assert overall["recommended"] in doc["arms"] and doc["arms"][overall["recommended"]]["decision"] == "recommended"
    assert f"decision: {overall['recommended']}" in r.stdout


def test_the_capacity_read_from_the_log_is_the_servers_own(validated):
    _, _, doc = validated
    for c in _served(doc):
        e = c["buckets"]["128"]
        cap, info = e["capacity"], e["cache"]
        assert cap["max_model_len"] == e["max_model_len"] and cap["requests_fit"] >= 1
        # the metrics page's cache_config_info (vLLM >= 0.24 carries the capacity among its labels)
        if "kv_cache_size_tokens" in info:
            assert int(info["kv_cache_size_tokens"]) == cap["kv_cache_tokens"]
        assert cap["requests_fit"] == math.floor(cap["max_concurrency"])
        assert int(info["num_gpu_blocks"]) * int(info["block_size"]) >= cap["kv_cache_tokens"] > 0


def test_each_level_served_every_request_with_every_token(validated):
    _, _, doc = validated
    for c in _served(doc):
        e = c["buckets"]["128"]
        assert [x["level"] for x in e["levels"]] == list(LEVELS) and e["repeat"]["status"] == "ok"
        for x in e["levels"]:
            assert x["status"] == "ok" and x["requests"] == x["completed"] == x["complete_answers"] == x["requests_sent"]
            assert x["failed"] == 0 and x["errors"] == []
            for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
                d = x[key]
                assert 0 <= d["p50"] <= d["p90"] <= d["p99"], key
            assert x["e2e_s"]["p50"] > x["ttft_s"]["p50"] > 0
            assert 0 < x["goodput"] <= x["request_throughput"]
            assert x["output_throughput"] == pytest.approx(x["request_throughput"] * OUTPUT_TOKENS)
            # goodput counted from the records, against the load generator's own count at the same SLO
            assert x["goodput"] == pytest.approx(x["generator"]["request_goodput"], rel=1e-6)
            s = x["server"]
            assert s["samples"] >= 1 and 0 <= s["max_running"] <= x["level"]
            assert s["preemptions"] == 0 and 0 <= s["max_kv_usage"] <= 1 and s["peak_memory_bytes"] > 0


def _cpu_build() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
