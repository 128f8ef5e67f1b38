"""`kvcalib validate`: a thin Click command over calib.validate.run (registered on the `kvcalib` group).

Importing it must stay cheap (no torch): the evaluation is imported inside the command.
"""

from __future__ import annotations

from pathlib import Path

import click

from calib import resources
from calib.errors import KvcalibError
from calib.evaluation import emulate as emulate_mod
from calib.evaluation import significance
from calib.load.options import load_options, spec_from


@click.command("validate")
@click.option("--model", "model_src", help="Model directory or hub id. Default: the embedded default model.")
@click.option("--data", "data_src", help="Your held-out prompts (same formats as calibrate). Default: the sample text.")
@click.option("--scales", multiple=True, help="A checkpoint whose KV scales form an arm (any tool's layout); repeatable.")
@click.option("--formats", "formats", help="Also serve the engine's own KV formats (as `kvcalib eval --formats`): "
              "comma-separated names, or `all`.")
@click.option("--buckets", default="256,512", show_default=True, help="Prompt-length buckets (tokens).")
@click.option("--samples", type=int, default=8, show_default=True, help="Held-out samples (prompts), over the buckets.")
@click.option("--pack/--no-pack", default=False, help="Concatenate records so prompts fill every bucket.")
@click.option("--min-tokens", type=int, default=16, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--passkey-trials", type=int, default=0, show_default=True,
              help=f"Passkey prompts per depth and bucket (0: off; {significance.DEFAULT_TRIALS} detects a 10-point drop).")
@load_options
@click.option("--emulate", "emulation", type=click.Choice(emulate_mod.names()), default=emulate_mod.DEFAULT,
              show_default=True, help="Whose FP8 arithmetic the emulated quality numbers follow (the engine's decide).")
@click.option("--max-kl", type=float, default=0.01, show_default=True, help="Quality bar: mean KL (nats) per bucket.")
@click.option("--max-ppl-increase", type=float, default=0.01, show_default=True, help="Quality bar: relative ppl rise.")
@click.option("--passkey-drop", type=int, default=0, show_default=True)
@click.option("--max-skip", type=int, default=3, show_default=True, help="Most layers tried in BF16 (skip trials).")
@click.option("--dominance", type=float, default=3.0, show_default=True,
              help="Skip trials take layers whose attention-output error is at least this many times the median's.")
@click.option("--failures", type=int, default=3, show_default=True, help="Worst samples kept per arm, with their text.")
@click.option("--vllm-venv", envvar="KVCALIB_VLLM_VENV", type=click.Path(file_okay=False, path_type=Path),
              help="Virtual environment with vLLM installed (env KVCALIB_VLLM_VENV). Required.")
@click.option("--engine-kv-gib", type=int, default=1, show_default=True,
              help="KV-cache pool per engine start in GiB (quality runs and the server alike).")
@click.option("--engine-timeout", type=float, default=3600.0, show_default=True,
              help="Seconds one engine start (a quality run, a server start, a load level) may take.")
@click.option("--budget-minutes", type=float, help="Bound the evaluation's measuring (as `kvcalib eval`): the plan "
              "drops passkey depths, skip trials, emulated long buckets, then the engine's passkey, and says which.")
@click.option("--emulate-up-to", type=int, help="Emulate buckets up to this many tokens (default 8192; longer "
              "buckets are measured in the engine only).")
@click.option("--device")
@click.option("--cpu-dtype", type=click.Choice(("float32", "bfloat16")),
              help="Model dtype on CPU for the emulation. Default: the checkpoint's own, which the engine serves.")
@click.option("--plots/--no-plots", default=True)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress lines on stderr.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Report folder. Default: out/<model>-validate.")
@click.option("--force", is_flag=True, help="Replace OUT if it is a previous kvcalib output (never other files).")
def validate(model_src, data_src, scales, buckets, samples, pack, min_tokens, seed, passkey_trials, emulation, max_kl,
             max_ppl_increase, passkey_drop, max_skip, dominance, failures, vllm_venv, engine_kv_gib, engine_timeout, device, cpu_dtype, plots, progress, out, force, formats=None,
             budget_minutes=None, emulate_up_to=None, **load_kw) -> None:
    """Does FP8 KV raise throughput for this workload? Each arm (BF16 KV, FP8 scale 1.0, each --scales checkpoint,
    skip trials) is evaluated in the engine for quality, then served with `vllm serve` and swept with `vllm bench
    serve` on your held-out prompts by length bucket: throughput, goodput at the SLO, TTFT / TPOT / ITL / E2E,
    running and waiting requests, KV usage, preemptions, the engine's own capacity. The decision: the arm with the
    best goodput within the quality bar, or BF16 where FP8 buys nothing. Writes OUT/validate.md, validate.json,
    validate.png and OUT/eval/ (the evaluation)."""
    from calib.engine.driver import EngineSpec
    from calib.evaluation.cli import echo_err, parse_formats, with_model
    from calib.evaluation.config import EvalConfig
    from calib.evaluation.report import Thresholds
    from calib.progress import Progress
    from calib.safety import options, outputs
    from calib.validate.run import check, run_validate

    try:
        bucket_list = tuple(int(b) for b in buckets.split(",") if b.strip())
    except ValueError:
        raise click.ClickException(f"--buckets {buckets!r}: give token lengths like 256,512") from None
    if vllm_venv is None:
        raise click.ClickException("validate needs --vllm-venv PATH (or KVCALIB_VLLM_VENV): the virtual environment "
                                   "where vLLM is installed (`make engine-venv` builds one)")
    load = spec_from(**load_kw)      # one line naming the option, before anything is read
    spec = EngineSpec("vllm", vllm_venv, kv_gib=engine_kv_gib, timeout=engine_timeout)
    try:
        cfg = EvalConfig(
            model=str(model_src or ""), data=data_src or str(resources.default_data()), out=out or Path("out"),
            scales=tuple(scales), formats=parse_formats(formats), emulate=emulation, buckets=bucket_list, samples=samples, min_tokens=min_tokens,
            pack=pack, seed=seed, passkey_trials=passkey_trials, failures=failures, plots=plots,
            thresholds=Thresholds(max_kl=max_kl, max_ppl_increase=max_ppl_increase, passkey_drop=passkey_drop,
                                  max_skip=max_skip, dominance=dominance),
            device=device, cpu_dtype=cpu_dtype, force=force, engine=spec, budget_minutes=budget_minutes,
            emulate_up_to=emulate_up_to)
        check(cfg, load)             # the serving options first: one line naming the option, nothing written
        options.evaluation(cfg)
        cfg = with_model(cfg, model_src, out, "validate")
        with outputs.terminate_as_interrupt():
            res = run_validate(cfg, load, log=echo_err, progress=Progress(echo_err if progress else None))
    except KvcalibError as e:
        raise click.ClickException(str(e)) from None
    for name, arm in res.doc["arms"].items():
        click.echo(f"{name}: {arm['decision']} ({arm['why']})")
    overall = res.doc["decision"]["overall"]
    click.echo(f"decision: {overall['recommended'] or 'none'}: {overall['why']}")
    if res.doc.get("recommended_command"):
        click.echo(f"serve: {res.doc['recommended_command']}")
    click.echo(f"report: {res.out / 'validate.md'} (speed measured on {res.doc['device']})")
