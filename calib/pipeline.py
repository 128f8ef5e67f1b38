"""The calibration job: data → model → observe → scales → export, each stage handing the next a plain value.

Why it is shaped like this: the floor for calibration is one forward pass of the base model over the
calibration tokens. So the loop does nothing but build a padded batch, set the token mask for the capture,
and run the base model with `use_cache=False` under `torch.inference_mode()`; statistics stay on the
device and are read once at the end.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import data as data_mod
from . import export, model as model_mod, observe, scales as scales_mod
from .recipe import Recipe


@dataclass
class Result:
    out: Path
    scales: scales_mod.Scales
    data: data_mod.DataReport
    seconds: float
    forward_seconds: float
    model_dtype: str
    device: str

    @property
    def tokens_per_second(self) -> float:
        return self.data.tokens / max(self.forward_seconds, 1e-9)


def batches(seqs: Iterable[list[int]], batch_size: int, pad_id: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded `(input_ids, attention_mask)` batches. Right padding keeps every real token at its true
    position, and causal attention never lets a real token see the padding after it."""
    group: list[list[int]] = []
    for s in seqs:
        group.append(s)
        if len(group) == batch_size:
            yield _pad(group, pad_id)
            group = []
    if group:
        yield _pad(group, pad_id)


def _pad(group: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in group)
    ids = torch.full((len(group), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    for row, s in enumerate(group):
        ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[row, : len(s)] = 1
    return ids, mask


def observe_kv(loaded: model_mod.LoadedModel, seqs: Iterable[list[int]], batch_size: int,
               progress: Any | None = None) -> tuple[observe.Stats, float]:
    """Run the base model over the sequences with the K/V capture installed; returns (stats, loop seconds,
    which include streaming and tokenizing the data)."""
    model, dev = loaded.model, loaded.device
    pad_id = getattr(loaded.tokenizer, "pad_token_id", None) or 0
    t0 = time.perf_counter()
    with observe.capture_kv(model, loaded.attention_layers) as cap, torch.inference_mode():
        for ids, mask in batches(seqs, batch_size, pad_id):
            n = int(mask.sum())
            ids, mask = ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True)
            cap.token_mask = mask.bool()
            model(input_ids=ids, attention_mask=mask, use_cache=False)
            if progress is not None:
                progress.update(n)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        spent = time.perf_counter() - t0
        stats = cap.stats()
    return stats, spent


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("kvcalib", "torch", "transformers", "compressed-tensors", "safetensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def provenance(recipe: Recipe, model_src: str, data_src: str, report: data_mod.DataReport,
               scales: scales_mod.Scales, dtype: str) -> dict[str, Any]:
    return {
        "producer": "kvcalib",
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": str(model_src),
        "data": {"source": str(data_src), **report.to_dict()},
        "recipe": recipe.to_dict(),
        "calibration_dtype": dtype,
        "versions": _versions(),
        "layers": {
            str(i): {
                "k_scale": float(s.k_scale), "v_scale": float(s.v_scale),
                "k_amax": float(s.k_amax.max()), "v_amax": float(s.v_amax.max()),
                "k_amax_per_head": [float(x) for x in s.k_amax], "v_amax_per_head": [float(x) for x in s.v_amax],
            }
            for i, s in scales.items()
        },
    }


def calibrate(model_src: str | Path, data_src: str | Path, recipe: Recipe, out: Path, *, device: str | None = None,
              trust_remote_code: bool = False, force: bool = False, progress: Any | None = None) -> Result:
    t_start = time.perf_counter()
    if Path(out).exists() and not force:  # fail before the expensive part
        raise export.ExportError(f"output {out} already exists; pass --force to replace it or choose another --out")
    data_mod.check_source(data_src)
    loaded = model_mod.load(model_src, device=device, trust_remote_code=trust_remote_code)
    max_pos = getattr(loaded.config, "max_position_embeddings", None)
    if max_pos and recipe.seq_len > max_pos:
        raise model_mod.ModelError(f"seq_len {recipe.seq_len} exceeds the model's context "
                                   f"(max_position_embeddings = {max_pos}); lower SEQ_LEN")
    report = data_mod.DataReport()
    seqs = data_mod.samples(data_src, loaded.tokenizer, seq_len=recipe.seq_len, max_samples=recipe.samples,
                            min_tokens=recipe.min_tokens, pack=recipe.pack, seed=recipe.seed,
                            vocab_size=getattr(loaded.config, "vocab_size", None), report=report)
    stats, fwd = observe_kv(loaded, seqs, recipe.batch_size, progress)
    scales = scales_mod.per_tensor_fp8(stats, recipe.headroom)
    dtype = str(loaded.dtype).removeprefix("torch.")
    prov = provenance(recipe, str(model_src), str(data_src), report, scales, dtype)
    path = export.export_vllm(loaded.source_dir, Path(out), scales, prov, force=force)
    return Result(out=path, scales=scales, data=report, seconds=time.perf_counter() - t_start,
                  forward_seconds=fwd, model_dtype=dtype, device=str(loaded.device))
