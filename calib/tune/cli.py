"""`kvcalib tune`: a thin Click command over calib.tune.search (registered on the `kvcalib` group).

Importing this module must stay cheap (no torch): heavy modules are imported inside the command.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from calib import resources
from calib.errors import KvcalibError
from calib.evaluation.cli import parse_formats
from calib.recipe import recipe as recipe_mod
from calib.safety import outputs
from calib.tune.space import OBSERVERS, TARGETS

# The embedded default model: a first look that finishes in minutes on a 2-core CPU (measured in the README).
DEFAULT_MODEL_TUNE = {"samples": 8, "seq_len": 128, "eval_samples": 8, "buckets": "64,128", "sensitivity_samples": 4}
TUNE_DEFAULTS = {"samples": 128, "seq_len": 512, "eval_samples": 32, "buckets": "512,2048", "sensitivity_samples": None}


@click.command("tune")
@click.option("--model", "model_src", help="Model directory or hub id. Default: the embedded SmolLM2-135M-Instruct "
              "(a first look: " + ", ".join(f"{k} {v}" for k, v in DEFAULT_MODEL_TUNE.items()) + ").")
@click.option("--data", "data_src", help="Calibration data (as calibrate). Default: the sample text, unless --stats.")
@click.option("--eval-data", "eval_src", help="Held-out data the candidates are scored on. Default: the sample text "
              "(records used for calibration are left out).")
@click.option("--target", type=click.Choice(TARGETS), default="vllm", show_default=True,
              help="The engine whose loadable recipes are searched.")
@click.option("--emulate", "emulation", help="Whose arithmetic scores the candidates (as eval). Default: vllm-cpu "
              "for --target vllm, trtllm for --target trtllm.")
@click.option("--observers", help=f"Comma list of observers to try. Default: {','.join(OBSERVERS)} "
              "(with --stats: those the files hold).")
@click.option("--headrooms", default="1.0,1.25", show_default=True, help="Comma list of headroom values to try.")
@click.option("--stats", "stats", multiple=True, help="Statistics of an earlier pass (a tune --stats-out folder or a "
              "calibrate --stats-out file); repeatable. Skips the pass over --data.")
@click.option("--stats-out", type=click.Path(file_okay=False, path_type=Path),
              help="Keep the pass's statistics in this folder (one file per observer) for --stats.")
@click.option("--samples", type=int, help="Calibration samples.")
@click.option("--seq-len", type=int, help="Tokens per calibration sample.")
@click.option("--pack/--no-pack", default=False, show_default=True,
              help="Concatenate calibration records into full --seq-len samples (held-out samples are always packed).")
@click.option("--batch-size", type=int, default=4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eval-samples", type=int, help="Held-out samples.")
@click.option("--buckets", help="Held-out context-length buckets (tokens), e.g. 512,2048.")
@click.option("--sensitivity-samples", type=int, help="Held-out samples the per-layer sensitivity runs on "
              "(default: all of them; 4 on the embedded default).")
@click.option("--max-skip", type=int, help="Most layers kept in the model dtype (top of the sensitivity ranking). "
              "Default: 2 for vllm, 0 for trtllm (it cannot skip).")
@click.option("--max-kl", type=float, default=0.01, show_default=True, help="Quality bar: mean KL (nats) in every bucket.")
@click.option("--max-ppl-increase", type=float, default=0.01, show_default=True, help="Quality bar: relative ppl rise.")
@click.option("--budget-minutes", type=float, help="Bound the whole run, engine confirmation included: measuring stops "
              "early (leaving the engine its time) and fewer candidates are confirmed; choose from what was scored.")
@click.option("--engine", type=click.Choice(["vllm"]), help="Confirm the short list in this real engine.")
@click.option("--vllm-venv", envvar="KVCALIB_VLLM_VENV", type=click.Path(file_okay=False, path_type=Path),
              help="Virtual environment with vLLM (env KVCALIB_VLLM_VENV); used with --engine vllm.")
@click.option("--confirm", type=int, default=3, show_default=True, help="Candidates confirmed in the engine.")
@click.option("--formats", "formats", help="Also score the engine's own KV formats (comma list or `all`: "
              "fp8_e5m2 and the per-token-head caches, emulated) and say which has the fewest bytes per token within "
              "the bar, static calibrated FP8 included.")
@click.option("--plots/--no-plots", default=True)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress lines on stderr.")
@click.option("--device")
@click.option("--cpu-dtype", type=click.Choice(("float32", "bfloat16")), help="Model dtype on CPU. Default: "
              "float32; with --engine the checkpoint's own dtype, which the engine serves.")
@click.option("--trust-remote-code", is_flag=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Output: the chosen checkpoint + tune.json.")
@click.option("--force", is_flag=True, help="Replace OUT if it is a previous kvcalib output (never other files).")
def tune(model_src, data_src, eval_src, target, emulation, observers, headrooms, stats, stats_out, samples, seq_len,
         pack, batch_size, seed, eval_samples, buckets, sensitivity_samples, max_skip, max_kl, max_ppl_increase,
         budget_minutes, engine, vllm_venv, confirm, plots, progress, device, cpu_dtype, trust_remote_code, out,
         force, formats=None) -> None:
    """Search the recipes the target engine can load; score each on held-out text; write the best checkpoint."""
    from calib.model.default_model import DIR_NAME
    from calib.progress import Progress
    from calib.tune import run, search, space

    small = DEFAULT_MODEL_TUNE if model_src is None else TUNE_DEFAULTS
    if model_src is None:
        click.echo("default model, first look: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in small.items()
                                                              if v is not None) + " unless given", err=True)
    try:
        obs = space.parse_list(observers, "--observers") if observers is not None else None
        heads = space.parse_list(headrooms, "--headrooms", float)
        try:
            bucket_list = tuple(int(b) for b in (buckets or small["buckets"]).split(",") if b.strip())
        except ValueError:
            raise click.ClickException(f"--buckets {buckets!r}: give token lengths like 512,2048") from None
        base = recipe_mod.Recipe().replace(samples=samples or small["samples"], seq_len=seq_len or small["seq_len"],
                                           pack=pack, batch_size=batch_size, seed=seed, targets=target)
        engine_spec = None
        if engine:
            from calib.engine.driver import EngineSpec

            if vllm_venv is None:
                raise click.ClickException("--engine vllm needs --vllm-venv PATH (or KVCALIB_VLLM_VENV): the virtual "
                                           "environment where vLLM is installed (`make engine-venv` builds one)")
            engine_spec = EngineSpec(engine, vllm_venv)
        data = data_src if (data_src or stats) else str(resources.default_data())
        name = DIR_NAME if model_src is None else Path(str(model_src).rstrip("/")).name
        cfg = search.TuneConfig(
            model=str(model_src or ""), data=data, eval_data=eval_src or str(resources.default_data()),
            out=out or Path("out") / f"{name}-tune", target=target, emulate=emulation, observers=obs, headrooms=heads,
            stats=tuple(stats), stats_out=stats_out, base=base,
            eval_samples=eval_samples if eval_samples is not None else small["eval_samples"], buckets=bucket_list,
            sensitivity_samples=sensitivity_samples if sensitivity_samples is not None else small["sensitivity_samples"],
            max_skip=max_skip, max_kl=max_kl, max_ppl_increase=max_ppl_increase, budget_minutes=budget_minutes,
            plots=plots, force=force, device=device,
            cpu_dtype=cpu_dtype or (None if engine else "float32"), trust_remote_code=trust_remote_code,
            engine=engine_spec, confirm=confirm, formats=parse_formats(formats), fit_buckets=buckets is None)
        search.check(cfg)             # before the default model is built or any model loads
        if model_src is None:
            from calib.model.default_model import ensure_default_model

            model_src = ensure_default_model(resources.build_dir(), log=lambda m: click.echo(m, err=True))
            cfg = dataclasses.replace(cfg, model=str(model_src))
        write = (lambda m: click.echo(m, err=True)) if progress else None
        with outputs.terminate_as_interrupt():     # SIGTERM: temporary folders removed, engine runners killed
            result = run.run(cfg, log=lambda m: click.echo(m, err=True), progress=Progress(write))
    except KvcalibError as e:
        raise click.ClickException(str(e)) from None
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
