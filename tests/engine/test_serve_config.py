"""Serve configurations (calib/engine/serve.py) and the scale check of the protocol: which arms share one engine
start, the scales each must hold (against the checkpoint's tensors read independently), and the one-line reason
when the engine holds other ones. Runs in kvcalib's venv: no engine here."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from calib.engine import protocol, serve
from calib.engine.run import request_arm, served_skip, starts
from calib.evaluation import verdict as honest
from calib.evaluation.arms import Geometry, checkpoint_arms, default_arm, reference_arm
from calib.recipe.dtypes import kv_dtype
from helpers import arm_metrics, calibrate_small, save_model_and_data
from tiny import tiny_causal_lm


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny model, two per-tensor checkpoints of it (one with q scales), one per-head, and another model."""
    tmp = tmp_path_factory.mktemp("serve")
    src, data = save_model_and_data(tmp, tiny_causal_lm("llama"), "model")
    other, _ = save_model_and_data(tmp, tiny_causal_lm("llama", seed=1), "other")
    a = calibrate_small(src, data, tmp / "a")
    b = calibrate_small(src, data, tmp / "b", q_scale=True, headroom=1.5)
    head = calibrate_small(src, data, tmp / "head", granularity="head", q_scale=True)
    return src, other, a, b, head


def _geo(src):
    config = json.loads((src / "config.json").read_text())
    return Geometry(tuple(range(config["num_hidden_layers"])), config["num_key_value_heads"],
                    config["hidden_size"] // config["num_attention_heads"])


def _tensors(ckpt):
    out = {}
    for f in ckpt.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def test_a_checkpoint_has_its_models_identity_and_another_model_not(models):
    src, other, a, b, head = models
    assert serve.identity(str(src))[0] == "weights"
    assert serve.identity(str(src)) == serve.identity(str(a)) == serve.identity(str(head))
    assert serve.identity(str(other)) != serve.identity(str(src))
    assert serve.identity("org/some-hub-model") == ("path", "org/some-hub-model")


def test_arms_differing_only_in_scales_share_a_start(models):
    src, other, a, b, head = models
    geo, fp8 = _geo(src), kv_dtype("fp8_e4m3")
    default = default_arm(geo, fp8)
    arms = [default, *checkpoint_arms(str(a), geo), *checkpoint_arms(str(b), geo)]
    specs = [request_arm(x, str(src)) for x in [reference_arm(torch.bfloat16), *arms]]
    assert serve.group(specs) == [[0], [1, 2, 3]]                 # the reference (model-dtype KV) alone
    assert starts(arms, str(src)) == 1
    # per head: its own start (its engine tensors have another shape); '@tensor' is not an engine arm
    per_head = checkpoint_arms(str(head), geo)
    assert [x.name.endswith("@tensor") for x in per_head] == [False, True]
    assert starts(arms + per_head, str(src)) == 2
    # another skip set, another KV dtype, other weights: each its own start
    assert starts([default.skipping([1]), default, default.skipping([1, 2])], str(src)) == 3
    e5m2 = {**request_arm(default, str(src)), "kv_cache_dtype": "fp8_e5m2"}
    specs = [request_arm(x, m) for x, m in ((default, str(src)), (default, str(other)), (default, str(src)))]
    assert serve.group(specs + [e5m2]) == [[0, 2], [1], [3]]


def test_scales_sent_are_the_checkpoints_as_the_engine_loads_them(models):
    """Per tensor: the stored value; per head: k/v flattened, q the max per KV-head group; 1.0 where none."""
    src, other, a, b, head = models
    geo = _geo(src)
    heads = json.loads((src / "config.json").read_text())["num_attention_heads"]
    for ckpt, layout in ((a, "tensor"), (b, "tensor"), (head, "head")):
        sent = request_arm(checkpoint_arms(str(ckpt), geo)[0], str(src))["scales"]
        t = _tensors(ckpt)
        assert sent["layout"] == layout and [r["layer"] for r in sent["layers"]] == list(geo.layers)
        for row in sent["layers"]:
            pre = f"model.layers.{row['layer']}.self_attn."
            assert row["k"] == t[pre + "k_scale"].float().flatten().tolist()
            assert row["v"] == t[pre + "v_scale"].float().flatten().tolist()
            q = t.get(pre + "q_scale")
            if q is None:
                assert row["q"] == [1.0] * len(row["k"])
            else:
                want = q.float().flatten().reshape(geo.kv_heads, heads // geo.kv_heads).amax(1) if layout == "head" \
                    else q.float().flatten()
                assert row["q"] == want.tolist()
        assert len(sent["layers"][0]["k"]) == (geo.kv_heads if layout == "head" else 1)
    assert any(len(set(r["q"])) == 1 and r["q"] != [1.0] for r in
               request_arm(checkpoint_arms(str(b), geo)[0], str(src))["scales"]["layers"])
    default = request_arm(default_arm(geo, kv_dtype("fp8_e4m3")), str(src))["scales"]
    assert all(r["k"] == r["v"] == r["q"] == [1.0] for r in default["layers"])
    assert request_arm(reference_arm(torch.bfloat16), str(src))["scales"] is None


def _held(rows):
    return {"layers": [{**r, **{f"{k}_float": max(r[k]) for k in "kvq"}} for r in rows]}


def test_scales_that_did_not_take_are_named_by_layer():
    sent = {"layout": "tensor", "layers": [{"layer": 0, "k": [0.5], "v": [0.25], "q": [1.0]},
                                           {"layer": 1, "k": [0.125], "v": [0.5], "q": [2.0]}]}
    same = _held([{k: v for k, v in r.items()} for r in sent["layers"]])
    assert protocol.scales_mismatch(sent, same) is None
    assert protocol.scales_mismatch(None, None) is None
    stale = _held([sent["layers"][0], {**sent["layers"][1], "k": [1.0]}])
    assert protocol.scales_mismatch(sent, stale) == "layer 1: sent k 0.125, engine holds 1"
    floats = json.loads(json.dumps(same))
    floats["layers"][0]["v_float"] = 1.0                       # the tensor changed, the kernel's float did not
    assert protocol.scales_mismatch(sent, floats) == "layer 0: engine's v tensor holds 0.25 but its v_float 1.0"
    assert protocol.scales_mismatch(sent, _held(sent["layers"][:1])) == \
        "layer 1: the engine has no attention layer with that index"
    heads = _held([{**sent["layers"][0], "k": [0.5, 0.5]}, sent["layers"][1]])
    assert protocol.scales_mismatch(sent, heads) == "layer 0: sent k 0.5, engine holds [0.5, 0.5]"
    assert protocol.scales_mismatch(sent, None) == "the runner read no scales back"
    # float32 rounding is not a difference; a relative 1e-5 is
    close = _held([{**sent["layers"][0], "k": [0.5 * (1 + 1e-7)]}, sent["layers"][1]])
    assert protocol.scales_mismatch(sent, close) is None
    far = _held([{**sent["layers"][0], "k": [0.5 * (1 + 1e-5)]}, sent["layers"][1]])
    assert protocol.scales_mismatch(sent, far).startswith("layer 0: sent k 0.5, engine holds 0.500005")


def test_skip_lists_equal_as_sets_share_a_start():
    """A layer-kind name and layer numbers in any order are one serve configuration (one engine start)."""
    def spec(skip):
        return {"model": "m", "kv_cache_dtype": "fp8", "skip_layers": skip, "scales": {"layout": "tensor"}}
    def ident(model):
        return ("path", model)
    assert serve.key(spec(["sliding_window", 7, 2]), ident) == serve.key(spec([2, 7, "sliding_window"]), ident)
    assert len(serve.group([spec(["sliding_window", 7, 2]), spec([7, "sliding_window", 2])])) == 1


def test_a_checkpoints_layer_skips_and_the_sliding_window_skip_are_served_in_one_order():
    """The engine's skip list of a checkpoint calibrated with layer skips, again with its sliding-window layers
    kept: the numbers in order, then the kind's name (as the serve key and the report write it)."""
    arm = SimpleNamespace(skip=(1, 4, 5), serve_skip=(5, 1), skip_kind="sliding_window")
    assert served_skip(arm) == [1, 5, "sliding_window"]
    info = replace(arm_metrics(skip=(1, 4, 5), serve_skip=(5, 1)).info, skip_kind="sliding_window")
    assert "--kv-cache-dtype-skip-layers 1 5 sliding_window`" in honest.how_to_serve(info)


def _loaded_q(stored, heads, kv_heads, strategy):
    """vLLM's loader rule, brute force: per KV head (compressed-tensors `attn_head`) query head h belongs to KV head
    h // (heads // kv_heads) and the engine holds the max of each KV head's query scales; per tensor it holds one."""
    if strategy == "tensor":
        return [max(stored)]
    return [max(s for h, s in enumerate(stored) if h // (heads // kv_heads) == j) for j in range(kv_heads)]


@pytest.mark.parametrize("kv_heads,heads,strategy", [(1, 4, "attn_head"), (2, 8, "attn_head"), (4, 4, "attn_head"),
                                                     (1, 4, "tensor")])
def test_q_scales_sent_are_what_the_loader_holds_per_kv_head(monkeypatch, kv_heads, heads, strategy):
    """Per query head q scales reach the engine reduced to its q tensor: one per KV head (MQA and GQA alike, MHA
    unchanged), one per tensor; k/v as stored."""
    per = kv_heads if strategy == "attn_head" else 1
    stored = {i: {"k": [0.5 + i] * per, "v": [0.25] * per, "q": [0.125 * (i + 1) * (1 + (h * 7) % 5)
                                                                     for h in range(heads)]} for i in range(2)}
    monkeypatch.setattr(serve, "read_kv_info", lambda _: SimpleNamespace(kv_scheme={"strategy": strategy},
                                                                         scales=stored))
    arm = SimpleNamespace(dtype=kv_dtype("fp8_e4m3"), kind="checkpoint", source="ck", k=stored, v=stored, skip=(),
                          serve_skip=())
    sent = serve.scales_of(arm)
    assert sent["layout"] == ("head" if strategy == "attn_head" else "tensor")
    for row in sent["layers"]:
        sc = stored[row["layer"]]
        assert row["q"] == _loaded_q(sc["q"], heads, kv_heads, strategy)
        assert row["k"] == sc["k"] and row["v"] == sc["v"]
