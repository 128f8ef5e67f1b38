"""`kvcalib validate`: a thin Click command over calib.validate.run (registered on the `kvcalib` group).

Its defaults are the pre-launch ones, eval's: buckets up to the model's own context, eval's samples, passkey on
(calib/cli_options.py holds the options and the first-look preset of the embedded default model). Importing it must
stay cheap (no torch): the evaluation is imported inside the command.
"""

from __future__ import annotations

from pathlib import Path

import click

from calib import cli_options as opts
from calib import resources
from calib.load.options import load_options, spec_from


@click.command("validate", cls=opts.Command)
@opts.use("model", "data", "scales", "formats", *opts.HELD_OUT)
@load_options
@opts.use("emulate", *opts.BAR, "failures", *opts.ENGINE[1:], "engine_version", "budget_minutes", "emulate_up_to",
          *opts.MODEL[1:], *opts.OUTPUT)
def validate(model_src, data_src, scales, formats, buckets, samples, min_tokens, pack, batch_size, seed, passkey_trials,
             emulation, max_kl, max_ppl_increase, passkey_drop, max_skip, dominance, failures, vllm_venv, engine_top_k,
             engine_kv_gib, engine_timeout, engine_version, budget_minutes, emulate_up_to, trust_remote_code, device,
             device_map, max_memory, offload_folder, cpu_dtype, plots, progress, out, force, **load_kw) -> None:
    """Does FP8 KV raise throughput for this workload? Each arm (BF16 KV, FP8 scale 1.0, each --scales checkpoint,
    skip trials) is evaluated in the engine for quality, then served with `vllm serve` and swept with `vllm bench
    serve` on your held-out prompts by length bucket: throughput, goodput at the SLO, TTFT / TPOT / ITL / E2E,
    running and waiting requests, KV usage, preemptions, the engine's own capacity. The decision: the arm with the
    best goodput within the quality bar, or BF16 where FP8 buys nothing. Writes OUT/validate.md, validate.json,
    validate.png and OUT/eval/ (the evaluation). Exit 0 when a quantized arm is recommended, 3 when BF16 stays or
    nothing could be measured (calib/errors.py)."""
    from calib import summary
    from calib.evaluation import served
    from calib.evaluation.cli import settings, with_model
    from calib.evaluation.config import EvalConfig
    from calib.evaluation.verdict import Thresholds
    from calib.progress import Progress
    from calib.safety import options, outputs
    from calib.validate.run import check, run_validate

    if vllm_venv is None:
        raise click.ClickException("validate needs --vllm-venv PATH (or KVCALIB_VLLM_VENV): the virtual environment "
                                   "where vLLM is installed (`make engine-venv` builds one)")
    load = spec_from(**load_kw)      # one line naming the option, before anything is read
    spec = opts.engine_spec("vllm", vllm_venv, top_k=engine_top_k, kv_gib=engine_kv_gib, timeout=engine_timeout)
    target = "vllm" if engine_version else None      # a stated vLLM version: the arms as that version serves them
    cfg = EvalConfig(
        model=str(model_src or ""), data=data_src or str(resources.default_data()), out=out or Path("out"),
        scales=tuple(scales), formats=opts.formats(formats),
        thresholds=Thresholds(**opts.given(max_kl=max_kl, max_ppl_increase=max_ppl_increase, passkey_drop=passkey_drop,
                                           max_skip=max_skip, dominance=dominance)),
        target=target, engine_version=served.stated(target, engine_version),
        **settings("validate", model_src, buckets=buckets, samples=samples, passkey_trials=passkey_trials,
                   cpu_dtype=cpu_dtype, engine=spec, emulation=emulation, device_map=device_map,
                   max_memory=max_memory, offload_folder=offload_folder, min_tokens=min_tokens, pack=pack,
                   batch_size=batch_size, seed=seed, failures=failures, plots=plots, device=device,
                   trust_remote_code=trust_remote_code, force=force, budget_minutes=budget_minutes,
                   emulate_up_to=emulate_up_to))
    check(cfg, load)             # the serving options first: one line naming the option, nothing written
    options.evaluation(cfg)
    cfg = with_model(cfg, model_src, out, "validate")
    with outputs.terminate_as_interrupt():
        res = run_validate(cfg, load, log=opts.echo_err, progress=Progress(opts.echo_err if progress else None))
    for name, arm in res.doc["arms"].items():
        click.echo(f"{name}: {arm['decision']} ({arm['why']})")
    overall = res.doc["decision"]["overall"]
    click.echo(f"decision: {overall['recommended'] or 'none'}: {overall['why']}")
    if res.doc.get("recommended_command"):
        click.echo(f"serve: {res.doc['recommended_command']}")
    click.echo(f"report: {res.out / 'validate.md'} (speed measured on {res.doc['device']})")
    summary.conclude(summary.of_validate(res), res.out)
