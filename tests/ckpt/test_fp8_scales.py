"""Scale tensors another tool stored as FP8 are read by widening their bytes (calib/ckpt/reader.py), the same
values torch gives, so `inspect`, `verify` and `eval --scales` see numbers instead of a numpy traceback."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from calib.ckpt.reader import tensor_values, widen_fp8
from calib.cli import main
from tiny import tiny_causal_lm


@pytest.mark.parametrize("dtype, name", [(torch.float8_e4m3fn, "F8_E4M3"), (torch.float8_e5m2, "F8_E5M2")])
def test_every_fp8_byte_widens_to_torchs_value(dtype, name):
    raw = bytes(range(256))
    ref = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).to(torch.float64).numpy()
    assert np.array_equal(widen_fp8(raw, name), ref, equal_nan=True)


def test_a_checkpoint_with_fp8_stored_scales_reads_their_values(tmp_path):
    from calib.export import vllm
    from calib.scales.fold import LayerScales

    src = tmp_path / "model"
    tiny_causal_lm("llama").save_pretrained(src)
    scales = {i: LayerScales(torch.tensor(0.1 * (i + 1)), torch.tensor(0.3), torch.ones(2), torch.ones(2))
              for i in range(3)}
    out = tmp_path / "ckpt"
    vllm.export_vllm(src, out, scales, {"producer": "kvcalib"})
    shard = out / "kv_scales.safetensors"
    stored = {k: v.to(torch.float8_e4m3fn) for k, v in load_file(shard).items()}
    save_file(stored, str(shard), metadata={"format": "pt"})
    for name, t in stored.items():
        assert tensor_values(shard, name).tolist() == [t.float().item()]
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert stored["model.layers.1.self_attn.k_scale"].float().item() == 0.203125 and " 0.203125 " in r.output
