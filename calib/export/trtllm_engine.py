"""TensorRT-LLM TensorRT-engine backend target (`trtllm-engine`): calibrated KV scales into a TensorRT-LLM checkpoint.

Why a target of its own: TensorRT-LLM's PyTorch backend runs its FP8 KV cache at scale 1.0 (calib.export.trtllm),
but the TensorRT-engine backend — TensorRT-LLM 1.2.x and 1.3.0rc1-rc20 (deprecated, removed from main in 2026) —
applies the checkpoint's scale in its gpt-attention plugin. Its input is not a Hugging Face folder but a TensorRT-LLM
checkpoint, what that release's `convert_checkpoint.py` writes and `trtllm-build` reads (read in NVIDIA/TensorRT-LLM,
the 1.2 / 1.3.0rc form):
- `config.json` = PretrainedConfig.to_dict (`tensorrt_llm/models/modeling_utils.py`): `architecture`,
  `num_hidden_layers`, `mapping` (tp_size, pp_size, cp_size, world_size) and `quantization` (QuantConfig asdict;
  `kv_cache_quant_algo` FP8 | INT8 switches the KV cache on: `tensorrt_llm/quantization/quantize.py`
  kv_cache_quantize gives EVERY Attention a `kv_cache_scaling_factor` Parameter of shape (1,), float32).
- `rank{r}.safetensors`, one per tensor x pipeline rank (PretrainedModel.save_checkpoint / from_checkpoint; context-
  parallel ranks share their file), r = tp_rank + pp_rank * tp_size (`tensorrt_llm/mapping.py` Mapping.pp_rank).
- One scale per layer, shared by K and V: `transformer.layers.{j}.attention.kv_cache_scaling_factor`, `j` local
  to the rank's pipeline stage (`tensorrt_llm/models/llama/convert.py` load_weights_from_hf_model: `tllm_prex =
  transformer.layers.{l - layers_range[0]}`, layers_range = Mapping.pp_layers: torch.tensor_split, the first
  num_layers % pp_size stages one more layer), the same value on every tensor-parallel rank. Separate k/v factors
  are folded by `preprocess_weights` (`process_kv_scaling_factor`: torch.max(k, v)), which also adds the reciprocal
  `kv_cache_rcp_scaling_factor` when the file carries none. PretrainedModel.load refuses a checkpoint missing any
  required scale ("Required but not provided tensors").
So: the dequantisation scale of both K and V is max(k_amax, v_amax) / 448 (FP8) or / 127 (INT8), calibrated from
the joint K/V statistics (calib.scales.fold.shared_kv_scales; K and V folded before the clip becomes a scale).
Per-head scales, a q_scale and skipped layers cannot be expressed: refused up front, one line each.

The output is a new folder (atomic, calib.safety.outputs.atomic_dir): config.json with only
`quantization.kv_cache_quant_algo` set, every rank file rewritten by streaming its bytes — every other tensor's
bytes copied unchanged — with the layer scales of its stage appended (old KV-scale tensors left out only with
--overwrite-kv-scales), every other file copied. The user's checkpoint is never modified.

Serve: `trtllm-build --checkpoint_dir OUT --output_dir ENGINE` then `trtllm-serve ENGINE --tokenizer MODEL`, or
`trtllm-serve OUT --backend tensorrt --tokenizer MODEL` (the LLM API builds the engine from the checkpoint).
"""

from __future__ import annotations

import json
import os
import shlex
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calib.ckpt import formats, integrity
from calib.ckpt.names import (CONFIG_FILE, PROVENANCE_FILE, TRTLLM_CKPT_KV_RE, trtllm_ckpt_scale_name,
                              trtllm_rank_file)
from calib.ckpt.source import ExportError, PreparedSource, SourceFiles, check_out_is_not_source, read_source
from calib.export.target import Target, WriteOptions
from calib.provenance import Provenance, as_provenance
from calib.recipe import dtypes
from calib.safety import files
from calib.safety.outputs import atomic_dir, check_room
from calib.safety.readers import raising

if TYPE_CHECKING:
    from calib.scales.fold import Scales

NAME = "trtllm-engine"
ALGO_OF_DTYPE = {d: d.cache_name(NAME) for d in dtypes.for_engine(NAME)}
_CHUNK = 1 << 24

PER_HEAD_NOTE = ("the TensorRT-LLM engine applies one kv_cache_scaling_factor per layer shared by K and V; "
                 "per-head scales cannot be expressed: use granularity tensor")
