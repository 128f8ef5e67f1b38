"""A run interrupted after a saved checkpoint resumes to bit-identical scales."""

import pytest
from safetensors.torch import load_file

from calib import pipeline
from calib.capture.statsfile import StatsError
from calib.recipe.recipe import Recipe


class Boom(RuntimeError):
    pass


def _opts(path, every=0, resume=False):
    return pipeline.RunOptions(prefetch=0, checkpoint=pipeline.Checkpointing(path=path, every=every, resume=resume))


@pytest.mark.parametrize("recipe", [Recipe(samples=12, seq_len=32, min_tokens=8, batch_size=2),
                                    Recipe(samples=12, seq_len=32, min_tokens=8, batch_size=2, observer="percentile")],
                         ids=["absmax", "percentile"])
def test_resume_after_interruption_is_bit_identical(tiny_llama_dir, token_data, tmp_path, monkeypatch, recipe):
    full = pipeline.calibrate(tiny_llama_dir, token_data, recipe, tmp_path / "full", device="cpu")
    state = tmp_path / "run.kvcalib-resume.safetensors"

    calls = {"n": 0}
    real_update = pipeline.observe.KVCapture.record

    def failing(self, *a, **k):  # crash in the 4th batch (layer calls: 3 layers per batch)
        calls["n"] += 1
        if calls["n"] > 3 * 3 + 1:
            raise Boom("power cut")
        return real_update(self, *a, **k)
    monkeypatch.setattr(pipeline.observe.KVCapture, "record", failing)
    with pytest.raises(Boom):
        pipeline.calibrate(tiny_llama_dir, token_data, recipe, tmp_path / "run", device="cpu",
                           options=_opts(state, every=2))
    assert state.is_file() and not (tmp_path / "run").exists()
    monkeypatch.setattr(pipeline.observe.KVCapture, "record", real_update)
    resumed = pipeline.calibrate(tiny_llama_dir, token_data, recipe, tmp_path / "run", device="cpu",
                                 options=_opts(state, every=2, resume=True))
    assert not state.exists()  # a completed run removes its saved state
    a, b = load_file(tmp_path / "full" / "kv_scales.safetensors"), load_file(tmp_path / "run" / "kv_scales.safetensors")
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    assert resumed.data.to_dict() == full.data.to_dict()


def test_resume_refuses_state_of_another_run(tiny_llama_dir, token_data, tmp_path):
    state = tmp_path / "s.safetensors"
    r = Recipe(samples=8, seq_len=32, min_tokens=8, batch_size=2)
    with pytest.raises(StatsError, match="no saved state"):
        pipeline.calibrate(tiny_llama_dir, token_data, r, tmp_path / "a", device="cpu", options=_opts(state, resume=True))
    from calib.capture import hook as observe, statsfile
    cap = observe.KVCapture([0, 1, 2])
    import torch
    for i in range(3):
        cap.record(i, torch.ones(1, 2, 3, 16), torch.ones(1, 2, 3, 16), torch.ones(1, 2, 3, 16))
    statsfile.save(state, cap, {"recipe": Recipe(seed=99).to_dict(), "batches_done": 1})
    with pytest.raises(StatsError, match=r"another run \(recipe: \{.*'seed': 99.*\} there, \{.*'seed': 0.*\} now\)"):
        pipeline.calibrate(tiny_llama_dir, token_data, r, tmp_path / "b", device="cpu", options=_opts(state, resume=True))


def _interrupted(model, data, recipe, tmp_path, monkeypatch, options=None):
    """A run stopped by a crash in its 4th batch, its state saved after batch 2; returns the state file."""
    state = tmp_path / "run.kvcalib-resume.safetensors"
    calls = {"n": 0}
    real = pipeline.observe.KVCapture.record

    def failing(self, *a, **k):
        calls["n"] += 1
        if calls["n"] > 3 * 3 + 1:
            raise Boom("power cut")
        return real(self, *a, **k)
    monkeypatch.setattr(pipeline.observe.KVCapture, "record", failing)
    with pytest.raises(Boom):
        pipeline.calibrate(model, data, recipe, tmp_path / "run", device="cpu", options=options or _opts(state, every=2))
    monkeypatch.setattr(pipeline.observe.KVCapture, "record", real)
    assert state.is_file()
    return state


RECIPE = Recipe(samples=12, seq_len=32, min_tokens=8, batch_size=2)


def test_resume_refuses_other_data_behind_the_same_name(tiny_llama_dir, token_data, tmp_path, monkeypatch):
    import json

    state = _interrupted(tiny_llama_dir, token_data, RECIPE, tmp_path, monkeypatch)
    lines = token_data.read_text().splitlines()
    first = json.loads(lines[0])
    first["input_ids"][3] = (first["input_ids"][3] + 1) % 257          # one token of one record
    token_data.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    with pytest.raises(StatsError, match=r"was saved from other batches than this run's first 2 \(token stream "
                                         r"[0-9a-f]{12} there, [0-9a-f]{12} now\): the data, its batching"):
        pipeline.calibrate(tiny_llama_dir, token_data, RECIPE, tmp_path / "run", device="cpu",
                           options=_opts(state, every=2, resume=True))
    assert state.is_file() and not (tmp_path / "run").exists()


def test_resume_refuses_other_batching(tiny_llama_dir, token_data, tmp_path, monkeypatch):
    state = _interrupted(tiny_llama_dir, token_data, RECIPE, tmp_path, monkeypatch)
    opts = pipeline.RunOptions(prefetch=0, max_batch_tokens=40,
                               checkpoint=pipeline.Checkpointing(path=state, every=2, resume=True))
    with pytest.raises(StatsError, match="was saved from other batches"):
        pipeline.calibrate(tiny_llama_dir, token_data, RECIPE, tmp_path / "run", device="cpu", options=opts)


def test_resume_refuses_other_weights_and_names_both(tiny_llama_dir, token_data, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    state = _interrupted(tiny_llama_dir, token_data, RECIPE, tmp_path, monkeypatch)
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2          # same config.json, other weights
    save_file(tensors, str(tiny_llama_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(StatsError, match=r"the saved state at .* was recorded on other weights than this run's model "
                                         r"\(weights [0-9a-f]{12} there, [0-9a-f]{12} here\)"):
        pipeline.calibrate(tiny_llama_dir, token_data, RECIPE, tmp_path / "run", device="cpu",
                           options=_opts(state, every=2, resume=True))


def test_a_state_without_fingerprints_resumes_with_one_line_saying_so(tiny_llama_dir, token_data, tmp_path,
                                                                       monkeypatch, capsys):
    from calib.capture import statsfile

    state = _interrupted(tiny_llama_dir, token_data, RECIPE, tmp_path, monkeypatch)
    raw = statsfile.read(state)
    capture = statsfile.build_capture(raw)
    old = {k: v for k, v in raw.header.items() if k not in ("stream_sha256", "model_weights_sha256", "layers")}
    statsfile.save(state, capture, old)                          # as a kvcalib before fingerprints wrote it
    capsys.readouterr()
    pipeline.calibrate(tiny_llama_dir, token_data, RECIPE, tmp_path / "run", device="cpu",
                       options=_opts(state, every=2, resume=True))
    err = capsys.readouterr().err
    assert "carries no weights fingerprint (written by an older kvcalib): not checked" in err
    assert "carries no hash of its batches (written by an older kvcalib)" in err
