"""`kvcalib` command line: thin Click commands over the library functions.

Importing this module must stay cheap (no torch): heavy modules are imported inside the commands.
Every known failure surfaces as one line `Error: ...` and a non-zero exit (calib/errors.py), never a traceback:
`Kvcalib.invoke` is the one place a `KvcalibError` becomes that line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import click

from calib import __version__, cli_options as opts, errors, resources
from calib.errors import KvcalibError
from calib.recipe import recipe as recipe_mod
from calib.export import serve
from calib.safety import outputs

DEFAULT_DATA = resources.default_data()

EXIT_CODES = f"""Exit codes:

\b
  {errors.OK}    done; for eval, validate, tune and plan: ship the quantized KV cache (go)
  {errors.ERROR}    a kvcalib error (one line: Error: ...)
  {errors.USAGE}    a usage error (an unknown option, a value of the wrong type)
  {errors.NO_GO}    keep the model's own KV dtype (BF16), or nothing to recommend (no-go)
  {errors.INTERRUPTED}  interrupted (Ctrl-C; SIGTERM / SIGHUP: 128 + the signal's number)

Each of calibrate, eval, validate, tune and plan writes summary.json (schema kvcalib.summary/1) in its output
folder: the decision, the serve command, the headline numbers."""


class Kvcalib(click.Group):
    """The `kvcalib` group: the one place a KvcalibError becomes one line and exit 1, and an interrupt exit 130."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KvcalibError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt as e:
            click.echo("\nAborted.", err=True)
            # 130 for Ctrl-C; 128 + N for signal N turned into an interrupt (outputs.terminate_as_interrupt)
            signum = str(e).removeprefix("signal ")
            ctx.exit(128 + int(signum) if str(e).startswith("signal ") and signum.isdigit() else errors.INTERRUPTED)


def _is_shipped(recipe_path: str | None) -> bool:
    return recipe_path is None or (not recipe_path.endswith((".yaml", ".yml")) and "/" not in recipe_path)


def _recipe_file(recipe_path: str | None) -> Path | None:
    """The YAML file a --recipe names, a shipped one by name (an input outputs must never overwrite)."""
    if not recipe_path:
        return None
    return resources.shipped_recipe(recipe_path) if _is_shipped(recipe_path) else Path(recipe_path)


def _load_recipe(recipe_path: str | None, **overrides) -> recipe_mod.Recipe:
    return recipe_mod.load(_recipe_file(recipe_path) or recipe_path).replace(**overrides)


@click.group(cls=Kvcalib, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES)
@click.version_option(__version__, "--version", prog_name="kvcalib", message="%(prog)s %(version)s")
def main() -> None:
    """Calibrate FP8 KV-cache scales on your own text; export checkpoints serving engines load directly."""


@main.command(cls=opts.Command)
@opts.use("model", "data")
@click.option("--recipe", "recipe_path", help="Recipe: a shipped name (`kvcalib recipes`) or a YAML file.")
@opts.use("out", "samples", "seq_len", "batch_size", "seed")
@click.option("--headroom", type=float, help="Scale multiplier, >= 1 leaves room for unseen data (overrides the recipe).")
@opts.use("pack", "kv_cache_dtype")
@click.option("--granularity", type=click.Choice(recipe_mod.GRANULARITIES), help="Scale granularity (overrides the recipe).")
@click.option("--observer", type=click.Choice(tuple(recipe_mod.OBSERVERS)), help="Range observer (overrides the recipe).")
@click.option("--q-scale/--no-q-scale", default=None, help="Also calibrate q_scale for vLLM's FP8 attention.")
@click.option("--skip-layers", help="Comma list of layer indices and/or sliding_window kept in the model dtype.")
@opts.use("target")
@click.option("--max-batch-tokens", type=int, help="Token budget per batch; groups similar lengths to cut padding.")
@opts.use("device_map", "max_memory", "offload_folder", "device", "cpu_dtype", "trust_remote_code")
@click.option("--into", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Attach the scales to this weight-quantized checkpoint of the same model (weights untouched). "
                   "Calibration runs through --model (default: the --into checkpoint itself).")
@click.option("--allow-pickle", is_flag=True,
              help="Load pickle (.bin) weights when a model has no safetensors (pickle can run code: trusted files only).")
@click.option("--overwrite-kv-scales", is_flag=True,
              help="With --into: replace KV scales the checkpoint already carries (vllm target).")
@click.option("--checkpoint-every", type=int, help="Save the observers every N batches to OUT.kvcalib-resume.safetensors.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its saved observers (same arguments).")
@click.option("--stats-out", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the raw statistics to this file (for `kvcalib merge`, `export --stats`, `eval --stats`, "
                   "`tune --stats`).")
@opts.use("engine_version", "force")
def calibrate(model_src, data_src, recipe_path, out, samples, seq_len, batch_size, seed, headroom, pack, kv_cache_dtype,
              granularity, observer, q_scale, skip_layers, target, max_batch_tokens, device_map, max_memory,
              offload_folder, device, cpu_dtype, trust_remote_code, allow_pickle, into, overwrite_kv_scales,
              checkpoint_every, resume, stats_out, engine_version, force) -> None:
    """Calibrate KV-cache scales and write checkpoints the engines load."""
    if into is None and _is_shipped(recipe_path):
        first = opts.first_look("calibrate", model_src, samples=samples, seq_len=seq_len)
        samples, seq_len = first["samples"], first["seq_len"]
    recipe = _load_recipe(recipe_path, samples=samples, seq_len=seq_len, batch_size=batch_size, seed=seed,
                          headroom=headroom, pack=pack, dtype=kv_cache_dtype, granularity=granularity,
                          observer=observer, q_scale=q_scale, skip_layers=skip_layers, targets=target)
    from tqdm import tqdm

    from calib import pipeline, summary
    from calib.capture import distributed
    from calib.model.load import Placement
    from calib.safety import options

    placement = Placement(device=device, cpu_dtype=cpu_dtype or "float32",
                          **opts.placement(device_map, max_memory, offload_folder))
    # options first: a bad value fails in milliseconds, before the default model is built or a model loads
    options.calibrate(device_name=device, max_batch_tokens=max_batch_tokens, seq_len=recipe.seq_len,
                      checkpoint_every=checkpoint_every, device_map=placement.device_map,
                      max_memory=placement.max_memory)
    versions = serve.parse_versions(engine_version, recipe.targets)
    serve.check(recipe, versions=versions)      # an engine that ignores these scales whatever the data: refuse now
    with outputs.terminate_as_interrupt():
        if model_src is None:
            model_src = str(into) if into is not None else opts.default_model()
        data_src = data_src or str(DEFAULT_DATA)
        out = out or Path("out") / f"{Path(str(model_src).rstrip('/')).name}-kv-{recipe.dtype.split('_')[0]}"
        dist = distributed.from_env()
        checkpoint = None if not (checkpoint_every or resume) else pipeline.Checkpointing(
            path=outputs.resume_path(Path(out)), every=checkpoint_every or 0, resume=resume)
        placement = dataclasses.replace(placement, device=distributed.device_for(dist, device))
        with _LazyBar(tqdm, desc="calibrating", unit="tok", unit_scale=True, file=sys.stderr,
                      dynamic_ncols=True, disable=not dist.is_main) as bar:
            job = pipeline.CalibrateJob(
                model_src, data_src, recipe, out, trust_remote_code=trust_remote_code, force=force,
                options=pipeline.RunOptions(max_batch_tokens=max_batch_tokens, dist=dist, checkpoint=checkpoint),
                placement=placement,
                stats_out=stats_out, into=into, overwrite_kv=overwrite_kv_scales, allow_pickle=allow_pickle,
                recipe_file=_recipe_file(recipe_path), engine_versions=versions)
            result = pipeline.run(job, progress=bar, options_checked=True)
    if dist.is_main:
        _report(result, recipe, versions)
        summary.conclude(summary.of_calibrate(result, recipe, stats_out), result.out)


class _LazyBar:
    """A tqdm bar that appears with the first batch, not while the model is still loading."""

    def __init__(self, tqdm, **kwargs) -> None:
        self._make, self._kwargs, self._bar = tqdm, kwargs, None

    def update(self, n: int) -> None:
        if self._bar is None:
            self._bar = self._make(**self._kwargs)
        self._bar.update(n)

    def __enter__(self) -> "_LazyBar":
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()


def _report(result, recipe: recipe_mod.Recipe, versions: dict[str, str]) -> None:
    d = result.data
    click.echo(f"\nsamples: {d.used} used, {d.skipped_short} skipped (shorter than {recipe.min_tokens} tokens); "
               f"{d.tokens} tokens in {result.forward_seconds:.1f} s ({result.tokens_per_second:,.0f} tokens/s, "
               f"{result.model_dtype} on {result.device}, {result.padding:.1%} padding)")
    from calib.data.sources import pack_hint

    hint = None if recipe.pack else pack_hint(d.used, d.tokens, recipe.seq_len, "--seq-len", result.padding)
    if hint:
        click.echo(hint, err=True)
    if result.scales:
        click.echo(f"{recipe.dtype} scales, granularity {recipe.granularity} (max over heads shown), "
                   f"observer {recipe.observer}:")
        click.echo(_scale_table(_scale_rows(result.scales)))
    over = {i: (float(s.k_over), float(s.v_over)) for i, s in result.stats.items() if float(s.k_over) + float(s.v_over) > 0}
    if over:
        click.echo(f"layers {sorted(over)} reach |x| > 448: with the default scale 1.0 their FP8 cache saturates "
                   "(share of K / V values: " + ", ".join(f"{i}: {k:.3%} / {v:.3%}" for i, (k, v) in over.items()) + ")")
    click.echo(f"\nwrote {result.out}")
    if not recipe.targets:
        click.echo("statistics only (no target): stats.safetensors and kvcalib.json")
        return
    if result.skipped:
        click.echo(f"layers {result.skipped} keep their KV cache in the model dtype (skip_layers)")
    _serve_report(recipe, result.out, result.scales, result.skipped, versions)


def _serve_report(recipe: recipe_mod.Recipe, out: Path, scales, skipped, versions: dict[str, str]) -> None:
    """Each target's serve command, then what its engine does with the scales (calib.recipe.support) for this
    model's architecture (as the check before writing read it); a result the engine serves differently from what
    was calibrated gets a warning line on stderr each way."""
    from calib.export import TARGETS

    multi = len(recipe.targets) > 1
    arch = serve.architecture_of(out / recipe.targets[0] if multi else out)
    served = serve.outcomes(recipe, scales, skipped, versions, arch)
    for t in recipe.targets:
        path = str(out / t if multi else out)      # quoted by the serve-command builder
        for line in serve.serve_lines(TARGETS[t], path, served[t], skipped):
            click.echo(line)
        for line in serve.warnings(TARGETS[t], recipe, served[t]):
            click.secho(f"warning: {line}", err=True, fg="yellow")


def _scale_rows(scales) -> dict[int, tuple[float, float, float, float]]:
    """Per layer (max|K|, k_scale, max|V|, v_scale), the largest over heads."""
    return {i: (float(s.k_amax.max()), float(s.k_scale.max()), float(s.v_amax.max()), float(s.v_scale.max()))
            for i, s in scales.items()}


def _scale_table(rows: dict[int, tuple[float, float, float, float]]) -> str:
    def num(x: float, width: int, fmt: str) -> str:
        return f"{'n/a':>{width}}" if x != x else f"{x:>{width}{fmt}}"
    return "\n".join([f"{'layer':>5}  {'max|K|':>10}  {'k_scale':>12}  {'max|V|':>10}  {'v_scale':>12}"] + [
        f"{i:>5}  {num(ka, 10, '.4g')}  {num(ks, 12, '.6g')}  {num(va, 10, '.4g')}  {num(vs, 12, '.6g')}"
        for i, (ka, ks, va, vs) in rows.items()])


@main.command()
@click.argument("ckpt", type=click.Path(exists=True, file_okay=False, path_type=Path))
def inspect(ckpt: Path) -> None:
    """Show a checkpoint's KV-cache format, target engines and per-layer scales."""
    variants = [ckpt / t for t in recipe_mod.TARGETS if (ckpt / t / "config.json").is_file()]
    multi = not (ckpt / "config.json").is_file() and variants     # a multi-target output: OUT/<target> each
    for v in variants if multi else [ckpt]:
        _inspect_one(v)
        if multi:
            click.echo("")


def _inspect_one(ckpt: Path) -> None:
    from calib.ckpt.kvinfo import read_kv_info

    try:
        info = read_kv_info(ckpt)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise click.ClickException(f"{ckpt}: {e}") from None
    click.echo(f"checkpoint: {info.path}")
    click.echo(f"targets:    {', '.join(info.targets) or 'none (no KV cache quantization declared)'}")
    if info.kv_scheme:
        s = info.kv_scheme
        click.echo(f"kv scheme:  {s.get('type')}{s.get('num_bits')} strategy={s.get('strategy')} dynamic={s.get('dynamic')}")
    if info.provenance:
        p = info.provenance
        d = p.get("data", {})
        r = p.get("recipe", {})
        click.echo(f"calibrated: by {p.get('producer')} on {d.get('samples')} samples / {d.get('tokens')} tokens "
                   f"of {d.get('source')} ({p.get('created')})")
        click.echo(f"recipe:     {r.get('dtype')} granularity={r.get('granularity')} observer={r.get('observer')} "
                   f"headroom={r.get('headroom')} q_scale={r.get('q_scale')}")
        if skipped := p.get("skipped_layers") or []:
            click.echo(f"skipped:    layers {skipped} keep the model dtype: serve with "
                       f"--kv-cache-dtype-skip-layers {' '.join(map(str, skipped))}")
    if not info.scales:
        click.echo("no KV scale tensors found")
        return
    layers, nan = (info.provenance or {}).get("layers", {}), float("nan")
    click.echo(_scale_table({i: (layers.get(str(i), {}).get("k_amax", nan), max(sc.get("k", [nan])),
                                 layers.get(str(i), {}).get("v_amax", nan), max(sc.get("v", [nan])))
                             for i, sc in info.scales.items()}))
    if info.num_layers is not None and len(info.scales) != info.num_layers:
        click.echo(f"warning: scales for {len(info.scales)} of {info.num_layers} layers; "
                   "engines use 1.0 for the others", err=True)


@main.command()
@click.argument("stats", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Merged statistics file.")
@click.option("--force", is_flag=True, help="Replace OUT if it is a kvcalib statistics file (never any other file).")
def merge(stats: tuple[Path, ...], out: Path, force: bool) -> None:
    """Combine statistics files of one model (other data, shards, days) exactly as one run over all of it."""
    from calib.capture import statsfile

    statsfile.merge(list(stats), out, force=force)
    click.echo(f"wrote {out} (merged {len(stats)} files)")


@main.command("export", cls=opts.Command)
@click.option("--stats", "stats_path", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Statistics file from `calibrate --stats-out` or `merge`.")
@click.option("--model", "model_src", required=True, help="The model the statistics were recorded on.")
@click.option("--recipe", "recipe_path", help="Recipe: a shipped name or a YAML file.")
@opts.use("kv_cache_dtype")
@click.option("--granularity", type=click.Choice(recipe_mod.EXPORTABLE))
@click.option("--headroom", type=float)
@click.option("--skip-layers")
@opts.use("target")
@click.option("--out", required=True, type=click.Path(path_type=Path))
@opts.use("engine_version", "force")
def export_cmd(stats_path, model_src, recipe_path, kv_cache_dtype, granularity, headroom, skip_layers, target, out,
               engine_version, force):
    """Turn statistics into a checkpoint for a recipe, without running the model again."""
    from calib import pipeline

    recipe = _load_recipe(recipe_path, dtype=kv_cache_dtype, granularity=granularity, headroom=headroom,
                          skip_layers=skip_layers, targets=target)
    versions = serve.parse_versions(engine_version, recipe.targets)
    path, scales, skipped = pipeline.export_from_stats(stats_path, model_src, recipe, out, force=force,
                                                       recipe_file=_recipe_file(recipe_path),
                                                       engine_versions=versions)
    click.echo(_scale_table(_scale_rows(scales)))
    click.echo(f"wrote {path}")
    _serve_report(recipe, path, scales, skipped, versions)


@main.command()
@click.argument("ckpt", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--engine", "--target", "engine", type=click.Choice(["all", *recipe_mod.TARGETS]), default="all",
              show_default=True, help="Check the rules of this engine (all: the engines the checkpoint declares).")
@click.option("--engine-version", "engine_version", help="The engine version or build you serve with: "
              "ENGINE=VERSION[,...] (e.g. trtllm=pr18953). Default: the newest version kvcalib knows.")
def verify(ckpt: Path, engine: str, engine_version: str | None) -> None:
    """Check CKPT against each engine's loader rules and say what each engine applies of its scales; one line per
    problem, non-zero exit on errors (a result the engine would not serve as calibrated is one)."""
    from calib.ckpt.reader import CheckpointFiles
    from calib.verify import ENGINES, engines, verify as run_verify
    from calib.verify.applied import applied, differs_problem, refusal_problem

    if engine != "all" and engine not in ENGINES:   # a target whose engine has no checks in calib.verify
        raise click.ClickException(f"kvcalib knows no loader rules for {engine}; it checks {', '.join(ENGINES)}")
    checked = engines(ckpt, engine)
    versions = serve.parse_versions(engine_version, checked)
    problems = run_verify(ckpt, engine)
    ck = CheckpointFiles(ckpt) if (ckpt / "config.json").is_file() else None
    served = {e: applied(ck, e, versions.get(e)) for e in checked} if ck is not None else {}
    problems += [refusal_problem(e, o) for e, o in served.items() if o is not None and o.refused]
    problems += [p for e, o in served.items() if o is not None and (p := differs_problem(e, o, problems))]
    for p in problems:
        click.echo(str(p))
    for e, o in served.items():
        if o is not None and not o.refused:
            for line in o.lines() or [o.summary()]:
                click.echo(f"APPLIES [{e}] {line}")
    failed = [p for p in problems if p.severity == "error"]
    click.echo(f"{ckpt}: {len(failed)} error(s), {len(problems) - len(failed)} warning(s)", err=True)
    if failed:
        sys.exit(errors.ERROR)


@main.command("default-model")
def default_model_cmd() -> None:
    """Build (once) and print the path of the embedded default model (SmolLM2-135M-Instruct)."""
    click.echo(opts.default_model())


@main.group(invoke_without_command=True)
@click.pass_context
def recipes(ctx: click.Context) -> None:
    """List the shipped recipes (recipes/*.yaml), one line each."""
    if ctx.invoked_subcommand is None:
        for path in resources.shipped_recipes():
            first = next((ln[1:].strip() for ln in path.read_text().splitlines() if ln.startswith("#")), "")
            click.echo(f"{path.stem:<18} {first}")


@recipes.command("show")
@click.argument("name")
def recipes_show(name: str) -> None:
    """Print the resolved recipe NAME (a shipped name or a YAML path), every field with its doc."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else resources.shipped_recipe(name)
    r = recipe_mod.load(path)
    docs = recipe_mod.Recipe.field_docs()
    for key, value in r.to_dict().items():
        click.echo(f"{key}: {json.dumps(value)}    # {docs[key]}")


# the deciding commands live in their own modules: cli.py stays short
from calib.tune.cli import tune as _tune  # noqa: E402
from calib.evaluation.cli import eval_cmd as _eval  # noqa: E402
from calib.routes.cli import plan as _plan  # noqa: E402
from calib.validate.cli import validate as _validate  # noqa: E402

for _command in (_tune, _eval, _plan, _validate):
    main.add_command(_command)

if __name__ == "__main__":
    main()
