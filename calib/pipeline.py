"""The calibration job: a frozen CalibrateJob → prepare → capture → fold → write, each stage handing the next a value.

Why it is shaped like this: the floor for calibration is one forward pass of the base model over the
calibration tokens. So the loop does nothing but build a padded batch, set the token mask for the capture,
and run the base model with `use_cache=False` under `torch.inference_mode()`; statistics stay on the
device and are read once at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from calib import export
from calib.export import serve, trtllm_engine
from calib.capture import hook as observe
from calib.capture import statsfile
from calib.capture.distributed import Dist, barrier, merge_all, shard
from calib.capture.spec import capture_spec
from calib.ckpt import fingerprint, integrity
from calib.ckpt.names import PROVENANCE_FILE, STATS_FILE
from calib.data import sources as data_mod
from calib.data.batching import PaddingStats, batches, prefetch
from calib.model import load as model_mod
from calib.provenance import Provenance
from calib.recipe.recipe import Recipe
from calib.safety import files as safefiles, options as opts, outputs
from calib.scales import fold as scales_mod
from calib.scales.stats import Stats


@dataclass
class Result:
    out: Path
    scales: scales_mod.Scales       # empty when the recipe has no targets (statistics only)
    stats: Stats
    skipped: list[int]
    data: data_mod.DataReport
    padding: float                  # share of computed positions that were padding
    seconds: float
    forward_seconds: float
    model_dtype: str
    device: str

    @property
    def tokens_per_second(self) -> float:
        return self.data.tokens / max(self.forward_seconds, 1e-9)


@dataclass(frozen=True)
class Checkpointing:
    """Long runs save the observers' state every `every` batches to `path` (one safetensors file, replaced
    atomically); `resume` continues after the last saved batch. The data stream is replayed (so the data
    report and fingerprint stay complete) but the model runs only on batches not yet observed; the result
    is bit-identical to an uninterrupted run. `run` identifies it (recipe, model config, data source): the
    resume header is derived from it."""
    path: Path
    every: int = 0
    resume: bool = False
    run: Provenance | None = None        # set by the capture stage's caller before the loop


@dataclass(frozen=True)
class RunOptions:
    """How the forward loop is fed (not part of the recipe: none of these changes a statistic)."""
    max_batch_tokens: int | None = None   # token budget per batch; enables length bucketing
    prefetch: int = 2                     # batches prepared ahead by a background thread (0: none)
    dist: Dist = Dist()                   # this process's rank under torchrun (default: one process)
    checkpoint: Checkpointing | None = None  # save observer state every N batches / resume from it


@dataclass(frozen=True)
class Observed:
    """What the capture stage hands on: the merged capture (what a statistics file saves), its statistics
    (what scales are computed from) and the forward loop's seconds."""
    capture: observe.KVCapture
    stats: Stats
    seconds: float


def observe_kv(loaded: model_mod.LoadedModel, seqs: Iterable[list[int]], batch_size: int,
               progress: Any | None = None, spec: observe.CaptureSpec | None = None,
               options: RunOptions = RunOptions(), padding: PaddingStats | None = None) -> Observed:
    """Run the base model over the sequences with the K/V capture installed; returns the merged capture,
    its statistics and the loop's seconds (which include streaming and tokenizing the data)."""
    return observe_kv_each(loaded, seqs, batch_size, (spec,), progress, options, padding)[0]


