"""Run vLLM's own per-token-head cache-write kernels on fixed K/V and save what they store (tests/engine/
test_vllm_formats.py compares it with calib/evaluation/dynamic.py, bit for bit).

Runs in the vLLM environment under Triton's CPU interpreter (TRITON_INTERPRET=1): vLLM's CPU build disables
Triton (no CPU backend), so `vllm.triton_utils` is pointed at the installed Triton before the kernels' modules
are imported. The kernels are vLLM's, unchanged:
`vllm/v1/attention/ops/triton_reshape_and_cache_flash.py` `triton_reshape_and_cache_flash_per_token_head_quant`
(FP8, INT8) and `vllm/v1/attention/ops/int4_per_token_head.py` `reshape_and_cache_int4` (INT4).

    TRITON_INTERPRET=1 <vllm venv>/bin/python vllm_kernels.py OUT.pt
"""

from __future__ import annotations

import os
import sys


def main(out: str) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import triton
    import triton.language as tl
    import triton.language.extra.libdevice as tldevice

    import vllm.triton_utils as tu

    tu.triton, tu.tl, tu.tldevice = triton, tl, tldevice
    from vllm.v1.attention.ops import triton_reshape_and_cache_flash as flash
    from vllm.v1.attention.ops.int4_per_token_head import reshape_and_cache_int4
    from vllm.v1.kv_cache_interface import KVQuantMode

    g = torch.Generator().manual_seed(0)
    tokens, heads, dim, block = 6, 2, 64, 16
    key = (torch.randn(tokens, heads, dim, generator=g) * 4).to(torch.bfloat16)
    value = torch.randn(tokens, heads, dim, generator=g).to(torch.bfloat16)
    key[2, 1] = 0                                        # an all-zero vector: the scale's 1e-6 floor
    key[3, 0, 7] = 200                                   # an outlier
    slots = torch.arange(tokens)
    saved = {"key": key, "value": value}
    for mode, dtype in ((KVQuantMode.FP8_PER_TOKEN_HEAD, torch.float8_e4m3fn),
                        (KVQuantMode.INT8_PER_TOKEN_HEAD, torch.int8)):
        kc, vc = torch.zeros(1, block, heads, dim, dtype=dtype), torch.zeros(1, block, heads, dim, dtype=dtype)
        ks, vs = torch.zeros(1, block, heads), torch.zeros(1, block, heads)
        flash.triton_reshape_and_cache_flash_per_token_head_quant(key, value, kc, vc, ks, vs, slots, mode)
        saved[mode.name] = {"k": kc[0, :tokens].float(), "v": vc[0, :tokens].float(), "k_scale": ks[0, :tokens],
                            "v_scale": vs[0, :tokens]}
    kc, vc = torch.zeros(1, block, heads, dim // 2, dtype=torch.uint8), torch.zeros(1, block, heads, dim // 2,
                                                                                   dtype=torch.uint8)
    ks, vs = torch.zeros(1, block, heads), torch.zeros(1, block, heads)
    reshape_and_cache_int4(key, value, kc, vc, slots, k_scale_cache=ks, v_scale_cache=vs)
    saved["INT4_PER_TOKEN_HEAD"] = {"k": kc[0, :tokens].clone(), "v": vc[0, :tokens].clone(),
                                    "k_scale": ks[0, :tokens].clone(), "v_scale": vs[0, :tokens].clone()}
    torch.save(saved, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