Q_NOTE = "the TensorRT-LLM engine reads no q_scale (the checkpoint has no tensor for it): drop q_scale"
SKIP_NOTE = ("the TensorRT-LLM engine quantizes every layer's KV cache (kv_cache_quantize gives every attention "
             "layer a scale): drop skip_layers or the trtllm-engine target")


@dataclass(frozen=True)
class EngineCheckpoint(PreparedSource):
    """A TensorRT-LLM checkpoint checked for this target: its grid, which global layers each rank file holds, the
    KV algorithm to declare, and per rank file the KV-scale tensors to leave out (--overwrite-kv-scales)."""
    num_layers: int = 0
    tp_size: int = 1
    pp_size: int = 1
    kv_algo: str = "FP8"
    rank_layers: dict[int, list[int]] = field(default_factory=dict)
    rank_drop: dict[int, tuple[str, ...]] = field(default_factory=dict)


def is_engine_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds a TensorRT-LLM checkpoint (its config.json is a PretrainedConfig's)."""
    try:
        return formats.is_trtllm_checkpoint(integrity.read_json(folder / "config.json", "--into config.json"))
    except (OSError, ValueError):
        return False


def same_model_config(source: Path, a: dict[str, Any], target: Path) -> dict[str, Any]:
    """A TensorRT-LLM checkpoint (`--into` for the trtllm-engine target) is of `source`'s model when its
    architecture and sizes, under their Hugging Face names, are `source`'s; its weights are split over ranks and
    renamed, so they are not compared byte for byte (said as a note). Returns its config.json."""
    from calib.ckpt import fingerprint

    b = integrity.read_json(target / "config.json", "--into config.json")
    mine, theirs = a.get("text_config", a), formats.trtllm_ckpt_sizes(b)
    mine = {**mine, "head_dim": mine.get("head_dim") or mine["hidden_size"] // mine["num_attention_heads"],
            "num_key_value_heads": mine.get("num_key_value_heads") or mine["num_attention_heads"]}
    diff = [k for k in theirs if k != "architectures" and theirs[k] != mine.get(k)]
    if (mine.get("architectures") or [None])[0] != theirs["architectures"][0]:
        diff.insert(0, "architecture")
    if diff:
        raise ExportError(f"--into {target} is not a TensorRT-LLM checkpoint of {source}: {', '.join(diff)} differ")
    fingerprint.note(f"--into {target}: a TensorRT-LLM checkpoint (weights split over ranks and renamed): its "
                     f"architecture and sizes match {source}'s; its weights are not compared byte for byte")
    return b


def _fail(path: Path, why: str) -> ExportError:
    return ExportError(f"--into {path}: {why}")


def prepare_engine_checkpoint(source: Path | SourceFiles, out: Path, *, kv_algo: str = "FP8",
                              granularity: str = "tensor", q_scale: bool = False,
                              overwrite_kv: bool = False) -> EngineCheckpoint:
    """Check a TensorRT-LLM checkpoint (config and safetensors headers only, nothing written) for this target."""
    if granularity != "tensor":
        raise ExportError(f"granularity {granularity!r} with target {NAME}: {PER_HEAD_NOTE}")
    if q_scale:
        raise ExportError(f"q_scale with target {NAME}: {Q_NOTE}")
    if kv_algo not in formats.TRTLLM_CKPT_KV_ALGOS:
        raise ExportError(f"kv_cache_quant_algo {kv_algo!r}: the TensorRT-LLM engine target writes "
                          f"{' or '.join(formats.TRTLLM_CKPT_KV_ALGOS)}")
    path = source.path if isinstance(source, SourceFiles) else Path(source)
    check_out_is_not_source(path, Path(out))
    if not (path / CONFIG_FILE).is_file():
        raise _fail(path, "has no config.json; give the folder TensorRT-LLM's convert_checkpoint.py wrote")
    config = read_source(path).config
    if not formats.is_trtllm_checkpoint(config):
        raise _fail(path, "config.json is not a TensorRT-LLM checkpoint's (no 'architecture' and 'mapping'); "
                    "convert the model with that release's convert_checkpoint.py and give its output folder")
    quant = config.get("quantization")
    if not isinstance(quant, dict):
        raise _fail(path, "config.json has no 'quantization' object (PretrainedConfig always writes one); "
                    "convert the checkpoint again with that release's convert_checkpoint.py")
    declared = quant.get("kv_cache_quant_algo")
    if declared is not None and not overwrite_kv:
        raise _fail(path, f"config.json already declares kv_cache_quant_algo={declared!r}; pass "
                    "--overwrite-kv-scales to replace its KV scales, or convert without --fp8_kv_cache/--int8_kv_cache")
    try:
        n, tp, pp = formats.trtllm_ckpt_grid(config)
        layers = formats.trtllm_rank_layers(n, tp, pp)
    except ValueError as e:
        raise _fail(path, str(e)) from None
    want = [trtllm_rank_file(r) for r in layers]
    missing = [f for f in want if not (path / f).is_file()]
    if missing:
        raise _fail(path, f"mapping tp_size={tp} x pp_size={pp} needs {len(want)} rank files; missing "
                    f"{', '.join(missing)}")
    extra = sorted(f.name for f in path.glob("rank*.safetensors") if f.name not in want)
    if extra:
        raise _fail(path, f"holds {', '.join(extra)} beyond the {len(want)} rank files its mapping "
                    f"(tp_size={tp}, pp_size={pp}) names; the config and the weights disagree")
    weight_map: dict[str, str] = {}
    drop: dict[int, tuple[str, ...]] = {}
    total = 0
    for r, mine in layers.items():
        name = trtllm_rank_file(r)
        with raising(ExportError, integrity.IntegrityError):
            shard = integrity.read_header(path / name)
        held = {int(k.split(".")[2]) for k in shard.tensors if k.startswith("transformer.layers.")
                and k.split(".")[2].isdigit()}
        if held and held != set(range(len(mine))):
            raise _fail(path, f"{name} holds layers {sorted(held)[:4]}{'...' if len(held) > 4 else ''} but "
                        f"pipeline stage {r // tp} of {pp} holds {len(mine)} (global {mine[0]}..{mine[-1]}, "
                        "Mapping.pp_layers); the config and the weights disagree")
        if not any(k.startswith("transformer.layers.0.attention.") for k in shard.tensors):
            raise _fail(path, f"{name} has no transformer.layers.0.attention.* tensors; not a decoder checkpoint "
                        "whose attention layers this target knows")
        old = tuple(sorted(k for k in shard.tensors if TRTLLM_CKPT_KV_RE.match(k)))
        if old and not overwrite_kv:
            raise _fail(path, f"{name} already carries KV scales ({old[0]}, ...); pass --overwrite-kv-scales to "
                        "replace them")
        drop[r] = old
        weight_map.update({k: name for k in shard.tensors})
        total += sum(t.nbytes for k, t in shard.tensors.items() if k not in old)
    return EngineCheckpoint(path, config, weight_map, total, frozenset(k for d in drop.values() for k in d),
                            tuple(want), num_layers=n, tp_size=tp, pp_size=pp, kv_algo=kv_algo, rank_layers=layers,
                            rank_drop=drop)


def rewrite_rank_file(src: Path, dst: Path, drop: tuple[str, ...] | frozenset[str], add: dict[str, float]) -> None:
    """A new safetensors file at `dst`: `src`'s tensors except `drop`, their bytes copied unchanged in their order,
    then the float32 shape-[1] tensors `add` appended. Streams: memory does not grow with the file."""
    shard = integrity.read_header(src)
    kept = sorted((t for k, t in shard.tensors.items() if k not in drop), key=lambda t: t.offset)
    header: dict[str, Any] = {"__metadata__": dict(shard.metadata)} if shard.metadata else {}
    at = 0
    for t in kept:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
        at += t.nbytes
    for name in add:
        if name in header:
            raise ExportError(f"{src} already holds {name}")
        header[name] = {"dtype": "F32", "shape": [1], "data_offsets": [at, at + 4]}
        at += 4
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)                      # the data section starts 8-byte aligned, as safetensors writes
    with files.open_new(dst, "wb") as out, open(src, "rb") as f:
        out.write(struct.pack("<Q", len(raw)) + raw)
        for t in kept:
            f.seek(t.offset)
            left = t.nbytes
            while left:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    raise ExportError(f"{src} ended inside tensor {t.name!r}; the file is truncated")
                out.write(chunk)
                left -= len(chunk)
        for value in add.values():
            out.write(struct.pack("<f", value))