def observe_kv_each(loaded: model_mod.LoadedModel, seqs: Iterable[list[int]], batch_size: int,
                    specs: Sequence[observe.CaptureSpec | None], progress: Any | None = None,
                    options: RunOptions = RunOptions(), padding: PaddingStats | None = None) -> list[Observed]:
    """One forward pass with one capture per spec, nested around it (each wraps the attention function the
    previous one installed, so every capture sees exactly the K/V the cache stores); one Observed per spec,
    in order. A causal LM runs without its head. Checkpointing saves and resumes a single capture."""
    ckpt = options.checkpoint
    if ckpt is not None and len(specs) != 1:
        raise ValueError("checkpointing saves one capture: observe one spec per run")
    model, dev = loaded.model, loaded.device
    body = getattr(model, "base_model", model)
    pad_id = getattr(loaded.tokenizer, "pad_token_id", None) or 0
    feed: Iterable = shard(batches(seqs, batch_size, pad_id, max_batch_tokens=options.max_batch_tokens,
                                   padding=padding), options.dist)
    if options.prefetch:
        feed = prefetch(feed, options.prefetch)
    pin = dev.type == "cuda"
    tick = progress.update if progress is not None else (lambda _n: None)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        caps = [stack.enter_context(observe.capture_kv(model, loaded.attention_layers, s)) for s in specs]
        stack.enter_context(torch.inference_mode())
        run = (ckpt.run or Provenance()) if ckpt is not None else None
        resumed = statsfile.resume_into(caps[0], ckpt.path, run) if ckpt is not None and ckpt.resume else None
        done = resumed.batches if resumed is not None else 0
        stream = hashlib.sha256() if ckpt is not None else None      # the token ids and masks fed so far
        i = -1
        for i, (ids, mask) in enumerate(feed):
            if stream is not None:
                stream.update(f"{tuple(ids.shape)}{ids.dtype}".encode() + ids.numpy().tobytes()
                              + mask.numpy().tobytes())
                if resumed is not None and i + 1 == done:
                    resumed.check_stream("sha256:" + stream.hexdigest())
            n = int(mask.sum())
            if i < done:  # observed before the interruption
                tick(n)
                continue
            if pin:
                ids, mask = ids.pin_memory(), mask.pin_memory()
            ids, mask = ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True)
            with contextlib.ExitStack() as masked:
                for cap in caps:
                    masked.enter_context(cap.masking(mask.bool()))
                body(input_ids=ids, attention_mask=mask, use_cache=False)
            tick(n)
            if ckpt is not None and ckpt.every and (i + 1) % ckpt.every == 0:
                statsfile.save(ckpt.path, caps[0], run.resume_header(batches_done=i + 1,
                                                                     stream_sha256="sha256:" + stream.hexdigest()))
        if resumed is not None and i + 1 < done:
            resumed.check_stream(None, batches=i + 1)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        spent = time.perf_counter() - t0
        for cap in caps:
            cap.merge_across(lambda obs: merge_all(obs, options.dist))
        return [Observed(capture=cap, stats=cap.stats(), seconds=spent) for cap in caps]


def token_stream(data: str | Path, loaded: model_mod.LoadedModel,
                 recipe: Recipe) -> tuple[Iterable[list[int]], data_mod.DataReport]:
    """The recipe's calibration sequences of `data` in the model's tokens, and the report they fill as they
    are read (complete once the sequences are consumed)."""
    report = data_mod.DataReport()
    seqs = data_mod.samples(data, loaded.tokenizer, seq_len=recipe.seq_len, max_samples=recipe.samples,
                            min_tokens=recipe.min_tokens, pack=recipe.pack, seed=recipe.seed,
                            vocab_size=getattr(loaded.config, "vocab_size", None), report=report)
    return seqs, report


def data_record(data_src: str | Path, report: data_mod.DataReport) -> dict[str, Any]:
    """The provenance's `data` entry for data read in this run: its source and what was used of it."""
    return {"source": str(data_src), **report.to_dict()}


def provenance(recipe: Recipe, model_src: str, data: dict[str, Any], stats: Stats,
               scales: scales_mod.Scales, skipped: list[int], dtype: str, *, rotary_dim: int | None,
               into: str | None = None, selected_by: dict[str, Any] | None = None,
               model_config_sha256: str | None = None, model_weights_sha256: str | None = None) -> Provenance:
    """The run's record (kvcalib.json, and the statistics header), complete when built: everything it names is
    computed by the caller first and passed in, so no stage patches it afterwards. `into` and `selected_by`
    appear only when given."""
    def vec(t):
        return None if t is None else [float(x) for x in t.reshape(-1)]

    layers = {}
    for i, st in stats.items():
        entry = {"k_amax": float(st.k_amax.max()), "v_amax": float(st.v_amax.max()),
                 "k_amax_per_head": vec(st.k_amax), "v_amax_per_head": vec(st.v_amax),
                 "k_range_per_head": vec(st.clip("k")), "v_range_per_head": vec(st.clip("v"))}
        if st.q_amax is not None:
            entry["q_amax_per_head"] = vec(st.q_amax)
        if i in scales:
            sc = scales[i]
            entry.update(k_scale=vec(sc.k_scale), v_scale=vec(sc.v_scale), q_scale=vec(sc.q_scale))
            entry = {k: (v[0] if isinstance(v, list) and len(v) == 1 and k.endswith("_scale") else v)
                     for k, v in entry.items() if v is not None}
        layers[str(i)] = entry
    return Provenance(model=str(model_src), model_config_sha256=model_config_sha256,
                      model_weights_sha256=model_weights_sha256, data=dict(data),
                      recipe=recipe.to_dict(), skipped_layers=tuple(skipped), calibration_dtype=dtype,
                      layers=layers, rotary_dim=rotary_dim, into=into,
                      selected_by=None if selected_by is None else dict(selected_by))


