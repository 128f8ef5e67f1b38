"""The support matrix's vLLM cells against what GPU vLLM did with kvcalib checkpoints (bench/gpu/matrix_check.py).

Each recorded case is one (checkpoint, cache dtype, attention backend) start of the real engine; its checkpoint
decides which aspects it shows (per-tensor scales and no q_scale; per-head scales with q_scale; a skipped layer).
For every aspect the matrix's cell at the recorded vLLM version says what the engine does, and the record must
agree: a refused cell did not start; an applied cell holds the file's scales (q: the max over each KV head's
query heads); an ignored cell is a per-token-head cache that ran (its kernels take no checkpoint scale: vLLM's
TritonAttentionImpl passes no descale on that path, though a compressed-tensors layer keeps the file's values in
its buffers); a skipped layer keeps the model-dtype cache. A matrix edit that
contradicts a measurement fails here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from calib.recipe.support import matrix
from calib.recipe.support.base import Effect

RESULTS = sorted((Path(__file__).resolve().parents[2] / "bench" / "results" / "matrix").glob("vllm-*.json"))
BACKENDS = {"FLASH_ATTN": ("fa3", "FlashAttentionImpl"), "TRITON_ATTN": ("triton", "TritonAttentionImpl")}
FORMATS = {"fp8": "fp8_e4m3"}             # vLLM's cache names that differ from kvcalib's format names
ASPECTS = {"plain": ("tensor", "q_absent"), "head-q": ("head", "q_scale"), "skip": ("tensor", "q_absent",
                                                                                    "skip_layers")}


def _cases():
    for path in RESULTS:
        doc = json.loads(path.read_text())
        for name, case in doc["cases"].items():
            yield pytest.param(doc, case, id=f"{path.stem}:{name}")


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(a, b))


def _group_max(q: list[float], kv_heads: int) -> list[float]:
    r = len(q) // kv_heads
    return [max(q[g * r:(g + 1) * r]) for g in range(kv_heads)]


def test_results_exist():
    assert RESULTS, "bench/results/matrix/ holds no vllm-*.json from bench/gpu/matrix_check.py"


@pytest.mark.parametrize("doc,case", list(_cases()))
def test_the_engine_did_what_the_cell_says(doc, case):
    backend, impl = BACKENDS[case["backend"]]
    fmt = FORMATS.get(case["kv_cache_dtype"], case["kv_cache_dtype"])
    effects = {a: matrix.effect("vllm", doc["vllm"], backend, fmt, a) for a in ASPECTS[case["checkpoint"]]}
    refused = [a for a, e in effects.items() if e is Effect.REFUSED]
    assert case["started"] == (not refused), (effects, case.get("error"))
    if refused:
        return
    assert case["impls"] == [impl], "the engine ran another attention backend than the one asked for"
    assert len(case["generated"]) == 16
    files = doc["files"][case["checkpoint"]]
    skipped = {str(i) for i in case.get("skipped", [])} | {
        i for i, d in case["layers"].items() if d["kv_cache_dtype"] == "auto"}
    for i, layer in case["layers"].items():
        scales = files[i]
        if i in skipped:
            assert effects.get("skip_layers") is Effect.APPLIED and layer["kv_cache_tensor_dtype"] == "bfloat16"
            continue
        assert layer["kv_cache_dtype"] == case["kv_cache_dtype"], i
        for aspect in ("tensor", "head"):
            if aspect not in effects:
                continue
            if effects[aspect] is Effect.APPLIED:
                assert _close(layer["k_scale_buffer"], scales["k"]) and _close(layer["v_scale_buffer"], scales["v"]), i
            else:  # a per-token-head cache: the layer may keep the file's scales, the kernels are given none
                assert effects[aspect] is Effect.IGNORED and fmt in matrix.DYNAMIC_FORMATS, (i, aspect)
        if "q_scale" in effects:
            assert effects["q_scale"] is Effect.APPLIED
            assert _close(layer["q_scale_buffer"], _group_max(scales["q"], layer["num_kv_heads"])), i
        if "q_absent" in effects:
            assert effects["q_absent"] in (Effect.IGNORED, Effect.UNQUANTIZED)
            assert layer["q_scale_float"] == 1.0, i
    if "skip_layers" in effects:
        assert skipped, "the checkpoint's skipped layer holds an FP8 cache"
