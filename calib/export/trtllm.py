"""TensorRT-LLM target (PyTorch backend / `LLM` API): the checkpoint variant TRT-LLM loads with our KV scales.

Why a second variant next to the vLLM one (both share the hard-linked weight files):
- TRT-LLM reads the KV-cache algorithm from `hf_quant_config.json` (`ModelConfig.from_pretrained` in
  `tensorrt_llm/_torch/model_config.py`, normalised by `read_modelopt_quant_config` in
  `tensorrt_llm/quantization/modelopt_config.py`, legacy `{"quantization": {...}}` shape). When that file
  sets no weight `quant_algo`, it falls back to `config.json`'s `quantization_config`
  (`ModelConfig.load_hf_quant_config`); a compressed-tensors block there goes to
  `update_quant_config_from_compressed_tensors` (`tensorrt_llm/models/quant_config_utils.py`), which
  raises "config_groups is empty" for the KV-only block the vLLM variant needs. Any other weight format
  found there replaces the whole quant config, dropping the `kv_cache_quant_algo` we declared. So the
  TRT-LLM variant carries no compressed-tensors block, and the vLLM variant cannot carry this layout.
- Scale tensor names: TRT-LLM fuses q/k/v into `qkv_proj` and hands the fused linear one dict per source
  projection (`_load_weights_impl` in `tensorrt_llm/_torch/models/modeling_utils.py`: `filter_weights`
  on `...self_attn.{q,k,v}_proj`), so it finds a scale only as `...self_attn.k_proj.k_scale` (key
  `k_scale` of the k shard) and `...self_attn.v_proj.v_scale`. Scalars, float32 (ModelOpt's layout).
  It loads every `*.safetensors` file of the directory (`HfWeightLoader.load_weights`,
  `tensorrt_llm/_torch/models/checkpoints/hf/weight_loader.py`), not through the index; we still list
  the scale shard in `model.safetensors.index.json` for every tool that does.

What the engine does with the scales (read 2026-12; the cells and their sources: calib.recipe.support.engines.trtllm):
- FP8 KV: nothing yet, the cache runs at scale 1.0 (`TrtllmAttention.__init__`; `Attention._attn_impl` passes
  `qkv_proj.kv_scales` only for an FP4 cache), so any |K| or |V| above 448 saturates: see `saturation_report`. We
  still write the calibrated scales (ModelOpt's format), so the checkpoint is right when the engine reads them.
- INT8 KV: the calibrated-INT8 path under review (pull request 18953; its tests load `weights[1]["k_scale"]`,
  `weights[2]["v_scale"]` into the fused QKV linear) requires BOTH scalar scales per layer, positive and finite, uses
  ONE `kv_cache_scaling_factor = max(k_scale, v_scale)` per layer, takes only unquantized FP16/BF16 projections and
  the TRTLLM attention backend. We write k and v separately (what it reads), record the max in `kvcalib.json`, and
  need INT8 scales (`amax / 127`) for `kv_algo="INT8"`.
- Skipped layers: not expressible (`apply_quant_config_exclude_modules`: "kv_cache_quant_algo takes precedence over
  exclude_modules"; the cache pool has one dtype), so a layer missing from `scales` is an `ExportError` here.

Unquantized (FP16/BF16) models: no hf_quant_config.json, the KV dtype at serve time (read 2026-12 and run on this
module's outputs: tests/export/test_trtllm_target.py `test_unquantized_model_writes_no_quant_algo_null_file`):
- The LLM API (PyTorch backend included) refuses an hf_quant_config.json whose `quant_algo` is null:
  `ValueError("Pre-quantized checkpoint must have quant_algo.")` from `ModelLoader._update_from_hf_quant_config`
  (`tensorrt_llm/llmapi/llm_utils.py`; main at commit 0066b2a5 and 1.0-1.2) before any weight is read. Main lets a
  null quant_algo through only with `quantized_layers` AND a config.json `quantization_config`: an unquantized model
  has neither.
- It accepts the serve-time KV dtype instead: `kv_cache_config.dtype: fp8` (`validate_and_set_kv_cache_quant`,
  `tensorrt_llm/_torch/pyexecutor/model_loader.py`). So the variant carries `llm_api_options.yaml` and the serve
  command passes it (`trtllm-serve OUT --extra_llm_api_options OUT/llm_api_options.yaml`). Its FP8 cache runs at 1.0
  like every FP8 cache of the PyTorch backend: calibrate and export say so, and refuse where K or V exceed 448
  (calib.export.serve). `dtype: int8` exists only with pull request 18953.
- Why not refuse the combination: who asks for the TensorRT-LLM variant of a BF16 model wants a folder that starts,
  with FP8 KV, and the truth about the scales; the served model is exactly the one configuration TensorRT-LLM
  supports for it, and the calibrated scales stay in the folder (what PR 18953 and a later release read). A fake
  weight `quant_algo` (e.g. NO_QUANT) would pass this check but is unverified further down the loader.
- A weight-quantized (ModelOpt) source keeps its hf_quant_config.json, `kv_cache_quant_algo` added (the loader takes
  it: `_apply_modelopt_quant_config`), and gets the same options file, so one command serves every variant.

Written by the one `write_variant` (calib/export/write.py), like the vLLM variant: atomic, weights linked.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calib import __version__
from calib.ckpt import formats
from calib.ckpt.names import (CONFIG_FILE, HF_QUANT_CONFIG, TRTLLM_API_OPTIONS, TRTLLM_CARRIED_SUFFIXES,
                              trtllm_scale_names)
from calib.ckpt.source import (ExportError, PreparedSource, SourceFiles, check_out_is_not_source, read_json,
                               read_source, scan_weights)
from calib.engine import command
from calib.export.target import Target, WriteOptions
from calib.export.write import write_variant
from calib.provenance import Provenance, as_provenance
from calib.recipe import dtypes

if TYPE_CHECKING:
    import torch

    from calib.scales.fold import Scales

FP8_E4M3_MAX = dtypes.FP8_E4M3.qmax

# KV dtype (calib.recipe.dtypes) -> TensorRT-LLM's kv_cache_quant_algo
ALGO_OF_DTYPE = {d: d.cache_name("trtllm") for d in dtypes.for_engine("trtllm")}
KV_ALGOS = tuple(ALGO_OF_DTYPE.values())


def saturation_report(scales: Scales, fractions: Mapping[int, tuple[float, float]] | None = None) -> list[str]:
    """One line per layer whose K or V range exceeds 448, the largest FP8 e4m3 value.

    TRT-LLM's FP8 KV cache runs with scale 1.0 today (module docstring), so every such value is clipped to
    ±448 in the cache. `fractions` (optional, from data: layer -> (fraction of K values, fraction of V
    values) above 448) adds how much of the layer saturates; without it only the range is known.
    """
    import torch

    lines = []
    for layer, s in sorted(scales.items()):
        parts = []
        for i, (kind, amax) in enumerate((("K", s.k_amax), ("V", s.v_amax))):
            peak = float(torch.as_tensor(amax, dtype=torch.float32).max())
            if not peak > FP8_E4M3_MAX:
                continue
            text = f"{kind} amax {peak:.4g} > {FP8_E4M3_MAX:g}"
            if fractions is not None and layer in fractions:
                text += f" ({100.0 * float(fractions[layer][i]):.3g}% of values)"
            parts.append(text)
        if parts:
            lines.append(f"layer {layer}: {', '.join(parts)}; TensorRT-LLM's FP8 KV cache (scale 1.0) "
                         "clips these to ±448")
    return lines


def _modelopt_quantization(qc: dict[str, Any], where: str) -> dict[str, Any]:
    q = formats.modelopt_quantization(qc)
    if q is None and "quantization" in qc:
        raise ExportError(f"{where}: 'quantization' must be an object")
    if q is None:
        raise ExportError(f"{where}: has neither a 'quantization' object nor a ModelOpt marker (producer.name "
                          "'modelopt' or quant_method 'modelopt'); TensorRT-LLM cannot read it")
    return q


def _source_quantization(source: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The source's weight quantization as a legacy `quantization` dict (quant_algo None when unquantized)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    inline = config.get("quantization_config") or text.get("quantization_config")
    if inline is not None and not isinstance(inline, dict):
        raise ExportError(f"{source}/config.json: quantization_config must be an object, not {type(inline).__name__}")
    if isinstance(inline, dict) and formats.is_compressed_tensors(inline):
        raise ExportError(
            f"{source}/config.json has a compressed-tensors quantization_config. TensorRT-LLM reads it when "
            "hf_quant_config.json sets no weight quant_algo and rejects one without weight config_groups "
            "(update_quant_config_from_compressed_tensors), and a KV-only hf_quant_config.json cannot describe "
            "compressed-tensors weights. Export the TRT-LLM variant from the unquantized model (or a ModelOpt "
            "checkpoint), not from a compressed-tensors one")
    hq_file = source / HF_QUANT_CONFIG
    if hq_file.is_file():
        inner = _modelopt_quantization(read_json(hq_file), str(hq_file))
    elif formats.is_modelopt(inline):
        inner = _modelopt_quantization(inline, f"{source}/config.json")
    else:
        inner = {}
    if inner.get("quant_algo") is None and isinstance(inline, dict) and not formats.is_modelopt(inline):
        raise ExportError(
            f"{source}/config.json has a quantization_config (quant_method "
            f"{inline.get('quant_method')!r}) that hf_quant_config.json cannot express. With no weight "
            "quant_algo in hf_quant_config.json, TensorRT-LLM takes the quantization from config.json instead "
            "(ModelConfig.from_pretrained) and drops the kv_cache_quant_algo we declare. Start from the "
            "unquantized model or a ModelOpt checkpoint")
    if inner.get("kv_cache_quant_algo") is not None:
        raise ExportError(f"{source} already declares kv_cache_quant_algo={inner['kv_cache_quant_algo']!r}; "
                          "start from a checkpoint without KV-cache quantization")
    inner.pop("kv_cache_quant_algo", None)
    return inner


def _scalar(t: torch.Tensor, what: str) -> torch.Tensor:
    import torch

    value = torch.as_tensor(t).detach().to(torch.float32).max().reshape(()).contiguous()
    if not (torch.isfinite(value) and value > 0):
        raise ExportError(f"{what} is {float(value)!r}; scales must be finite and > 0")
    return value


@dataclass(frozen=True)
class TrtllmSource(PreparedSource):
    """A source checked for the TensorRT-LLM variant: its weight quantization as a legacy `quantization` dict
    (quant_algo None when unquantized), its layer count and the KV algorithm to declare."""
    quantization: dict[str, Any] = field(default_factory=dict)
    num_layers: int = 0
    kv_algo: str = "FP8"


def prepare_trtllm(source: Path | SourceFiles, out: Path, *, kv_algo: str = "FP8") -> TrtllmSource:
    """Check `source` for the TensorRT-LLM variant (config and headers only, nothing written). An unquantized
    source and a ModelOpt one (hf_quant_config.json, or config.json's `quant_method: modelopt` block as
    ModelOpt's export writes it) are accepted; what TensorRT-LLM would misread is refused
    (`_source_quantization`)."""
    kv_algo = str(kv_algo).upper()
    if kv_algo not in KV_ALGOS:
        raise ExportError(f"kv_algo {kv_algo!r} is not one kvcalib writes for TensorRT-LLM; use one of {KV_ALGOS}")
    path = source.path if isinstance(source, SourceFiles) else Path(source)
    check_out_is_not_source(path, Path(out))
    if not isinstance(source, SourceFiles) and not (path / CONFIG_FILE).is_file():
        raise ExportError(f"{path} has no config.json; point at a checkpoint directory")
    files = read_source(source)
    text = files.config.get("text_config") if isinstance(files.config.get("text_config"), dict) else files.config
    n_layers = text.get("num_hidden_layers", files.config.get("num_hidden_layers"))
    if not isinstance(n_layers, int) or n_layers <= 0:
        raise ExportError(f"{path}/config.json has no num_hidden_layers; cannot tell which layers need scales")
    quantization = _source_quantization(path, files.config)
    weight_algo = quantization.get("quant_algo")
    if kv_algo == "INT8" and weight_algo is not None:
        raise ExportError(f"INT8 KV cache in TensorRT-LLM needs unquantized FP16/BF16 projections, but {path} "
                          f"has weight quant_algo {weight_algo!r}; use kv_algo='FP8' or an unquantized model")
    weights = scan_weights(files, files.config, lambda name: name.endswith(TRTLLM_CARRIED_SUFFIXES))
    return TrtllmSource(**{f.name: getattr(weights, f.name) for f in fields(PreparedSource)},
                        quantization=quantization, num_layers=n_layers, kv_algo=kv_algo)


def export_trtllm(source: Path | TrtllmSource, out: Path, scales: Scales, provenance: Provenance | dict[str, Any], *,
                  kv_algo: str = "FP8", force: bool = False, extra_files: dict[str, str] | None = None) -> Path:
    """Write the TensorRT-LLM variant of `source` with `scales` to `out`; returns `out`. A `source` already
    prepared (`prepare_trtllm`) is not checked again, and its KV algorithm is the one it was prepared for.

    `scales` must cover every layer (TRT-LLM cannot keep some layers out of a quantized KV cache) and hold
    scales for `kv_algo` (FP8: amax / 448; INT8: amax / 127). Per-head scales are folded to one per layer
    by their max, which is all TRT-LLM reads.
    """
    prepared = source if isinstance(source, TrtllmSource) else prepare_trtllm(source, out, kv_algo=kv_algo)
    kv_algo, n_layers = prepared.kv_algo, prepared.num_layers
    beyond = sorted(i for i in scales if not 0 <= i < n_layers)
    if beyond:
        raise ExportError(f"scales name layer(s) {beyond} but the model has {n_layers} layers (0..{n_layers - 1})")
    skipped = sorted(set(range(n_layers)) - set(scales))
    if skipped:
        raise ExportError(
            f"the TensorRT-LLM target cannot skip layers (layers {skipped} have no scales): TRT-LLM applies "
            "kv_cache_quant_algo to every attention layer, exclude_modules included, and its cache pool has one "
            "dtype. Calibrate all layers for TRT-LLM, or serve the skipping variant with vLLM "
            "(--kv-cache-dtype-skip-layers)")

    tensors: dict[str, torch.Tensor] = {}
    for layer, s in sorted(scales.items()):
        for name, kind, t in zip(trtllm_scale_names(layer), "kv", (s.k_scale, s.v_scale)):
            tensors[name] = _scalar(t, f"layer {layer} {kind}_scale")

    quantization = prepared.quantization
    files = {TRTLLM_API_OPTIONS: formats.trtllm_api_options(kv_algo)}
    if quantization.get("quant_algo") is not None:
        quantization = {**quantization, "kv_cache_quant_algo": kv_algo,
                        "exclude_modules": list(quantization.get("exclude_modules") or [])}
        files[HF_QUANT_CONFIG] = json.dumps(formats.hf_quant_config(quantization, __version__), indent=2) + "\n"
        declared = f"{HF_QUANT_CONFIG} kv_cache_quant_algo={kv_algo} and {TRTLLM_API_OPTIONS}"
    else:   # an unquantized model: no quant_algo-null file, which the LLM API refuses (module docstring)
        declared = (f"{TRTLLM_API_OPTIONS} kv_cache_config.dtype={kv_algo.lower()} (serve-time); no {HF_QUANT_CONFIG}: "
                    "TensorRT-LLM refuses one without a weight quant_algo")
    notes: dict[str, Any] = {"trtllm_kv_declared_by": declared}
    if kv_algo == "FP8":
        notes["trtllm_fp8_saturation"] = saturation_report(scales)
    else:
        notes["trtllm_int8_layer_scale"] = {str(i): max(float(tensors[n]) for n in trtllm_scale_names(i))
                                            for i in sorted(scales)}
    prov = as_provenance(provenance).written_as("trtllm", kv_cache_quant_algo=kv_algo, **notes)
    return write_variant(prepared, out, tensors, None, prov, force=force, extra_files={**(extra_files or {}), **files})


class TrtllmTarget(Target):
    name = "trtllm"
    order = 1
    folds_heads = True

    def serve_command(self, path: str, skip: tuple[int | str, ...] = (), dtype: str = dtypes.FP8_E4M3.name) -> str:
        """`trtllm-serve PATH --extra_llm_api_options PATH/llm_api_options.yaml`: the options file carries the KV
        dtype (the only way an unquantized model gets a quantized KV cache; module docstring)."""
        options = str(path).rstrip("/") + "/" + TRTLLM_API_OPTIONS
        return f"{command.line(self.name, str(path), dtype, skip)} {shlex.join(['--extra_llm_api_options', options])}"

    def prepare(self, source: Path | SourceFiles, out: Path, options: WriteOptions = WriteOptions()) -> TrtllmSource:
        """An unquantized or ModelOpt source, with or without --into (`prepare_trtllm`)."""
        if options.dtype not in ALGO_OF_DTYPE:
            raise ExportError(f"KV dtype {options.dtype.name!r} has no TensorRT-LLM kv_cache_quant_algo; use one "
                              f"of {sorted(d.name for d in ALGO_OF_DTYPE)}")
        return prepare_trtllm(source, out, kv_algo=ALGO_OF_DTYPE[options.dtype])

    def write(self, source: Path | PreparedSource, out: Path, scales: Scales, provenance: Provenance | dict[str, Any],
              options: WriteOptions = WriteOptions()) -> Path:
        prepared = source if isinstance(source, TrtllmSource) else self.prepare(getattr(source, "path", source), out,
                                                                               options)
        return export_trtllm(prepared, out, scales, provenance, force=options.force, extra_files=options.extra_files)


TARGET = TrtllmTarget()
