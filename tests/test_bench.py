"""The benchmark script runs end to end on CPU (the smoke run; real numbers come from a GPU, bench/RESULTS.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_smoke_run_writes_every_arm(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--shape", "tiny", "--samples", "4",
                        "--seq-len", "64", "--export", "--workdir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert doc["env"]["tokens"] == 256
    for arm in ("plain forward (floor)", "kvcalib absmax tensor", "kvcalib absmax head", "kvcalib percentile",
                "kvcalib mse", "kvcalib rope_bound", "kvcalib absmax head + q"):
        assert res[arm]["seconds"] > 0 and res[arm]["tokens_per_s"] > 0, arm
    llmc = [k for k in res if k.startswith("llm-compressor")]
    assert llmc, "the llm-compressor arms are reported (timed, or skipped with the reason)"
    for k in llmc:
        assert "skipped" in res[k] or (res[k]["seconds"] > 0 and res[k]["layer0_k_rows"] == 2 * 256), k
    assert doc["export"]["export_seconds"] > 0 and doc["export"]["checkpoint_gib"] > 0
