"""`kvcalib plan --routes routes.yaml`: a thin Click command over calib.routes (registered on `kvcalib`).

Importing this module must stay cheap (no torch): heavy modules are imported inside the command.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from calib import resources
from calib.errors import KvcalibError
from calib.evaluation import emulate as emulate_mod
from calib.evaluation import significance
from calib.load.options import load_options, spec_from
from calib.safety import outputs


@click.command("plan")
@click.option("--routes", "routes_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="YAML file of named routes, each with its held-out data, buckets and bar (max_kl, "
              "max_ppl_increase, min_passkey); see calib/routes/spec.py.")
@click.option("--model", "model_src", help="Model directory or hub id. Default: the embedded SmolLM2-135M-Instruct.")
@click.option("--scales", multiple=True, help="Checkpoint with KV scales (any tool's layout); repeatable. Each is an "
              "arm on every route, next to FP8 with scale 1.0.")
@click.option("--emulate", "emulation", type=click.Choice(emulate_mod.names()), default=emulate_mod.DEFAULT,
              show_default=True, help="Whose FP8 arithmetic the emulated arms follow.")
@click.option("--passkey-trials", type=int, default=significance.DEFAULT_TRIALS, show_default=True,
              help="Passkey prompts per depth and bucket (0: off).")
@click.option("--max-skip", type=int, default=3, show_default=True, help="Most layers tried in BF16 when no arm passes.")
@click.option("--engine", type=click.Choice(["vllm"]), help="Also run every arm in this engine; its numbers decide.")
@click.option("--vllm-venv", envvar="KVCALIB_VLLM_VENV", type=click.Path(file_okay=False, path_type=Path),
              help="Virtual environment with vLLM (env KVCALIB_VLLM_VENV).")
@click.option("--engine-kv-gib", type=int, default=1, show_default=True)
@click.option("--serve", "serve", is_flag=True, help="Also serve each route's arms under load (`vllm serve`, swept by "
              "`vllm bench serve` on the route's prompts, as `kvcalib validate`) and decide by goodput at the SLO.")
@load_options
@click.option("--device")
@click.option("--cpu-dtype", type=click.Choice(("float32", "bfloat16")),
              help="Model dtype on CPU. Default: float32, the checkpoint's own with --engine.")
@click.option("--plots/--no-plots", default=True)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress lines on stderr.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Plan folder. Default: out/<model>-plan.")
@click.option("--force", is_flag=True, help="Replace OUT if it is a previous kvcalib output (never other files).")
def plan(routes_file, model_src, scales, emulation, passkey_trials, max_skip, engine, vllm_venv, engine_kv_gib, device,
         cpu_dtype, plots, progress, out, force, serve=False, **load_kw) -> None:
    """One FP8 / FP8-with-skips / BF16 decision per route, the `vllm serve` command for each, and plan.json."""
    from calib.evaluation.config import EvalConfig
    from calib.evaluation.report import Thresholds
    from calib.progress import Progress
    from calib.routes import plan as plan_mod
    from calib.routes import spec

    try:
        load = spec_from(**load_kw) if serve else None
        if serve and not engine:
            raise click.ClickException("--serve needs --engine vllm (and --vllm-venv): the arms are served by the engine")
        routes = spec.load(routes_file)          # every route's data checked before any model loads
        engine_spec = None
        if engine:
            from calib.engine.driver import EngineSpec

            if vllm_venv is None:
                raise click.ClickException("--engine vllm needs --vllm-venv PATH (or KVCALIB_VLLM_VENV)")
            engine_spec = EngineSpec(engine, vllm_venv, kv_gib=engine_kv_gib)
        from calib.model.default_model import DIR_NAME

        name = DIR_NAME if model_src is None else Path(str(model_src).rstrip("/")).name
        base = EvalConfig(model=str(model_src or ""), data="", out=out or Path("out") / f"{name}-plan",
                          scales=tuple(scales), emulate=emulation, passkey_trials=passkey_trials, plots=plots,
                          thresholds=Thresholds(max_skip=max_skip), device=device,
                          cpu_dtype=cpu_dtype or (None if engine else "float32"), force=True, engine=engine_spec)
        plan_mod.check(routes, base, force)      # every input and option, before the default model is built
        if model_src is None:
            from calib.model.default_model import ensure_default_model

            model_src = str(ensure_default_model(resources.build_dir(), log=lambda m: click.echo(m, err=True)))
            base = dataclasses.replace(base, model=model_src)
        with outputs.terminate_as_interrupt():     # SIGTERM / SIGHUP: the temporary plan and its lock removed
            doc = plan_mod.run_plan(routes, base, force=force, log=lambda m: click.echo(m, err=True),
                                    progress=Progress((lambda m: click.echo(m, err=True)) if progress else None),
                                    load=load)
    except KvcalibError as e:
        raise click.ClickException(str(e)) from None
    for name, r in doc["routes"].items():
        click.echo(f"{name}: {r['decision']} — {r['serve']}")
    click.echo(f"plan: {base.out / 'plan.json'}")
