"""`kvcalib plan --routes routes.yaml`: a thin Click command over calib.routes (registered on `kvcalib`).

Its options come from the shared table (calib/cli_options.py). Importing this module must stay cheap (no torch):
heavy modules are imported inside the command.
"""

from __future__ import annotations

from pathlib import Path

import click

from calib import cli_options as opts
from calib.evaluation import emulate
from calib.load.options import load_options, spec_from
from calib.safety import outputs


@click.command("plan", cls=opts.Command)
@click.option("--routes", "routes_file", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="YAML file of named routes, each with its held-out data, buckets and bar (max_kl, "
              "max_ppl_increase, min_passkey); see calib/routes/spec.py.")
@opts.use("model", "scales", "emulate", "passkey_trials", "batch_size", "max_skip", *opts.ENGINE, "engine_version")
@click.option("--serve", "serve", is_flag=True, help="Also serve each route's arms under load (`vllm serve`, swept by "
              "`vllm bench serve` on the route's prompts, as `kvcalib validate`) and decide by goodput at the SLO.")
@load_options
@opts.use(*opts.MODEL[1:], *opts.OUTPUT)
def plan(routes_file, model_src, scales, emulation, passkey_trials, batch_size, max_skip, engine, vllm_venv,
         engine_top_k, engine_kv_gib, engine_timeout, engine_version, serve, trust_remote_code, device, device_map,
         max_memory, offload_folder, cpu_dtype, plots, progress, out, force, **load_kw) -> None:
    """One FP8 / FP8-with-skips / BF16 decision per route, the `vllm serve` command for each, and plan.json.
    Exit 0 when some route serves FP8, 3 when every route keeps BF16 (calib/errors.py)."""
    from calib import summary
    from calib.evaluation import served
    from calib.evaluation.cli import with_model
    from calib.evaluation.config import EvalConfig
    from calib.evaluation.verdict import Thresholds
    from calib.model.default_model import DIR_NAME
    from calib.progress import Progress
    from calib.routes import plan as plan_mod
    from calib.routes import spec

    load = spec_from(**load_kw) if serve else None
    if serve and not engine:
        raise click.ClickException("--serve needs --engine vllm (and --vllm-venv): the arms are served by the engine")
    routes = spec.load(routes_file)          # every route's data checked before any model loads
    engine_spec = opts.engine_spec(engine, vllm_venv, top_k=engine_top_k, kv_gib=engine_kv_gib, timeout=engine_timeout)
    name = DIR_NAME if model_src is None else Path(str(model_src).rstrip("/")).name
    target = "vllm" if engine_version else None      # a stated vLLM version: the arms as that version serves them
    base = EvalConfig(model=str(model_src or ""), data="", out=out or Path("out") / f"{name}-plan",
                      scales=tuple(scales), emulate=emulation or emulate.for_this_machine(),
                      thresholds=Thresholds(**opts.given(max_skip=max_skip)),
                      cpu_dtype=cpu_dtype or (None if engine else "float32"), force=True, engine=engine_spec,
                      target=target, engine_version=served.stated(target, engine_version),
                      **opts.given(passkey_trials=passkey_trials, batch_size=batch_size, plots=plots, device=device,
                                   trust_remote_code=trust_remote_code,
                                   **opts.placement(device_map, max_memory, offload_folder)))
    plan_mod.check(routes, base, force)      # every input and option, before the default model is built
    base = with_model(base, model_src, base.out, "plan")
    with outputs.terminate_as_interrupt():     # SIGTERM / SIGHUP: the temporary plan and its lock removed
        doc = plan_mod.run_plan(routes, base, force=force, log=opts.echo_err,
                                progress=Progress(opts.echo_err if progress else None), load=load)
    for name, r in doc["routes"].items():
        click.echo(f"{name}: {r['decision']} — {r['serve']}")
    click.echo(f"plan: {base.out / 'plan.json'}")
    summary.conclude(summary.of_plan(doc, base.out), base.out)