def write_options(recipe: Recipe, *, force: bool = False, overwrite_kv: bool = False, into: bool = False,
                  extra_files: dict[str, str] | None = None) -> export.WriteOptions:
    """What every target is prepared and written with, from the recipe and the command line."""
    return export.WriteOptions(dtype=recipe.kv_dtype, granularity=recipe.scale_granularity, force=force,
                               overwrite_kv=overwrite_kv, into=into, extra_files=extra_files)


def prepare_targets(source: Path | export.SourceFiles, out: Path, recipe: Recipe, *, overwrite_kv: bool = False,
                    into: bool = False) -> dict[str, export.PreparedSource]:
    """Every target of the recipe checks the source checkpoint by its own rules (nothing written): what
    `write_outputs` writes from. One target writes OUT, several OUT/<target>."""
    how = write_options(recipe, overwrite_kv=overwrite_kv, into=into)
    multi = len(recipe.targets) > 1
    return {t: export.target(t).prepare(source, Path(out) / t if multi else Path(out), how) for t in recipe.targets}


def write_outputs(source: Path, out: Path, recipe: Recipe, capture: observe.KVCapture, scales: scales_mod.Scales,
                  prov: Provenance, *, force: bool, overwrite_kv: bool = False,
                  extra_files: dict[str, str] | None = None,
                  prepared: dict[str, export.PreparedSource] | None = None,
                  engine_versions: Mapping[str, str] | None = None) -> Path:
    """One target → OUT is that checkpoint; several → OUT/<target> each (weights hard-linked between them);
    no target → OUT holds the statistics only (stats.safetensors + kvcalib.json). `extra_files` ({name: text},
    one target only) are written into OUT in the same atomic step. `prepared` (from `prepare_targets`, run by
    the checks) is what each target writes from; without it each target checks `source` itself. Before anything
    is written, a target whose engine (at `engine_versions`, for this model's architecture) would not serve these
    scales as calibrated refuses (calib.export.serve)."""
    targets = list(recipe.targets)
    serve.check(recipe, scales, prov.skipped_layers, engine_versions, serve.architecture_of(source))
    if not targets:
        with outputs.atomic_dir(out, force, kind="statistics") as tmp:
            statsfile.save(tmp / STATS_FILE, capture, prov.stats_header())
            safefiles.write_text(tmp / PROVENANCE_FILE, json.dumps(prov.written_as(None).to_dict(), indent=2) + "\n")
        return out

    if extra_files and len(targets) != 1:
        raise export.ExportError("extra files go into a single-target checkpoint only")

    def one(target: str, path: Path, force_one: bool, extra: dict[str, str] | None = None) -> Path:
        how = write_options(recipe, force=force_one, overwrite_kv=overwrite_kv, extra_files=extra)
        return export.target(target).write((prepared or {}).get(target, source), path, scales, prov, how)

    if len(targets) == 1:
        return one(targets[0], out, force, extra_files)
    with outputs.atomic_dir(out, force) as tmp:
        for t in targets:
            one(t, tmp / t, False)
    return out


