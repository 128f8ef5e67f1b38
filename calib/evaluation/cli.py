"""`kvcalib eval`: a thin Click command over calib.evaluation.run (registered on the `kvcalib` group).

Its own module, as tune's is, so calib/cli.py stays short. Importing it must stay cheap (no torch): the
evaluation itself is imported inside the command.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import click

from calib import resources
from calib.errors import KvcalibError
from calib.evaluation import emulate as emulate_mod
from calib.evaluation import significance
from calib.recipe import dtypes as dtypes_mod
from calib.recipe import recipe as recipe_mod
from calib.safety import outputs

# The embedded default model: a first look that finishes in minutes on a 2-core CPU (measured in the README).
DEFAULT_MODEL_EVAL = {"samples": 8, "buckets": "256,512", "passkey_trials": 0}
# passkey: prompts per depth enough to detect a 10-point drop in each bucket (calib/evaluation/significance.py)
EVAL_DEFAULTS = {"samples": 64, "buckets": "512,2048,8192", "passkey_trials": significance.DEFAULT_TRIALS}
# --formats: the KV formats that need no kvcalib scales (the static ones are the default and checkpoint arms)
FORMAT_CHOICES = tuple(n for n, d in dtypes_mod.KV_FORMATS.items() if d.scaling != dtypes_mod.STATIC)


def echo_err(message: str) -> None:
    click.echo(message, err=True)


def with_model(cfg: Any, model_src: str | None, out: Path | None, kind: str) -> Any:
    """`cfg` with its model (the embedded default built on first use when none was given) and its report folder
    (default out/<model>-<kind>): shared by eval and validate, after their options are checked."""
    if model_src is None:
        from calib.model.default_model import ensure_default_model

        model_src = str(ensure_default_model(resources.build_dir(), log=echo_err))
    return dataclasses.replace(cfg, model=str(model_src),
                               out=out or Path("out") / f"{Path(str(model_src).rstrip('/')).name}-{kind}")


def parse_formats(text: str | None) -> tuple[str, ...]:
    """--formats as format names (`all`: every one of FORMAT_CHOICES); a click error naming the choices."""
    if not text:
        return ()
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return FORMAT_CHOICES
    bad = [n for n in names if n not in FORMAT_CHOICES]
    if bad:
        raise click.ClickException(f"--formats {text!r}: unknown {', '.join(bad)}; choose from "
                                   f"{', '.join(FORMAT_CHOICES)} or all")
    return tuple(dict.fromkeys(names))


@click.command("eval")
@click.option("--model", "model_src", help="Model directory or hub id. Default: the embedded default model.")
@click.option("--data", "data_src", help="Held-out text (same formats as calibrate). Default: the sample text.")
@click.option("--scales", multiple=True, help="A checkpoint whose KV scales form an arm (any tool's layout); repeatable.")
@click.option("--stats", "stats_src", help="A kvcalib statistics output: adds per-tensor/head/channel/token arms.")
@click.option("--dtype", type=click.Choice(recipe_mod.DTYPES), default="fp8_e4m3", show_default=True)
@click.option("--formats", "formats", help="Also evaluate the engine's own KV formats, comma-separated: "
              f"{', '.join(FORMAT_CHOICES)}, or `all`; the report then chooses the format with the fewest bytes "
              "per token within the bar (static calibrated FP8 against the dynamic caches).")
@click.option("--emulate", "emulation", type=click.Choice(emulate_mod.names()), default=emulate_mod.DEFAULT,
              show_default=True, help="Whose FP8 arithmetic the emulated arms follow: vLLM's CPU build (the default: "
              "the engine this tool's users run), vLLM FlashAttention-3 (Hopper), TensorRT-LLM, or K/V rounding only.")
@click.option("--buckets", help=f"Context-length buckets (tokens). Default: {EVAL_DEFAULTS['buckets']}; "
              f"{DEFAULT_MODEL_EVAL['buckets']} on the embedded default model.")
@click.option("--samples", type=int, help=f"Held-out samples. Default: {EVAL_DEFAULTS['samples']}; "
              f"{DEFAULT_MODEL_EVAL['samples']} on the embedded default model.")
@click.option("--min-tokens", type=int, default=16, show_default=True)
@click.option("--pack/--no-pack", default=False, help="Concatenate records so samples fill every bucket.")
@click.option("--batch-size", type=int, default=4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--passkey-trials", type=int, help="Prompts per depth and bucket; 0: off. Default: "
              f"{EVAL_DEFAULTS['passkey_trials']}; {DEFAULT_MODEL_EVAL['passkey_trials']} on the embedded default model.")
@click.option("--failures", type=int, default=3, show_default=True, help="Worst samples kept per arm.")
@click.option("--plots/--no-plots", default=True)
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Progress lines on stderr: arms, samples, buckets, passkey prompts, tokens/s, time left.")
@click.option("--max-kl", type=float, default=0.01, show_default=True, help="Ship threshold: mean KL (nats) per bucket.")
@click.option("--max-ppl-increase", type=float, default=0.01, show_default=True, help="Ship threshold: relative ppl rise.")
@click.option("--passkey-drop", type=int, default=0, show_default=True)
@click.option("--max-skip", type=int, default=3, show_default=True, help="Most layers tried unquantised.")
@click.option("--dominance", type=float, default=3.0, show_default=True,
              help="A layer is tried unquantised (skip trial) when its attention-output error is at least this many "
                   "times the median layer's; 1 tries the worst --max-skip layers whenever no arm passes.")
@click.option("--device")
@click.option("--cpu-dtype", type=click.Choice(("float32", "bfloat16")), help="Model dtype on CPU (GPUs run bf16); the reference "
              "arm runs in it. Default: float32; with --engine the checkpoint's own dtype, which the engine serves.")
@click.option("--trust-remote-code", is_flag=True)
@click.option("--engine", type=click.Choice(["vllm"]), help="Also measure every arm in this real engine, on the same "
              "token ids (its own environment: --vllm-venv).")
@click.option("--vllm-venv", envvar="KVCALIB_VLLM_VENV", type=click.Path(file_okay=False, path_type=Path),
              help="Virtual environment with vLLM installed (env KVCALIB_VLLM_VENV); used with --engine vllm.")
@click.option("--engine-top-k", type=int, default=20, show_default=True,
              help="Log-probabilities per position from the engine (its KL is a lower bound from these).")
@click.option("--engine-kv-gib", type=int, default=1, show_default=True,
              help="KV-cache pool per engine run in GiB (an integer); capacity is reported in tokens.")
@click.option("--engine-timeout", type=float, default=3600.0, show_default=True,
              help="Seconds one engine arm may take before it is stopped and reported as not run.")
@click.option("--target", "target", type=click.Choice(recipe_mod.TARGETS), help="Evaluate the calibrated arms as this "
              "engine serves them: with scale 1.0 where it ignores the scales, the max over heads where it folds them "
              "(read from the support matrix; the report says so).")
@click.option("--engine-version", "engine_version", help="The --target engine's version or build (e.g. 0.5.18, "
              "pr18953). Default: the newest version kvcalib knows.")
@click.option("--budget-minutes", type=float, help="Bound the whole run, engine included: after a short probe the "
              "plan drops passkey depths, skip trials, emulated long buckets, then the engine's passkey, and says which.")
@click.option("--emulate-up-to", type=int, help="Emulate buckets up to this many tokens (default: all; with --engine "
              "8192, longer buckets measured in the engine only).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), help="Report directory.")
@click.option("--force", is_flag=True, help="Replace OUT if it is a previous kvcalib report (never other files).")
def eval_cmd(model_src, data_src, scales, stats_src, dtype, emulation, buckets, samples, min_tokens, pack, batch_size,
             seed, passkey_trials, failures, plots, progress, max_kl, max_ppl_increase, passkey_drop, max_skip,
             dominance, device, cpu_dtype, trust_remote_code, engine, vllm_venv, engine_top_k, engine_kv_gib,
             engine_timeout, target, engine_version, budget_minutes, emulate_up_to, out, force, formats=None) -> None:
    """Compare BF16, default-scale and calibrated FP8 KV by layer and context length; write a report + verdict."""
    from calib.evaluation.config import EvalConfig
    from calib.evaluation.report import Thresholds
    from calib.evaluation import served
    from calib.evaluation.run import run_eval
    from calib.progress import Progress

    small = DEFAULT_MODEL_EVAL if model_src is None else EVAL_DEFAULTS
    fit_buckets = buckets is None          # default buckets beyond the model's context are dropped, given ones refused
    if model_src is None and None in (buckets, samples, passkey_trials):
        click.echo(f"default model, first look: --samples {small['samples']} --buckets {small['buckets']} "
                   f"--passkey-trials {small['passkey_trials']} unless given", err=True)
    buckets = small["buckets"] if buckets is None else buckets
    samples = small["samples"] if samples is None else samples
    passkey_trials = small["passkey_trials"] if passkey_trials is None else passkey_trials
    try:
        bucket_list = tuple(int(b) for b in buckets.split(",") if b.strip())
    except ValueError:
        raise click.ClickException(f"--buckets {buckets!r}: give token lengths like 512,2048,8192") from None
    from calib.safety import options

    engine_spec = None
    if engine:
        from calib.engine.driver import EngineSpec

        if vllm_venv is None:
            raise click.ClickException("--engine vllm needs --vllm-venv PATH (or KVCALIB_VLLM_VENV): the virtual "
                                       "environment where vLLM is installed (`make engine-venv` builds one)")
        engine_spec = EngineSpec(engine, vllm_venv, top_k=engine_top_k, kv_gib=engine_kv_gib, timeout=engine_timeout)
    try:
        cfg = EvalConfig(
            model=str(model_src or ""), data=data_src or str(resources.default_data()), out=out or Path("out"), scales=tuple(scales),
            stats=stats_src, formats=parse_formats(formats), dtype=dtype, emulate=emulation, buckets=bucket_list, samples=samples,
            min_tokens=min_tokens, pack=pack,
            batch_size=batch_size, seed=seed, passkey_trials=passkey_trials, failures=failures, plots=plots,
            thresholds=Thresholds(max_kl=max_kl, max_ppl_increase=max_ppl_increase,
                                  passkey_drop=passkey_drop, max_skip=max_skip, dominance=dominance),
            device=device, cpu_dtype=cpu_dtype or (None if engine else "float32"),
            trust_remote_code=trust_remote_code, force=force,
            engine=engine_spec, target=target, engine_version=served.stated(target, engine_version),
            budget_minutes=budget_minutes, emulate_up_to=emulate_up_to, fit_buckets=fit_buckets)
        options.evaluation(cfg)        # before the default model is built or any model loads
        cfg = with_model(cfg, model_src, out, "eval")
        with outputs.terminate_as_interrupt():
            result = run_eval(cfg, log=echo_err, progress=Progress(echo_err if progress else None))
    except KvcalibError as e:
        raise click.ClickException(str(e)) from None
    click.echo(result.verdict.text)
    click.echo(f"report: {result.out / 'report.md'} ({result.seconds:.1f} s)")
