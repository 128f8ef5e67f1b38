"""One `kvcalib eval` run's settings, and everything about them checkable before the model loads.

Why its own module: the CLI, `kvcalib tune` (which scores candidates on the same held-out text) and the
run driver all build or read an `EvalConfig`; none of them needs the measuring code to do so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Iterable
from typing import Any

from calib.data import sources as data_mod
from calib.evaluation import emulate, served, significance
from calib.evaluation.arms import EvalError
from calib.evaluation.results import record
from calib.evaluation.verdict import Thresholds
from calib.model import context
from calib.model.context import Context
from calib.safety import options, outputs


@dataclass(frozen=True)
class EvalConfig:
    """One `kvcalib eval` run. `scales`: checkpoint directories (any tool's layout); `stats`: a kvcalib
    statistics-only output (directory or its stats.safetensors) for per-tensor/head/channel/token arms.
    `emulate`: whose FP8 arithmetic the quantised arms follow (`calib/evaluation/emulate.py`; default vLLM's CPU build)."""
    model: str
    data: str
    out: Path
    scales: tuple[str, ...] = ()
    stats: str | None = None
    formats: tuple[str, ...] = ()     # whole KV formats of the engine as arms (arms.format_arms)
    dtype: str = "fp8_e4m3"
    emulate: str = emulate.DEFAULT
    buckets: tuple[int, ...] = (512, 2048, 8192)
    samples: int = 64
    min_tokens: int = 16
    pack: bool = False                # concatenate records into samples that fill every bucket
    batch_size: int = 4
    seed: int = 0
    passkey_trials: int = significance.DEFAULT_TRIALS   # prompts per depth per bucket (a 10-point drop shows); 0: off
    failures: int = 3                 # worst samples (by KL) kept per arm
    plots: bool = True
    thresholds: Thresholds = field(default_factory=Thresholds)
    device: str | None = None
    cpu_dtype: str | None = "float32"  # model dtype on CPU (model.Placement; None: the checkpoint's own)
    device_map: str | None = None     # accelerate device map for a model larger than one device (model.Placement)
    max_memory: dict[str, str] | None = None   # memory per device for device_map, e.g. {"0": "70GiB", "cpu": "200GiB"}
    offload_folder: str | None = None  # disk offload folder for device_map
    trust_remote_code: bool = False
    force: bool = False
    engine: Any = None                # calib.engine.driver.EngineSpec: also measure every arm in that engine
    target: str | None = None         # evaluate calibrated arms as this engine serves them (calib.evaluation.served)
    engine_version: str | None = None  # the target's version or build (None: the newest the support matrix read)
    budget_minutes: float | None = None   # the whole run, engine included (calib/evaluation/plan.py drops parts)
    emulate_up_to: int | None = None  # emulate buckets up to this many tokens (None: all; with an engine a short window)
    fit_buckets: bool = False         # default buckets: drop those beyond the model's context instead of refusing

    def placement(self) -> Any:
        """Where the model's weights go (calib.model.load.Placement)."""
        from calib.model.load import Placement

        return Placement(device=self.device, device_map=self.device_map, max_memory=self.max_memory,
                         offload_folder=self.offload_folder, cpu_dtype=self.cpu_dtype)

    def to_dict(self) -> dict[str, Any]:
        """The settings as report.json records them (paths as strings, the engine spec as a mapping)."""
        return {**record(self), "out": str(self.out), "engine": None if self.engine is None else
                {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.engine).items()}}


def check_eval(cfg: EvalConfig) -> None:
    """Everything checkable before the model loads: options, the report folder (never an input, never a
    folder of someone else's files), the data source."""
    options.evaluation(cfg)
    inputs = [("the model folder", cfg.model), ("the data", cfg.data), ("the statistics output", cfg.stats),
              *(("a --scales checkpoint", p) for p in cfg.scales)]
    outputs.check_folder(Path(cfg.out), force=cfg.force, inputs=inputs)
    outputs.check_room(Path(cfg.out))
    try:
        emulate.by_name(cfg.emulate)
    except ValueError as e:
        raise EvalError(f"--emulate: {e}") from None
    data_mod.check_source(cfg.data)
    served.stated(cfg.target, cfg.engine_version)
    if not cfg.fit_buckets:
        check_buckets(cfg.buckets, context.of_directory(cfg.model), cfg.model)


def check_buckets(requested: Iterable[int], ctx: Context | None, model: str) -> None:
    """Refuse a bucket longer than the model's context (one line naming the bucket, the context and where it
    comes from), before any weight loads."""
    beyond = sorted(int(b) for b in set(requested) if ctx and int(b) > ctx.tokens)
    if ctx and beyond:
        raise EvalError(f"--buckets {','.join(map(str, beyond))}: longer than the context of MODEL {model} "
                        f"({ctx.tokens} tokens: {ctx.why}); use buckets of at most {ctx.tokens}")
