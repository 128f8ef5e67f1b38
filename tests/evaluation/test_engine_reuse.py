"""Engine arms grouped by serve configuration (calib/engine/run.py + serve.py), through the driver and the fake
runner (tests/fake_vllm_runner.py, which logs each engine start): FP8 at 1.0 and two per-tensor checkpoints of
the same model take one start after the reference's, their numbers equal those of separate starts, and an arm
whose scales the engine does not hold afterwards is not run, naming the layer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from calib.engine import driver
from calib.engine.driver import EngineSpec
from calib.engine.run import EngineRun
from calib.evaluation.arms import Geometry, checkpoint_arms, default_arm, reference_arm
from calib.evaluation.samples import Sample
from calib.progress import SILENT, Progress
from calib.recipe.dtypes import kv_dtype
from helpers import calibrate_small, save_model_and_data
from tiny import random_sequences, tiny_causal_lm

FAKE = Path(__file__).resolve().parents[1] / "fake_vllm_runner.py"
VENV = Path(sys.executable).parent.parent


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reuse")
    lm = tiny_causal_lm("llama")
    src, data = save_model_and_data(tmp, lm, "model")
    a = calibrate_small(src, data, tmp / "a")
    b = calibrate_small(src, data, tmp / "b", headroom=4.0)
    cfg = lm.config
    geo = Geometry(tuple(range(cfg.num_hidden_layers)), cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    arms = [default_arm(geo, kv_dtype("fp8_e4m3")), *checkpoint_arms(str(a), geo), *checkpoint_arms(str(b), geo)]
    samples = [Sample(j, tuple(ids[:24]), 32) for j, ids in enumerate(random_sequences(3, lo=24, hi=30, seed=5))]
    return src, arms, samples, tmp


def _measure(setup, monkeypatch, groups_of_arms, progress=None, **env):
    src, arms, samples, tmp = setup
    starts = tmp / f"starts-{len(list(tmp.glob('starts-*')))}.log"
    for k, v in {driver.RUNNER_ENV: str(FAKE), "FAKE_ENGINE": "fp8", "FAKE_STARTS": str(starts), **env}.items():
        monkeypatch.setenv(k, v)
    run = EngineRun(EngineSpec("vllm", VENV, top_k=4, continuation_tokens=2), "0.0-fake", str(src), "float32",
                    samples, (32,), progress=progress or SILENT)
    out = {}
    for group in groups_of_arms:
        out.update(run.measure(reference_arm(torch.float32), [arms[j] for j in group]))
    return out, starts.read_text().splitlines(), run.starts


def test_arms_differing_only_in_scales_share_one_start_and_match_separate_starts(setup, monkeypatch):
    _, arms, samples, _ = setup
    lines: list[str] = []
    together, log, n = _measure(setup, monkeypatch, [[0, 1, 2]], Progress(lines.append, every=0.0))
    names = [a.name for a in arms]
    assert log == ["fp32", " + ".join(names)] and n == 2         # before: 4 starts (one per arm)
    # one progress stage per start; its counters run over the arms of the start, each line names the arm
    group = [x for x in lines if x.startswith("eval vllm `default` + 2 arm(s) on one engine start")]
    assert group, lines
    assert f"samples {3 * len(samples)}/{3 * len(samples)}" in group[-1] and "arm 4/4" in group[-1]
    assert any("arm 2/4" in x for x in group) and any("arm 3/4" in x for x in group)
    apart, log, n = _measure(setup, monkeypatch, [[0], [1], [2]])
    assert log == ["fp32", *names] and n == 4
    for name in names:
        assert together[name].ok, together[name]
        assert together[name].summary == apart[name].summary
        assert together[name].sample_nll == apart[name].sample_nll
    assert together[names[1]].summary != together[names[2]].summary    # the checkpoints differ: a real check


def test_an_arm_whose_scales_did_not_take_is_not_run_naming_the_layer(setup, monkeypatch):
    _, arms, _, _ = setup
    out, log, _ = _measure(setup, monkeypatch, [[0, 1, 2]], FAKE_SCALES="drop")
    assert out[arms[0].name].ok
    for arm in arms[1:]:
        got = out[arm.name]
        want_k = float(arm.k[0])
        assert not got.ok
        assert got.reason.startswith(f"scales did not take (layer 0: sent k {want_k:.6g}, engine holds 1)"), got
