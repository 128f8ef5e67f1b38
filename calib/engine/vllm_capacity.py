"""What the loaded vLLM engine says about its KV cache: the pool in tokens, and the capacity its hybrid KV cache
manager computes with the groups it computes it from.

Why a module of its own, beside calib/engine/vllm_runner.py and run by the same engine python (it imports nothing
from kvcalib): these reads follow vLLM's internals, which move between versions (0.24 on the GPU machine, 0.32 on
CPU); each number is read on its own so one attribute a version lacks costs that number, not the answer.
"""

from __future__ import annotations

import re


def pool(llm) -> tuple[int | None, str]:
    """(the pool in tokens as blocks x block size, the cache dtype as served): one group's tokens on a hybrid model."""
    cfg = llm.llm_engine.vllm_config.cache_config
    blocks = getattr(cfg, "num_gpu_blocks", None)
    tokens = int(blocks) * int(cfg.block_size) if blocks else None
    dtype = str(cfg.cache_dtype)
    if dtype == "auto":                        # the model's dtype
        dtype = f"auto ({str(llm.llm_engine.model_config.dtype).removeprefix('torch.')})"
    return tokens, dtype


def _read(get, cast):
    """cast(get()), or None where this vLLM lacks the attribute or holds None there."""
    try:
        value = get()
        return None if value is None else cast(value)
    except Exception:
        return None


def _in_flight_tokens(cfg) -> int | None:
    """The tokens a sliding-window or chunked-local layer reserves beyond its window (the prefill in flight):
    vLLM 0.32 reads `VllmConfig.max_in_flight_tokens` (max_concurrent_batches x max_num_batched_tokens,
    vllm/config/vllm.py); vLLM 0.24 has no such property and reads `scheduler_config.max_num_batched_tokens`
    (v1/kv_cache_interface.py SlidingWindowSpec / ChunkedLocalAttentionSpec.max_memory_usage_bytes)."""
    own = _read(lambda: cfg.max_in_flight_tokens, int)
    return own if own is not None else _read(lambda: cfg.scheduler_config.max_num_batched_tokens, int)


def _kv_group(g) -> dict:
    """One KV cache group: its layers (the number in each layer name) and its spec's block size, page and dtype."""
    spec = g.kv_cache_spec
    idx = [int(m.group(1)) for m in (re.search(r"\.(\d+)\.", f".{n}.") for n in g.layer_names) if m]
    return {"layers": idx, "spec": type(spec).__name__, "block_size": int(spec.block_size),
            "page_bytes": int(spec.page_size_bytes), "dtype": str(spec.dtype).removeprefix("torch."),
            "window": getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)}


def kv_groups(llm) -> dict | None:
    """vLLM's own capacity as its hybrid KV cache manager computes it, and the groups it computes it from: layers
    of one attention kind share a block table (v1/core/kv_cache_utils.py get_kv_cache_groups, 0.24 and 0.32),
    every block is drawn from one pool, and `kv_cache_size_tokens` = requests of max_model_len that fit x
    max_model_len (get_kv_cache_capacity, stored on the cache config by v1/engine/core.py, in this process).
    `pool`'s blocks x block size counts one group's tokens: the context only when every layer is global.
    The capacity, the concurrency and the tokens in flight come back None where unreadable (the protocol allows it
    for those three); the whole is None only when the groups, the block count or max_model_len cannot be read (the
    engine core in another process)."""
    try:
        cfg = llm.llm_engine.vllm_config
        kcc = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
        groups = [_kv_group(g) for g in kcc.kv_cache_groups]
        max_model_len, num_blocks = int(cfg.model_config.max_model_len), int(kcc.num_blocks)
    except Exception:                          # another vLLM layout: the plain capacity still comes back
        return None
    return {"size_tokens": _read(lambda: cfg.cache_config.kv_cache_size_tokens, int),
            "max_concurrency": _read(lambda: cfg.cache_config.kv_cache_max_concurrency, float),
            "max_model_len": max_model_len, "num_blocks": num_blocks, "in_flight_tokens": _in_flight_tokens(cfg),
            "groups": groups}
