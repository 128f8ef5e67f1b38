"""Models larger than memory: accelerate device maps with CPU/disk offload give the same scales."""

import torch

from calib import pipeline
from calib.model.load import Placement
from calib.recipe.recipe import Recipe


def test_disk_offload_gives_the_same_scales(tiny_llama_dir, token_data, tmp_path):
    r = Recipe(samples=8, seq_len=32, min_tokens=8)
    plain = pipeline.calibrate(tiny_llama_dir, token_data, r, tmp_path / "a", device="cpu")
    # ~100 KB of CPU memory forces most decoder layers onto disk
    place = Placement(device_map="auto", max_memory={"cpu": "100KB"}, offload_folder=str(tmp_path / "offload"))
    from calib.model.load import load
    loaded = load(tiny_llama_dir, placement=place)
    assert "disk" in set(loaded.model.hf_device_map.values()), loaded.model.hf_device_map
    off = pipeline.calibrate(tiny_llama_dir, token_data, r, tmp_path / "b", placement=place)
    for i in plain.scales:
        assert torch.equal(plain.scales[i].k_scale, off.scales[i].k_scale)
        assert torch.equal(plain.scales[i].v_scale, off.scales[i].v_scale)
