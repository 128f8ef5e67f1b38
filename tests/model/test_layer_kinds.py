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
