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
    with pytest.raises(StatsError, match="recipe differs"):
        pipeline.calibrate(tiny_llama_dir, token_data, r, tmp_path / "b", device="cpu", options=_opts(state, resume=True))
