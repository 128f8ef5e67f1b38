"""vLLM's own KV formats, checked in the vLLM environment (`make engine-test`; run alone with -k formats):

- the runner's probe lists the cache dtypes from vLLM's own config type, per-token-head ones included;
- vLLM's per-token-head cache-write kernels, run unchanged under Triton's CPU interpreter (tests/engine/
  vllm_kernels.py), store what calib/evaluation/dynamic.py says they store: INT8 and the scales bit for bit;
  INT4 bit for bit with the product rounded before the add (the interpreter does not fuse it; GPUs do, which
  the emulation follows by default); FP8 equal except where the interpreter's float32->e4m3 conversion is known
  to differ from the GPU's round-to-nearest-even (`cvt.rn.satfinite`): it loses the carry into the next binade
  and rounds ties away from zero;
- a per-token-head cache in CPU vLLM comes back "not run" with the reason (CPU vLLM 0.32 accepts the dtype,
  runs its own attention backend and computes garbage: docs/design.md §11), never as numbers, and the run ends
  normally.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
RUNNER = ROOT / "calib" / "engine" / "vllm_runner.py"
KERNELS = Path(__file__).resolve().parent / "vllm_kernels.py"
DYNAMIC = ("fp8_per_token_head", "int8_per_token_head", "int4_per_token_head")


def test_the_probe_lists_the_formats_vllm_accepts():
    pytest.importorskip("vllm")
    import typing

    from vllm.config.cache import CacheDType

    r = subprocess.run([sys.executable, str(RUNNER), "--probe"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("{")))
    assert doc["kv_cache_dtypes"] == list(typing.get_args(CacheDType))
    assert {"auto", "fp8", "fp8_e5m2", *DYNAMIC} <= set(doc["kv_cache_dtypes"])


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("triton")
    import torch

    out = tmp_path_factory.mktemp("kernels") / "stored.pt"
    r = subprocess.run([sys.executable, str(KERNELS), str(out)], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("part", ["key", "value"])
def test_int8_and_int4_kernels_store_what_the_emulation_says(stored, part):
    import torch

    from calib.evaluation import dynamic

    x, kv = stored[part], part[0]
    codes, scale = dynamic.int8_codes(x)
    assert torch.equal(codes, stored["INT8_PER_TOKEN_HEAD"][kv])
    assert torch.equal(scale[..., 0], stored["INT8_PER_TOKEN_HEAD"][f"{kv}_scale"])
    q, zp, read = dynamic.int4_codes(dynamic.rht(x.float()).to(x.dtype), fused=False)
    packed = q[..., 0::2].to(torch.uint8) | (q[..., 1::2].to(torch.uint8) << 4)
    assert torch.equal(packed, stored["INT4_PER_TOKEN_HEAD"][kv])
    bits = read.view(torch.int32) | zp.to(torch.int32)           # the zero point in the low mantissa bits
    assert torch.equal(bits[..., 0], stored["INT4_PER_TOKEN_HEAD"][f"{kv}_scale"].view(torch.int32))


@pytest.mark.parametrize("part", ["key", "value"])
def test_the_fp8_kernel_stores_the_emulations_codes_up_to_the_interpreters_conversion(stored, part):
    import torch

    from calib.evaluation import dynamic
    from calib.scales import fp8

    x, kv = stored[part], part[0]
    codes, scale = dynamic.fp8_codes(x)
    got = stored["FP8_PER_TOKEN_HEAD"]
    assert torch.equal(scale[..., 0], got[f"{kv}_scale"])
    v = (x.float() * (1.0 / scale)).clamp(-448, 448)
    down = fp8.round_fp8(v, fp8.E4M3, fp8.RZ)
    _, e_down = torch.frexp(down.abs())
    _, e_up = torch.frexp(codes.abs())
    carry = (codes.abs() > down.abs()) & (e_up > e_down)            # rounding up into the next binade
    spacing = torch.where(down == 0, torch.tensor(2.0 ** -9), torch.pow(2.0, (e_down - 1).clamp_min(-6) - 3))
    tie = (v.abs() - down.abs()) == spacing / 2                  # exactly halfway between two e4m3 values
    differ = codes != got[kv]
    assert differ.float().mean() < 0.05
    assert not (differ & ~carry & ~tie).any(), v[differ & ~carry & ~tie][:8]


def test_a_per_token_head_cache_in_cpu_vllm_is_not_run_with_the_reason(request, tmp_path):
    """One engine start: fp8_per_token_head with the Triton backend asked for, on vLLM's CPU build."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("a GPU build serves per-token-head caches: tests/engine/test_vllm_eval.py measures them")
    model = request.config.getoption("--eval-model") or request.config.getoption("--ckpt")
    if not model:
        pytest.skip("needs --ckpt or --eval-model (a model directory vLLM loads)")
    sys.path.insert(0, str(RUNNER.parent))
    import protocol

    from calib.engine import answer

    req = {"protocol": protocol.PROTOCOL, "arms": [{"name": "fp8_per_token_head", "model": str(model),
                                                    "kv_cache_dtype": "fp8_per_token_head", "skip_layers": [],
                                                    "attention_backend": "TRITON_ATTN", "scales": None}],
           "samples": [list(range(100, 140))], "continuation_tokens": 1, "passkey": [], "passkey_tokens": 1,
           "stop_token_ids": [], "top_k": 1, "kv_gib": 1, "max_model_len": 64, "dtype": "bfloat16", "seed": 0,
           "chunk": 1}
    (tmp_path / "req.json").write_text(json.dumps(req))
    r = subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "req.json"), str(tmp_path / "resp.json")],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    resp = answer.read_response(tmp_path / "resp.json", req)["arms"][0]
    print(f"fp8_per_token_head on CPU vLLM: {resp['status']}: {resp['reason']}")
    assert resp["status"] == protocol.NOT_RUN and resp["reason"] and resp["samples"] == []
