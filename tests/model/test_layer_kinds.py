"""Layer kinds from real architectures' configs, and the KV bytes model against a brute-force count."""

from __future__ import annotations

import pytest

from calib.model import layer_kinds as lk
from calib.model.geometry import GeometryError
from tests.tiny import tiny_config


def brute_bytes(kinds: list[str], window: int | None, length: int, kv_heads: int, head_dim: int,
                element: dict[int, int]) -> int:
    """Count every (layer, token, head, K/V, channel) element the last query of a `length`-token sequence can read
    (a sliding layer: the last `window` positions; a chunked layer: its current chunk, bounded by the chunk size)."""
    total = 0
    for i, kind in enumerate(kinds):
        for pos in range(length):
            if kind == "sliding" and pos < length - window:
                continue
            if kind == "chunked" and pos < length - window:
                continue
            for _h in range(kv_heads):
                for _kv in range(2):
                    total += head_dim * element[i]
    return total


CASES = {   # arch -> (overrides, expected kinds per layer with 6 layers)
    "llama": ({}, ["global"] * 6),
    "mistral": ({}, ["sliding"] * 6),
    "gemma2": ({}, ["sliding", "global"] * 3),
    "gemma3": ({}, ["sliding"] * 5 + ["global"]),
}


@pytest.mark.parametrize("arch", sorted(CASES))
@pytest.mark.parametrize("length", [5, 8, 33])
def test_bytes_model_matches_brute_force(arch, length):
    overrides, expected = CASES[arch]
    cfg = tiny_config(arch, num_hidden_layers=6, **overrides)
    layers = lk.layer_kinds(cfg)
    assert [{"global": "global", "sliding_window": "sliding"}[k.kind] for k in layers.kinds] == expected
    skip = set(layers.sliding)
    st = lk.storage_for(6, "bfloat16", "fp8_e4m3", [i for i in range(6) if i not in skip])
    element = {i: 2 if i in skip else 1 for i in range(6)}
    got = lk.kv_bytes(layers, 2, 16, length, st)
    assert got == brute_bytes(expected, 8, length, 2, 16, element)
    ref = lk.kv_bytes(layers, 2, 16, length, lk.storage_for(6, "bfloat16", None, range(6)))
    assert ref == brute_bytes(expected, 8, length, 2, 16, {i: 2 for i in range(6)})


