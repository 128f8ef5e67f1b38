"""Real CPU vLLM on a tiny hybrid-attention model (3 sliding-window layers, window 64, and 1 global layer): the
sliding-window skip arm runs with the engine's own flag value, keeps exactly the sliding layers at the model dtype,
and the engine's capacity equals the bytes model's (calib.model.layer_kinds) in the engine's own definition.

Why the definition matters: vLLM's hybrid KV cache manager gives each layer kind its own block table drawn from one
pool (vLLM 0.32 v1/core/kv_cache_utils.py get_kv_cache_groups), and its capacity `kv_cache_size_tokens` is the
number of max_model_len requests the pool holds x max_model_len (get_kv_cache_capacity), where a sliding layer
reserves window - 1 + the tokens in flight, rounded up to blocks, plus a block (SlidingWindowSpec). The runner's
plain `kv_capacity_tokens` (blocks x block size) counts one group's tokens: for a hybrid model it is not context.

Runs in the vLLM venv (`make engine-test`), one engine start per arm, one after another, through
calib/engine/vllm_runner.py as `kvcalib eval --engine vllm` runs it. It imports only calib.model.layer_kinds
(no torch, no transformers) from kvcalib.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from calib.model import layer_kinds as lk  # noqa: E402

pytestmark = pytest.mark.engine
RUNNER = ROOT / "calib" / "engine" / "vllm_runner.py"
WINDOW, LAYERS, HEAD_DIM, KV_HEADS, MAX_LEN, KV_GIB = 64, 4, 64, 1, 512, 1


def _fp8_cache_runs_on_this_cpu() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    import torch
    import transformers

    cfg = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=1024, sliding_window=WINDOW,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], query_pre_attn_scalar=HEAD_DIM)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("hybrid") / "g3"
    transformers.Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def _run(model: Path, tmp: Path, name: str, kv: str, skip: list) -> dict:
    rng = random.Random(0)
    req = {"protocol": 2, "arms": [{"name": name, "model": str(model), "kv_cache_dtype": kv, "skip_layers": skip,
                                    "scales": None}],
           "samples": [[rng.randrange(3, 500) for _ in range(200)] for _ in range(2)], "continuation_tokens": 1,
           "passkey": [], "passkey_tokens": 1, "stop_token_ids": [], "top_k": 5, "kv_gib": KV_GIB,
           "max_model_len": MAX_LEN, "dtype": "bfloat16", "seed": 0, "chunk": 2}
    (tmp / "req.json").write_text(json.dumps(req))
    r = subprocess.run([sys.executable, str(RUNNER), str(tmp / "req.json"), str(tmp / "resp.json")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    resp = json.loads((tmp / "resp.json").read_text())["arms"][0]
    assert resp["status"] == "ok", resp["reason"]
    return resp


def _predicted(model: Path, groups: dict, kv: str | None, quantised) -> int:
    layers = lk.layer_kinds(json.loads((model / "config.json").read_text()))
    st = lk.storage_for(LAYERS, "bfloat16", kv, quantised)
    block = {i: g["block_size"] for g in groups["groups"] for i in g["layers"]}
    pool = groups["num_blocks"] * max(g["page_bytes"] * len(g["layers"]) for g in groups["groups"])
    assert pool == KV_GIB * 2 ** 30
    return lk.engine_capacity_tokens(layers, KV_HEADS, HEAD_DIM, st, pool, groups["max_model_len"],
                                     groups["in_flight_tokens"], block)


def _kinds(groups: dict) -> dict[int, tuple[str, str]]:
    return {i: (g["spec"], g["dtype"]) for g in groups["groups"] for i in g["layers"]}


@pytest.mark.parametrize("arm", ["bf16", "fp8 skip sliding_window"])
def test_capacity_matches_the_bytes_model(model, tmp_path, arm):
    if arm != "bf16" and not _fp8_cache_runs_on_this_cpu():
        pytest.skip("vLLM's CPU build needs AVX-512 or AMX for an FP8 cache")
    kv, skip = ("auto", []) if arm == "bf16" else ("fp8", ["sliding_window"])
    resp = _run(model, tmp_path, arm, kv, skip)
    groups = resp["kv_groups"]
    layers = lk.layer_kinds(json.loads((model / "config.json").read_text()))
    assert layers.sliding == (0, 1, 2)
    # the largest batch kvcalib reports is the engine's own count of max_model_len requests
    assert lk.engine_requests_fit(groups, groups["max_model_len"]) == int(groups["max_concurrency"]) > 0
    if arm == "bf16":
        assert _predicted(model, groups, None, ()) == groups["size_tokens"]
        return
    # the flag kept exactly the sliding-window layers at bf16; the global layer is FP8 (vLLM stores it as uint8)
    assert _kinds(groups) == {0: ("SlidingWindowSpec", "bfloat16"), 1: ("SlidingWindowSpec", "bfloat16"),
                              2: ("SlidingWindowSpec", "bfloat16"), 3: ("FullAttentionSpec", "uint8")}
    assert _predicted(model, groups, "fp8_e4m3", [3]) == groups["size_tokens"]
    # blocks x block size is not the context the pool holds on a hybrid model
    assert resp["kv_capacity_tokens"] != groups["size_tokens"]


def test_fp8_everywhere_capacity(model, tmp_path):
    if not _fp8_cache_runs_on_this_cpu():
        pytest.skip("vLLM's CPU build needs AVX-512 or AMX for an FP8 cache")
    groups = _run(model, tmp_path, "fp8", "fp8", [])["kv_groups"]
    assert {d for _, d in _kinds(groups).values()} == {"uint8"}
    assert _predicted(model, groups, "fp8_e4m3", range(LAYERS)) == groups["size_tokens"]
