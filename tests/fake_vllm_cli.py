"""A stand-in for vLLM's `serve` and `bench serve` (calib/load/server.py runs it through KVCALIB_VLLM_CLI), for fast
tests of `kvcalib validate`'s serving half without an engine.

It is not vLLM. `serve` logs the capacity lines vLLM logs (pool bytes over FAKE_BYTES_PER_TOKEN for a model-dtype
cache, half for FP8; a skipped layer list costs a quarter of the saving back) and answers /health, /metrics and
/fake (its capacity, for the fake load generator). `bench serve` simulates a server on a clock: requests run in
waves of min(concurrency, requests the pool holds); a wave prefills then decodes, a step slower with a bigger
batch and 5 % slower with an FP8 cache; requests beyond the batch queue inside the server. It writes the result
file `vllm bench serve --save-detailed` writes. FAKE_SERVE=die makes the server exit at start-up;
FAKE_BENCH_FAIL_AT=C makes the load generator exit 1 at C or more requests in flight. FAKE_ENGINE_PID=FILE makes
the server start a child process first, as vLLM starts its engine process, and write the child's pid to FILE.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.request import urlopen


def _arg(argv, flag, default=None):
    return argv[argv.index(flag) + 1] if flag in argv else default


def _skips(argv):
    if "--kv-cache-dtype-skip-layers" not in argv:
        return []
    out = []
    for a in argv[argv.index("--kv-cache-dtype-skip-layers") + 1:]:
        if a.startswith("--"):
            break
        out.append(a)
    return out


def serve(argv):
    if os.environ.get("FAKE_SERVE") == "die":
        print("RuntimeError: fake engine refused to start", flush=True)
        return 1
    if os.environ.get("FAKE_ENGINE_PID"):
        engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.environ["FAKE_ENGINE_PID"], "w") as f:
            f.write(str(engine.pid))
    port, length = int(_arg(argv, "--port")), int(_arg(argv, "--max-model-len"))
    kv = _arg(argv, "--kv-cache-dtype", "auto")
    pool = int(_arg(argv, "--kv-cache-memory-bytes", 0)) or int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")) << 30
    per_token = float(os.environ.get("FAKE_BYTES_PER_TOKEN", "1000"))
    if kv.startswith("fp8"):
        per_token *= 0.625 if _skips(argv) else 0.5
    tokens = int(pool / per_token)
    state = {"fits": tokens // length, "fp8": kv.startswith("fp8"), "length": length}
    print(f"INFO [kv_cache_utils.py:1] CPU KV cache size: {tokens:,} tokens, Maximum concurrency for {length:,} tokens "
          f"per request: {tokens / length:.2f}x", flush=True)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            body = {"/health": "", "/fake": json.dumps(state),
                    "/metrics": "\n".join(['vllm:num_requests_running{engine="0"} 0.0',
                                           'vllm:num_requests_waiting{engine="0"} 0.0',
                                           'vllm:kv_cache_usage_perc{engine="0"} 0.0',
                                           'vllm:num_preemptions_total{engine="0"} 0.0',
                                           f'vllm:cache_config_info{{block_size="16",cache_dtype="{kv}",engine="0",'
                                           f'num_gpu_blocks="{tokens // 16}"}} 1.0'])}.get(self.path)
            self.send_response(404 if body is None else 200)
            self.end_headers()
            self.wfile.write((body or "").encode())
    srv = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    while True:
        time.sleep(3600)


def bench(argv):
    state = json.loads(urlopen(_arg(argv, "--base-url") + "/fake").read())
    rows = [json.loads(x) for x in open(_arg(argv, "--dataset-path"))]
    n, c = int(_arg(argv, "--num-prompts")), int(_arg(argv, "--max-concurrency"))
    if c >= int(os.environ.get("FAKE_BENCH_FAIL_AT") or 10 ** 9):
        print("aiohttp.client_exceptions.ServerDisconnectedError: Server disconnected", flush=True)
        return 1
    assert len(rows) == n and "--save-detailed" in argv and "--ignore-eos" in argv
    batch = max(1, min(c, state["fits"]))
    slow = 1.05 if state["fp8"] else 1.0
    out_tokens = rows[0]["output_tokens"]
    prompt = sum(len(r["prompt"].split()) for r in rows) / n
    prefill = batch * prompt * 2e-4 * slow
    step = 0.004 * (1 + batch / 16) * slow
    wave = prefill + (out_tokens - 1) * step
    queued = math.ceil(c / batch)                 # waves a request may wait inside the server
    ttfts = [prefill + (k // batch % queued) * wave for k in range(n)]
    doc = {"duration": math.ceil(n / batch) * wave, "completed": n, "ttfts": ttfts,
           "itls": [[step] * (out_tokens - 1) for _ in range(n)], "output_lens": [out_tokens] * n,
           "input_lens": [len(r["prompt"].split()) for r in rows], "errors": [""] * n,
           "latencies": [t + (out_tokens - 1) * step for t in ttfts]}
    doc["request_throughput"] = n / doc["duration"]
    path = os.path.join(_arg(argv, "--result-dir"), _arg(argv, "--result-filename"))
    with open(path, "w") as f:
        json.dump(doc, f)
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["serve"]:
        sys.exit(serve(args[1:]))
    if args[:2] == ["bench", "serve"]:
        sys.exit(bench(args[2:]))
    sys.exit(f"fake vllm: unknown command {args}")
