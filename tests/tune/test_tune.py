"""kvcalib tune on tiny models: candidates per engine, sensitivity against brute force, statistics reuse, the
>448 case, budget and the written checkpoint."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from calib import pipeline
from calib.evaluation import emulate
from calib.evaluation.arms import Geometry, default_arm
from calib.evaluation.fakequant import fake_quant_kv
from calib.evaluation.measure import measure
from calib.evaluation.samples import Sample
from calib.evaluation.session import open_session
from calib.recipe import recipe as recipe_mod
from calib.recipe.dtypes import FP8_E4M3
from calib.tune import run, score, search, space
from calib.tune import stats as stats_mod
from helpers import TUNE_SMALL as SMALL
from helpers import tune_config as _config
from helpers import tune_data as _data
from helpers import tune_held as _held
from tiny import random_sequences, tiny_causal_lm


def _model(tmp: Path, name: str, k_layer: int | None = None, factor: float = 3000.0, sharpness: float = 60.0,
           layers: int = 3, **overrides) -> Path:
    """A tiny Llama (logits sharpened like a trained model's); with `k_layer`, that layer's K reaches ~factor
    (k_proj x factor, q_proj / (factor / sharpness): the same attention pattern, K beyond FP8's 448)."""
    model = tiny_causal_lm("llama", num_hidden_layers=layers, **overrides)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
        if k_layer is not None:
            attn = model.model.layers[k_layer].self_attn
            attn.k_proj.weight.mul_(factor)
            attn.q_proj.weight.div_(factor / sharpness)
    model.save_pretrained(tmp / name)
    return tmp / name


# ------------------------------------------------------------------------------------------- candidates

def test_candidates_per_engine_are_what_the_engine_loads():
    vllm = space.generate("vllm")
    assert len(vllm) == 2 * 2 * len(space.OBSERVERS) * len(space.HEADROOMS)
    assert {(c.dtype, c.granularity, c.q_scale) for c in vllm} == {
        ("fp8_e4m3", g, q) for g in ("tensor", "head") for q in (False, True)}
    trt = space.generate("trtllm", ("absmax", "mse"), (1.0,))
    assert [(c.dtype, c.granularity, c.q_scale, c.observer) for c in trt] == [
        ("fp8_e4m3", "tensor", False, "absmax"), ("fp8_e4m3", "tensor", False, "mse"),
        ("int8", "tensor", False, "absmax"), ("int8", "tensor", False, "mse")]
    # every candidate is a recipe the recipe checks accept for its engine (INT8 never for vLLM, no skip for TRT)
    for c in vllm + trt:
        r = c.recipe(recipe_mod.Recipe())
        assert r.targets == (c.target,) and r.dtype == c.dtype and r.headroom == c.headroom
    assert vllm[0].skipping([5, 2]).recipe(recipe_mod.Recipe()).skip_layers == (2, 5)
    with pytest.raises(recipe_mod.RecipeError, match="cannot skip"):
        trt[0].skipping([1]).recipe(recipe_mod.Recipe())
    assert len({c.name for c in vllm}) == len(vllm) and len({c.name for c in trt}) == len(trt)


def test_candidate_arms_apply_what_each_backend_reads():
    """Per-head scales and q_scale count only under FlashAttention-3; elsewhere the max over heads; TensorRT-LLM
    FP8 at scale 1.0; skipped layers stay unquantised. Scales checked against amax / qmax by hand."""
    from calib.scales.stats import LayerStats

    geo = Geometry((0, 1), 2, 4)
    st = {i: LayerStats(k_amax=torch.tensor([100.0, 448.0 * (i + 1)]), v_amax=torch.tensor([2.0, 1.0]),
                        q_amax=torch.tensor([8.0, 16.0, 4.0, 2.0])) for i in geo.layers}
    cpu, fa3 = emulate.by_name("vllm-cpu"), emulate.by_name("vllm-fa3")
    head_q = space.Candidate("vllm", granularity="head", q_scale=True, headroom=1.25)
    a = score.arm_for(head_q, st, geo, cpu)
    assert a.k[1].shape == () and float(a.k[1]) == pytest.approx(896 * 1.25 / 448) and not a.q
    b = score.arm_for(head_q, st, geo, fa3)
    assert b.k[0].shape == (1, 2, 1, 1) and b.k[0].reshape(-1).tolist() == pytest.approx([100 * 1.25 / 448, 1.25])
    assert float(b.q[0]) == pytest.approx(16 * 1.25 / 448)
    trt = score.arm_for(space.Candidate("trtllm"), st, geo, emulate.by_name("trtllm"))
    assert all(float(trt.k[i]) == 1.0 and float(trt.v[i]) == 1.0 for i in geo.layers)
    int8 = score.arm_for(space.Candidate("trtllm", dtype="int8"), st, geo, emulate.by_name("trtllm"))
    assert float(int8.v[0]) == pytest.approx(2.0 / 127)
    skip = score.arm_for(space.Candidate("vllm", skip=(1,)), st, geo, cpu)
    assert set(skip.k) == {0} and skip.skip == (1,)
    # same stored cache -> same key (measured once); a different scale -> another key
    assert score.arm_key(score.arm_for(space.Candidate("vllm", granularity="head"), st, geo, cpu)) == \
        score.arm_key(score.arm_for(space.Candidate("vllm"), st, geo, cpu))
    assert score.arm_key(a) != score.arm_key(score.arm_for(space.Candidate("vllm"), st, geo, cpu))


def test_paired_noise_is_the_standard_error_of_the_ratio():
    a, b, t = [10.0, 12.0, 9.0, 11.0], [10.5, 12.0, 9.5, 11.5], [10, 12, 9, 11]
    p = score.paired(a, b, t)
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / sum(t)
    var = sum((di - mean * ti) ** 2 for di, ti in zip(d, t)) / 3 * 4
    assert p.delta == pytest.approx(-1.5 / 42) and p.noise == pytest.approx(2 * var ** 0.5 / 42)
    assert p.measurable == (abs(p.delta) > p.noise)
    assert score.paired([1.0], [2.0], [5]).noise == float("inf")


# ------------------------------------------------------------------------------------------- sensitivity

def test_sensitivity_ranking_matches_brute_force(tmp_path):
    """Layers 1 and 3 saturate at scale 1.0 (K up to ~3000 and ~1500). The ranking by 'only this layer quantised'
    must pick the same layers to skip as trying every subset of 1 and 2 skipped layers."""
    model = tiny_causal_lm("llama", num_hidden_layers=4)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
        for layer, f in ((1, 3000.0), (3, 1500.0)):
            attn = model.model.layers[layer].self_attn
            attn.k_proj.weight.mul_(f)
            attn.q_proj.weight.div_(f / 60)
    ids = random_sequences(8, lo=24, hi=33, seed=5)
    samples = [Sample(i, tuple(s), 32) for i, s in enumerate(ids)]
    geo = Geometry((0, 1, 2, 3), 2, 16)
    base = default_arm(geo, FP8_E4M3)
    with fake_quant_kv(model, emulate.by_name("vllm-cpu")) as hook, torch.inference_mode():
        sess, _ = open_session(model, hook, None, samples, (32,), 8, 0)
        _, only = measure(sess, [score.only_layer(base, i) for i in geo.layers])
        sens = {i: only[f"only layer {i}"].summary.kl for i in geo.layers}
        subsets = [s for k in (1, 2) for s in itertools.combinations(geo.layers, k)]
        _, brute = measure(sess, [base.skipping(s) for s in subsets])
    rank = search.ranking(sens)
    assert rank[:2] == [1, 3]
    for k in (1, 2):
        kl = {s: brute[base.skipping(s).name].summary.kl for s in subsets if len(s) == k}
        assert set(min(kl, key=kl.get)) == set(rank[:k])


# ------------------------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def over448(tmp_path_factory):
    """Layer 1's K reaches ~3000: tune with --stats-out, then again from the statistics alone."""
    tmp = tmp_path_factory.mktemp("tune448")
    src = _model(tmp, "m", k_layer=1)
    first = run.run(_config(src, _data(tmp), tmp / "out", stats_out=tmp / "stats"))
    again = run.run(_config(src, None, tmp / "out2", stats=(str(tmp / "stats"),)))
    return tmp, src, first, again


def test_over_448_picks_a_calibrated_recipe_over_the_default(over448):
    tmp, src, first, _ = over448
    doc = first.doc
    assert doc["scales_matter"]["k_amax"] > 448 and doc["scales_matter"]["layers_over_448"] == [1]
    assert doc["baseline"]["failures"], "the default scale 1.0 saturates layer 1 and misses the bar"
    assert first.chosen is not None and first.chosen["summary"]["max_bucket_kl"] <= 0.01
    assert doc["scales_matter"]["measurable"] is True and first.chosen["name"] in doc["scales_matter"]["better"]
    assert doc["baseline"]["summary"]["kl"] > 3 * first.chosen["summary"]["kl"]
    assert first.serve == f"vllm serve {tmp / 'out'} --kv-cache-dtype fp8"
    # at least the whole cross product scored, the sensitivity measured, the skips tried
    assert sum(r["scored"] for r in doc["candidates"]) == len(doc["candidates"]) >= 8 + 1
    assert sorted(map(int, doc["sensitivity"]["kl_only_this_layer"])) == [0, 1, 2]


def test_checkpoint_is_what_calibrate_writes(over448):
    """The chosen recipe through `calibrate` on the same data gives the same scale tensors and config."""
    tmp, src, first, _ = over448
    cand = next(c for c in space.generate("vllm", ("absmax", "mse"), (1.0,)) if c.name == first.chosen["name"])
    recipe = cand.recipe(recipe_mod.Recipe().replace(samples=12, seq_len=32, min_tokens=8, batch_size=8))
    ref = pipeline.calibrate(src, _data(tmp), recipe, tmp / "by-calibrate", device="cpu").out
    ours, theirs = load_file(tmp / "out" / "kv_scales.safetensors"), load_file(ref / "kv_scales.safetensors")
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.allclose(ours[k], theirs[k], rtol=1e-6), k
    cfg = [json.loads((p / "config.json").read_text())["quantization_config"] for p in (tmp / "out", ref)]
    assert cfg[0] == cfg[1]
    from calib.verify import verify
    assert not [p for p in verify(tmp / "out", "all") if p.severity == "error"]
    record = json.loads((tmp / "out" / "tune.json").read_text())
    assert record["choice"]["candidate"] == cand.name
    marker = json.loads((tmp / "out" / ".kvcalib-output.json").read_text())
    assert {"tune.json", "tune.md", "kv_scales.safetensors"} <= set(marker["files"])


def test_resuming_from_statistics_gives_the_same_numbers(over448):
    tmp, _, first, again = over448
    assert sorted(p.name for p in (tmp / "stats").glob("*.safetensors")) == ["mse-fp8_e4m3.safetensors"]
    assert "pass" in first.doc["statistics"] and "pass" not in again.doc["statistics"]
    a = {r["name"]: r["summary"] for r in first.doc["candidates"]}
    b = {r["name"]: r["summary"] for r in again.doc["candidates"]}
    assert a == b and first.chosen["name"] == again.chosen["name"]
    assert load_file(tmp / "out" / "kv_scales.safetensors").keys() == load_file(tmp / "out2" / "kv_scales.safetensors").keys()


def test_in_range_model_reports_no_measurable_difference(tmp_path):
    src = _model(tmp_path, "m")
    res = run.run(_config(src, _data(tmp_path), tmp_path / "out", max_skip=0, observers=("absmax",)))
    matter = res.doc["scales_matter"]
    assert matter["k_amax"] < 448 and matter["measurable"] is False
    assert matter["text"].startswith("scales make no measurable difference")


def test_budget_stops_early_and_keeps_bf16_when_nothing_was_scored(tmp_path):
    src = _model(tmp_path, "m")
    res = run.run(_config(src, _data(tmp_path), tmp_path / "out", budget_minutes=1e-9))
    assert res.chosen is None and res.doc["budget"]["stopped"]
    assert len(res.doc["budget"]["not_scored"]) == len(res.doc["candidates"])
    assert res.headline.startswith("keep FP32 KV")         # the model's own dtype: this tiny model is FP32
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".kvcalib-output.json", "tune.json", "tune.md"]


def test_stats_from_another_model_are_refused(over448, tmp_path):
    tmp, _, _, _ = over448
    other = _model(tmp_path, "other", layers=2)
    with pytest.raises(Exception, match="another model"):
        stats_mod.load([tmp / "stats"], other)


@pytest.mark.slow        # one engine subprocess per arm (each imports torch and transformers): ~1-2 min
def test_engine_confirms_the_short_list(over448, tmp_path, monkeypatch):
    """With an engine (here tests/fake_vllm_runner.py, FP8 through kvcalib's emulation), the short list is
    exported as real checkpoints, measured there, and the engine's numbers decide; the exports are removed."""
    import sys

    from calib.engine import driver
    from calib.engine.driver import EngineSpec

    tmp, src, _, _ = over448
    monkeypatch.setenv(driver.RUNNER_ENV, str(Path(__file__).resolve().parents[1] / "fake_vllm_runner.py"))
    monkeypatch.setenv("FAKE_ENGINE", "fp8")
    spec = EngineSpec("vllm", Path(sys.executable).parent.parent, top_k=8, continuation_tokens=2)
    res = run.run(_config(src, None, tmp_path / "out", stats=(str(tmp / "stats"),), engine=spec, confirm=2,
                             max_skip=0))
    confirmed = [r for r in res.doc["candidates"] if r["numbers"] == "engine"]
    assert 1 <= len(confirmed) <= 2 and res.chosen["name"] in {r["name"] for r in confirmed}
    assert res.doc["reference"] is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held.jsonl", "out"]   # no temporary export left


@pytest.mark.parametrize("minutes, slow, elapsed, planned", [
    (0.5, 1.0, 30.0, "  candidates: 4 of 8 (2 measured arm(s) with the default scale 1.0): 30s"),
    (1.0, 1.5, 45.0, "  candidates: 8 of 8 (3 measured arm(s) with the default scale 1.0): 50s")])
def test_budget_plans_up_front_and_keeps_the_best_so_far(over448, tmp_path, monkeypatch, minutes, slow, elapsed,
                                                         planned):
    """A fake clock: a measuring pass of k arms over every held-out sample takes 10 s x (1 + k) by the probe and
    `slow` times that when it runs. Three arms in passes of two (the default + absmax, then mse), then the layer
    skips (50 s + 20 s). The plan, printed before any pass, fits the budget: at 30 s it drops the skips and the mse
    candidates (named); at 60 s the skips only, and the first pass's 45 s (1.5x its estimate) says the next would
    overrun. Either way the mse candidates stay unscored and the choice is among the rest. The clock before the
    plan (the reactive one) overran: it started a pass whenever the time was not yet spent (50 s of 30, 75 of 60)."""
    from calib.evaluation import plan

    tmp, src, _, _ = over448
    t, unit = [0.0], {}

    def probe(s, arm, cost):
        unit["w"], unit["cost"] = sum(cost.work(len(x.ids)) for x in s.samples), cost
        return plan.default_rates("cpu", 10 / unit["w"], 10 / unit["w"], 32)

    def timed(s, arms, **kw):
        out = measure(s, arms, **kw)
        t[0] += slow * 10 * (1 + len(arms)) * sum(unit["cost"].work(len(x.ids)) for x in s.samples) / unit["w"]
        return out
    monkeypatch.setattr(search, "now", lambda: t[0])
    monkeypatch.setattr(search, "probe", probe)
    monkeypatch.setattr(search, "measure", timed)
    log = []
    res = run.run(_config(src, None, tmp_path / "out", stats=(str(tmp / "stats"),), chunk=2, budget_minutes=minutes,
                          sensitivity_samples=8), log=lambda m: log.append((t[0], m)))
    doc, mse = res.doc, [r["name"] for r in res.doc["candidates"] if r["observer"] == "mse"]
    assert t[0] == pytest.approx(elapsed) and t[0] <= 60 * minutes
    plan_lines = [m for at, m in log if at == 0.0 and m.startswith("  ")]      # logged before any pass ran
    dropped = "layer skips (sensitivity of 3 layers, skips of 1..1)"
    dropped += f"; 4 candidate(s) not scored: {', '.join(mse)}" if minutes < 1 else ""
    assert planned in plan_lines and f"  dropped to fit the budget: {dropped}" in plan_lines
    assert doc["budget"]["not_scored"] == mse and doc["measuring_passes"] == 3
    assert doc["budget"]["stopped"].startswith("--budget-minutes: ")
    assert res.chosen is not None and res.chosen["observer"] == "absmax" and res.chosen["name"] == "fp8/tensor/absmax/h1"
    assert "stopped early" in (tmp_path / "out" / "tune.md").read_text().lower()


def test_tune_engines_and_observers_come_from_the_project_vocabulary():
    from calib.recipe import recipe
    from calib.tune import space
    assert set(space.TARGETS) <= set(recipe.TARGETS) and space.OBSERVERS == tuple(recipe.OBSERVERS)


def test_hybrid_model_gets_the_sliding_window_skip(tmp_path):
    """A model with sliding-window and global layers: tune measures the best candidate with the sliding-window
    layers kept at the model dtype, without being asked (--max-skip 0)."""
    torch.manual_seed(0)
    model = tiny_causal_lm("gemma3", num_hidden_layers=4, sliding_window=8,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"])
    model.save_pretrained(tmp_path / "g")
    res = run.run(_config(tmp_path / "g", _data(tmp_path), tmp_path / "out", max_skip=0, observers=("absmax",)))
    names = [r["name"] for r in res.doc["candidates"]]
    skipped = [n for n in names if n.endswith(" skip 0,1,2")]
    assert len(skipped) == 1 and skipped[0].split(" skip ")[0] in names
    row = next(r for r in res.doc["candidates"] if r["name"] == skipped[0])
    assert row["summary"] is not None
    # no engine: the fewest skipped layers chose, and tune says the engine did not count capacity
    assert res.doc["capacity"]["rule"] == "fewest skipped layers" and not res.doc["capacity"]["counted_by_engine"]
    assert "capacity was not counted by the engine" in (tmp_path / "out" / "tune.md").read_text()