def export_from_stats(stats_path: Path, model_src: str | Path, recipe: Recipe, out: Path, *,
                      force: bool = False, recipe_file: Path | None = None,
                      engine_versions: Mapping[str, str] | None = None) -> tuple[Path, scales_mod.Scales, list[int]]:
    """Scales for `recipe` from a statistics file, written against the model's checkpoint — no forward pass.
    Checks (output path, statistics file, model files, each target's rules, room), then OUT's lock, then the
    export from what the checks read."""
    if not recipe.targets:
        raise statsfile.StatsError(f"export needs at least one target ({', '.join(export.TARGETS)})")
    serve.check(recipe, versions=engine_versions)
    inputs = [("the statistics file", stats_path), ("the model folder", model_src), ("the recipe", recipe_file)]
    outputs.check_folder(Path(out), force=force, inputs=inputs)
    sf = statsfile.load(Path(stats_path))
    source = model_mod.resolve_source(model_src)
    if statsfile.config_sha256(source) != sf.provenance.model_config_sha256:
        raise statsfile.StatsError(f"{stats_path} was recorded on another model than {source} (config.json differs)")
    files = export.read_source(source)
    files = dataclasses.replace(files, weights=export.scan_source(files))
    mine = fingerprint.of_model(files.weights)
    why = fingerprint.mismatch(sf.provenance.model_weights_sha256, mine, f"statistics file {stats_path}",
                               f"--model {source}")
    if why:
        raise statsfile.StatsError(f"{why}; export statistics recorded on this model")
    prepared = prepare_targets(files, Path(out), recipe)
    outputs.check_room(Path(out), [source / f for f in sorted(set(files.weights.weight_map.values()))],
                       copies=len(recipe.targets))
    with outputs.lock(Path(out)):
        outputs.check_folder(Path(out), force=force, inputs=inputs)     # taking the lock may restore an output
        stats = statsfile.stats_for_recipe(sf, recipe, str(stats_path))
        config = model_mod.preflight(files).text_config
        skipped = model_mod.resolve_skip_layers(recipe.skip_layers, config, sf.capture.layers)
        scales = _fold(recipe, stats)
        recorded = sf.provenance
        data = {**recorded.data, "statistics_file": str(stats_path)}
        prov = provenance(recipe, str(model_src), data, stats, scales, skipped, "from statistics file",
                          rotary_dim=recorded.rotary_dim, model_config_sha256=recorded.model_config_sha256,
                          model_weights_sha256=recorded.model_weights_sha256)
        path = write_outputs(files.path, Path(out), recipe, sf.capture, scales, prov, force=force, prepared=prepared,
                             engine_versions=engine_versions or {})
        return path, scales, skipped


def _check_same_model(source: Path, a: dict[str, Any], target: Path, b: dict[str, Any]) -> None:
    """The scales of `source` fit `target` only when it is a checkpoint of the same model: the same
    architecture and sizes in their config.json (`a` and `b`, as the checks read them), and, where both store a
    tensor alike (a weight-quantized checkpoint keeps embeddings, norms and often the head as they were), the
    same bytes (calib.ckpt.fingerprint)."""
    keys = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_size", "intermediate_size", "vocab_size")
    a, b = a.get("text_config", a), b.get("text_config", b)
    diff = [k for k in keys if a.get(k) != b.get(k)]
    if diff:
        raise export.ExportError(f"--into {target} is not the same model as {source}: {', '.join(diff)} differ "
                                 f"({[a.get(k) for k in diff]} vs {[b.get(k) for k in diff]})")
    if source.resolve() == target.resolve():
        return
    try:
        mine, theirs = fingerprint.tensor_prints(source), fingerprint.tensor_prints(target)
    except integrity.IntegrityError:         # pickle weights (--allow-pickle): no headers to read
        fingerprint.note(f"--into {target}: its weights could not be compared with {source}'s (no safetensors); "
                         "not checked that it is a checkpoint of the same model")
        return
    differ, shape = fingerprint.same_weights(mine, theirs)
    if shape:
        n = shape[0]
        raise export.ExportError(f"--into {target} is not a checkpoint of {source}: tensor {n!r} is "
                                 f"{list(theirs[n].shape)} there and {list(mine[n].shape)} here")
    if differ:
        raise export.ExportError(f"--into {target} holds other weights than {source}: {len(differ)} of the tensors "
                                 f"both store alike differ (e.g. {differ[0]!r}, sampled bytes "
                                 f"{fingerprint.short(theirs[differ[0]].digest)} there vs "
                                 f"{fingerprint.short(mine[differ[0]].digest)} here); it is a checkpoint of another "
                                 "model — give --into a checkpoint of this one")
    if not fingerprint.comparable(mine, theirs):
        fingerprint.note(f"--into {target}: no tensor is stored alike in it and in {source} (every weight "
                         "quantized or renamed); not checked that it is a checkpoint of the same model")


@dataclass(frozen=True)
class Checked:
    """What the calibrate checks read and computed, handed to the stages so none of it is read again."""
    model: model_mod.Preflight                      # the model that runs: config, weight headers
    target_dir: Path                                # the checkpoint whose files the output carries (model or --into)
    prepared: dict[str, export.PreparedSource]      # target -> its source, checked by that target's rules
    inputs: tuple                                   # (what, path) of every input: no output is, holds or is in one
    weights_sha256: str | None = None               # calib.ckpt.fingerprint of the model that runs (None: pickle)

    @property
    def source_dir(self) -> Path:
        return self.model.path


