"""`kvcalib tune`: a thin Click command over calib.tune.search (registered on the `kvcalib` group).

Its options come from the shared table (calib/cli_options.py) plus tune's own search-space options. Importing this
module must stay cheap (no torch): heavy modules are imported inside the command.
"""

from __future__ import annotations

from pathlib import Path

import click

from calib import cli_options as opts
from calib import resources
from calib.evaluation import emulate
from calib.safety import outputs
from calib.tune.space import OBSERVERS


@click.command("tune", cls=opts.Command)
@opts.use("model", "data")
@click.option("--eval-data", "eval_src", help="Held-out data the candidates are scored on. Default: the sample text "
              "(records used for calibration are left out).")
@opts.use("target", "emulate")
@click.option("--observers", help=f"Comma list of observers to try. Default: {','.join(OBSERVERS)} "
              "(with --stats: those the files hold).")
@click.option("--headrooms", default="1.0,1.25", show_default=True, help="Comma list of headroom values to try.")
@opts.use("stats")
@click.option("--stats-dir", "stats_out", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the pass's statistics in this folder (one file per observer) for a later --stats.")
@opts.deprecated("--stats-out", "--stats-dir", "stats_out", type=click.Path(file_okay=False, path_type=Path))
@opts.use("samples", "seq_len", "pack", "batch_size", "seed")
@click.option("--eval-samples", type=int, cls=opts.HelpOption,
              help="Held-out samples. Default: {tune_eval_samples}; fewer on the embedded default model.")
@opts.use("buckets")
@click.option("--sensitivity-samples", type=int, help="Held-out samples the per-layer sensitivity runs on "
              "(default: all of them; 4 on the embedded default).")
@opts.use("max_skip", "max_kl", "max_ppl_increase", "budget_minutes", *opts.ENGINE)
@click.option("--confirm", type=int, default=3, show_default=True, help="Candidates confirmed in the engine.")
@opts.use("formats", "engine_version", *opts.MODEL[1:], *opts.OUTPUT)
def tune(model_src, data_src, eval_src, target, emulation, observers, headrooms, stats, stats_out, samples, seq_len,
         pack, batch_size, seed, eval_samples, buckets, sensitivity_samples, max_skip, max_kl, max_ppl_increase,
         budget_minutes, engine, vllm_venv, engine_top_k, engine_kv_gib, engine_timeout, confirm, formats,
         engine_version, trust_remote_code, device, device_map, max_memory, offload_folder, cpu_dtype, plots,
         progress, out, force) -> None:
    """Search the recipes the target engine can load; score each on held-out text; write the best checkpoint.
    Exit 0 when a candidate is chosen (its checkpoint written), 3 when BF16 stays (calib/errors.py)."""
    from calib import summary
    from calib.evaluation import served
    from calib.evaluation.cli import with_model
    from calib.model.default_model import DIR_NAME
    from calib.progress import Progress
    from calib.recipe import recipe as recipe_mod
    from calib.tune import run, search, space

    first = opts.first_look("tune", model_src, samples=samples, seq_len=seq_len, eval_samples=eval_samples,
                            buckets=buckets, sensitivity_samples=sensitivity_samples)
    target = target or search.TuneConfig.target
    obs = space.parse_list(observers, "--observers") if observers is not None else None
    heads = space.parse_list(headrooms, "--headrooms", float)
    base = recipe_mod.Recipe().replace(**opts.given(samples=first["samples"], seq_len=first["seq_len"], pack=pack,
                                                    batch_size=batch_size, seed=seed), targets=target)
    spec = opts.engine_spec(engine, vllm_venv, top_k=engine_top_k, kv_gib=engine_kv_gib, timeout=engine_timeout)
    if emulation is None and target == "vllm":
        emulation = emulate.for_this_machine()     # FlashAttention-3's arithmetic on a Hopper GPU
    data = data_src if (data_src or stats) else str(resources.default_data())
    name = DIR_NAME if model_src is None else Path(str(model_src).rstrip("/")).name
    version = served.stated(target, engine_version) if target in space.TARGETS else None
    cfg = search.TuneConfig(
        model=str(model_src or ""), data=data, eval_data=eval_src or str(resources.default_data()),
        out=out or Path("out") / f"{name}-tune", target=target, emulate=emulation, observers=obs, headrooms=heads,
        stats=tuple(stats), stats_out=stats_out, base=base, max_skip=max_skip,
        cpu_dtype=cpu_dtype or (None if engine else "float32"), trust_remote_code=trust_remote_code, engine=spec,
        confirm=confirm, formats=opts.formats(formats), fit_buckets=buckets is None, engine_version=version,
        **opts.given(eval_samples=first["eval_samples"], buckets=opts.buckets(first["buckets"]),
                     sensitivity_samples=first["sensitivity_samples"], max_kl=max_kl, max_ppl_increase=max_ppl_increase,
                     budget_minutes=budget_minutes, plots=plots, force=force, device=device,
                     **opts.placement(device_map, max_memory, offload_folder)))
    search.check(cfg)             # before the default model is built or any model loads
    cfg = with_model(cfg, model_src, cfg.out, "tune")
    with outputs.terminate_as_interrupt():     # SIGTERM: temporary folders removed, engine runners killed
        result = run.run(cfg, log=opts.echo_err, progress=Progress(opts.echo_err if progress else None))
    click.echo(result.doc["scales_matter"]["text"])
    if result.doc["budget"]["stopped"]:
        click.echo(f"stopped early ({result.doc['budget']['stopped']}): best of what was scored; "
                   f"{len(result.doc['budget']['not_scored'])} candidate(s) not scored")
    click.echo(result.headline)
    scored = sum(1 for r in result.doc["candidates"] if r["scored"])
    click.echo(f"{scored} of {len(result.doc['candidates'])} candidates scored, "
               f"{result.doc['measuring_passes']} measuring passes, {result.seconds:.0f} s")
    if result.serve:
        click.echo(f"wrote {result.out} (the checkpoint, tune.json, tune.md)\nserve it:\n  {result.serve}")
    else:
        click.echo(f"wrote {result.out} (tune.json, tune.md): no checkpoint — serve the model with its BF16 KV cache")
    summary.conclude(summary.of_tune(result, cfg), result.out)
