"""Two gloo processes under torchrun give bit-identical scales to one process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from calib.capture.distributed import Dist, shard


def test_shard_is_a_disjoint_cover():
    items = list(range(11))
    parts = [list(shard(items, Dist(rank=r, world=3))) for r in range(3)]
    assert sorted(sum(parts, [])) == items and parts[1] == [1, 4, 7, 10]


def _calibrate(cmd_prefix, model, data, out, extra=()):
    args = [*cmd_prefix, "-m", "calib.cli", "calibrate", "--model", str(model), "--data", str(data), "--out", str(out),
            "--samples", "14", "--seq-len", "40", "--batch-size", "3", "--device", "cpu", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.mark.parametrize("extra", [(), pytest.param(("--granularity", "head", "--observer", "rope_bound"),
                                                   marks=pytest.mark.slow)], ids=["absmax", "head-rope"])
def test_two_processes_bit_identical_to_one(tiny_llama_dir, token_data, tmp_path, extra):
    torchrun = Path(sys.executable).with_name("torchrun")
    _calibrate([sys.executable], tiny_llama_dir, token_data, tmp_path / "one", extra)
    r = _calibrate([str(torchrun), "--nproc-per-node", "2", "--master-port", "29517"], tiny_llama_dir, token_data,
                   tmp_path / "two", extra)
    assert r.stdout.count("wrote ") == 1  # only rank 0 reports and writes
    one = load_file(tmp_path / "one" / "kv_scales.safetensors")
    two = load_file(tmp_path / "two" / "kv_scales.safetensors")
    assert one.keys() == two.keys() and len(one) == 6
    for k in one:
        assert one[k].dtype == two[k].dtype and bool((one[k] == two[k]).all()), k