def engine_scales(scales: Scales, n_layers: int) -> dict[int, float]:
    """{global layer: the shared float32 scale} (max over K and V: calib.scales.fold.shared_from_scales), checked:
    every layer present, one scale per layer, no q_scale, finite and positive."""
    import torch

    from calib.scales.fold import shared_from_scales

    beyond = sorted(i for i in scales if not 0 <= i < n_layers)
    if beyond:
        raise ExportError(f"scales name layer(s) {beyond} but the checkpoint has {n_layers} layers")
    skipped = sorted(set(range(n_layers)) - set(scales))
    if skipped:
        raise ExportError(f"layers {skipped} have no scales: {SKIP_NOTE}")
    for layer, s in scales.items():
        if torch.as_tensor(s.k_scale).numel() != 1 or torch.as_tensor(s.v_scale).numel() != 1:
            raise ExportError(f"layer {layer} has per-head scales: {PER_HEAD_NOTE}")
        if s.q_scale is not None:
            raise ExportError(f"layer {layer} has a q_scale: {Q_NOTE}")
    out = {layer: float(t) for layer, t in shared_from_scales(scales).items()}
    for layer, v in out.items():
        if not (v > 0 and v < float("inf")):
            raise ExportError(f"layer {layer}'s shared scale is {v!r}; scales must be finite and > 0")
    return out


