"""`run_validate`: quality in the engine (one evaluation), then each serve configuration swept under load through
vLLM's own server, then the decision — into one folder.

The folder is written whole or not at all (calib.safety.outputs.atomic_dir): `eval/` holds the evaluation's own
report (every quality number, per layer and per sample), `validate.md` / `validate.json` / `validate.png` the
sweep per arm and bucket, goodput at the SLO and the decision (calib/validate/report.py).

Speed depends on what the engine fixes at start-up — the weights, the KV cache dtype, the layers kept in the
model dtype, the attention backend — not on the scale values, so arms that differ only in their scales share one
sweep (the report says whose).
"""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from calib.engine import driver
from calib.engine.serve import identity
from calib.evaluation.arms import EvalError
from calib.evaluation.config import EvalConfig
from calib.load import server, sweep
from calib.load.spec import LoadSpec
from calib.progress import SILENT, Progress
from calib.safety.outputs import atomic_dir
from calib.validate import report

Log = Callable[[str], Any]


@dataclass(frozen=True)
class ValidateResult:
    out: Path
    doc: dict[str, Any]
    files: tuple[str, ...]


def check(cfg: EvalConfig, load: LoadSpec) -> None:
    """The serving settings, checked before any work (EvalError: one line naming the option)."""
    if cfg.engine is None:
        raise EvalError("validate needs an engine that serves: --vllm-venv PATH (or KVCALIB_VLLM_VENV)")
    problems = load.problems()
    if problems:
        raise EvalError(problems[0])


def on_cpu(venv: Path) -> bool:
    """Whether the engine's torch sees no CUDA device (then the server runs on the CPU and sizes its KV pool by
    VLLM_CPU_KVCACHE_SPACE)."""
    py = Path(venv) / "bin" / "python"
    try:
        out = subprocess.run([str(py), "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                             text=True, timeout=300).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return True
    return out != "True"


def serve_configs(entries: dict[str, Any], cpu: bool) -> list[tuple[server.ServeConfig, list[str]]]:
    """The serve configurations of the arms the engine measured, each with its arms in order; arms whose weights,
    KV dtype, skipped layers and backend agree share one (the first arm's folder is served)."""
    groups: dict[tuple[Any, ...], tuple[server.ServeConfig, list[str]]] = {}
    ident = functools.cache(identity)          # a folder's identity reads its weights' bytes: once per folder
    for name, e in entries.items():
        if e.engine is None or not e.engine.ok or not e.engine.serve:
            continue
        serve = e.engine.serve      # the CUDA-only backend (fp8_e5m2's FLASHINFER) on a GPU only
        backend = serve.get("attention_backend") or (None if cpu else serve.get("cuda_attention_backend"))
        cfg = server.ServeConfig(str(serve["model"]), str(serve["kv_cache_dtype"]),
                                 tuple(serve.get("skip_layers") or ()), backend)
        key = (ident(cfg.model), cfg.kv_cache_dtype, tuple(str(s) for s in cfg.skip_layers), cfg.attention_backend)
        groups.setdefault(key, (cfg, []))[1].append(name)
    return list(groups.values())


def prompt_buckets(samples: Sequence[Any], tokenizer: Any, output_tokens: int, context: int | None) -> list[sweep.Bucket]:
    """The held-out samples as the load generator's prompts, per bucket: decoded to text, each cut so that it and
    its output fit the model's context."""
    if tokenizer is None:
        raise EvalError("validate serves text prompts and the model has no tokenizer")
    room = None if context is None else context - output_tokens - sweep.MARGIN
    if room is not None and room < 1:
        raise EvalError(f"--output-tokens {output_tokens}: leaves no room for a prompt in the model's context "
                        f"({context} tokens)")
    by: dict[int, list[tuple[str, int]]] = {}
    for s in samples:
        ids = list(s.ids)[:room] if room else list(s.ids)
        by.setdefault(int(s.bucket), []).append((tokenizer.decode(ids, skip_special_tokens=True), len(ids)))
    return [sweep.Bucket(b, tuple(t for t, _ in rows), tuple(n for _, n in rows)) for b, rows in sorted(by.items())]


def serve(result: Any, cfg: EvalConfig, load: LoadSpec, log: Log) -> dict[str, Any]:
    """Each serve configuration of a finished evaluation (`result`, whose engine is `cfg.engine`) swept under `load`
    on the evaluation's own held-out prompts, then validate.json's document with the decision."""
    spec = cfg.engine
    entries = {result.report["reference"]: result.reference, **result.arms}
    cpu = on_cpu(spec.venv)
    configs = serve_configs(entries, cpu)
    buckets = prompt_buckets(result.samples, result.tokenizer, load.output_tokens, result.context)
    base = server.Launch(0, spec.kv_gib, "auto", on_cpu=cpu, timeout=spec.timeout)     # the dtype users serve
    tok = str(((result.reference.engine and result.reference.engine.serve) or {}).get("model") or cfg.model)
    sweeps = []
    with tempfile.TemporaryDirectory(prefix=f"{driver.DIR_PREFIX}{os.getpid()}-") as work:
        for j, (scfg, names) in enumerate(configs):
            log(f"validate: serve configuration {j + 1}/{len(configs)} ({', '.join(names)}): {scfg.command()}")
            sweeps.append((scfg, names, sweep.sweep_config(spec.venv, scfg, buckets, load, base, result.context,
                                                           Path(work), tok, log)))
    return report.build(result, cfg.thresholds, load, sweeps, "CPU" if cpu else "GPU")


def run_validate(cfg: EvalConfig, load: LoadSpec, log: Log = lambda _m: None,
                 progress: Progress = SILENT) -> ValidateResult:
    """Evaluate every arm in the engine, sweep each serve configuration under load, decide; write into `cfg.out`."""
    from calib.evaluation.config import check_eval
    from calib.evaluation.run import run_eval

    check(cfg, load)
    check_eval(cfg)
    with atomic_dir(Path(cfg.out), cfg.force, kind="validation report") as tmp:
        doc = serve(run_eval(replace(cfg, out=tmp / "eval", force=False), log=log, progress=progress), cfg, load, log)
        made = report.write(tmp, doc, cfg.plots)
    return ValidateResult(Path(cfg.out), doc, tuple(made))
