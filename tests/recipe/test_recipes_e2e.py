"""Every shipped recipe end to end on a tiny model, each output checked against an independent number."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from calib import pipeline, resources
from calib.capture import spec
from calib.recipe import recipe as recipe_mod
from tiny import tiny_causal_lm
from helpers import reference_amax, rotate_half, used_sequences

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))
SMALL = dict(samples=8, seq_len=32, min_tokens=8, batch_size=4)


def _run(src, data, out, name, **extra):
    r = recipe_mod.load(Path("recipes") / f"{name}.yaml" if not str(name).endswith(".yaml") else name)
    r = r.replace(**SMALL, **extra)
    # INT8 for TensorRT-LLM is written only for a build that applies it (calib.recipe.support)
    versions = {"trtllm": "pr18953"} if r.dtype == "int8" else {}
    return r, pipeline.calibrate(src, data, r, out, device="cpu", engine_versions=versions)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for shard in sorted(set(index.values())):
        with safe_open(path / shard, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if k.endswith("_scale")})
    return out


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_shipped_recipe_runs(path, tiny_llama_dir, token_data, tmp_path):
    src = tiny_llama_dir
    if path.stem == "fp8-skip-sliding":
        src = tmp_path / "gemma2"
        tiny_causal_lm("gemma2").save_pretrained(src)
    r, res = _run(src, token_data, tmp_path / "out", path)
    prov = json.loads(((res.out / r.targets[0]) if len(r.targets) > 1 else res.out).joinpath("kvcalib.json").read_text())
    assert prov["recipe"] == r.to_dict()
    if not r.targets:
        assert (res.out / "stats.safetensors").is_file()
    for s in res.scales.values():
        assert torch.isfinite(s.k_scale).all() and (s.k_scale > 0).all()


def test_per_head_scales_are_head_amax_over_448_in_vllm_layout(tiny_llama_dir, token_data, tmp_path):
    r, res = _run(tiny_llama_dir, token_data, tmp_path / "out", "fp8-head")
    ref = reference_amax(tiny_causal_lm("llama"), used_sequences(token_data, r, 257)[0])
    t = _tensors(res.out)
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    for i, (k, v) in ref.items():
        got = t[f"model.layers.{i}.self_attn.k_scale"]
        assert got.shape == (2, 1, 1) and got.dtype == torch.float32
        torch.testing.assert_close(got.flatten(), k / 448, rtol=1e-5, atol=0)
        torch.testing.assert_close(t[f"model.layers.{i}.self_attn.v_scale"].flatten(), v / 448, rtol=1e-5, atol=0)


def test_q_scale_is_max_q_after_rope_per_head(tiny_llama_dir, token_data, tmp_path):
    r, res = _run(tiny_llama_dir, token_data, tmp_path / "out", "fp8-head-q")
    seqs = used_sequences(token_data, r, 257)[0]
    model = tiny_causal_lm("llama")
    q_max = {}

    def hook(module, args, kwargs):  # Q from the projection with RoPE applied here, independently
        h = kwargs["hidden_states"]
        q = module.q_proj(h).view(*h.shape[:2], -1, module.head_dim).transpose(1, 2)
        cos, sin = (x.unsqueeze(1) for x in kwargs["position_embeddings"])
        q = q * cos + rotate_half(q) * sin
        m = q.abs().amax(dim=(0, 2, 3))
        q_max[module.layer_idx] = torch.maximum(q_max.get(module.layer_idx, m), m)

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        for s in seqs:
            model(input_ids=torch.tensor([s]))
    t = _tensors(res.out)
    for i, m in q_max.items():
        got = t[f"model.layers.{i}.self_attn.q_scale"]
        assert got.shape == (4, 1, 1)  # one per query head
        torch.testing.assert_close(got.flatten(), m / 448, rtol=1e-5, atol=0)


def test_skip_sliding_window_layers_of_gemma2(tmp_path, token_data):
    src = tmp_path / "gemma2"
    model = tiny_causal_lm("gemma2", num_hidden_layers=4)
    model.save_pretrained(src)
    sliding = [i for i, t in enumerate(model.config.layer_types) if t == "sliding_attention"]
    assert 0 < len(sliding) < 4
    r, res = _run(src, token_data, tmp_path / "out", "fp8-skip-sliding")
    assert res.skipped == sliding
    assert json.loads((res.out / "kvcalib.json").read_text())["skipped_layers"] == sliding


def test_skip_unknown_layer_is_an_error(tiny_llama_dir, token_data, tmp_path):
    from calib.model.load import ModelError
    with pytest.raises(ModelError, match="layer 7"):
        _run(tiny_llama_dir, token_data, tmp_path / "out", "fp8-tensor", skip_layers=(7,))
    with pytest.raises(ModelError, match="no sliding-window layers"):
        _run(tiny_llama_dir, token_data, tmp_path / "out", "fp8-skip-sliding")
    assert not (tmp_path / "out").exists()


def test_channel_statistics_reduce_to_the_head_amax(tiny_llama_dir, token_data, tmp_path):
    r, res = _run(tiny_llama_dir, token_data, tmp_path / "out", "stats-channel")
    stats = load_file(res.out / "stats.safetensors")
    ch = stats["stats.layers.1.k_channel"]
    assert ch.shape == (2, 16)
    torch.testing.assert_close(ch.amax(dim=1), stats["stats.layers.1.k_amax"])


def test_token_statistics_are_ordered_quantiles_below_the_max(tiny_llama_dir, token_data, tmp_path):
    r, res = _run(tiny_llama_dir, token_data, tmp_path / "out", "stats-token")
    stats = load_file(res.out / "stats.safetensors")
    tok, amax = stats["stats.layers.0.k_token"], stats["stats.layers.0.k_amax"]
    assert tok.shape == (len(spec.TOKEN_QUANTILES), 2)
    assert (tok[1:] >= tok[:-1]).all()
    assert (tok[-1] <= amax * 1.001).all() and (tok[-1] >= amax * 0.99).all()


def test_rope_bound_k_scale_is_at_least_absmax(tiny_llama_dir, token_data, tmp_path):
    _, base = _run(tiny_llama_dir, token_data, tmp_path / "a", "fp8-tensor")
    _, rope = _run(tiny_llama_dir, token_data, tmp_path / "b", "fp8-rope-bound")
    for i in base.scales:
        assert float(rope.scales[i].k_scale) >= float(base.scales[i].k_scale)
        assert float(rope.scales[i].v_scale) == float(base.scales[i].v_scale)  # V is not rotated: absmax


def test_percentile_and_mse_clip_at_or_below_absmax(tiny_llama_dir, token_data, tmp_path):
    _, base = _run(tiny_llama_dir, token_data, tmp_path / "a", "fp8-tensor")
    for name in ("fp8-percentile", "fp8-mse"):
        _, res = _run(tiny_llama_dir, token_data, tmp_path / name, name)
        for i in base.scales:
            assert float(res.scales[i].k_scale) <= float(base.scales[i].k_scale) * 1.001


@pytest.mark.slow
@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_on_the_embedded_default(path, tmp_path):
    """The shipped recipes on the embedded default (SmolLM2-135M-Instruct, built once) and the sample text."""
    from calib.cli import DEFAULT_DATA
    from calib.model.default_model import ensure_default_model
    from calib.verify import verify

    model = ensure_default_model(resources.build_dir(), log=lambda m: None)
    r = recipe_mod.load(path).replace(samples=8, seq_len=64)  # plumbing, not statistics: a 135M model on CPU
    if "sliding_window" in r.skip_layers:  # the default Llama has no sliding-window layers: a clear refusal
        from calib.model.load import ModelError
        with pytest.raises(ModelError, match="no sliding-window layers"):
            pipeline.calibrate(model, DEFAULT_DATA, r, tmp_path / "out", device="cpu")
        return
    res = pipeline.calibrate(model, DEFAULT_DATA, r, tmp_path / "out", device="cpu")
    assert res.data.used == 8 and len(res.stats) == 30
    dirs = [res.out / t for t in r.targets] if len(r.targets) > 1 else [res.out] if r.targets else []
    for d, target in zip(dirs, r.targets):
        assert [p for p in verify(d, target) if p.severity == "error"] == [], d
    for s in res.scales.values():
        assert torch.isfinite(s.k_scale).all() and (s.k_scale > 0).all()
    if r.granularity == "tensor" and r.observer == "absmax" and r.targets:
        qmax = 448.0 if r.dtype == "fp8_e4m3" else 127.0
        for i, s in res.scales.items():
            assert float(s.k_scale) == pytest.approx(float(res.stats[i].k_amax.max()) / qmax, rel=1e-6)
