"""Statistics as a file: calibrate once, merge runs, try recipes without running the model again.

Why: the forward pass is the expensive part; folding statistics into scales is not. A statistics file
holds every observer's full state (exact maxima, histograms, counts), not just the final ranges, so
  - `merge` combines runs over different data (domains, shards, days) exactly as one run over all of it
    would have (maxima and histogram counts merge exactly);
  - `export --stats` forms scales for another dtype, granularity, headroom or target from the same pass.

Layout (safetensors): `stats.layers.{i}.{field}` — the readable ranges (`observe.LayerStats` fields) —
and `state.layers.{i}.{observer}.{key}` — the observer states; metadata `kvcalib` holds a JSON header
(recipe, rotary_dim, layers, model, model_config_sha256, data report).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import observe
from .recipe import Recipe, from_dict

# Recipe fields that decide what the observers recorded; runs must agree on them to be merged.
OBSERVED = ("dtype", "granularity", "observer", "observer_params", "q_scale")


class StatsError(ValueError):
    """A statistics file cannot be read, merged or exported as asked; the message says why."""


@dataclass
class StatsFile:
    header: dict[str, Any]
    capture: observe.KVCapture

    @property
    def recipe(self) -> Recipe:
        return from_dict(self.header["recipe"], source="statistics file recipe")

    def stats(self) -> observe.Stats:
        return self.capture.stats()


def config_sha256(model_dir: Path) -> str:
    return "sha256:" + hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()


def save(path: Path, capture: observe.KVCapture, header: dict[str, Any]) -> Path:
    """Write `capture`'s statistics and observer states to `path` (a .safetensors file)."""
    from safetensors.torch import save_file

    stats = capture.stats()
    tensors = {f"stats.{k}": v for k, v in observe.stats_to_tensors(stats).items()}
    tensors.update({f"state.{k}": v.contiguous() for k, v in capture.state_dict().items()})
    header = {**header, "layers": capture.layers}
    path = Path(path)
    tmp = path.with_name(f".{path.name}.kvcalib-tmp")
    save_file(tensors, str(tmp), metadata={"kvcalib": json.dumps(header)})
    tmp.replace(path)
    return path


def load(path: Path) -> StatsFile:
    from safetensors import safe_open

    from .pipeline import capture_spec

    path = Path(path)
    if not path.is_file():
        raise StatsError(f"statistics file {path} not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            state = {k[len("state."):]: f.get_tensor(k) for k in f.keys() if k.startswith("state.")}
    except Exception as e:
        raise StatsError(f"{path}: not a readable safetensors file ({type(e).__name__})") from None
    if "kvcalib" not in meta:
        raise StatsError(f"{path} is not a kvcalib statistics file (no kvcalib header); "
                         "write one with `kvcalib calibrate --stats-out FILE`")
    header = json.loads(meta["kvcalib"])
    recipe = from_dict(header["recipe"], source=f"{path} recipe")
    capture = observe.KVCapture(header["layers"], capture_spec(recipe, rotary_dim=header["rotary_dim"]))
    capture.load_state_dict(state)
    return StatsFile(header, capture)


def merge(paths: list[Path], out: Path) -> Path:
    """Combine statistics files of the same model and observers into one, exactly."""
    if len(paths) < 2:
        raise StatsError("merge needs at least two statistics files")
    files = [load(p) for p in paths]
    first = files[0]
    for p, f in zip(paths[1:], files[1:]):
        for key in ("model_config_sha256", "rotary_dim", "layers"):
            if f.header.get(key) != first.header.get(key):
                raise StatsError(f"{p}: {key} differs from {paths[0]}; only runs of the same model can be merged")
        mine, theirs = first.header["recipe"], f.header["recipe"]
        diff = [k for k in OBSERVED if mine.get(k) != theirs.get(k)]
        if diff:
            raise StatsError(f"{p}: recipe field(s) {diff} differ from {paths[0]}; runs must record the same "
                             "statistics to be merged")
        first.capture.merge_from(f.capture)
    datas = [f.header.get("data", {}) for f in files]
    joined = hashlib.sha256("".join(str(d.get("fingerprint")) for d in datas).encode()).hexdigest()
    data = {"sources": [d.get("source") for d in datas],
            "samples": sum(d.get("samples", 0) for d in datas), "tokens": sum(d.get("tokens", 0) for d in datas),
            "skipped_short": sum(d.get("skipped_short", 0) for d in datas), "fingerprint": f"sha256:{joined}",
            "merged_from": [str(p) for p in paths]}
    return save(out, first.capture, {**first.header, "data": data})


def stats_for_recipe(sf: StatsFile, recipe: Recipe, where: str) -> observe.Stats:
    """The statistics `recipe` needs from this file; errors say what the file lacks."""
    have = sf.recipe
    if recipe.observer not in ("absmax", have.observer) or (
            recipe.observer == have.observer and recipe.observer_params != have.observer_params):
        raise StatsError(f"{where} was recorded with observer {have.observer} {have.observer_params or ''}; "
                         f"it cannot give {recipe.observer} ranges (absmax is always available)")
    if recipe.q_scale and not have.q_scale:
        raise StatsError(f"{where} has no Q statistics; calibrate with q_scale to export q_scale")
    stats = sf.stats()
    if recipe.observer == "absmax" and have.observer != "absmax":  # fall back to the exact maxima
        stats = {i: observe.LayerStats(k_amax=s.k_amax, v_amax=s.v_amax, q_amax=s.q_amax, k_over=s.k_over,
                                       v_over=s.v_over) for i, s in stats.items()}
    return stats


def tensor_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