def export_engine_checkpoint(source: Path | EngineCheckpoint, out: Path, scales: Scales,
                             provenance: Provenance | dict[str, Any], *, kv_algo: str = "FP8", force: bool = False,
                             overwrite_kv: bool = False) -> Path:
    """Write `source` (a TensorRT-LLM checkpoint) with one shared K/V scale per layer into the new folder `out`."""
    prepared = source if isinstance(source, EngineCheckpoint) else \
        prepare_engine_checkpoint(source, out, kv_algo=kv_algo, overwrite_kv=overwrite_kv)
    shared = engine_scales(scales, prepared.num_layers)
    src = prepared.path
    config = json.loads(json.dumps(prepared.config))
    config["quantization"]["kv_cache_quant_algo"] = prepared.kv_algo
    rank_files = set(prepared.shards)
    check_room(Path(out), [src / f for f in prepared.shards])
    with atomic_dir(out, force, inputs=[("the --into checkpoint", src)]) as tmp:
        for r, layers in sorted(prepared.rank_layers.items()):
            name = trtllm_rank_file(r)
            add = {trtllm_ckpt_scale_name(j): shared[g] for j, g in enumerate(layers)}
            rewrite_rank_file(src / name, tmp / name, prepared.rank_drop.get(r, ()), add)
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name not in rank_files | {CONFIG_FILE, PROVENANCE_FILE}:
                files.copy(f, tmp / f.name)
        files.write_text(tmp / CONFIG_FILE, json.dumps(config, indent=4) + "\n")
        prov = as_provenance(provenance).written_as(
            NAME, kv_cache_quant_algo=prepared.kv_algo, tp_size=prepared.tp_size, pp_size=prepared.pp_size,
            trtllm_layer_scale={str(i): v for i, v in sorted(shared.items())})
        prov = prov.with_weights(["rank files rewritten: every tensor's bytes copied, kv_cache_scaling_factor added"])
        files.write_text(tmp / PROVENANCE_FILE, json.dumps(prov.to_dict(), indent=2) + "\n")
        for f in prepared.shards:
            os.chmod(tmp / f, 0o644)
    return Path(out)


class TrtllmEngineTarget(Target):
    name = NAME
    order = 3
    folds_heads = False

    def serve_command(self, path: str, skip: tuple[int | str, ...] = (), dtype: str = dtypes.FP8_E4M3.name) -> str:
        """`trtllm-serve OUT --backend tensorrt` (TensorRT-LLM 1.2.x / 1.3.0rc up to rc20); the checkpoint carries no
        tokenizer, so `--tokenizer` names the Hugging Face model folder."""
        if skip:
            raise ExportError(SKIP_NOTE)
        return shlex.join(["trtllm-serve", str(path), "--backend", "tensorrt", "--tokenizer", "MODEL"])

    def prepare(self, source: Path | SourceFiles, out: Path, options: WriteOptions = WriteOptions()) -> EngineCheckpoint:
        if options.dtype not in ALGO_OF_DTYPE:
            raise ExportError(f"KV dtype {options.dtype.name!r} with target {NAME}: the TensorRT-LLM engine's "
                              "kv_cache_quant_algo is FP8 or INT8")
        return prepare_engine_checkpoint(source, out, kv_algo=ALGO_OF_DTYPE[options.dtype],
                                         granularity=options.granularity.name, overwrite_kv=options.overwrite_kv)

    def write(self, source: Path | PreparedSource, out: Path, scales: Scales, provenance: Provenance | dict[str, Any],
              options: WriteOptions = WriteOptions()) -> Path:
        prepared = source if isinstance(source, EngineCheckpoint) else self.prepare(getattr(source, "path", source),
                                                                                   out, options)
        return export_engine_checkpoint(prepared, out, scales, provenance, force=options.force)


TARGET = TrtllmEngineTarget()
