"""bench/e2e.py runs end to end on CPU: a saved checkpoint, `kvcalib calibrate` and `kvcalib eval` through the
CLI, the plain forward over the same tokens (real numbers come from a GPU, bench/RESULTS.md)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_e2e_smoke_run_times_every_stage(tmp_path):
    out = tmp_path / "e2e.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--shape", "tiny", "--samples", "2",
                        "--seq-len", "32", "--eval-samples", "2", "--workdir", str(tmp_path / "w"), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert doc["save"]["calib_tokens"] == 64 and doc["save"]["eval_tokens"] == 64
    assert doc["kvcalib calibrate"]["seconds"] > 0 and doc["kvcalib calibrate"]["tokens"] == 64
    assert (tmp_path / "w" / "kvcalib-out" / "config.json").is_file()
    llmc = doc["llm-compressor oneshot"]
    assert "skipped" in llmc or all(v["seconds"] > 0 and v["tokens"] == 64 for v in llmc.values())
    ev = doc["kvcalib eval"]
    assert ev["tokens"] == ev["eval_tokens"] == 64 and ev["plain_forward"]["seconds"] > 0
    assert "kvcalib-out" in " ".join(ev["arms"]) and "default" in ev["arms"]   # the calibrated arm and scale 1.0
    assert all(a["seconds"] > 0 and a["ratio_to_forward"] > 0 for a in ev["arms"].values())
    assert "plain causal-LM forward" in r.stdout
