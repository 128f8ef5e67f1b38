"""The KV scale name parser against an independent statement of what the engines map: a layer index is the
name of the layer's module, str(i) (ASCII digits, no leading zero); the prefix is one of the layouts'; the
attention module is `self_attn`. Property tests over arbitrary layer tokens, prefixes and module names."""

from __future__ import annotations

import string

from hypothesis import given, settings
from hypothesis import strategies as st

from calib.ckpt.names import (PREFIXES, is_scale_like, parse_scale_name, scale_module, trtllm_scale_names,
                              unparsed_reason, vllm_scale_name)

LEAVES = {"self_attn.k_scale": ("k", "attn"), "self_attn.v_scale": ("v", "attn"), "self_attn.q_scale": ("q", "attn"),
          "self_attn.k_proj.k_scale": ("k", "proj"), "self_attn.v_proj.v_scale": ("v", "proj"),
          "self_attn.k_proj.output_scale": ("k", "quark"), "self_attn.v_proj.output_scale": ("v", "quark")}
leaves = st.sampled_from(sorted(LEAVES))
# layer tokens of every kind: ASCII digits (with and without leading zeros), other scripts' decimal digits,
# letters, signs, blanks
tokens = st.one_of(st.integers(0, 10**6).map(str), st.text(string.digits, min_size=1, max_size=6),
                   st.text(st.characters(categories=["Nd"]), min_size=1, max_size=4),
                   st.text(st.characters(exclude_characters="."), min_size=1, max_size=6))


def engine_names_a_module(token: str) -> bool:
    """Independent of the parser: an nn.ModuleList names its i-th child str(i)."""
    return token.isascii() and token.isdigit() and token == str(int(token))


@settings(max_examples=400, deadline=None)
@given(tokens, leaves, st.sampled_from(PREFIXES))
def test_a_layer_token_parses_exactly_when_it_is_a_module_name(token, leaf, prefix):
    name = f"{prefix}layers.{token}.{leaf}"
    parsed = parse_scale_name(name)
    assert is_scale_like(name)
    if engine_names_a_module(token):
        assert parsed is not None and parsed.layer == int(token) and (parsed.kind, parsed.form) == LEAVES[leaf]
        assert scale_module(name) == f"{prefix}layers.{token}.self_attn"
    else:
        assert parsed is None
        why = unparsed_reason(name)
        assert why.startswith(f"layer index {token!r} ") and "\n" not in why


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 999), st.integers(1, 3), leaves)
def test_zero_padded_layers_are_refused_naming_the_real_module(layer, zeros, leaf):
    token = "0" * zeros + str(layer)
    name = f"model.layers.{token}.{leaf}"
    assert parse_scale_name(name) is None
    assert unparsed_reason(name) == (f"layer index {token!r} has a leading zero (the engines' module for that layer "
                                     f"is named {str(layer)!r})")


@settings(max_examples=200, deadline=None)
@given(st.text(st.characters(categories=["Nd"]).filter(lambda c: not c.isascii()), min_size=1, max_size=3), leaves)
def test_other_scripts_digits_are_refused(token, leaf):
    name = f"model.layers.{token}.{leaf}"
    assert parse_scale_name(name) is None and "is not written in ASCII digits" in unparsed_reason(name)


@settings(max_examples=300, deadline=None)
@given(st.text(string.ascii_lowercase + "._", max_size=24), st.integers(0, 64), leaves)
def test_a_prefix_parses_exactly_when_it_is_a_layouts(prefix, layer, leaf):
    name = f"{prefix}layers.{layer}.{leaf}"
    assert (parse_scale_name(name) is not None) == (prefix in PREFIXES)


@settings(max_examples=300, deadline=None)
@given(st.text(string.ascii_lowercase + "_", min_size=1, max_size=12), st.integers(0, 64), st.sampled_from("kv"))
def test_an_attention_module_parses_exactly_when_it_is_self_attn(module, layer, kind):
    name = f"model.layers.{layer}.{module}.{kind}_scale"
    parsed = parse_scale_name(name)
    assert (parsed is not None) == (module == "self_attn")
    if parsed is None:
        assert unparsed_reason(name) == f"attention module {module!r} (the scale layouts hang under 'self_attn')"


@given(st.integers(0, 10**5), st.sampled_from("qkv"))
def test_the_names_kvcalib_writes_parse_back(layer, kind):
    p = parse_scale_name(vllm_scale_name(layer, kind))
    assert (p.layer, p.kind, p.form) == (layer, kind, "attn")
    for kind, name in zip("kv", trtllm_scale_names(layer)):
        p = parse_scale_name(name)
        assert (p.layer, p.kind, p.form, p.proj) == (layer, kind, "proj", kind)


def test_weight_quantization_tensors_are_not_scale_like():
    for name in ("model.layers.0.self_attn.k_proj.weight_scale", "model.layers.0.self_attn.k_proj.input_scale",
                 "model.layers.0.mlp.down_proj.output_scale", "model.layers.0.self_attn.o_proj.output_scale",
                 "model.layers.0.self_attn.k_proj.weight"):
        assert not is_scale_like(name), name
    for name in ("model.layers.0.self_attn.kv_scale", "transformer.h.0.attn.k_scale",
                 "model.layers.0.self_attn.k_cache.scale"):
        assert is_scale_like(name) and parse_scale_name(name) is None, name