def test_raw_configs_of_older_checkpoints():
    # Gemma 2 config.json without layer_types; Gemma 3 with sliding_window_pattern; Qwen2 with max_window_layers
    g2 = lk.layer_kinds({"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 4096})
    assert [k.kind for k in g2.kinds] == ["sliding_window", "global"] * 2
    g3 = lk.layer_kinds({"model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 512,
                         "sliding_window_pattern": 6})
    assert g3.of("global") == (5, 11) and g3.kinds[0].window == 512
    q2 = lk.layer_kinds({"num_hidden_layers": 4, "sliding_window": 64, "use_sliding_window": True,
                         "max_window_layers": 2})
    assert q2.sliding == (2, 3)
    q2off = lk.layer_kinds({"num_hidden_layers": 4, "sliding_window": 64, "use_sliding_window": False,
                            "max_window_layers": 2})
    assert not q2off.hybrid


def test_llama4_chunked_and_shared_layers():
    import transformers

    cfg = transformers.Llama4TextConfig(num_hidden_layers=8, attention_chunk_size=16)
    layers = lk.layer_kinds(cfg)
    assert layers.of("global") == (3, 7) and layers.of("chunked_local") == (0, 1, 2, 4, 5, 6)
    st = lk.storage_for(8, "bfloat16", None, range(8))
    kinds = ["global" if k.kind == "global" else "chunked" for k in layers.kinds]
    assert lk.kv_bytes(layers, 2, 8, 40, st) == brute_bytes(kinds, 16, 40, 2, 8, {i: 2 for i in range(8)})
    shared = lk.layer_kinds({"num_hidden_layers": 6, "sliding_window": 8, "num_kv_shared_layers": 2,
                             "layer_types": ["sliding_attention", "full_attention"] * 3})
    assert [k.source for k in shared.kinds[4:]] == [2, 3] and shared.kinds[4].held_tokens(100) == 0


@pytest.mark.parametrize("cfg, field", [
    ({"num_hidden_layers": 2, "layer_types": ["full_attention", "linear_attention"]}, "layer_types"),
    ({"num_hidden_layers": 3, "layer_types": ["full_attention"]}, "layer_types"),
    ({"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
    ({"num_hidden_layers": 2, "sliding_window": -4}, "sliding_window"),
    ({"num_hidden_layers": 2, "sliding_window": 4, "num_kv_shared_layers": 2}, "num_kv_shared_layers"),
    ({"num_hidden_layers": 2, "sliding_window": 4, "use_sliding_window": True}, "max_window_layers"),
])
def test_bad_kinds_name_the_field(cfg, field):
    with pytest.raises(GeometryError, match=f"'{field}'") as e:
        lk.layer_kinds(cfg, "MODEL m/config.json")
    assert "\n" not in str(e.value) and "MODEL m/config.json" in str(e.value)


def test_engine_reservation_of_a_sliding_layer():
    # window 8, a 16-token prefill chunk in flight, blocks of 16: cdiv(min(8 - 1 + 16, 64), 16) + 1 = 3 blocks
    assert lk.engine_held_tokens(lk.LayerKind("sliding_window", 8), 64, 16, 16) == 48
    assert lk.engine_held_tokens(lk.LayerKind("global"), 70, 16, 16) == 80


# ------------------------------------------------------------------ the engine's capacity: vLLM's rule by brute force

def vllm_sizing(layers: list[dict], pool: int, max_model_len: int, in_flight: int, version: str) -> tuple[int, int]:
    """A second, literal reading of how vLLM sizes its KV pool (layer-outer layout; vLLM 0.24 and 0.32
    v1/core/kv_cache_utils.py unify_kv_cache_spec_page_size, _get_kv_cache_groups_uniform_page_size,
    get_kv_cache_config_from_groups, get_max_concurrency_for_kv_cache_config, get_kv_cache_capacity; the per-layer
    reservation of v1/kv_cache_interface.py *Spec.max_memory_usage_bytes). `layers`: one dict per layer that keeps KV
    ({"type", "window", "block", "bytes" per token}). Returns (num_blocks, kv_cache_size_tokens)."""
    def cdiv(a, b):
        return -(-a // b)
    pages = [s["block"] * s["bytes"] for s in layers]
    page = max(pages)
    specs = [{**s, "block": s["block"] * page // p} for s, p in zip(layers, pages)]    # smaller pages: bigger blocks
    by_spec: dict = {}
    for name, s in enumerate(specs):
        by_spec.setdefault(tuple(sorted(s.items())), []).append(name)
    fewest, most = min(len(v) for v in by_spec.values()), max(len(v) for v in by_spec.values())
    size = most if most < fewest * 1.5 else fewest
    groups = []                               # (spec, layer names), the last group of a spec possibly short
    for key, names in by_spec.items():
        n = cdiv(len(names), size)
        groups += [(dict(key), names[i::n]) for i in range(n)]
    group_size = max(len(names) for _, names in groups)
    num_blocks = int(pool // page // group_size)

    def usage(s: dict) -> int:                # bytes one request of max_model_len reserves in one layer
        if s["type"] == "full":
            return cdiv(max_model_len, s["block"]) * page
        if s["type"] == "sliding":
            return (cdiv(min(s["window"] - 1 + in_flight, max_model_len), s["block"]) + 1) * page
        return cdiv(min(s["window"] + in_flight, max_model_len), s["block"]) * page
    if version == "0.24":                     # every group counted as group_size layers, padding included
        per_request = group_size * sum(usage(s) for s, _ in groups)
        concurrency = num_blocks / cdiv(per_request, page * group_size)
    else:                                     # 0.32: whole blocks of each group from one pool
        concurrency = num_blocks / sum(cdiv(usage(s), page) for s, _ in groups)
    return num_blocks, int(concurrency * max_model_len)


GEMMA3_4B = {"num_hidden_layers": 34, "sliding_window": 1024,       # every 6th layer global: 5, 11, 17, 23, 29
             "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)]}


def _both(cfg: dict, kv_heads: int, head_dim: int, kv: str | None, quantised, pool: int, max_model_len: int,
          in_flight: int, block: int) -> tuple[tuple[int, int], tuple[int, int], int]:
    """vLLM 0.24's and 0.32's numbers by brute force, and kvcalib's prediction, for one arm."""
    layers = lk.layer_kinds(cfg)
    st = lk.storage_for(len(layers.kinds), "bfloat16", kv, quantised)
    kept = [i for i, k in enumerate(layers.kinds) if k.kind != lk.SHARED]
    name = {lk.GLOBAL: "full", lk.SLIDING: "sliding", lk.CHUNKED: "chunked"}
    specs = [{"type": name[layers.kinds[i].kind], "window": layers.kinds[i].window or 0, "block": block,
              "bytes": lk.token_bytes(kv_heads, head_dim, st[i])} for i in kept]
    page = max(s["bytes"] for s in specs) * block
    blocks = {i: page // s["bytes"] for i, s in zip(kept, specs)}    # the engine's enlarged blocks
    mine = lk.engine_capacity_tokens(layers, kv_heads, head_dim, st, pool, max_model_len, in_flight, blocks)
    return (vllm_sizing(specs, pool, max_model_len, in_flight, "0.24"),
            vllm_sizing(specs, pool, max_model_len, in_flight, "0.32"), mine)


@pytest.mark.parametrize("arm, kv, quantised, engine_blocks_x16, size_tokens", [
    ("bf16", None, (), 838_848, 200_181),
    ("fp8", "fp8_e4m3", range(34), 1_677_712, 400_367),
    ("fp8 skip sliding_window", "fp8_e4m3", (5, 11, 17, 23, 29), 838_848, 227_303),
])
def test_engine_capacity_of_a_gemma3_like_model_follows_vllms_grouping(arm, kv, quantised, engine_blocks_x16,
                                                                       size_tokens):
    """Gemma-3-4B's shape (5 global, 29 sliding layers of window 1024; 4 KV heads x 256), a 16 GiB pool, blocks of
    16, max_model_len 32768, 16384 tokens in flight (vLLM 0.24's max_num_batched_tokens default for LLM() on an
    H100/H200: engine/arg_utils.py get_batch_defaults). vLLM groups the layers 5 to a group: 1 global group and 6
    sliding groups, the last of 4 layers padded to 5, which counts as 5. engine_blocks_x16: blocks x block size as
    GPU vLLM 0.24 reported it for these three arms; size_tokens: vLLM 0.32's own get_kv_cache_capacity on these
    specs with max_in_flight_tokens 16384 gave the same."""
    v024, v032, mine = _both(GEMMA3_4B, 4, 256, kv, quantised, 16 * 2 ** 30, 32768, 16384, 16)
    assert v024 == v032 == (engine_blocks_x16 // 16, size_tokens)
    assert mine == size_tokens
    layers = lk.layer_kinds(GEMMA3_4B)
    st = lk.storage_for(34, "bfloat16", kv, quantised)
    enlarged = layers.of(lk.GLOBAL) if arm == "fp8 skip sliding_window" else ()     # fp8 pages among bf16 ones
    lay = lk.engine_layout(layers, 4, 256, st, {i: 32 if i in enlarged else 16 for i in range(34)})
    assert lay.group_size == 5 and sorted(map(len, lay.groups)) == [4, 5, 5, 5, 5, 5, 5]


@pytest.mark.parametrize("cfg, kv_heads, head_dim, pool, max_model_len, in_flight, block", [
    # the CPU engine test's tiny Gemma 3 (3 sliding, 1 global): 4 groups of 1 layer
    ({"num_hidden_layers": 4, "sliding_window": 64, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]},
     1, 64, 2 ** 30, 512, 1024, 128),
    # 12 sliding and 13 global layers: the group size is the larger count (13 < 1.5 x 12), the sliding group padded
    ({"num_hidden_layers": 25, "sliding_window": 128,
      "layer_types": ["sliding_attention", "full_attention"] * 12 + ["full_attention"]}, 8, 64, 3 * 2 ** 30, 8192,
     2048, 16),
    # Llama 4's chunked layers, 3 of every 4
    ({"num_hidden_layers": 8, "attention_chunk_size": 8192}, 8, 128, 8 * 2 ** 30, 131072, 8192, 16),
    # Gemma 2: half the layers sliding, group size 6
    ({"model_type": "gemma2", "num_hidden_layers": 12, "sliding_window": 4096}, 4, 256, 5 * 2 ** 30, 8192, 2048,
     16),
])
@pytest.mark.parametrize("kv, share", [(None, ()), ("fp8_e4m3", "all"), ("fp8_e4m3", "global")])
def test_engine_capacity_matches_vllms_rule_by_brute_force(cfg, kv_heads, head_dim, pool, max_model_len, in_flight,
                                                           block, kv, share):
    layers = lk.layer_kinds(cfg)
    quantised = range(len(layers.kinds)) if share == "all" else layers.of(lk.GLOBAL)
    v024, v032, mine = _both(cfg, kv_heads, head_dim, kv, quantised, pool, max_model_len, in_flight, block)
    assert v024 == v032 and mine == v024[1] > 0


def _groups(num_blocks, in_flight, sliding, glob, window=1024, block=16):
    """An engine's reported KV cache groups (calib/engine/vllm_capacity.kv_groups): lists of layers per kind."""
    return {"num_blocks": num_blocks, "in_flight_tokens": in_flight, "groups": [
        {"layers": g, "spec": "SlidingWindowSpec", "block_size": block, "window": window} for g in sliding] + [
        {"layers": g, "spec": "FullAttentionSpec", "block_size": block, "window": None} for g in glob]}


def test_requests_that_fit_are_the_engines_own_count():
    # GPU vLLM 0.24, Gemma-3-4B shape (6 sliding groups of window 1024, 1 global group), bf16, 16 GiB: 52,428 blocks,
    # 16,384 tokens in flight; the engine said kv_cache_size_tokens 200,330 at max_model_len 32,800, i.e. 6 requests
    g = _groups(52428, 16384, [[0]] * 6, [[5]])
    assert lk.engine_requests_fit(g, 32800) == 200330 // 32800 == 6
    # by hand at 8,224 tokens: global cdiv(8224, 16) = 514 blocks, each sliding group cdiv(min(1023 + 16384, 8224),
    # 16) + 1 = 515; the pool over 8,224 tokens (52,428 x 16 // 8,224 = 102) overstates it seven times
    assert lk.engine_requests_fit(g, 8224) == 52428 // (514 + 6 * 515) == 14
    # CPU vLLM 0.32's answer for tests/engine/test_vllm_hybrid.py's tiny model: floor of its own max_concurrency
    cpu = {"num_blocks": 32768, "in_flight_tokens": 1024, "groups": [
        {"layers": [i], "spec": "SlidingWindowSpec", "block_size": 128, "window": 64} for i in range(3)] + [
        {"layers": [3], "spec": "FullAttentionSpec", "block_size": 256, "window": None}]}
    assert lk.engine_requests_fit(cpu, 512) == int(1927.5294117647059)
    # every layer global: the blocks over the request's blocks, each request rounded up to whole blocks
    assert lk.engine_requests_fit(_groups(1000, None, [], [[0, 1]]), 65) == 1000 // 5


def test_requests_that_fit_are_unknown_rather_than_guessed():
    assert lk.engine_requests_fit(_groups(1000, None, [[0]], [[1]]), 4096) is None      # window needs in-flight
    mamba = _groups(1000, 512, [], [[0]])
    mamba["groups"].append({"layers": [1], "spec": "MambaSpec", "block_size": 16, "window": None})
    assert lk.engine_requests_fit(mamba, 4096) is None
    # a hostile answer the protocol lets through (whole numbers >= 0): a block of 0 tokens or no groups at all
    assert lk.engine_requests_fit(_groups(1000, 512, [], [[0]], block=0), 4096) is None
    assert lk.engine_requests_fit({"num_blocks": 1000, "in_flight_tokens": 512, "groups": []}, 4096) is None
