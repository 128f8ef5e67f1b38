"""`kvcalib eval`: a thin Click command over calib.evaluation.run (registered on the `kvcalib` group).

Its own module, as tune's is, so calib/cli.py stays short; its options come from the shared table
(calib/cli_options.py). Importing it must stay cheap (no torch): the evaluation itself is imported inside the command.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from calib import cli_options as opts
from calib import resources
from calib.evaluation import emulate
from calib.safety import outputs


def with_model(cfg: Any, model_src: str | None, out: Path | None, kind: str) -> Any:
    """`cfg` with its model (the embedded default built on first use when none was given) and its report folder
    (default out/<model>-<kind>): shared by eval and validate, after their options are checked."""
    if model_src is None:
        model_src = opts.default_model()
    return dataclasses.replace(cfg, model=str(model_src),
                               out=out or Path("out") / f"{Path(str(model_src).rstrip('/')).name}-{kind}")


def settings(command: str, model_src: str | None, *, buckets: str | None, samples: int | None,
             passkey_trials: int | None, cpu_dtype: str | None, engine: Any, emulation: str | None,
             device_map: str | None, max_memory: str | None, offload_folder: str | None, **rest: Any) -> dict[str, Any]:
    """The EvalConfig fields eval and validate share, from their options: the first-look preset on the default
    model, the emulation for this machine, the model's placement; None (not given) left to EvalConfig's defaults."""
    first = opts.first_look(command, model_src, buckets=buckets, samples=samples, passkey_trials=passkey_trials)
    return {**opts.given(buckets=opts.buckets(first["buckets"], "512,2048,8192"), samples=first["samples"],
                         passkey_trials=first["passkey_trials"], engine=engine,
                         **opts.placement(device_map, max_memory, offload_folder), **rest),
            "emulate": emulation or emulate.for_this_machine(),
            "cpu_dtype": cpu_dtype or (None if engine else "float32"),   # None: the checkpoint's own, as served
            "fit_buckets": buckets is None}      # default buckets beyond the model's context are dropped, not refused


@click.command("eval", cls=opts.Command)
@opts.use("model", "data", "scales", "stats", "kv_cache_dtype", "formats", "emulate", *opts.HELD_OUT, "failures",
          *opts.BAR, *opts.MODEL[1:], *opts.ENGINE, "target", "engine_version", "budget_minutes", "emulate_up_to",
          *opts.OUTPUT)
def eval_cmd(model_src, data_src, scales, stats, kv_cache_dtype, formats, max_kl, max_ppl_increase, passkey_drop,
             max_skip, dominance, engine, vllm_venv, engine_top_k, engine_kv_gib, engine_timeout, target,
             engine_version, progress, out, **rest) -> None:
    """Compare BF16, default-scale and calibrated FP8 KV by layer and context length; write a report + verdict.
    Exit 0 when the verdict ships a quantized KV cache, 3 when it keeps BF16 (calib/errors.py)."""
    from calib import summary
    from calib.evaluation import served
    from calib.evaluation.config import EvalConfig
    from calib.evaluation.verdict import Thresholds
    from calib.evaluation.run import run_eval
    from calib.progress import Progress
    from calib.safety import options

    if len(stats) > 1:
        raise click.ClickException(f"--stats given {len(stats)} times: eval takes one statistics output")
    spec = opts.engine_spec(engine, vllm_venv, top_k=engine_top_k, kv_gib=engine_kv_gib, timeout=engine_timeout)
    cfg = EvalConfig(
        model=str(model_src or ""), data=data_src or str(resources.default_data()), out=out or Path("out"),
        scales=tuple(scales), stats=stats[0] if stats else None, formats=opts.formats(formats),
        thresholds=Thresholds(**opts.given(max_kl=max_kl, max_ppl_increase=max_ppl_increase, passkey_drop=passkey_drop,
                                           max_skip=max_skip, dominance=dominance)),
        target=target, engine_version=served.stated(target, engine_version),
        **settings("eval", model_src, engine=spec, dtype=kv_cache_dtype, **rest))
    options.evaluation(cfg)        # before the default model is built or any model loads
    cfg = with_model(cfg, model_src, out, "eval")
    with outputs.terminate_as_interrupt():
        result = run_eval(cfg, log=opts.echo_err, progress=Progress(opts.echo_err if progress else None))
    click.echo(result.verdict.text)
    click.echo(f"report: {result.out / 'report.md'} ({result.seconds:.1f} s)")
    summary.conclude(summary.of_eval(result, cfg), result.out)
