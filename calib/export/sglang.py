"""SGLang target: the compressed-tensors variant SGLang (0.5.19 and later) loads with our KV scales.

SGLang reads the same compressed-tensors layout as vLLM — `config.json` `quantization_config` with a
`kv_cache_scheme`, tensors `model.layers.{i}.self_attn.{k,v}_scale` — but only its static, symmetric
per-tensor FP8 form: `CompressedTensorsKVCacheMethod.is_supported_scheme`
(sgl-project/sglang `python/sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py`)
drops any other scheme (`attn_head` included) with a warning and the cache then runs at scale 1.0. So
this variant is the vLLM writer's per-tensor variant: per-head scales are folded to their max per layer,
which SGLang applies, rather than written in a form SGLang ignores. It carries no q_scale (SGLang's Llama
loader has no parameter for it: `LlamaForCausalLM._legacy_load_weights`, `python/sglang/srt/models/llama.py`)
and cannot skip layers (no per-layer KV dtype option). What SGLang does with each format and version is the
support matrix's (calib.recipe.support); the loader rules are checked by calib.verify.sglang.

Serve: `python -m sglang.launch_server --model-path DIR --kv-cache-dtype fp8_e4m3`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calib.ckpt.source import PreparedSource
from calib.export.target import WriteOptions
from calib.export.vllm import VllmTarget, export_vllm
from calib.provenance import Provenance

if TYPE_CHECKING:
    from calib.scales.fold import Scales


def per_tensor(scales: Scales) -> Scales:
    """Each layer's k and v scale folded to one value (their max over heads); q_scale dropped."""
    return {layer: replace(s, k_scale=s.k_scale.max().reshape(()), v_scale=s.v_scale.max().reshape(()), q_scale=None)
            for layer, s in scales.items()}


def export_sglang(source: Path | PreparedSource, out: Path, scales: Scales, provenance: Provenance | dict[str, Any],
                  *, force: bool = False, overwrite_kv: bool = False, extra_files: dict[str, str] | None = None) -> Path:
    """Write the SGLang variant of `source` (compressed-tensors, per-tensor FP8 k/v scales) to `out`; a `source`
    already prepared (`SglangTarget.prepare`) is not checked again."""
    return export_vllm(source, out, per_tensor(scales), provenance, strategy="tensor", force=force,
                       overwrite_kv=overwrite_kv, extra_files=extra_files, target="sglang")


class SglangTarget(VllmTarget):
    """vLLM's layout, so vLLM's `prepare`: a weight-quantized source only through --into, compressed-tensors only."""
    name = "sglang"
    order = 2
    folds_heads = True

    def write(self, source: Path | PreparedSource, out: Path, scales: Scales, provenance: Provenance | dict[str, Any],
              options: WriteOptions = WriteOptions()) -> Path:
        return export_sglang(source, out, scales, provenance, force=options.force, overwrite_kv=options.overwrite_kv,
                             extra_files=options.extra_files)


TARGET = SglangTarget()
