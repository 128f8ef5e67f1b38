"""vLLM target (compressed-tensors format): the checkpoint variant vLLM loads with our KV scales.

`config.json` gains a `quantization_config` with an empty `config_groups` and a `kv_cache_scheme`;
tensors `model.layers.{i}.self_attn.k_scale` / `.v_scale` (and `q_scale`). Without the config vLLM refuses
the scale tensors; with the config but without tensors it silently uses 1.0 — so both are written
together, always.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from calib.ckpt import formats
from calib.ckpt.names import is_kv_scale, vllm_scale_name
from calib.ckpt.source import (ExportError, PreparedSource, SourceFiles, check_out_is_not_source, read_source,
                               scan_weights)
from calib.export.target import Target, WriteOptions
from calib.export.write import write_variant
from calib.provenance import Provenance, as_provenance

if TYPE_CHECKING:
    import torch

    from calib.scales.fold import Scales


def prepare_source(source: Path | SourceFiles, out: Path, *, quantized_ok: bool = False,
                   overwrite_kv: bool = False) -> PreparedSource:
    """Validate a source checkpoint for export (before anything is written). A weight-quantized source is
    accepted when `quantized_ok` and its config is compressed-tensors (the only weight format whose config
    we merge into for vLLM); other formats get an error that says so."""
    files = read_source(source)
    source, out = files.path, Path(out)
    check_out_is_not_source(source, out)
    config = files.config
    qc = config.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ExportError(f"{source}/config.json: quantization_config must be an object, not {type(qc).__name__}")
    if qc is not None and not quantized_ok:
        raise ExportError(f"{source}/config.json already has a quantization_config; to add KV scales to a "
                          "weight-quantized checkpoint, pass it to calibrate as --into")
    if qc is not None and not formats.is_compressed_tensors(qc):
        raise ExportError(f"{source}: weight quantization {qc.get('quant_method')!r} — the vllm target merges KV "
                          "scales only into compressed-tensors configs; use the trtllm target for ModelOpt checkpoints")
    if formats.ct_declared_kv_scheme(qc) and not overwrite_kv:
        raise ExportError(f"{source} already declares a kv_cache_scheme; pass --overwrite-kv-scales to replace its "
                          "KV scales, or start from the checkpoint without them")
    return scan_weights(files, config, is_kv_scale, overwrite_kv=overwrite_kv,
                        hint="pass --overwrite-kv-scales to replace them, or ")


def export_vllm(source: Path | PreparedSource, out: Path, scales: Scales, provenance: Provenance | dict[str, Any], *,
                strategy: str = "tensor", force: bool = False, overwrite_kv: bool = False,
                extra_files: dict[str, str] | None = None, target: str = "vllm") -> Path:
    """Write the vLLM (compressed-tensors) variant of `source` with `scales` to `out`; returns `out`.
    `strategy` is `tensor` (scales of shape []) or `attn_head` (scales of shape [kv_heads]). A `source`
    already prepared (`VllmTarget.prepare`) is not checked again.

    A `source` that already carries a compressed-tensors weight config (W8A8, FP8, W4A16 ... made by
    llm-compressor) keeps it — `config_groups`, `ignore`, `format` and the rest — and gains only a
    `kv_cache_scheme`; its weight files are carried over byte for byte like any other source's."""
    import torch

    prepared = source if isinstance(source, PreparedSource) else \
        prepare_source(source, out, quantized_ok=True, overwrite_kv=overwrite_kv)
    tensors: dict[str, torch.Tensor] = {}
    for layer, s in scales.items():
        for kind, value in (("k", s.k_scale), ("v", s.v_scale), ("q", s.q_scale)):
            if value is not None:
                if strategy == "tensor" and value.numel() != 1:
                    raise ExportError(f"layer {layer}: {kind}_scale has {value.numel()} values but strategy is tensor")
                # per tensor: shape []; attn_head: [heads, 1, 1], the layout vLLM's loader flattens
                t = value.to(torch.float32).contiguous()
                tensors[vllm_scale_name(layer, kind)] = t.reshape(()) if strategy == "tensor" else t.reshape(-1, 1, 1)
    qc = prepared.config.get("quantization_config")
    qc = formats.ct_quantization_config(strategy) if qc is None else formats.ct_with_kv_scheme(qc, strategy)
    config = dict(prepared.config, quantization_config=qc)
    return write_variant(prepared, out, tensors, config, as_provenance(provenance).written_as(target), force=force,
                         extra_files=extra_files)


class VllmTarget(Target):
    name = "vllm"
    order = 0
    # calib.recipe.granularity name -> compressed-tensors kv_cache_scheme strategy
    strategies = {"tensor": "tensor", "head": "attn_head"}

    def prepare(self, source: Path | SourceFiles, out: Path, options: WriteOptions = WriteOptions()) -> PreparedSource:
        """A weight-quantized source only through --into, and only compressed-tensors (`prepare_source`)."""
        return prepare_source(source, out, quantized_ok=options.into, overwrite_kv=options.overwrite_kv)

    def write(self, source: Path | PreparedSource, out: Path, scales: Scales, provenance: Provenance | dict[str, Any],
              options: WriteOptions = WriteOptions()) -> Path:
        return export_vllm(source, out, scales, provenance, strategy=self.strategies[options.granularity.name],
                           force=options.force, overwrite_kv=options.overwrite_kv, extra_files=options.extra_files)


TARGET = VllmTarget()