@dataclass(frozen=True)
class CalibrateJob:
    """One calibration, as the CLI (or a caller) states it: what runs, on what, into where, and how. The
    stages (prepare -> capture -> fold -> write) read it and hand each other plain values."""
    model: str | Path
    data: str | Path
    recipe: Recipe
    out: Path
    device: str | None = None
    trust_remote_code: bool = False
    force: bool = False
    options: RunOptions = RunOptions()
    placement: model_mod.Placement | None = None
    stats_out: Path | None = None
    into: Path | None = None             # a weight-quantized checkpoint of the same model the scales join
    overwrite_kv: bool = False
    allow_pickle: bool = False
    recipe_file: Path | None = None
    engine_versions: Mapping[str, str] = field(default_factory=dict)   # --engine-version: {target: version}


def check_calibrate(job: CalibrateJob, *, options_checked: bool = False) -> Checked:
    """Every check of `job` that needs no weights, in the order a user fixes them: options (`options_checked`:
    the caller ran `safety.options.calibrate` on them already), inputs, output paths (writable, room, never
    over an input or a foreign file), the model's config and checkpoint files, the context length, each
    target's rules for the checkpoint it writes from. Each file is read once; what was read comes back for
    the stages."""
    recipe, out, options = job.recipe, Path(job.out), job.options
    ckpt = options.checkpoint
    place = job.placement or model_mod.Placement(device=job.device)
    if not options_checked:
        opts.calibrate(device_name=place.device, max_batch_tokens=options.max_batch_tokens, seq_len=recipe.seq_len,
                       checkpoint_every=(ckpt.every or None) if ckpt is not None else None,
                       device_map=place.device_map, max_memory=place.max_memory)
    # an engine that would run these scales at 1.0 whatever the data (INT8 on TensorRT-LLM) refuses before any work
    serve.check(recipe, versions=job.engine_versions)
    if ckpt is not None and options.dist.world > 1:
        raise statsfile.StatsError("--checkpoint-every/--resume run in a single process, not under torchrun")
    data_mod.check_source(job.data)
    local = safefiles.expand_user(job.model, "MODEL").exists()
    source_dir = model_mod.resolve_source(job.model) if local else None   # a hub download waits for the checks
    inputs = [("the model folder", job.model), ("the --into checkpoint", job.into), ("the data", job.data),
              ("the recipe", job.recipe_file)]
    outputs.check_folder(out, force=job.force, inputs=inputs)
    theirs = [*inputs, ("the --out folder", out)]
    if job.stats_out is not None:
        outputs.check_file(Path(job.stats_out), inputs=theirs, option="--stats-out", force=job.force)
        outputs.check_room(Path(job.stats_out), option="--stats-out")
    if ckpt is not None:
        outputs.check_file(ckpt.path, inputs=theirs, option="--checkpoint-every", force=None)
    if place.offload_folder:
        outputs.check_scratch(Path(place.offload_folder), inputs=theirs, option="--offload-folder")
    source_dir = source_dir or model_mod.resolve_source(job.model)
    target_dir = source_dir if job.into is None else model_mod.resolve_source(job.into)
    model = model_mod.preflight(source_dir, trust_remote_code=job.trust_remote_code, allow_pickle=job.allow_pickle)
    model.check_context(recipe.seq_len)
    files = model.files
    if job.into is not None and trtllm_engine.is_engine_checkpoint(target_dir):
        files = export.SourceFiles(target_dir, trtllm_engine.same_model_config(source_dir, model.raw, target_dir))
    elif job.into is not None:
        files = export.SourceFiles(target_dir, model_mod.read_config(target_dir))
        _check_same_model(source_dir, model.raw, target_dir, files.config)
    # a broken source checkpoint surfaces before anything is loaded
    prepared = prepare_targets(files, out, recipe, overwrite_kv=job.overwrite_kv, into=job.into is not None)
    weights = [target_dir / f for f in next(iter(prepared.values())).shards] if prepared else []
    outputs.check_room(out, weights, copies=max(1, len(recipe.targets)))
    return Checked(model, target_dir, prepared, tuple(inputs), fingerprint.of_model(model.weights))


def calibrate(model_src: str | Path, data_src: str | Path, recipe: Recipe, out: Path, *, progress: Any | None = None,
              engine_versions: Mapping[str, str] | None = None, **job: Any) -> Result:
    """Calibrate `model_src` on `data_src` and write the recipe's targets to `out`; `job`: CalibrateJob's other
    fields (device, placement, into, ...). With `into` (a weight-quantized checkpoint of the same model), the
    scales are attached to `into`'s files instead: its weights are carried over byte for byte and its
    quantization config gains the KV scheme."""
    return run(CalibrateJob(model_src, data_src, recipe, out, engine_versions=dict(engine_versions or {}), **job),
               progress)


