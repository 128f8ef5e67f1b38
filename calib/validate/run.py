"""`run_validate`: one evaluation whose engine also serves, then the validation report, into one folder.

The folder is written whole or not at all (calib.safety.outputs.atomic_dir): `eval/` holds the evaluation's own
report (every quality number, per layer and per sample), `validate.md` / `validate.json` / `validate.png` the
decision per arm with quality and speed side by side (calib/validate/report.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from calib.engine import serving
from calib.evaluation.arms import EvalError
from calib.evaluation.config import EvalConfig
from calib.progress import SILENT, Progress
from calib.safety.outputs import atomic_dir
from calib.validate import report

Log = Callable[[str], Any]


@dataclass(frozen=True)
class ValidateResult:
    out: Path
    doc: dict[str, Any]
    files: tuple[str, ...]


def check(cfg: EvalConfig) -> serving.ServingSpec:
    """The serving settings of `cfg`, checked before any work (EvalError: one line naming the option)."""
    if cfg.engine is None or cfg.engine.serving is None:
        raise EvalError("validate needs an engine that serves: --vllm-venv PATH (or KVCALIB_VLLM_VENV)")
    problems = cfg.engine.serving.problems()
    if problems:
        raise EvalError(problems[0])
    return cfg.engine.serving


def run_validate(cfg: EvalConfig, log: Log = lambda _m: None, progress: Progress = SILENT) -> ValidateResult:
    """Evaluate every arm in the engine with its serving phase and write the validation report into `cfg.out`."""
    from calib.evaluation.config import check_eval
    from calib.evaluation.run import run_eval

    spec = check(cfg)
    check_eval(cfg)
    with atomic_dir(Path(cfg.out), cfg.force, kind="validation report") as tmp:
        result = run_eval(replace(cfg, out=tmp / "eval", force=False), log=log, progress=progress)
        doc = report.build(result, cfg.thresholds, spec)
        made = report.write(tmp, doc, cfg.plots)
    return ValidateResult(Path(cfg.out), doc, tuple(made))
