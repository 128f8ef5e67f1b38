"""The statistics every candidate needs, from one forward pass over the calibration data — or from files.

Why one pass: the forward pass is the expensive part of calibration; an observer is cheap. Every observer
of the search (absmax is kept by all of them; `mse` depends on the dtype it minimises the error of) gets its
own capture, and the captures are nested around the same forward pass (pipeline.observe_kv_each, the
calibration's own capture stage: each wraps the attention function the previous one installed, so all of them
see exactly the K/V the cache would store). The result is one
ordinary statistics file per observer (`calib/capture/statsfile.py`, the format `calibrate --stats-out` writes and
`kvcalib export --stats` reads): `tune --stats-dir DIR` keeps them, `tune --stats DIR|FILE` reuses them
and skips the pass — a file from `calibrate --stats-out` works too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from calib import pipeline
from calib.capture import spec, statsfile
from calib.data import sources as data_sources
from calib.data.batching import PaddingStats
from calib.ckpt import fingerprint, integrity
from calib.model import load as model_mod
from calib.recipe.recipe import Recipe
from calib.safety import outputs
from calib.scales.stats import Stats
from calib.tune.space import Candidate


def stats_key(observer: str, dtype: str) -> str:
    """Which recorded statistics serve `observer` for `dtype` (only `mse` depends on the dtype)."""
    return f"mse-{dtype}" if observer == "mse" else observer


def needed_keys(candidates: Sequence[Candidate]) -> list[tuple[str, str, str]]:
    """[(key, observer, dtype)] the candidates need, in a fixed order; absmax alone when nothing else is asked
    (every statistics file keeps the exact absmax)."""
    out: dict[str, tuple[str, str, str]] = {}
    for c in candidates:
        if c.observer != "absmax":
            out.setdefault(stats_key(c.observer, c.dtype), (stats_key(c.observer, c.dtype), c.observer, c.dtype))
    if not out:
        out["absmax"] = ("absmax", "absmax", candidates[0].dtype)
    return list(out.values())


@dataclass
class StatsSet:
    """Statistics files by key (`stats_key`), all of one model; `origin` says where they came from."""
    files: dict[str, statsfile.StatsFile]
    origin: dict[str, Any]

    def has(self, c: Candidate) -> bool:
        return c.observer == "absmax" or stats_key(c.observer, c.dtype) in self.files

    def stats_for(self, c: Candidate, base: Recipe) -> Stats:
        """The per-layer ranges the candidate's recipe turns into scales (statsfile.stats_for_recipe)."""
        key = stats_key(c.observer, c.dtype) if c.observer != "absmax" else next(iter(self.files))
        stats = statsfile.stats_for_recipe(self.files[key], c.recipe(base), f"statistics {key}")
        if not c.q_scale:         # Q was recorded for the q_scale candidates; the others export no q_scale
            stats = {i: dataclasses.replace(s, q_amax=None) for i, s in stats.items()}
        return stats

    def any(self) -> statsfile.StatsFile:
        return next(iter(self.files.values()))


def collect(loaded: model_mod.LoadedModel, data_src: str, base: Recipe, keys: Sequence[tuple[str, str, str]],
            target: str, model_src: str, log: Any = None) -> StatsSet:
    """One forward pass over the calibration samples with every key's observers installed at once (the
    pipeline's capture stage, one capture per key)."""
    recipes = {key: base.replace(dtype=dtype, observer=obs, observer_params={}, granularity="tensor",
                                 q_scale=target == "vllm", skip_layers="", targets=target, headroom=1.0)
               for key, obs, dtype in keys}
    seqs, report = pipeline.token_stream(data_src, loaded, base)
    padding = PaddingStats()
    seen = pipeline.observe_kv_each(loaded, seqs, base.batch_size,
                                    [spec.capture_spec(r, loaded.config) for r in recipes.values()], padding=padding)
    seconds = seen[0].seconds
    dtype = str(loaded.dtype).removeprefix("torch.")
    sha, weights = statsfile.config_sha256(loaded.source_dir), _weights(loaded.source_dir)
    files = {}
    for key, got in zip(recipes, seen):
        prov = pipeline.provenance(recipes[key], model_src, pipeline.data_record(data_src, report), got.stats, {},
                                   [], dtype, rotary_dim=model_mod.rotary_dim(loaded.config), model_config_sha256=sha,
                                   model_weights_sha256=weights)
        files[key] = statsfile.StatsFile(prov.stats_header(), got.capture)
    if log:
        log(f"tune: statistics of {len(files)} observer set(s) from one pass: {report.used} samples / "
            f"{report.tokens} tokens in {seconds:.1f} s")
        hint = None if base.pack else data_sources.pack_hint(report.used, report.tokens, base.seq_len, "--seq-len",
                                                                 padding.fraction)
        if hint:
            log(hint)
    return StatsSet(files, {"pass": {"data": str(data_src), **report.to_dict(), "seconds": seconds}})


def save(stats: StatsSet, out: Path, force: bool) -> Path:
    """Write every statistics file into the folder `out` (atomic, with our marker): `<key>.safetensors`."""
    with outputs.atomic_dir(Path(out), force, kind="statistics", option="--stats-dir") as tmp:
        for key, sf in stats.files.items():
            statsfile.save(tmp / f"{key}.safetensors", sf.capture, sf.header)
    return Path(out)


def stats_files(paths: Iterable[str | Path]) -> list[Path]:
    """The statistics files `--stats` names: files as given, folders by their *.safetensors."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.safetensors"))
            if not found:
                raise statsfile.StatsError(f"--stats {p}: the folder holds no statistics files (*.safetensors)")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise statsfile.StatsError(f"--stats {p} not found")
    return out


def _weights(source: Path) -> str | None:
    """The weights fingerprint of the model folder (None: pickle weights, no headers to read)."""
    try:
        return fingerprint.weights_sha256(source)
    except integrity.IntegrityError:
        return None


def load(paths: Sequence[str | Path], source: Path) -> StatsSet:
    """Statistics files of the model at `source`, checked (statsfile's reader), one per key."""
    files: dict[str, statsfile.StatsFile] = {}
    where: dict[str, str] = {}
    want, weights = statsfile.config_sha256(source), _weights(source)
    for p in stats_files(paths):
        sf = statsfile.load(p, "--stats")
        if sf.provenance.model_config_sha256 != want:
            raise statsfile.StatsError(f"--stats {p} was recorded on another model than {source} "
                                       "(config.json differs)")
        why = fingerprint.mismatch(sf.provenance.model_weights_sha256, weights, f"--stats {p}", f"--model {source}")
        if why:
            raise statsfile.StatsError(f"{why}; give statistics recorded on this model")
        key = stats_key(sf.recipe.observer, sf.recipe.dtype)
        if key in files:
            raise statsfile.StatsError(f"--stats {p} records {key} statistics, as {where[key]} does; give one")
        files[key], where[key] = sf, str(p)
    layers = {tuple(sf.capture.layers) for sf in files.values()}
    if len(layers) > 1:
        raise statsfile.StatsError("--stats files cover different layers; they are not of one run")
    return StatsSet(files, {"files": where})
