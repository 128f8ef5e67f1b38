"""One engine start for arms that differ only in their KV scales, in real vLLM (calib/engine/vllm_runner.py).

Runs inside the vLLM venv (like the other engine tests) and needs no kvcalib venv: it writes a tiny model and
two compressed-tensors checkpoints of it by hand (the scales are known exactly), then asks the runner for the
FP8 default arm and both checkpoints on ONE start, and for each checkpoint on its own start. What it checks:
the arms whose scales were set in place give the prompt log-probabilities, continuations and passkey answers
of their own start, and the engine holds exactly the checkpoint's scales (read back). The control: the second
checkpoint's scales are small enough to saturate, so its numbers differ from the default's by far more than
the tolerance; an arm that silently kept the first arm's scales would fail.

Tolerance: the same kernels on the same token ids in the same batches are deterministic on CPU; TOL (1e-4
nats per position) leaves room only for float32 rounding of a log-softmax over a tiny vocabulary, far below
the control's difference (> 0.05 nats).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "calib" / "engine" / "vllm_runner.py"
sys.path.insert(0, str(RUNNER.parent))
import protocol  # noqa: E402  (stdlib only, like the runner)

from calib.engine import answer  # noqa: E402  (kvcalib's check of the runner's answer)

TOL = 1e-4
LAYERS, KV_HEADS = 2, 2
CT = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": [],
      "quantization_status": "compressed", "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                               "dynamic": False, "symmetric": True}}
# exactly representable in float32: what the checkpoint stores is what the engine must hold
SCALES_A = {i: {"k": 0.0078125 * (i + 1), "v": 0.00390625 * (i + 1), "q": 0.0625} for i in range(LAYERS)}
SCALES_B = {i: {"k": 2.0 ** -14, "v": 2.0 ** -15} for i in range(LAYERS)}      # saturates: the control


def _fp8_cache_runs_here() -> bool:
    import torch

    return torch.cuda.is_available() or bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("reuse")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                      num_attention_heads=2, num_key_value_heads=KV_HEADS, head_dim=64, max_position_embeddings=256,
                      initializer_range=0.2, tie_word_embeddings=False)
    base = tmp / "model"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(base)
    out = {"model": base}
    for name, scales in (("a", SCALES_A), ("b", SCALES_B)):
        ck = tmp / name
        shutil.copytree(base, ck)
        config = json.loads((ck / "config.json").read_text())
        config["quantization_config"] = CT
        (ck / "config.json").write_text(json.dumps(config))
        tensors = load_file(ck / "model.safetensors")
        for i, sc in scales.items():
            for kind, value in sc.items():
                tensors[f"model.layers.{i}.self_attn.{kind}_scale"] = torch.tensor([value], dtype=torch.float32)
        save_file(tensors, ck / "model.safetensors", metadata={"format": "pt"})
        out[name] = ck
    return out


def _sent(scales: dict | None) -> dict:
    scales = scales or {}
    return {"layout": "tensor", "layers": [{"layer": i, **{k: [scales.get(i, {}).get(k, 1.0)] for k in "kvq"}}
                                           for i in range(LAYERS)]}


def _arm(name: str, model: Path, scales: dict | None) -> dict:
    return {"name": name, "model": str(model), "kv_cache_dtype": "fp8", "skip_layers": [], "scales": _sent(scales)}


def _request(arms: list[dict]) -> dict:
    filler = [(7 * j) % 500 + 3 for j in range(48)]
    return {"protocol": protocol.PROTOCOL, "arms": arms,
            "samples": [[(13 * j + 5 * s) % 500 + 3 for j in range(96)] for s in range(3)],
            "continuation_tokens": 3, "passkey": [filler + [11, 12, 13, 14], filler + [21, 22, 23, 24]],
            "passkey_tokens": 4, "stop_token_ids": [], "top_k": 5, "kv_gib": 1, "max_model_len": 128,
            "dtype": "bfloat16", "seed": 0, "chunk": 2}


def _run(tmp: Path, arms: list[dict], log: list) -> list[dict]:
    """One runner process = one engine start; its answers, checked by the protocol."""
    req = _request(arms)
    (tmp / "req.json").write_text(json.dumps(req))
    resp = tmp / "resp.json"
    resp.unlink(missing_ok=True)
    t0, c0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run([sys.executable, str(RUNNER), str(tmp / "req.json"), str(resp)], capture_output=True, text=True,
                       timeout=1800, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    log.append((" + ".join(a["name"] for a in arms), time.perf_counter() - t0,
                c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime))
    assert r.returncode == 0, r.stderr[-3000:]
    return answer.read_response(resp, req)["arms"]


def _max_diff(x: dict, y: dict) -> float:
    return max(abs(a - b) for rx, ry in zip(x["samples"], y["samples"]) for a, b in zip(rx["target"], ry["target"]))


def test_checkpoints_on_one_start_equal_their_own_starts(models, tmp_path, required):
    if not _fp8_cache_runs_here():
        why = "vLLM's CPU build needs AVX-512 or AMX for an FP8 cache"
        if "fp8-kv" in required:
            pytest.fail(f"--require fp8-kv: {why}")
        pytest.skip(why)
    log: list = []
    one = _run(tmp_path, [_arm("default", models["model"], None), _arm("a", models["a"], SCALES_A),
                          _arm("b", models["b"], SCALES_B)], log)
    own_a = _run(tmp_path, [_arm("a", models["a"], SCALES_A)], log)[0]
    own_b = _run(tmp_path, [_arm("b", models["b"], SCALES_B)], log)[0]
    print("\nengine starts (arms, wall s, cpu s):", *log, sep="\n  ")
    assert [a["status"] for a in one] == ["ok"] * 3, [a["reason"] for a in one]
    assert own_a["status"] == own_b["status"] == "ok"
    for got, sent in zip(one, (None, SCALES_A, SCALES_B)):
        assert protocol.scales_mismatch(_sent(sent), got["scales"]) is None
        held = {row["layer"]: row for row in got["scales"]["layers"]}
        for i in range(LAYERS):       # read back: exactly the checkpoint's values (1.0 where it has none)
            assert [held[i][k] for k in ("k_float", "v_float", "q_float")] == \
                [(sent or {}).get(i, {}).get(k, 1.0) for k in "kvq"]
    assert "startup" in one[0]["seconds"] and "set_scales" in one[1]["seconds"] and "startup" not in one[1]["seconds"]
    diffs = {"a": _max_diff(one[1], own_a), "b": _max_diff(one[2], own_b), "control": _max_diff(one[2], one[0])}
    print("max |log-prob difference| per position:", diffs)
    assert diffs["a"] <= TOL and diffs["b"] <= TOL
    assert diffs["control"] > 0.05 and math.isfinite(diffs["control"])
    assert one[1]["continuations"] == own_a["continuations"] and one[2]["continuations"] == own_b["continuations"]
    assert one[1]["passkey"] == own_a["passkey"] and one[2]["passkey"] == own_b["passkey"]