def run(job: CalibrateJob, progress: Any | None = None, *, options_checked: bool = False) -> Result:
    """Checks first (nothing loaded), then the output locks (a second run into OUT refuses), then the stages.
    `options_checked`: the caller ran `check_options(job)` already (the CLI does, before it builds a model)."""
    t_start = time.perf_counter()
    checked = check_calibrate(job, options_checked=options_checked)
    ckpt = job.options.checkpoint
    # the resume file's lock too, checkpointing or not: it clears what a killed save left beside it
    locks = [(job.out, "--out"), (job.stats_out, "--stats-out"),
             (ckpt.path if ckpt else outputs.resume_path(Path(job.out)), "--checkpoint-every")]
    with outputs.locked(locks if job.options.dist.is_main else []):
        # again under the lock: taking it may have put back an output a killed run had moved aside
        outputs.check_folder(Path(job.out), force=job.force, inputs=checked.inputs)
        return _calibrate(job, checked, t_start, progress)


def _fold(recipe: Recipe, stats: Stats) -> scales_mod.Scales:
    """The recipe's scales from the statistics (none for a statistics-only recipe)."""
    if not recipe.targets:
        return {}
    return scales_mod.compute(stats, dtype=recipe.kv_dtype, granularity=recipe.scale_granularity,
                              headroom=recipe.headroom)


def _write(job: CalibrateJob, checked: Checked, options: RunOptions, seen: Observed, scales: scales_mod.Scales,
           prov: Provenance) -> Path:
    """The checkpoint(s) and the statistics file, from the main process only; then every rank meets."""
    path = Path(job.out)
    if options.dist.is_main:
        with contextlib.ExitStack() as stack:    # --stats-out lands only with OUT: a failed OUT leaves neither
            if job.stats_out is not None:
                tmp = stack.enter_context(outputs.atomic_file(Path(job.stats_out), "--stats-out"))
                statsfile.write(tmp, seen.capture, prov.stats_header())
            path = write_outputs(checked.target_dir, Path(job.out), job.recipe, seen.capture, scales, prov,
                                 force=job.force, overwrite_kv=job.overwrite_kv, prepared=checked.prepared,
                                 engine_versions=job.engine_versions)
        if options.checkpoint is not None:
            options.checkpoint.path.unlink(missing_ok=True)  # the run completed: nothing to resume
    barrier(options.dist)
    return path


def _calibrate(job: CalibrateJob, checked: Checked, t_start: float, progress: Any | None) -> Result:
    """Load the model the checks read, resolve the skipped layers, open the token stream; capture, fold, write."""
    recipe, options = job.recipe, job.options
    loaded = model_mod.load(checked.model, device=job.device, trust_remote_code=job.trust_remote_code,
                            placement=job.placement, allow_pickle=job.allow_pickle)
    skipped = model_mod.resolve_skip_layers(recipe.skip_layers, loaded.config, loaded.attention_layers)
    seqs, report = token_stream(job.data, loaded, recipe)      # `report` is filled while `seqs` is consumed
    if options.checkpoint is not None:      # the checkpoint header of this run
        run = Provenance(model=str(job.model), model_config_sha256=checked.model.config_sha256,
                         model_weights_sha256=checked.weights_sha256,
                         data={"source": str(job.data)}, recipe=recipe.to_dict(),
                         rotary_dim=model_mod.rotary_dim(loaded.config))
        options = dataclasses.replace(options, checkpoint=dataclasses.replace(options.checkpoint, run=run))
    padding = PaddingStats()
    seen = observe_kv(loaded, seqs, recipe.batch_size, progress, capture_spec(recipe, loaded.config), options, padding)
    scales = _fold(recipe, seen.stats)
    dtype = str(loaded.dtype).removeprefix("torch.")
    prov = provenance(recipe, str(job.model), data_record(job.data, report), seen.stats, scales, skipped,
                      dtype, rotary_dim=model_mod.rotary_dim(loaded.config),
                      into=None if job.into is None else str(job.into),
                      model_config_sha256=checked.model.config_sha256, model_weights_sha256=checked.weights_sha256)
    path = _write(job, checked, options, seen, scales, prov)
    return Result(out=path, scales=scales, stats=seen.stats, skipped=skipped, data=report,
                  padding=padding.fraction, seconds=time.perf_counter() - t_start, forward_seconds=seen.seconds,
                  model_dtype=dtype, device=str(loaded.device))
